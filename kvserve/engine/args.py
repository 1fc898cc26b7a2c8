"""Engine options, defined once. `generate`, `chat`, `serve`, `bench` and `LLM(...)` all take them
from here, so an option added to this dataclass is a flag everywhere (vLLM's flag names)."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from kvserve.cache.eviction import NO_EVICTION, POLICY_CHOICES
from kvserve.cache.formats import KV_CACHE_DTYPES
from kvserve.model.cpu_attention import ATTENTION_BACKENDS


def _opt(help: str, **argparse_kwargs: Any) -> Any:
    """Dataclass field metadata: the CLI help text and any extra argparse settings."""
    return {"help": help, **argparse_kwargs}




@dataclass
class EngineArgs:
    model: str | None = field(default=None, metadata=_opt(
        "HF model directory, GGUF file or locally cached hub id (default: the bundled SmolLM2-135M-Instruct)"))
    dtype: str = field(default="auto", metadata=_opt(
        "weight and activation dtype; auto = bfloat16 on CUDA, and on CPUs with native bf16 matmul, else float32",
        choices=("auto", "float32", "bfloat16", "float16")))
    device: str = field(default="auto", metadata=_opt("cpu, cuda, cuda:N or auto"))
    block_size: int = field(default=16, metadata=_opt("tokens per KV-cache block", choices=(8, 16, 32, 64, 128)))
    kv_cache_memory: str | None = field(default=None, metadata=_opt(
        "KV pool budget in bytes or with a unit (4GiB, 512MiB); default: CPU min(4GiB, RAM/4), "
        "CUDA from --gpu-memory-utilization after a profiling pass"))
    gpu_memory_utilization: float = field(default=0.9, metadata=_opt(
        "fraction of GPU memory kvserve may use (weights + activations + KV cache); CUDA only"))
    max_model_len: int | None = field(default=None, metadata=_opt(
        "longest sequence (prompt + output) in tokens; default: the model's max_position_embeddings",
        type=int))
    max_num_seqs: int = field(default=256, metadata=_opt("maximum sequences in one batch"))
    max_num_batched_tokens: int = field(default=2048, metadata=_opt(
        "token budget per step (decodes + prefill chunks); longer prompts are prefilled in chunks"))
    kv_cache_dtype: str = field(default="auto", metadata=_opt(
        "storage dtype of the KV cache; auto = the model dtype", choices=KV_CACHE_DTYPES))
    enable_prefix_caching: bool = field(default=True, metadata=_opt(
        "reuse the KV cache of shared prompt prefixes (automatic prefix caching)",
        action=argparse.BooleanOptionalAction))
    kv_eviction: str = field(default=NO_EVICTION, metadata=_opt(
        "KV eviction policy: none; streaming (StreamingLLM: sink tokens + recent window); h2o (heavy "
        "hitters + recent window). With a policy a sequence holds at most --kv-budget tokens (+ one block) "
        "and may run past max-model-len", choices=POLICY_CHOICES))
    kv_budget: int | None = field(default=None, metadata=_opt(
        "tokens a sequence under --kv-eviction may hold, sinks included (<= max-model-len)", type=int))
    sink_tokens: int | None = field(default=None, metadata=_opt(
        "first tokens always kept under --kv-eviction (default 4)", type=int))
    recent_tokens: int | None = field(default=None, metadata=_opt(
        "newest tokens always kept under --kv-eviction (default: streaming budget - sinks; h2o half of that)",
        type=int))
    attention_backend: str = field(default="auto", metadata=_opt(
        "decode attention: cpu_paged = a C++ kernel reading the paged pool in place (built on first use); "
        "torch = gather the blocks, then torch matmuls (the CUDA path); auto = cpu_paged on CPU when it "
        "builds and reads the KV cache dtype (the model dtype, fp8, int8, int4), else torch", choices=ATTENTION_BACKENDS))
    seed: int = field(default=0, metadata=_opt("seed of the global random generator"))

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        group = parser.add_argument_group("engine options")
        for f in fields(cls):
            if f.name in skip:
                continue
            kwargs = dict(f.metadata)
            default = f.default if f.default is not MISSING else None
            if "action" not in kwargs and "type" not in kwargs:
                kwargs["type"] = str if default is None else type(default)
            group.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=default, **kwargs)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls) if hasattr(namespace, f.name)})
