"""`--reasoning-parser deepseek_r1` (vLLM's): a reasoning model's thinking goes out as `reasoning`,
apart from the answer, streamed or not; structured outputs constrain the answer only; usage counts
the reasoning tokens. The model is scripted (tiny_models.build_scripted_reasoning_model): greedy, it
writes REASONING + "</think>" + ANSWER, so every split is known."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server import sse_events
from tiny_models import build_scripted_reasoning_model, build_tokenizer

from kvserve.server.reasoning import ReasoningParser

REASONING, ANSWER = "Elizabeth smiled", " Mr. Darcy"
MESSAGES = [{"role": "user", "content": "Hello there"}]
GREEDY = {"temperature": 0}
REASONING_TOKENS = len(build_tokenizer().encode(REASONING, add_special_tokens=False))
NO_ARGUMENTS = [{"type": "function", "function": {"name": "look", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def thinking_model(tmp_path_factory):
    return build_scripted_reasoning_model(tmp_path_factory.mktemp("thinking") / "model", REASONING, ANSWER)


@pytest.fixture(scope="module")
def server(server_factory, thinking_model):
    return server_factory(str(thinking_model), "--dtype", "float32", "--kv-cache-memory", "8MiB",
                          "--served-model-name", "thinker", "--reasoning-parser", "deepseek_r1")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)


def typed_events(response: httpx.Response) -> list[dict]:
    """The data of an SSE body whose events also carry `event:` lines (Responses, Messages)."""
    return [json.loads(line[len("data: "):]) for line in response.text.splitlines() if line.startswith("data: ")]


def parser() -> ReasoningParser:
    tokenizer = build_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])
    return ReasoningParser.for_tokenizer("deepseek_r1", tokenizer)


def test_the_split_holds_back_what_may_become_a_tag():
    p = parser()
    assert p.split("a b</think>c", final=True) == ("a b", "c", True)
    assert p.split("<think>a</think>", final=True) == ("a", "", True)
    assert p.split("a b", final=True) == ("a b", "", False)  # no end: all of it is thinking
    assert p.split("a b</thi", final=False) == ("a b", "", False)  # perhaps a tag: held back
    assert p.split("a b</thi", final=True) == ("a b</thi", "", False)
    assert p.split("<thi", final=False) == ("", "", False)
    assert p.ended_in([1, p.start_id, 5, p.end_id]) and not p.ended_in([p.end_id, 7, p.start_id, 9])
    assert not p.ended_in([1, 2, 3]) and p.reasoning_tokens([p.start_id, 4, 5, p.end_id, 6]) == 2


def test_the_reply_carries_thinking_and_answer_apart(client, server):
    reply = client.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=30, **GREEDY)
    message = reply.model_dump()["choices"][0]["message"]
    assert message["reasoning"] == REASONING and message["content"] == ANSWER
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS
    # the raw text (completions are never parsed) has the tag; the chat reply does not
    raw = httpx.post(f"{server.base_url}/v1/completions", json={
        "model": "thinker", "prompt": "<|im_start|>user\nHello there<|im_end|>\n<|im_start|>assistant\n<think>\n",
        "max_tokens": 30, "temperature": 0}).json()
    assert raw["choices"][0]["text"] == f"{REASONING}</think>{ANSWER}"
    hidden = client.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=30, **GREEDY,
                                            extra_body={"include_reasoning": False}).model_dump()
    assert hidden["choices"][0]["message"]["reasoning"] is None and hidden["choices"][0]["message"]["content"] == ANSWER


def test_the_stream_sends_thinking_then_answer(server):
    body = {"model": "thinker", "messages": MESSAGES, "max_tokens": 30, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    chunks = [json.loads(e) for e in sse_events(httpx.post(f"{server.base_url}/v1/chat/completions", json=body,
                                                           timeout=60)) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning", "") for d in deltas) == REASONING
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    last_thought = max(i for i, d in enumerate(deltas) if d.get("reasoning"))
    assert last_thought <= first_answer, deltas  # the answer comes after the thinking (a delta may hold both)
    assert chunks[-1]["usage"]["completion_tokens_details"]["reasoning_tokens"] == REASONING_TOKENS
    hidden = [json.loads(e) for e in sse_events(httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                                                           json={**body, "include_reasoning": False}))
              if e != "[DONE]"]
    assert not any("reasoning" in c["choices"][0]["delta"] for c in hidden if c["choices"])


def test_a_cut_in_the_thinking_leaves_no_answer(client):
    reply = client.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=2, **GREEDY)
    message = reply.model_dump()["choices"][0]["message"]
    assert message["content"] is None and REASONING.startswith(message["reasoning"]) and message["reasoning"]
    assert reply.choices[0].finish_reason == "length"


def test_structured_outputs_constrain_the_answer_only(client):
    """The grammar starts after </think>: the thinking is the model's own, the answer one of the choices."""
    reply = client.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=30, **GREEDY,
                                           extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    message = reply.model_dump()["choices"][0]["message"]
    assert message["reasoning"] == REASONING and message["content"] in ("yes", "no")


