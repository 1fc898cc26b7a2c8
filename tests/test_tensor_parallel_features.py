"""What else users run keeps working under tensor parallelism: logprobs and prompt logprobs,
structured outputs, `kvserve bench serve` against a TP=2 server and `kvserve eval
--tensor-parallel-size 2`. Each HTTP request goes to a TP=2 server and to the single-process
tiny server (both float32), whose answers must agree: the tokens exactly, the logprobs within
float32 rounding of the all-reduces' summation order."""
from __future__ import annotations

import json

import openai
import pytest
from server_process import TINY_SERVER_ARGS

from kvserve.cli import main

CLOSE = 1e-4
SCHEMA = {"type": "object",
          "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 99},
                         "colour": {"enum": ["red", "green", "blue"]}},
          "required": ["size", "colour"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tp_server(server_factory, tiny_llama):
    return server_factory(str(tiny_llama), *TINY_SERVER_ARGS, "--tensor-parallel-size", "2")


@pytest.fixture(scope="module")
def clients(tiny_server, tp_server) -> tuple[openai.OpenAI, openai.OpenAI]:
    """(one process, TP=2)."""
    return tuple(openai.OpenAI(base_url=f"{s.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
                 for s in (tiny_server, tp_server))


def assert_close(expected, actual) -> None:
    """Equal JSON trees, except that floats may differ by CLOSE."""
    if isinstance(expected, float):
        assert actual == pytest.approx(expected, abs=CLOSE)
    elif isinstance(expected, dict):
        assert expected.keys() == actual.keys()
        for key in expected:
            assert_close(expected[key], actual[key])
    elif isinstance(expected, list):
        assert len(expected) == len(actual)
        for e, a in zip(expected, actual):
            assert_close(e, a)
    else:
        assert expected == actual


def test_logprobs_and_prompt_logprobs(clients):
    """echo + logprobs on completions (lm-evaluation-harness's request), vLLM's prompt_logprobs
    and chat's top_logprobs."""
    answers = []
    for client in clients:
        completion = client.completions.create(model="tiny", prompt="It is a truth universally acknowledged",
                                               max_tokens=4, echo=True, logprobs=3, temperature=0,
                                               extra_body={"ignore_eos": True, "prompt_logprobs": 2})
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                              max_tokens=4, logprobs=True, top_logprobs=3, temperature=0,
                                              extra_body={"ignore_eos": True})
        answers.append([completion.choices[0].model_dump(), completion.model_extra.get("prompt_logprobs")
                        or completion.choices[0].model_extra.get("prompt_logprobs"),
                        chat.choices[0].model_dump()])
    single, parallel = answers
    assert single[1], "the prompt logprobs came back"
    assert single[0]["logprobs"]["token_logprobs"][1] is not None
    assert_close(single, parallel)


def test_json_schema_response_format(clients):
    texts = []
    for client in clients:
        reply = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "A thing:"}], max_tokens=40, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
        texts.append(reply.choices[0].message.content)
    value = json.loads(texts[1])
    assert set(value) == {"size", "colour"} and value["colour"] in ("red", "green", "blue")
    assert texts[1] == texts[0]


def test_bench_serve_against_a_tp_server(tp_server, tiny_llama, tmp_path, capsys):
    out = tmp_path / "bench.json"
    code = main(["bench", "serve", "--base-url", tp_server.base_url, "--model", "tiny", "--tokenizer",
                 str(tiny_llama), "--num-prompts", "6", "--random-input-len", "16", "--random-output-len", "4",
                 "--max-concurrency", "3", "--disable-tqdm", "--save-result", str(out)])
    assert code == 0, capsys.readouterr()
    data = json.loads(out.read_text())
    assert data["completed"] == 6 and data["failed"] == 0 and data["total_output_tokens"] > 0


def test_eval_with_tensor_parallel_size(tiny_llama, capsys):
    """Two KV dtypes: two TP=2 engines, one after the other, in the eval process; the same
    perplexity and KL as one process."""
    results = []
    for tp in ("1", "2"):
        code = main(["eval", "--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-dtypes", "auto,fp8",
                     "--kv-cache-memory", "8MiB", "--num-tokens", "16", "--context-len", "16", "--score-len", "16",
                     "--chunk-size", "8", "--no-passkey", "--json", "--tensor-parallel-size", tp])
        assert code == 0
        results.append([r["fidelity"] for r in json.loads(capsys.readouterr().out)["results"]])
    single, parallel = results
    for s, p in zip(single, parallel):
        assert p["perplexity"] == pytest.approx(s["perplexity"], rel=1e-4)
        assert p["mean_kl"] == pytest.approx(s["mean_kl"], abs=1e-5)
        assert p["top1_agreement"] == s["top1_agreement"]
