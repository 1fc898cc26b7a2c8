"""What agent frameworks send, on the default model through real clients against `kvserve serve`
(issue 44): the Responses API with a tool loop (openai's responses.create and responses.stream),
openai-agents' default model running a one-tool agent, langchain's OpenAIEmbeddings, logit_bias,
continue_final_message and min_tokens with a stop string. One default-model server for the module
(shared with the other default-model server tests of the same flags)."""
from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory("--kv-cache-memory", "256MiB", "--max-model-len", "2048")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def test_responses_tool_loop_and_stream(client, model):
    first = client.responses.create(model=model, input="What's the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=100, **GREEDY)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments)["city"]
    with client.responses.stream(model=model, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                                 input=[{"type": "function_call_output", "call_id": call.call_id,
                                         "output": '{"temperature": 18, "sky": "sunny"}'}],
                                 max_output_tokens=40, **GREEDY) as stream:
        events = list(stream)
    final = events[-1].response
    assert events[-1].type in ("response.completed", "response.incomplete") and final.output_text.strip()
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text


def test_openai_agents_default_model_runs_a_one_tool_agent(server, model):
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install -e '.[test]')")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool

    called = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        called.append(city)
        return "Sunny, 21 C."

    agents.set_tracing_disabled(True)
    responses_model = OpenAIResponsesModel(model=model, openai_client=openai.AsyncOpenAI(
        base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0))
    agent = Agent(name="weather", instructions="Use the weather tool to answer.", tools=[get_weather],
                  model=responses_model, tool_use_behavior="stop_on_first_tool",
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                               temperature=0))
    result = Runner.run_sync(agent, "What's the weather in Paris?", max_turns=3)
    assert called and result.final_output == "Sunny, 21 C."


def test_langchain_openai_embeddings_rank_paraphrases_first(server, model):
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    embeddings = langchain_openai.OpenAIEmbeddings(model=model, base_url=f"{server.base_url}/v1", api_key="unused",
                                                   check_embedding_ctx_length=False, max_retries=0)
    query = np.array(embeddings.embed_query("The cat sat on the mat."))
    paraphrase, unrelated = (np.array(v) for v in embeddings.embed_documents(
        ["A cat was sitting on the rug.", "Interest rates rose sharply this quarter."]))
    assert query @ paraphrase > query @ unrelated


def test_logit_bias_forces_and_bans_on_the_default_model(server, client, model):
    def complete(**extra):
        return client.completions.create(model=model, prompt="The capital of France is", max_tokens=4, logprobs=1,
                                         **GREEDY, **extra).choices[0]

    greedy = complete()
    forced = complete(logit_bias={"1000": 100})
    assert len(set(forced.logprobs.tokens)) == 1
    first_id = httpx.post(f"{server.base_url}/tokenize", json={"prompt": greedy.logprobs.tokens[0],
                                                               "add_special_tokens": False}).json()["tokens"][0]
    banned = complete(logit_bias={str(first_id): -100})
    assert banned.logprobs.tokens[0] != greedy.logprobs.tokens[0]


def test_continue_final_message_and_min_tokens_on_the_default_model(client, model):
    messages = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The fruit I pick is"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=8, **GREEDY,
                                           extra_body={"add_generation_prompt": False,
                                                       "continue_final_message": True}).choices[0].message.content
    fresh = client.chat.completions.create(model=model, messages=messages[:1], max_tokens=8,
                                           **GREEDY).choices[0].message.content
    assert reply and reply != fresh  # it continued the open turn, not a new one
    full = client.completions.create(model=model, prompt="One, two, three,", max_tokens=20, **GREEDY).choices[0].text
    stop = ","
    assert stop in full
    held = client.completions.create(model=model, prompt="One, two, three,", max_tokens=20, stop=[stop], **GREEDY,
                                     extra_body={"min_tokens": 6}).choices[0]
    early = client.completions.create(model=model, prompt="One, two, three,", max_tokens=20, stop=[stop],
                                      **GREEDY).choices[0]
    assert len(held.text) > len(early.text) and full.startswith(held.text)