def test_a_continued_message_is_thinking_only_while_its_think_is_open(client):
    """Continuing a final message: past </think> (or with no tag) the output is the answer; after an
    open <think> it is thinking until </think>."""
    for prefill, thinking in (("<think>done</think>", False), ("Sure", False), ("<think>\n", True)):
        messages = [*MESSAGES, {"role": "assistant", "content": prefill}]
        reply = client.chat.completions.create(model="thinker", messages=messages, max_tokens=30, **GREEDY,
                                               extra_body={"continue_final_message": True,
                                                           "add_generation_prompt": False})
        message = reply.model_dump()["choices"][0]["message"]
        assert (message["reasoning"] is not None) == thinking, (prefill, message)
        assert message["content"] == (ANSWER if prefill != "Sure" else "")  # (off its script the model stops)


def test_a_named_tool_call_comes_after_the_thinking(server, client):
    """The call's grammar starts after </think>; streamed, no call delta goes out while the model
    thinks, and /v1/messages tells a thinking block, then one tool_use block."""
    body = {"model": "thinker", "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "tools": NO_ARGUMENTS,
            "tool_choice": {"type": "function", "function": {"name": "look"}}}
    reply = client.chat.completions.create(**body).model_dump()["choices"][0]
    assert reply["message"]["reasoning"] == REASONING
    assert [c["function"]["name"] for c in reply["message"]["tool_calls"]] == ["look"]
    chunks = [json.loads(e) for e in sse_events(httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                                                           json={**body, "stream": True})) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    first_call = next(i for i, d in enumerate(deltas) if d.get("tool_calls"))
    last_thought = max(i for i, d in enumerate(deltas) if d.get("reasoning"))
    assert last_thought <= first_call and "".join(d.get("reasoning", "") for d in deltas) == REASONING
    anthropic = {"model": "thinker", "max_tokens": 40, "messages": MESSAGES, "temperature": 0, "stream": True,
                 "tools": [{"name": "look", "input_schema": {"type": "object", "properties": {}}}],
                 "tool_choice": {"type": "tool", "name": "look"}}
    events = typed_events(httpx.post(f"{server.base_url}/v1/messages", json=anthropic, timeout=60))
    blocks = [e["content_block"] for e in events if e["type"] == "content_block_start"]
    assert [b["type"] for b in blocks] == ["thinking", "tool_use"] and blocks[1]["name"] == "look"
    signatures = [e for e in events if e["type"] == "content_block_delta" and e["delta"]["type"] == "signature_delta"]
    assert [e["index"] for e in signatures] == [0]


def test_earlier_thinking_reaches_the_template(server):
    """An assistant turn's `reasoning` (vLLM's field) or `reasoning_content` is the template's reasoning_content."""
    for field in ("reasoning", "reasoning_content"):
        messages = [*MESSAGES, {"role": "assistant", "content": "Hi", field: "hmm"},
                    {"role": "user", "content": "Again"}]
        ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}).json()["tokens"]
        text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": ids}).json()["prompt"]
        assert "<|im_start|>assistant\n<think>hmm</think>Hi<|im_end|>" in text, (field, text)


