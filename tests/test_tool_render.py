"""Tool conversations in the prompt: through the chat template where it renders tools and calls,
in hermes text where it does not (the tiny model's template, like SmolLM2's, only concatenates
`content`)."""
from __future__ import annotations

import copy
import json

from kvserve.engine.output_processor import apply_chat_template
from kvserve.server.prompts import conversation
from kvserve.server.protocol import ChatMessage
from kvserve.engine.tool_prompts import render_messages

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]
NATIVE_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def messages() -> list[dict]:
    return conversation([ChatMessage.model_validate(m) for m in [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "rain"},
    ]])


def render(tokenizer, template: str) -> str:
    tokenizer = copy.copy(tokenizer)
    tokenizer.chat_template = template
    return tokenizer.decode(apply_chat_template(tokenizer, messages(), True, TOOLS))


def test_a_template_that_knows_tools_gets_them_as_transformers_passes_them(tiny_tokenizer):
    text = render(tiny_tokenizer, NATIVE_TEMPLATE)
    assert "TOOLS:get_weather;" in text
    assert 'CALL get_weather {"city": "Paris"}CALL get_weather {"city": "Rome"}' in text  # arguments as objects
    assert "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>tool\nrain<|im_end|>" in text
    assert "<tool_call>" not in text and "<tools>" not in text


def test_a_template_without_tools_gets_them_in_hermes_text(tiny_tokenizer):
    text = render(tiny_tokenizer, tiny_tokenizer.chat_template)
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools")
    assert f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>" in system
    assert ("<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
            "</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}\n</tool_call>"
            "<|im_end|>") in text
    # consecutive results: one user turn
    assert ("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n") in text


def test_without_a_system_message_one_is_added_for_the_tools():
    rendered, tools = render_messages([{"role": "user", "content": "hi"}], TOOLS, "{{ messages }}")
    assert tools is None and rendered[0]["role"] == "system" and "<tools>" in rendered[0]["content"]
    assert rendered[1] == {"role": "user", "content": "hi"}


def test_openai_wire_messages_render_the_same_offline(tiny_tokenizer, tiny_llama):
    """Arguments as JSON text (what OpenAI's API and clients send) render like objects; the offline
    `LLM.chat(..., tools=)` takes the same conversations."""
    from kvserve import LLM, SamplingParams

    wire = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "a", "content": "sunny"}]
    parsed = conversation([ChatMessage.model_validate(m) for m in wire])
    assert apply_chat_template(tiny_tokenizer, wire, True, TOOLS) == apply_chat_template(tiny_tokenizer, parsed, True, TOOLS)
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="16MiB")
    [output] = llm.chat(wire, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False, tools=TOOLS)
    assert output.prompt_token_ids == apply_chat_template(llm.engine.tokenizer, wire, True, TOOLS)
    assert output.outputs[0].token_ids


def test_other_message_keys_reach_the_template(tiny_tokenizer):
    """A reasoning model's template reads an earlier turn's `reasoning_content` (vLLM passes a
    message's other keys through); a template that does not use a key never sees it in the text."""
    template = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}[{{ m.reasoning_content }}]{% endif %}"
                "{{ m.content }};{% endfor %}")
    turns = conversation([ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"}]])
    assert turns[1]["reasoning_content"] == "greet back"
    tokenizer = copy.copy(tiny_tokenizer)
    tokenizer.chat_template = template
    assert tokenizer.decode(apply_chat_template(tokenizer, turns, False, None)) == "user:Hi;assistant:[greet back]Hello;"
