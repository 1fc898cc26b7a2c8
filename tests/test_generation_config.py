"""The model creator's sampling defaults (`--generation-config`, vLLM's): a request that leaves a
sampling field unset gets the model's generation_config.json value, its max_new_tokens caps HTTP
requests and bounds requests without max_tokens; `vllm` and `--override-generation-config`."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from server_process import TINY_SERVER_ARGS

from kvserve import LLM, SamplingParams
from kvserve.engine.generation_defaults import load_generation_defaults

SHIPPED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 7, "do_sample": True,
           "repetition_penalty": 1.0, "bos_token_id": 1, "eos_token_id": 2}


def with_generation_config(model: Path, directory: Path, config: dict) -> Path:
    shutil.copytree(model, directory, dirs_exist_ok=True)
    (directory / "generation_config.json").write_text(json.dumps(config))
    return directory


def test_defaults_are_read_as_vllm_reads_them(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "generation_config.json").write_text(json.dumps(SHIPPED))
    defaults = load_generation_defaults("auto", model, None)
    assert defaults.sampling == {"temperature": 0.6, "top_p": 0.9, "top_k": 20} and defaults.max_tokens == 7
    assert load_generation_defaults("vllm", model, None).sampling == {}
    (model / "generation_config.json").write_text(json.dumps({"top_k": 50, "temperature": 0.7}))
    assert load_generation_defaults("auto", model, None).sampling == {"temperature": 0.7}  # vLLM skips top_k 50
    (model / "generation_config.json").write_text(json.dumps(SHIPPED))
    assert load_generation_defaults(str(model), tmp_path / "elsewhere.gguf", None).max_tokens == 7
    assert load_generation_defaults("auto", tmp_path / "model.gguf", None).sampling == {}  # a GGUF has none
    overridden = load_generation_defaults("auto", model, '{"temperature": 0.2, "max_new_tokens": 3}')
    assert overridden.sampling["temperature"] == 0.2 and overridden.max_tokens == 3
    assert load_generation_defaults("vllm", model, {"top_k": 5}).sampling == {"top_k": 5}


@pytest.mark.parametrize("setting, overrides, message", [
    ("auto", '{"temprature": 0.5}', "'temprature' would do nothing"),
    ("auto", "temperature=0.5", "must be a JSON object"),
    ("auto", '{"temperature": -1}', "temperature must be non-negative"),
    ("auto", '{"max_new_tokens": 0}', "max_new_tokens must be at least 1"),
    ("/no/such/dir", None, "no generation_config.json there"),
])
def test_bad_settings_are_one_line_errors(tmp_path, setting, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_generation_defaults(setting, tmp_path, overrides)


def test_offline_generate_without_params_uses_the_models_defaults(tiny_llama, tmp_path):
    model = with_generation_config(tiny_llama, tmp_path / "greedy", {"temperature": 0.0, "max_new_tokens": 5})
    llm = LLM(str(model), dtype="float32", kv_cache_memory="8MiB")
    default = llm.get_default_sampling_params()
    assert default.temperature == 0.0 and default.max_tokens == 5
    [output] = llm.generate(["It is a truth"], use_tqdm=False)
    [greedy] = llm.generate(["It is a truth"], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)
    assert output.outputs[0].token_ids == greedy.outputs[0].token_ids and len(greedy.outputs[0].token_ids) == 5
    # explicit offline params keep their max_tokens (vLLM's); "up to the context" stops at max_new_tokens
    [longer] = llm.generate(["It is a truth"], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
                            use_tqdm=False)
    [open_ended] = llm.generate(["It is a truth"], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True),
                                use_tqdm=False)
    assert len(longer.outputs[0].token_ids) == 9 and len(open_ended.outputs[0].token_ids) == 5
    engine_defaults = LLM(str(model), dtype="float32", kv_cache_memory="8MiB", generation_config="vllm")
    assert engine_defaults.get_default_sampling_params() == SamplingParams()


def test_the_server_fills_unset_fields_and_caps_max_tokens(server_factory, tiny_llama, tmp_path_factory):
    model = with_generation_config(tiny_llama, tmp_path_factory.mktemp("gen") / "model",
                                   {"temperature": 0.0, "max_new_tokens": 6})
    server = server_factory(str(model), *TINY_SERVER_ARGS)
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    messages = [{"role": "user", "content": "Hello"}]
    ignore_eos = {"extra_body": {"ignore_eos": True}}
    # no temperature: the model's 0, so the reply is the greedy one; no max_tokens: at most 6
    first = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, **ignore_eos)
    greedy = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=6,
                                            logprobs=True, top_logprobs=1, **ignore_eos)
    assert first.usage.completion_tokens == 6
    assert [t.token for t in first.choices[0].logprobs.content] == [t.top_logprobs[0].token
                                                                   for t in greedy.choices[0].logprobs.content]
    # Anthropic's Messages: the cap is reported as max_tokens, not as a full context window
    anthropic = httpx.post(f"{server.base_url}/v1/messages", json={
        "model": "tiny", "max_tokens": 100, "messages": messages, "ignore_eos": True}).json()
    assert anthropic["usage"]["output_tokens"] == 6 and anthropic["stop_reason"] == "max_tokens"
    capped = client.completions.create(model="tiny", prompt="It is", max_tokens=50, **ignore_eos)
    assert capped.usage.completion_tokens == 6 and capped.choices[0].finish_reason == "length"
    overridden = server_factory(str(model), *TINY_SERVER_ARGS, "--override-generation-config",
                                '{"max_new_tokens": 2}')
    client = openai.OpenAI(base_url=f"{overridden.base_url}/v1", api_key="x")
    assert client.chat.completions.create(model="tiny", messages=messages, **ignore_eos).usage.completion_tokens == 2
    engine_defaults = server_factory(str(model), *TINY_SERVER_ARGS, "--generation-config", "vllm")
    client = openai.OpenAI(base_url=f"{engine_defaults.base_url}/v1", api_key="x")
    assert client.completions.create(model="tiny", prompt="It is", max_tokens=9,
                                     **ignore_eos).usage.completion_tokens == 9


def test_the_cli_sampling_flags_fall_back_to_the_model_then_greedy():
    import argparse

    from kvserve.entrypoints.offline import sampling_params_from_args

    args = argparse.Namespace(max_tokens=4, temperature=None, top_p=None, top_k=5, sampling_seed=None,
                              ignore_eos=False)
    assert sampling_params_from_args(args).temperature == 0.0  # no generation config: greedy
    params = sampling_params_from_args(args, {"temperature": 0.6, "top_p": 0.9, "top_k": 20})
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 5)  # a given flag wins