def test_responses_put_the_thinking_in_a_reasoning_item(server):
    """/v1/responses: a reasoning item before the message, streamed as reasoning_text events; sent back
    as input (the openai-agents SDK replays it), it is the assistant turn's reasoning_content."""
    url = f"{server.base_url}/v1/responses"
    body = {"model": "thinker", "input": "Hello there", "max_output_tokens": 30, "temperature": 0}
    response = httpx.post(url, json=body, timeout=60).json()
    kinds = [item["type"] for item in response["output"]]
    assert kinds == ["reasoning", "message"], response
    assert response["output"][0]["content"][0] == {"type": "reasoning_text", "text": REASONING}
    assert response["output"][1]["content"][0]["text"] == ANSWER
    assert response["usage"]["output_tokens_details"]["reasoning_tokens"] > 0
    events = typed_events(httpx.post(url, json={**body, "stream": True}, timeout=60))
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == REASONING
    done = next(e for e in events if e["type"] == "response.reasoning_text.done")
    assert done["text"] == REASONING and events[-1]["response"]["output"][0]["type"] == "reasoning"
    # each item finishes before the next opens, as OpenAI streams them
    order = [(e["type"], e.get("output_index")) for e in events]
    assert order.index(("response.output_item.done", 0)) < order.index(("response.output_item.added", 1))
    assert [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"] == ["completed"] * 2
    history = [{"role": "user", "content": "Hello there"}, *response["output"], {"role": "user", "content": "And?"}]
    follow_up = httpx.post(url, timeout=60, json={**body, "input": history})
    assert follow_up.status_code == 200, follow_up.text
    without = httpx.post(url, timeout=60, json={**body, "input": [history[0], *history[2:]]}).json()
    # the replayed thinking is written back (<think>...</think> in the assistant turn)
    assert follow_up.json()["usage"]["input_tokens"] == without["usage"]["input_tokens"] + REASONING_TOKENS + 2
    chained = httpx.post(url, timeout=60, json={**body, "input": "And?", "previous_response_id": response["id"]})
    assert chained.status_code == 200 and chained.json()["usage"]["input_tokens"] == \
        follow_up.json()["usage"]["input_tokens"]
    lonely = httpx.post(url, timeout=60, json={**body, "input": [*history[:2], {"role": "user", "content": "And?"}]})
    assert lonely.status_code == 200  # thinking that nothing followed is dropped
    logprobs = httpx.post(url, timeout=60, json={**body, "include": ["message.output_text.logprobs"]}).json()
    text = logprobs["output"][1]["content"][0]
    assert "".join(entry["token"] for entry in text["logprobs"]) == ANSWER + "<|im_end|>"  # the answer's tokens only
    streamed = typed_events(httpx.post(url, timeout=60, json={**body, "stream": True,
                                                              "include": ["message.output_text.logprobs"]}))
    done = next(e for e in streamed if e["type"] == "response.output_text.done")
    assert "".join(entry["token"] for entry in done["logprobs"]).startswith(ANSWER)


def test_messages_answer_with_a_thinking_block_first(server):
    url = f"{server.base_url}/v1/messages"
    body = {"model": "thinker", "max_tokens": 30, "messages": MESSAGES, "temperature": 0}
    message = httpx.post(url, json=body, timeout=60).json()
    assert message["content"] == [{"type": "thinking", "thinking": REASONING, "signature": ""},
                                  {"type": "text", "text": ANSWER}]
    events = typed_events(httpx.post(url, json={**body, "stream": True}, timeout=60))
    starts = [e["content_block"]["type"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["thinking", "text"]
    assert "".join(e["delta"]["thinking"] for e in events
                   if e["type"] == "content_block_delta" and e["delta"]["type"] == "thinking_delta") == REASONING
    off = httpx.post(url, json={**body, "thinking": {"type": "disabled"}}, timeout=60).json()
    assert off["content"] == [{"type": "text", "text": ANSWER}]
    history = [*MESSAGES, {"role": "assistant", "content": message["content"]}, {"role": "user", "content": "And?"}]
    counts = [httpx.post(f"{url}/count_tokens", json={"model": "thinker", "messages": h}).json()["input_tokens"]
              for h in (history, [history[0], {"role": "assistant", "content": message["content"][1:]}, history[2]])]
    assert counts[0] == counts[1] + REASONING_TOKENS + 2  # an earlier thinking block reaches the template


# ----------------------------------------------------------------------- a model that opens <think> itself
@pytest.fixture(scope="module")
def opening_server(server_factory, tmp_path_factory):
    """`--reasoning-parser qwen3` on a model whose template does not open <think> (Qwen3's hybrid
    models): it writes "<think>" + REASONING + "</think>" + ANSWER."""
    path = build_scripted_reasoning_model(tmp_path_factory.mktemp("opening") / "model", REASONING, ANSWER, opens=True)
    return server_factory(str(path), "--dtype", "float32", "--kv-cache-memory", "8MiB",
                          "--served-model-name", "thinker", "--reasoning-parser", "qwen3")


def test_an_output_that_opens_its_thinking_is_thinking_after_a_prompt_that_closed_one(opening_server):
    """A tool loop's prompt (Qwen3's template writes the loop's earlier thinking back) ends on </think>;
    the model then opens <think> again: still reasoning, streamed or not, and counted as such."""
    url = f"{opening_server.base_url}/v1/chat/completions"
    earlier = [*MESSAGES, {"role": "assistant", "content": "Hi", "reasoning": "hmm"},
               {"role": "user", "content": "Again"}]
    for messages in (MESSAGES, earlier):
        body = {"model": "thinker", "messages": messages, "max_tokens": 30, "temperature": 0}
        reply = httpx.post(url, json=body, timeout=60).json()
        assert reply["choices"][0]["message"]["reasoning"] == REASONING, reply
        assert reply["choices"][0]["message"]["content"] == ANSWER
        assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == REASONING_TOKENS
        chunks = [json.loads(e) for e in sse_events(httpx.post(url, json={**body, "stream": True}, timeout=60))
                  if e != "[DONE]"]
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == REASONING
        assert "".join(d.get("content") or "" for d in deltas) == ANSWER


def test_messages_thinking_disabled_switches_a_qwen3_templates_thinking_off(opening_server):
    """Anthropic's `thinking: {"type": "disabled"}` reaches a template that can switch thinking off
    (Qwen3's enable_thinking): its generation prompt closes an empty thinking, as with vLLM's
    chat_template_kwargs; the request's own chat_template_kwargs win."""
    url = f"{opening_server.base_url}/v1/messages/count_tokens"
    body = {"model": "thinker", "messages": MESSAGES}

    def count(**extra) -> int:
        return httpx.post(url, json={**body, **extra}, timeout=60).json()["input_tokens"]

    closed = len(build_tokenizer().encode("\n\n\n\n", add_special_tokens=False)) + 2  # + <think>, </think>
    assert count(thinking={"type": "disabled"}) == count() + closed
    assert count(thinking={"type": "disabled"}, chat_template_kwargs={"enable_thinking": True}) == count()


def test_responses_logprobs_leave_out_the_outputs_own_think_tag(opening_server):
    """/v1/responses with the text's logprobs: the output's opening <think> is thinking, not the
    answer's first token, streamed or not."""
    url = f"{opening_server.base_url}/v1/responses"
    body = {"model": "thinker", "input": "Hello there", "max_output_tokens": 30, "temperature": 0,
            "include": ["message.output_text.logprobs"]}
    whole = httpx.post(url, json=body, timeout=60).json()
    assert [item["type"] for item in whole["output"]] == ["reasoning", "message"], whole
    assert "".join(entry["token"] for entry in whole["output"][1]["content"][0]["logprobs"]) == ANSWER + "<|im_end|>"
    streamed = typed_events(httpx.post(url, json={**body, "stream": True}, timeout=60))
    done = next(e for e in streamed if e["type"] == "response.output_text.done")
    assert "".join(entry["token"] for entry in done["logprobs"]).startswith(ANSWER), done["logprobs"]


# ----------------------------------------------------------------------- thinking_token_budget
def test_a_thinking_token_budget_ends_the_thinking_there_and_the_model_answers(client, server):
    """vLLM's `thinking_token_budget`: after that many thinking tokens </think> is forced; the scripted
    model then answers as it would have. A budget past the thinking changes nothing."""
    tokenizer = build_tokenizer()
    words = tokenizer.encode(REASONING, add_special_tokens=False)
    for budget in (0, 2, REASONING_TOKENS + 5):
        reply = client.chat.completions.create(model="thinker", messages=MESSAGES, max_tokens=30, n=2, **GREEDY,
                                               extra_body={"thinking_token_budget": budget})
        kept = min(budget, REASONING_TOKENS)
        for choice in reply.model_dump()["choices"]:  # each sample counts its own thinking
            assert (choice["message"]["reasoning"] or "") == tokenizer.decode(words[:kept]), (budget, choice)
            assert choice["message"]["content"] == ANSWER and choice["finish_reason"] == "stop"
        assert reply.usage.completion_tokens_details.reasoning_tokens == 2 * kept
    chunks = [json.loads(e) for e in sse_events(httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": "thinker", "messages": MESSAGES, "max_tokens": 30, "stream": True, "temperature": 0,
        "thinking_token_budget": 1})) if e != "[DONE]"]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert "".join(d.get("reasoning") or "" for d in deltas) == tokenizer.decode(words[:1])
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER


def test_a_continued_messages_thinking_counts_against_the_budget(client):
    """vLLM counts the thinking after the prompt's last <think>: a continued final message that left
    its thinking open has spent part of the budget already."""
    words = build_tokenizer().encode(REASONING, add_special_tokens=False)
    spent = build_tokenizer().decode(words[:1])
    messages = [*MESSAGES, {"role": "assistant", "content": "<think>" + spent}]
    for budget, more in ((1, 0), (2, 1)):
        reply = client.chat.completions.create(model="thinker", messages=messages, max_tokens=30, **GREEDY,
                                               extra_body={"continue_final_message": True,
                                                           "add_generation_prompt": False,
                                                           "thinking_token_budget": budget})
        message = reply.model_dump()["choices"][0]["message"]
        assert reply.usage.completion_tokens_details.reasoning_tokens == more, (budget, message)
        assert message["content"] == ANSWER


def test_a_thinking_budget_counts_after_the_outputs_own_think_tag(opening_server):
    reply = httpx.post(f"{opening_server.base_url}/v1/chat/completions", timeout=60, json={
        "model": "thinker", "messages": MESSAGES, "max_tokens": 30, "temperature": 0,
        "thinking_token_budget": 1}).json()
    words = build_tokenizer().encode(REASONING, add_special_tokens=False)
    assert reply["choices"][0]["message"]["reasoning"] == build_tokenizer().decode(words[:1])
    assert reply["choices"][0]["message"]["content"] == ANSWER
    assert reply["usage"]["completion_tokens_details"]["reasoning_tokens"] == 1


def test_messages_thinking_budget_tokens_caps_the_thinking_block(server):
    tokenizer = build_tokenizer()
    words = tokenizer.encode(REASONING, add_special_tokens=False)
    body = {"model": "thinker", "max_tokens": 30, "messages": MESSAGES, "temperature": 0,
            "thinking": {"type": "enabled", "budget_tokens": 1}}
    message = httpx.post(f"{server.base_url}/v1/messages", json=body, timeout=60).json()
    assert message["content"] == [{"type": "thinking", "thinking": tokenizer.decode(words[:1]), "signature": ""},
                                  {"type": "text", "text": ANSWER}]
    bad = httpx.post(f"{server.base_url}/v1/messages", timeout=60,
                     json={**body, "thinking": {"type": "enabled", "budget_tokens": -1}})
    assert bad.status_code == 400 and "budget_tokens" in bad.json()["error"]["message"]


def test_a_thinking_budget_is_refused_where_nothing_thinks_or_below_zero(server, tiny_server):
    body = {"messages": MESSAGES, "max_tokens": 4, "thinking_token_budget": 8}
    refused = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json={"model": "tiny", **body}, timeout=60)
    assert refused.status_code == 400 and "--reasoning-parser" in refused.json()["error"]["message"]
    for value in (-1, True, "5", 2.5):
        refused = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                             json={"model": "thinker", **body, "thinking_token_budget": value})
        assert refused.status_code == 400 and "thinking_token_budget" in refused.text, (value, refused.text)
