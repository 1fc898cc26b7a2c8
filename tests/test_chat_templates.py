"""Chat templates from outside the model, as vLLM takes them: `--chat-template` (a file or the
template text) for every conversation the server renders, a request's own `chat_template` only
with `--trust-request-chat-template` (vLLM's 400 otherwise), and `LLM.chat(chat_template=...)`."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_process import TINY_SERVER_ARGS

from kvserve import LLM, SamplingParams
from kvserve.router.prompt_hashes import PromptTokens

# A template unlike the tiny model's ChatML one, so which template rendered is visible.
BRACKETS = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}[assistant]{% endif %}")
REQUEST_TEMPLATE = "{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
MESSAGES = [{"role": "user", "content": "Hello"}]
UNTRUSTED = "--trust-request-chat-template is not set"


def rendered(server, **body) -> str:
    """The prompt /tokenize renders for MESSAGES, as text (or the error body)."""
    reply = httpx.post(f"{server.base_url}/tokenize", json={"messages": MESSAGES, **body})
    if reply.status_code != 200:
        return reply.json()["error"]["message"]
    return httpx.post(f"{server.base_url}/detokenize", json={"tokens": reply.json()["tokens"]}).json()["prompt"]


@pytest.fixture(scope="module")
def templated_server(server_factory, tiny_llama, tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "brackets.jinja"
    path.write_text(BRACKETS)
    return server_factory(str(tiny_llama), *TINY_SERVER_ARGS, "--chat-template", str(path),
                          "--trust-request-chat-template")


def test_the_server_template_renders_every_conversation(templated_server):
    assert rendered(templated_server) == "[user] Hello\n[assistant]"
    client = openai.OpenAI(base_url=f"{templated_server.base_url}/v1", api_key="x")
    count = len(httpx.post(f"{templated_server.base_url}/tokenize", json={"messages": MESSAGES}).json()["tokens"])
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0)
    assert reply.usage.prompt_tokens == count
    anthropic = httpx.post(f"{templated_server.base_url}/v1/messages/count_tokens",
                           json={"model": "tiny", "messages": MESSAGES}).json()
    assert anthropic["input_tokens"] == count


def test_a_trusted_request_template_renders_that_request_only(templated_server):
    assert rendered(templated_server, chat_template=REQUEST_TEMPLATE) == "<Hello>"
    assert rendered(templated_server, chat_template_kwargs={"chat_template": REQUEST_TEMPLATE}) == "<Hello>"
    assert rendered(templated_server) == "[user] Hello\n[assistant]"
    client = openai.OpenAI(base_url=f"{templated_server.base_url}/v1", api_key="x")
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0,
                                           extra_body={"chat_template": REQUEST_TEMPLATE})
    assert reply.usage.prompt_tokens == len(httpx.post(f"{templated_server.base_url}/tokenize",
                                                       json={"prompt": "<Hello>", "add_special_tokens": False}
                                                       ).json()["tokens"])
    broken = rendered(templated_server, chat_template="{% for m in messages %}")
    assert "chat template" in broken


def test_documents_go_to_a_template_that_reads_them(templated_server):
    """vLLM's `documents` (retrieval-augmented templates): the template's `documents` variable, in
    chat and /tokenize alike; a 400 naming them where the template never reads that variable (it
    was logged as ignored)."""
    docs = [{"title": "Longbourn", "text": "the Bennets' house"}]
    template = ("{% for d in documents %}(doc {{ d['title'] }}: {{ d['text'] }}){% endfor %}"
                "{% for m in messages %}<{{ m['content'] }}>{% endfor %}")
    assert rendered(templated_server, chat_template=template, documents=docs) == \
        "(doc Longbourn: the Bennets' house)<Hello>"
    client = openai.OpenAI(base_url=f"{templated_server.base_url}/v1", api_key="x")
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, temperature=0,
                                           extra_body={"chat_template": template, "documents": docs})
    assert reply.usage.prompt_tokens == len(httpx.post(f"{templated_server.base_url}/tokenize", json={
        "messages": MESSAGES, "chat_template": template, "documents": docs}).json()["tokens"])
    assert "its chat template does not read it" in rendered(templated_server, documents=docs)
    with pytest.raises(openai.BadRequestError, match="`documents` is not supported for this model") as caught:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body={"documents": docs})
    assert caught.value.body["param"] == "documents"


def test_reasoning_effort_goes_to_a_template_that_reads_it(templated_server, tiny_server):
    """OpenAI's reasoning_effort (chat) and reasoning.effort (Responses): the template's
    `reasoning_effort` variable, as vLLM passes it; a 400 where the template never reads it (the
    reasoning models kvserve serves have no effort setting)."""
    template = "[{{ reasoning_effort }}]{% for m in messages %}<{{ m['content'] }}>{% endfor %}"
    assert rendered(templated_server, chat_template=template, reasoning_effort="low") == "[low]<Hello>"
    client = openai.OpenAI(base_url=f"{templated_server.base_url}/v1", api_key="x")
    count = len(httpx.post(f"{templated_server.base_url}/tokenize", json={
        "prompt": "[high]<Hello>", "add_special_tokens": False}).json()["tokens"])
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, reasoning_effort="high",
                                           extra_body={"chat_template": template})
    response = client.responses.create(model="tiny", input="Hello", max_output_tokens=1, reasoning={"effort": "high"},
                                       extra_body={"chat_template": template})
    assert reply.usage.prompt_tokens == response.usage.input_tokens == count
    tiny = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="`reasoning_effort` is not supported for this model") as caught:
        tiny.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, reasoning_effort="low")
    assert caught.value.body["param"] == "reasoning_effort"


def test_an_untrusted_request_template_is_refused(tiny_server):
    """vLLM's 400 and text, whichever field carries the template; the model's template otherwise."""
    client = openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="x")
    for extra in ({"chat_template": REQUEST_TEMPLATE}, {"chat_template_kwargs": {"chat_template": REQUEST_TEMPLATE}}):
        with pytest.raises(openai.BadRequestError, match=UNTRUSTED):
            client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body=extra)
        assert UNTRUSTED in rendered(tiny_server, **extra)
        for path, body in (("/v1/responses", {"input": "Hello"}),
                           ("/v1/messages", {"messages": MESSAGES, "max_tokens": 1}),
                           ("/v1/messages/count_tokens", {"messages": MESSAGES})):
            reply = httpx.post(f"{tiny_server.base_url}{path}", json={"model": "tiny", **body, **extra})
            assert reply.status_code == 400 and UNTRUSTED in reply.text, (path, reply.text)
    assert rendered(tiny_server).startswith("<|im_start|>user\nHello")


def test_offline_chat_takes_a_template(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    params = SamplingParams(max_tokens=1, temperature=0)
    output = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=BRACKETS)[0]
    assert output.prompt_token_ids == llm.engine.tokenizer.encode("[user] Hello\n[assistant]",
                                                                  add_special_tokens=False)
    default = llm.chat(MESSAGES, params, use_tqdm=False)[0]
    assert default.prompt_token_ids != output.prompt_token_ids


def test_the_router_renders_chat_prompts_with_the_replicas_template(tiny_llama):
    from kvserve.model.loader import load_tokenizer

    tokenizer = load_tokenizer(tiny_llama)
    body = {"messages": MESSAGES}
    with_template = PromptTokens(tokenizer, BRACKETS).token_ids("chat", body)
    assert with_template == tokenizer.encode("[user] Hello\n[assistant]", add_special_tokens=False)
    assert PromptTokens(tokenizer).token_ids("chat", body) != with_template
    # a request with its own template is routed by load (not rendered in the router)
    assert PromptTokens(tokenizer).token_ids("chat", {**body, "chat_template": REQUEST_TEMPLATE}) is None


@pytest.mark.parametrize("value, message", [
    ("/no/such/template.jinja", "looks like a file path, but no such file exists"),
    ("{% for m in messages %}", "is not a valid Jinja template"),
])
def test_a_bad_chat_template_flag_is_a_one_line_error(capsys, value, message):
    from kvserve.cli import main

    for argv in (["serve", "--chat-template", value], ["router", "--backend", "http://a:1", "--chat-template", value]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
