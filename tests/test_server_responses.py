"""`/v1/responses` (OpenAI's Responses API) through the openai client against a real server: a tool
loop with `previous_response_id`, streaming with the Responses event types, `text.format`,
`instructions`, the store (`GET`, an unknown id, `cancel`), and openai-agents' default model where
that package is installed."""
from __future__ import annotations

import json
import time
from typing import Literal

import httpx
import openai
import pytest

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def client(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_a_tool_loop_with_previous_response_id(client):
    first = client.responses.create(model="tiny", input="What is the weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", max_output_tokens=200, temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert first.status == "completed" and calls
    assert all(c.name == "get_weather" and "city" in json.loads(c.arguments) for c in calls)
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": "Sunny, 21 C."} for c in calls]
    second = client.responses.create(model="tiny", previous_response_id=first.id, input=results, tools=[WEATHER],
                                     tool_choice="none", max_output_tokens=8, temperature=0)
    assert second.output[0].type == "message" and isinstance(second.output_text, str)
    assert second.previous_response_id == first.id
    # the second prompt holds the first exchange, the calls and their results
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    stored = client.responses.retrieve(first.id)
    assert stored.id == first.id and [i.type for i in stored.output] == [i.type for i in first.output]


def test_a_call_cut_off_by_max_output_tokens_is_incomplete_and_the_loop_goes_on(client):
    """OpenAI marks the item max_output_tokens stopped in `incomplete`, streamed or not; the cut
    call's partial arguments go back into the conversation as they are."""
    request = dict(model="tiny", input="Weather in Paris?", tools=[WEATHER], max_output_tokens=4, temperature=0,
                   tool_choice={"type": "function", "name": "get_weather"})
    first = client.responses.create(**request)
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert [item.status for item in first.output] == ["completed"] * (len(first.output) - 1) + ["incomplete"]
    call = first.output[-1]
    assert call.type == "function_call" and call.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.arguments)
    with client.responses.stream(**request) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [item.status for item in done] == [item.status for item in first.output]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}
    second = client.responses.create(model="tiny", previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                                     input=[result], max_output_tokens=4, temperature=0)
    assert second.output[0].type == "message" and second.usage.input_tokens > first.usage.input_tokens


def test_streaming_events_tell_the_same_response(client):
    plain = client.responses.create(model="tiny", input="Hello", instructions="Be brief.", max_output_tokens=8,
                                    temperature=0)
    with client.responses.stream(model="tiny", input="Hello", instructions="Be brief.", max_output_tokens=8,
                                 temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in kinds
    # cut by max_output_tokens: OpenAI's closing event is then response.incomplete
    assert kinds[-1] == ("response.completed" if plain.status == "completed" else "response.incomplete")
    final = events[-1].response
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == plain.output_text
    assert final.output_text == plain.output_text and final.usage.output_tokens == plain.usage.output_tokens
    without = client.responses.create(model="tiny", input="Hello", max_output_tokens=8, temperature=0)
    assert plain.usage.input_tokens > without.usage.input_tokens  # the instructions are in the prompt
    assert plain.status == "completed" or plain.incomplete_details.reason == "max_output_tokens"


def test_an_empty_reply_streamed_is_the_empty_message_it_is_not_streamed(client):
    """A reply cut to nothing (a stop string at its start) is one empty message item both ways."""
    first = client.responses.create(model="tiny", input="Hello", max_output_tokens=8, temperature=0).output_text
    request = dict(model="tiny", input="Hello", max_output_tokens=8, temperature=0, extra_body={"stop": [first[:1]]})
    plain = client.responses.create(**request)
    with client.responses.stream(**request) as stream:
        events = list(stream)
    final = events[-1].response
    assert [(i.type, i.status, i.content[0].text) for i in plain.output] == [("message", "completed", "")]
    assert events[-1].type == "response.completed"
    assert [(i.type, i.status, i.content[0].text) for i in final.output] == [("message", "completed", "")]
    assert [e.type for e in events][2:-1] == ["response.output_item.added", "response.content_part.added",
                                              "response.output_text.done", "response.content_part.done",
                                              "response.output_item.done"]


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["size"]}
    response = client.responses.create(model="tiny", input="A thing:", max_output_tokens=30, temperature=0,
                                       text={"format": {"type": "json_schema", "name": "thing", "schema": schema}})
    assert set(json.loads(response.output_text)) == {"size"}


