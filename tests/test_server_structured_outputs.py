"""Structured outputs over HTTP with the official `openai` client against a real `kvserve serve`:
OpenAI's `response_format` (json_object, json_schema; `chat.completions.parse` with a pydantic
model), vLLM's `structured_outputs` and its older `guided_*` fields, on completions and chat; bad
constraints get a 400 with vLLM's texts. The default model's part loads it once (slow)."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

REGEX = r"[0-9]{3}-[a-c]{2}"
CHOICES = ["Elizabeth", "Darcy", "Jane"]
BOUNDED_SCHEMA = {"type": "object",
                  "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 99},
                                 "colour": {"enum": ["red", "green", "blue"]}},
                  "required": ["size", "colour"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tiny(tiny_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client: openai.OpenAI, content: str, **kwargs):
    return client.chat.completions.create(model=client.models.list().data[0].id,
                                          messages=[{"role": "user", "content": content}], **kwargs)


def complete(client: openai.OpenAI, prompt: str, **kwargs):
    return client.completions.create(model=client.models.list().data[0].id, prompt=prompt, **kwargs)


def check_bounded(text: str) -> None:
    value = json.loads(text)
    assert set(value) == {"size", "colour"} and 0 <= value["size"] <= 99 and value["colour"] in ("red", "green", "blue")


# ---------------------------------------------------------------------- tiny model: every spelling
@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": REGEX}}, {"guided_regex": REGEX}])
def test_regex_on_completions_and_chat(tiny, extra):
    outputs = complete(tiny, ["It is a truth", "Mr. Darcy"], max_tokens=40, n=2, seed=1, extra_body=extra)
    chats = chat(tiny, "Give a code.", max_tokens=40, n=2, seed=2, extra_body=extra)
    texts = [c.text for c in outputs.choices] + [c.message.content for c in chats.choices]
    assert len(texts) == 6
    for text in texts:
        assert re.fullmatch(REGEX, text), text
    assert {c.finish_reason for c in [*outputs.choices, *chats.choices]} == {"stop"}


@pytest.mark.parametrize("extra", [{"structured_outputs": {"choice": CHOICES}}, {"guided_choice": CHOICES}])
def test_choice_samples_always_match(tiny, extra):
    response = chat(tiny, "Who is proud?", max_tokens=20, n=8, temperature=1.0, seed=5, extra_body=extra)
    assert all(c.message.content in CHOICES for c in response.choices)
    assert all(c.finish_reason == "stop" for c in response.choices)


@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "guided_json"])
def test_json_schema_spellings_on_completions(tiny, field):
    value = {"response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": BOUNDED_SCHEMA}},
             "structured_outputs": {"json": BOUNDED_SCHEMA},
             "guided_json": json.dumps(BOUNDED_SCHEMA)}[field]
    response = complete(tiny, "A thing:", max_tokens=40, extra_body={field: value})
    check_bounded(response.choices[0].text)


def test_grammar_field(tiny):
    grammar = 'start: "yes" | "no" | "maybe " DIGIT\nDIGIT: /[0-9]/'
    for extra in ({"structured_outputs": {"grammar": grammar}}, {"guided_grammar": grammar}):
        text = complete(tiny, "Well?", max_tokens=10, extra_body=extra).choices[0].text
        assert re.fullmatch(r"yes|no|maybe [0-9]", text), text


def test_streamed_json_schema_reassembles_to_a_valid_object(tiny):
    stream = chat(tiny, "A thing:", max_tokens=40, n=2, temperature=1.0, seed=3, stream=True,
                  response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": BOUNDED_SCHEMA}})
    texts, finish = {0: "", 1: ""}, {}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert finish == {0: "stop", 1: "stop"}
    for text in texts.values():
        check_bounded(text)


def test_response_format_objects_are_closed_unless_strict_is_false(tiny):
    """A schema whose objects leave additionalProperties unset: closed (xgrammar's strict mode), so
    ten samples at temperature 1 hold only the declared keys; `strict: false` keeps it open, and the
    grammar then lets the model add keys (this tiny random model does, at temperature 1)."""
    open_schema = {"type": "object", "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 9}},
                   "required": ["size"]}

    def samples(strict):
        response_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": open_schema}}
        if strict is not None:
            response_format["json_schema"]["strict"] = strict
        response = chat(tiny, "A thing:", max_tokens=60, n=10, temperature=1.0, seed=4,
                        response_format=response_format)
        return [c.message.content for c in response.choices], [c.finish_reason for c in response.choices]

    texts, reasons = samples(None)
    assert reasons == ["stop"] * 10
    assert all(set(json.loads(t)) == {"size"} for t in texts), texts
    opened, _ = samples(False)
    assert any(not t.rstrip().endswith("}") or set(json.loads(t)) != {"size"} for t in opened), opened


def test_max_tokens_cut_reports_length(tiny):
    schema = {"type": "object", "properties": {"story": {"type": "string", "minLength": 500}}, "required": ["story"]}
    response = chat(tiny, "Tell a story.", max_tokens=12, response_format={
        "type": "json_schema", "json_schema": {"name": "story", "schema": schema}})
    assert response.choices[0].finish_reason == "length"
    assert response.choices[0].message.content.startswith('{"story": "')


@pytest.mark.parametrize("body, message", [
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "You can only use one kind of structured outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "You can only use one kind"),
    ({"structured_outputs": {"json": {"type": "object"}}, "guided_choice": ["a"]}, "You can only use one kind"),
    ({"structured_outputs": {}}, "You must use one kind"),
    ({"structured_outputs": {"regex": "[a-"}}, "Grammar error"),
    ({"guided_regex": "(unclosed"}, "Grammar error"),
    ({"guided_regex": "(a{1000}){1000}"}, "unroll to more than 100000 characters"),  # a 200 of nothing before
    ({"structured_outputs": {"grammar": "start: missing_rule"}}, "unknown name"),
    ({"guided_json": "{not json"}, "Invalid grammar specification"),
    ({"guided_json": {"type": "strange"}}, "strange"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "string"}}, "if": {"required": ["a"]}}}}}, '"if"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"choice": []}}, "non-empty list"),
    ({"structured_outputs": {"regex": "a", "backend": "outlines"}}, "backend"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
])
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_bad_constraints_get_a_400(tiny_server, route, body, message):
    prompt = {"prompt": "Hi"} if route == "completions" else {"messages": [{"role": "user", "content": "Hi"}]}
    response = httpx.post(f"{tiny_server.base_url}/v1/{route}", json={**prompt, "max_tokens": 5, **body}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error", error


# ---------------------------------------------------------------------- the default model
class Person(BaseModel):
    name: str = Field(max_length=40)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=40)
    occupation: str = Field(max_length=40)
    likes_tea: bool
    mood: Literal["happy", "calm", "busy"]


PEOPLE = ["Invent a person who lives in Paris.", "Describe a fictional doctor from Tokyo.",
          "Make up a teacher living in Cairo.", "Create a character: a young painter from Lima.",
          "Describe an old fisherman from Oslo.", "Invent a chef who lives in Rome.",
          "Describe a student from Nairobi.", "Create a retired pilot from Sydney.",
          "Invent a musician from Vienna.", "Describe a farmer from Kansas."]
OBJECT_PROMPTS = ['What is the capital of France? Reply with a JSON object with the key "capital".',
                  'Give the name and age of a fictional person as a JSON object with keys "name" and "age".',
                  'Translate "hello" into French. Reply as JSON: {"translation": ...}.',
                  'Is water wet? Answer with a JSON object {"answer": true or false}.',
                  'What is 2 + 2? Answer with a JSON object with the key "result".']


@pytest.fixture(scope="module")
def default_client(server_factory) -> openai.OpenAI:
    server = server_factory("--kv-cache-memory", "256MiB", "--max-model-len", "2048")
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.mark.slow
def test_parse_returns_a_valid_object_for_every_prompt(default_client):
    """`chat.completions.parse(response_format=PydanticModel)`: every answer is a Person."""
    model = default_client.models.list().data[0].id
    for prompt in PEOPLE:
        response = default_client.chat.completions.parse(
            model=model, messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
            response_format=Person, max_tokens=300, temperature=0)
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Person), choice.message.content


@pytest.mark.slow
def test_a_schema_without_additional_properties_gets_no_extra_keys_at_temperature_1(default_client):
    """Ten samples at temperature 1 of a schema that leaves additionalProperties unset: closed, so
    none invents keys (issue 44: two of ten ran to `length` inventing them)."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"]}
    response = chat(default_client, PEOPLE[0] + " Answer in JSON.", max_tokens=100, n=10, temperature=1.0, seed=7,
                    response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    for choice in response.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert set(json.loads(choice.message.content)) == {"name", "age"}


@pytest.mark.slow
def test_json_object_output_always_parses(default_client):
    for prompt in OBJECT_PROMPTS:
        response = chat(default_client, prompt, max_tokens=300, temperature=0, response_format={"type": "json_object"})
        assert response.choices[0].finish_reason == "stop", response.choices[0].message.content
        assert isinstance(json.loads(response.choices[0].message.content), dict)


@pytest.mark.slow
def test_regex_and_choice_on_the_default_model(default_client):
    phone = r"\+[0-9]{2} [0-9]{3} [0-9]{4}"
    response = chat(default_client, "Give me a phone number.", max_tokens=30, n=3, temperature=0.7, seed=1,
                    extra_body={"structured_outputs": {"regex": phone}})
    assert all(re.fullmatch(phone, c.message.content) for c in response.choices), response.choices
    response = chat(default_client, "Is the sky blue? Answer yes or no.", max_tokens=5, temperature=0,
                    extra_body={"guided_choice": ["yes", "no"]})
    assert response.choices[0].message.content in ("yes", "no")