def test_the_store_and_its_errors(client):
    unstored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError, match="Previous response with id 'resp_nothing' not found") as error:
        client.responses.create(model="tiny", input="Hi", previous_response_id="resp_nothing")
    assert error.value.code == "previous_response_not_found"  # a 400, as OpenAI answers
    stored = client.responses.create(model="tiny", input="Hi", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError, match="background=true"):
        client.responses.cancel(stored.id)
    with pytest.raises(openai.BadRequestError, match="`background` with `stream` is not supported"):
        client.responses.create(model="tiny", input="Hi", background=True, stream=True)
    with pytest.raises(openai.BadRequestError, match="`background` requires `store`"):
        client.responses.create(model="tiny", input="Hi", background=True, store=False)
    with pytest.raises(openai.BadRequestError, match="only function tools are supported"):
        client.responses.create(model="tiny", input="Hi", tools=[{"type": "web_search"}])
    with pytest.raises(openai.BadRequestError, match="`n` must be 1 on /v1/responses"):
        client.responses.create(model="tiny", input="Hi", max_output_tokens=2, extra_body={"n": 3})


def test_include_logprobs_returns_the_texts_token_logprobs(client):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs` (what openai-agents sends for
    ModelSettings(top_logprobs=2)): each output token's logprob and its two best alternatives, the
    same streamed (per delta) as not."""
    request = dict(model="tiny", input="Hello", max_output_tokens=6, temperature=0, top_logprobs=2,
                   include=["message.output_text.logprobs"])
    response = client.responses.create(**request)
    part = response.output[0].content[0]
    assert len(part.logprobs) == response.usage.output_tokens
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in part.logprobs)
    # greedy: the chosen token is the best alternative
    assert all(lp.top_logprobs[0].logprob == pytest.approx(lp.logprob) for lp in part.logprobs)
    with client.responses.stream(**request) as stream:
        events = list(stream)
    deltas = [lp for e in events if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in deltas] == [lp.token for lp in part.logprobs]
    assert [lp.token for lp in events[-1].response.output[0].content[0].logprobs] == [lp.token for lp in deltas]
    assert client.responses.create(model="tiny", input="Hello", max_output_tokens=6).output[0].content[0].logprobs == []


def test_items_replayed_by_agent_clients_make_the_chat_turns(client):
    """What openai-agents and langchain send back: the model's text and its call in one assistant
    turn (as generated), a tool output as a list of text parts. The prompt is the chat one."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat_messages = [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": "Let me look.", "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C."}]
    function = {k: WEATHER[k] for k in ("name", "description", "parameters")} | {"strict": True}
    chat = client.chat.completions.create(model="tiny", messages=chat_messages,
                                          tools=[{"type": "function", "function": function}], tool_choice="none",
                                          max_tokens=4, temperature=0)
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
              "content": [{"type": "output_text", "text": "Let me look.", "annotations": [], "logprobs": []}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
              "arguments": '{"city": "Paris"}', "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1",
              "output": [{"type": "input_text", "text": "Sunny, 21 C."}]}]
    response = client.responses.create(model="tiny", input=items, tools=[WEATHER], tool_choice="none",
                                       max_output_tokens=4, temperature=0)
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match=r"input\[3\].output\[0\]: only text parts"):
        client.responses.create(model="tiny", input=items[:3] + [{**items[3], "output": [{"type": "input_image"}]}],
                                max_output_tokens=2)


def test_responses_fields_that_would_change_the_answer_are_refused(client):
    for field, value in [("conversation", "conv_1"), ("reasoning", {"summary": "auto"}),
                         ("prompt", {"id": "pmpt_1"}), ("context_management", [{"type": "compaction"}])]:
        with pytest.raises(openai.BadRequestError, match=f"`{field}.*` is not supported by kvserve") as caught:
            client.responses.create(model="tiny", input="Hi", max_output_tokens=2, extra_body={field: value})
        assert caught.value.body["param"] == (field if field != "reasoning" else "reasoning.summary")
    # an effort goes to a chat template that reads it (test_chat_templates.py); the tiny one does not
    with pytest.raises(openai.BadRequestError, match="`reasoning_effort` is not supported for this model: its chat "
                                                     "template does not read it"):
        client.responses.create(model="tiny", input="Hi", max_output_tokens=2, reasoning={"effort": "low"})
    # their off values, and fields that ask for nothing kvserve makes, are answered
    quiet = dict(truncation="disabled", reasoning={"effort": None, "summary": None}, include=[], max_tool_calls=3,
                 extra_body={"stream_options": {"include_obfuscation": False}, "conversation": None})
    assert client.responses.create(model="tiny", input="Hi", max_output_tokens=2, **quiet).status
    with client.responses.stream(model="tiny", input="Hi", max_output_tokens=2, **quiet) as stream:
        assert list(stream)[-1].response.usage.output_tokens == 2  # kvserve's own stream options hold
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):  # a whole-request check: a 400, not a 500
        client.responses.create(model="tiny", input="Hi", max_output_tokens=2, stream=True,
                                extra_body={"prompt_logprobs": 1})


def test_truncation_auto_drops_the_oldest_messages_that_do_not_fit(client):
    """A conversation longer than the context: a 400 by default (`truncation: "disabled"`), and with
    `"auto"` the prompt of the fewest last messages dropped that fit, as a chat request of them
    gets; the instructions stay."""
    turns = []
    for i in range(8):
        turns += [{"role": "user", "content": f"Question {i}: " + "tell me more about the weather " * 12},
                  {"role": "assistant", "content": f"Answer {i}: " + "it is sunny and warm today " * 12}]
    turns.append({"role": "user", "content": "And tomorrow?"})
    request = dict(model="tiny", input=turns, instructions="Be brief.", max_output_tokens=16, temperature=0)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.responses.create(**request)
    response = client.responses.create(**request, truncation="auto")
    assert response.truncation == "auto" and response.status in ("completed", "incomplete")
    system = [{"role": "system", "content": "Be brief."}]

    def chat(start):
        try:
            return client.chat.completions.create(model="tiny", messages=system + turns[start:], max_tokens=16,
                                                  temperature=0)
        except openai.BadRequestError as exc:
            assert "maximum context length" in str(exc)
            return None
    # the first suffix that fits (no more dropped than needed) is what was answered
    kept = next(reply for reply in map(chat, range(1, len(turns))) if reply is not None)
    assert kept.usage.prompt_tokens == response.usage.input_tokens
    assert kept.choices[0].message.content == response.output_text


def test_openai_agents_default_model_runs_a_tool_loop(tiny_server):
    agents = pytest.importorskip("agents", reason="openai-agents is not installed (pip install openai-agents)")
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool

    called = []

    @function_tool
    def get_weather(city: Literal["Paris", "London"]) -> str:  # an enum: a tiny random model's calls end
        """The weather in a city."""
        called.append(city)
        return "Sunny, 21 C."

    client = openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0)
    model = OpenAIResponsesModel(model="tiny", openai_client=client)
    agents.set_tracing_disabled(True)
    agent = Agent(name="weather", instructions="Answer with the weather tool.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                                temperature=0),
                  tool_use_behavior="stop_on_first_tool")
    result = Runner.run_sync(agent, "What is the weather in Paris?", max_turns=3)
    assert called and result.final_output == "Sunny, 21 C."


def test_langchain_chat_openai_on_the_responses_api_runs_a_tool_loop(tiny_server):
    """langchain-openai's ChatOpenAI with use_responses_api: a forced call, then its AIMessage and a
    ToolMessage of text blocks sent back as Responses items, answered in text."""
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    from langchain_core.messages import HumanMessage, ToolMessage

    def get_weather(city: Literal["Paris", "London"]) -> str:  # an enum: a tiny random model's calls end
        """The weather in a city."""
        return "Sunny, 21 C."

    llm = langchain_openai.ChatOpenAI(model="tiny", base_url=f"{tiny_server.base_url}/v1", api_key="unused",
                                      use_responses_api=True, temperature=0, max_tokens=60, max_retries=0)
    question = HumanMessage("What is the weather in Paris?")
    called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    [call] = called.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "London")
    result = ToolMessage(content=[{"type": "text", "text": get_weather(call["args"]["city"])}],
                         tool_call_id=call["id"])
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke([question, called, result])
    assert not answer.tool_calls and isinstance(answer.text, str)
    assert answer.usage_metadata["input_tokens"] > called.usage_metadata["input_tokens"]


def test_the_router_renders_a_responses_prompt_as_the_replica_does(tiny_server, tiny_llama):
    """kv_aware routing of /v1/responses: the router's tokens are the replica's whole prompt."""
    from kvserve.model.loader import load_tokenizer
    from kvserve.router.prompt_hashes import PromptTokens

    body = {"model": "tiny", "instructions": "Answer briefly.", "max_output_tokens": 2,
            "input": [{"role": "user", "content": "Mr. Darcy?"},
                      {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{\"q\": \"x\"}"},
                      {"type": "function_call_output", "call_id": "c1", "output": "found"}],
            "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}], "tool_choice": "none"}
    reply = httpx.post(f"{tiny_server.base_url}/v1/responses", json=body, timeout=60).json()
    assert "usage" in reply, reply
    ids = PromptTokens(load_tokenizer(tiny_llama)).token_ids("responses", body)
    assert ids and len(ids) == reply["usage"]["input_tokens"]


def wait_for(condition, timeout_s: float = 30.0):
    """Poll until condition() is truthy (a bound on waiting, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def wait_for_status(client, response_id: str, statuses: tuple[str, ...], timeout_s: float = 60.0):
    """Poll GET /v1/responses/{id} until its status is one of `statuses` (a bound on waiting)."""
    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status not in statuses:
        assert time.monotonic() < deadline, response.status
        time.sleep(0.05)
    return response


def test_background_mode_polls_to_the_synchronous_answer_and_cancels(client, tiny_server):
    """OpenAI's background mode: queued at once, then the same output as a synchronous request;
    a long one cancelled while running ends `cancelled` and frees its blocks; continuing from a
    response still running is a 400."""
    request = {"model": "tiny", "input": "Mr. Darcy", "max_output_tokens": 6, "temperature": 0}
    queued = client.responses.create(background=True, **request)
    assert queued.status in ("queued", "in_progress") and queued.background
    done = wait_for_status(client, queued.id, ("completed", "incomplete"))
    assert done.output_text == client.responses.create(**request).output_text and done.usage.output_tokens == 6
    with pytest.raises(openai.BadRequestError, match="has already finished"):
        client.responses.cancel(done.id)
    follow_up = client.responses.create(model="tiny", input="And?", max_output_tokens=2, previous_response_id=done.id)
    assert follow_up.status == "incomplete"

    long = client.responses.create(background=True, model="tiny", input="Elizabeth", max_output_tokens=900,
                                   extra_body={"ignore_eos": True})
    wait_for_status(client, long.id, ("in_progress",))
    with pytest.raises(openai.BadRequestError, match="is still in progress"):
        client.responses.create(model="tiny", input="Next", previous_response_id=long.id)
    assert client.responses.cancel(long.id).status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert client.responses.cancel(long.id).status == "cancelled"  # cancelling twice: idempotent
    with pytest.raises(openai.BadRequestError, match="cancelled: it has no output to continue from"):
        client.responses.create(model="tiny", input="Next", previous_response_id=long.id)
    metrics = wait_for(lambda: (m := tiny_server.metrics())["kvserve:num_requests_running"] == 0 and m)
    assert metrics and metrics["kvserve:kv_cache_usage_perc"] == 0.0


def test_a_background_response_that_cannot_run_is_failed_with_its_error(client):
    too_long = client.responses.create(background=True, model="tiny", input="word " * 2000, max_output_tokens=2)
    failed = wait_for_status(client, too_long.id, ("failed",))
    assert failed.error.code == "context_length_exceeded" and "maximum context length" in failed.error.message
