"""Engine options, defined once. `generate`, `chat`, `serve`, `bench` and `LLM(...)` all take them
from here, so an option added to this dataclass is a flag everywhere (vLLM's flag names)."""
from __future__ import annotations

import argparse
import os
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import torch

from kvserve.cache.eviction import NO_EVICTION, POLICY_CHOICES
from kvserve.cache.formats import KV_CACHE_DTYPES
from kvserve.engine.generation_defaults import parse_overrides
from kvserve.engine.scheduler import SCHEDULING_POLICIES
from kvserve.engine.speculative import SpeculativeConfig
from kvserve.units import parse_size
from kvserve.hardware import triton_unavailable
from kvserve.model.attention import attention_backend_names
from kvserve.model.quant_linear import QUANTIZATION_MODES

# A --kv-cache-memory above this (1 PiB) is a typo, not a machine.
MAX_KV_CACHE_BYTES = 1 << 50
# Options only the embeddings path reads: commands that never embed do not take them.
EMBEDDING_ARGS = ("pooling_type",)
# The disk KV tier's size when --kv-offloading-disk-path is given without --kv-offloading-disk-size.
DEFAULT_DISK_TIER_GIB = 10.0


def _opt(help: str, **argparse_kwargs: Any) -> Any:
    """Dataclass field metadata: the CLI help text and any extra argparse settings."""
    return {"help": help, **argparse_kwargs}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int, optional: bool = False) -> None:
    """`value` is an int >= minimum (or None when optional); ValueError naming the flag otherwise."""
    if value is None and optional:
        return
    if not _is_int(value):
        raise ValueError(f"{_flag(name)} must be an integer, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise ValueError(f"{_flag(name)} must be {'positive' if minimum == 1 else f'at least {minimum}'}, got {value}")


def _device_type(name: str) -> str:
    """The device type a checked --device value resolves to (auto: cuda where torch sees a GPU)."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name).type


def _check_device(name: Any) -> None:
    """cpu, cuda, cuda:N or auto, and CUDA only where torch sees a GPU."""
    expected = "--device must be cpu, cuda, cuda:N or auto"
    if not isinstance(name, str):
        raise ValueError(f"{expected}, got {name!r}")
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"{expected}, got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{expected}, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available (torch {torch.__version__} sees no GPU)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA device(s)")


def _check_size(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{_flag(name)} must be bytes or a size like 4GiB, got {value!r}")
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{_flag(name)}: {exc}") from None
    if size > MAX_KV_CACHE_BYTES:
        raise ValueError(f"{_flag(name)} {value!r} is more than 1 PiB ({MAX_KV_CACHE_BYTES} bytes): "
                         f"use bytes or a unit like 512MiB, 4GiB")


@dataclass
class EngineArgs:
    model: str | None = field(default=None, metadata=_opt(
        "HF model directory, GGUF file or locally cached hub id (default: the bundled SmolLM2-135M-Instruct)"))
    load_format: str = field(default="auto", metadata=_opt(
        "how the weights are read (vLLM's flag): auto = as the model path is; safetensors or gguf = the path "
        "must be that; dummy = random weights of the shapes in an HF directory's config.json, no weight files "
        "needed (to measure a model's shapes without its checkpoint; the output is noise)",
        choices=("auto", "safetensors", "gguf", "dummy")))
    tokenizer: str | None = field(default=None, metadata=_opt(
        "load the tokenizer (and chat template) from here instead of the model (vLLM's flag): a directory "
        "with a Hugging Face tokenizer, a GGUF file or a locally cached hub id; e.g. a GGUF's base model's "
        "tokenizer. Its vocabulary must fit the model's"))
    trust_remote_code: bool = field(default=False, metadata=_opt(
        "let transformers run a checkpoint's own Python code for its tokenizer or config (vLLM's flag); "
        "without it such a checkpoint is refused", action="store_true"))
    dtype: str = field(default="auto", metadata=_opt(
        "weight and activation dtype; auto = bfloat16 on CUDA, and on CPUs with native bf16 matmul, else float32",
        choices=("auto", "float32", "bfloat16", "float16")))
    quantization: str = field(default="auto", metadata=_opt(
        "weight quantization: auto = as the checkpoint stores them (a GGUF's Q4_0/Q4_1/Q4_K stay int4, Q8_0 "
        "int8, other quantized types int8 in groups of 32; "
        "a safetensors checkpoint stays --dtype); none = dequantize to --dtype; int8 (per output channel) or "
        "int4 (groups of 32; the LM head int8) = quantize at load", choices=QUANTIZATION_MODES))
    device: str = field(default="auto", metadata=_opt("cpu, cuda, cuda:N or auto"))
    block_size: int = field(default=16, metadata=_opt("tokens per KV-cache block", choices=(8, 16, 32, 64, 128)))
    kv_cache_memory: str | int | None = field(default=None, metadata=_opt(
        "KV pool budget in bytes or with a unit (4GiB, 512MiB), per process; default: CPU min(4GiB, RAM/4 "
        "shared by the TP ranks and DP replicas on the machine) (generate "
        "and chat: one sequence of max-model-len), CUDA from --gpu-memory-utilization after a profiling pass"))
    enforce_eager: bool = field(default=False, metadata=_opt(
        "CUDA: run every step eagerly, without replaying decode steps from CUDA graphs (vLLM's flag)",
        action="store_true"))
    max_cudagraph_capture_size: int | None = field(default=None, metadata=_opt(
        "CUDA: the largest decode batch captured in a CUDA graph (sizes 1, 2, 4, then multiples of 8 up to "
        "it); larger decode steps run eagerly. Default: --max-num-seqs, at most 512", type=int))
    async_scheduling: bool = field(default=False, metadata=_opt(
        "schedule and prepare the next step while the device runs this one (vLLM's flag): a decode reads "
        "its input token on the device; the host waits for a step's tokens only after launching the next. "
        "Steps with requests under KV eviction or asking for prompt logprobs run one at a time. On CPU the "
        "forward pass runs in the engine's thread, so nothing overlaps there", action="store_true"))
    scheduling_policy: str = field(default="fcfs", metadata=_opt(
        "which waiting request is admitted first and which running one is preempted when the KV pool runs "
        "dry (vLLM's flag): fcfs = arrival order, the newest preempted; priority = by each request's "
        "`priority` (lower first, ties by arrival), the least urgent preempted. Under fcfs a priority "
        "other than 0 is refused", choices=SCHEDULING_POLICIES))
    gpu_memory_utilization: float = field(default=0.9, metadata=_opt(
        "fraction of GPU memory kvserve may use (weights + activations + KV cache); CUDA only"))
    max_model_len: int | None = field(default=None, metadata=_opt(
        "longest sequence (prompt + output) in tokens; default: the model's max_position_embeddings, "
        "lowered to what the KV budget holds",
        type=int))
    max_num_seqs: int | None = field(default=None, metadata=_opt(
        "maximum sequences in one batch. Default: 256 on CPU; on CUDA vLLM's, 1024 on a GPU of 70 GiB or more "
        "other than an A100, else 256", type=int))
    max_num_batched_tokens: int | None = field(default=None, metadata=_opt(
        "token budget per step (decodes + prefill chunks); longer prompts are prefilled in chunks. "
        "Default: 2048 on CPU; on CUDA vLLM's, 8192 served and 16384 offline on a GPU of 70 GiB or more "
        "other than an A100, else 2048 served and 8192 offline", type=int))
    enable_chunked_prefill: bool = field(default=True, metadata=_opt(
        "split a prompt longer than a step's token budget over several steps, beside the running decodes "
        "(vLLM's flag and default). Without it a prompt is computed in one step or waits, and "
        "--max-num-batched-tokens defaults to at least --max-model-len (it may not be less)",
        action=argparse.BooleanOptionalAction))
    long_prefill_token_threshold: int = field(default=0, metadata=_opt(
        "with chunked prefill: while other requests run or wait, a prompt advances at most this many tokens "
        "a step, so that one long prompt does not hold up the others' prefills (vLLM's flag; 0 = no cap)",
        type=int))
    kv_cache_dtype: str = field(default="auto", metadata=_opt(
        "storage dtype of the KV cache; auto = the model dtype", choices=KV_CACHE_DTYPES))
    enable_prefix_caching: bool = field(default=True, metadata=_opt(
        "reuse the KV cache of shared prompt prefixes (automatic prefix caching)",
        action=argparse.BooleanOptionalAction))
    kv_eviction: str = field(default=NO_EVICTION, metadata=_opt(
        f"KV eviction policy: {', '.join(POLICY_CHOICES)} (one module each in kvserve/cache/eviction/policies). "
        "A policy keeps sink tokens, a recent window and the tokens it scores highest; with one a sequence "
        "holds at most --kv-budget tokens (+ one block) and may run past max-model-len", choices=POLICY_CHOICES))
    kv_budget: int | None = field(default=None, metadata=_opt(
        "tokens a sequence under --kv-eviction may hold, sinks included (<= max-model-len)", type=int))
    sink_tokens: int | None = field(default=None, metadata=_opt(
        "first tokens always kept under --kv-eviction (default 4)", type=int))
    recent_tokens: int | None = field(default=None, metadata=_opt(
        "newest tokens always kept under --kv-eviction (default: the policy's own, given in its module's "
        "docstring; budget - sinks for a policy that only keeps sinks and recent tokens)",
        type=int))
    pooling_type: str = field(default="LAST", metadata=_opt(
        "how /v1/embeddings pools a sequence's final hidden states (vLLM's pooling types): LAST = the last "
        "token's, MEAN = the mean over all tokens; L2-normalised either way", choices=("LAST", "MEAN")))
    attention_backend: str = field(default="auto", metadata=_opt(
        "how attention reads the paged KV pool (kvserve/model/attention/): triton = Triton kernels reading every "
        "KV dtype in place (CUDA; on CPU only under TRITON_INTERPRET=1, for tests); cpu_paged = a C++ decode "
        "kernel reading the pool in place (kvserve build-kernel); torch = gather the blocks, then torch ops; "
        "auto = triton on CUDA, cpu_paged on CPU, where they serve the configuration, else torch "
        "(the start-up log says which and why)", choices=attention_backend_names))
    deterministic: bool = field(default=False, metadata=_opt(
        "batch-invariant inference: a request's tokens (greedy, or sampled with a seed) depend on the request "
        "alone, not on batching, chunked prefill, prefix-cache hits, KV tiers, preemption or the thread count "
        "(CPU; CUDA through Triton kernels; README, 'Deterministic inference'). "
        "Alias: --enable-deterministic-inference (SGLang's name)",
        action=argparse.BooleanOptionalAction, aliases=("--enable-deterministic-inference",)))
    speculative_config: str | dict | None = field(default=None, metadata=_opt(
        "speculative decoding, as vLLM's JSON: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' drafts up to that many tokens a decode by "
        "looking the sequence's last tokens up earlier in it (prompt lookup), and keeps those the model "
        "confirms in the same step; the tokens' distribution is unchanged (README, 'Speculative decoding'). "
        "\"disable_by_batch_size\": N drafts nothing while more than N requests run. Only the ngram method is built"))
    kv_offloading_size: float | None = field(default=None, metadata=_opt(
        "GiB of host memory for the KV offload tier (vLLM's flag): published prefix-cache blocks the pool "
        "reclaims are kept there and loaded back on a prefix hit; 0 or absent: off", type=float))
    kv_offloading_disk_path: str | None = field(default=None, metadata=_opt(
        "directory of the disk KV tier (created 0700; shareable by several servers): blocks leaving the "
        "host tier (or the pool, without one) are written there and survive restarts; absent: off"))
    kv_offloading_disk_size: float | None = field(default=None, metadata=_opt(
        f"GiB the disk KV tier's directory may hold (least recently used files are removed beyond it); "
        f"needs --kv-offloading-disk-path. Default {DEFAULT_DISK_TIER_GIB:g}", type=float))
    kv_offloading_disk_key: str | None = field(default=None, metadata=_opt(
        "authenticate the disk tier's blocks with HMAC-SHA256 under a secret key, so that whoever can write "
        "the directory but not read the key cannot forge a block: `auto` keeps the key in the directory "
        "(DIR/.kvserve-block-key, 0600, made on first use), a path keeps it there (off the shared storage); "
        "processes sharing a directory use one key. Absent: a CRC-32, which catches accidents only"))
    max_logprobs: int = field(default=20, metadata=_opt(
        "most logprobs (per generated token) and prompt_logprobs a request may ask for; -1: no limit"))
    generation_config: str = field(default="auto", metadata=_opt(
        "the model creator's sampling defaults (vLLM's flag): auto = the model's generation_config.json "
        "(its temperature, top_p, top_k, min_p and repetition_penalty for requests that leave them unset; its "
        "max_new_tokens caps HTTP requests' max_tokens and bounds requests without one); vllm = the engine's "
        "own defaults; or a directory holding a generation_config.json"))
    override_generation_config: str | dict | None = field(default=None, metadata=_opt(
        "a JSON object of those keys (max_new_tokens included) laid over the generation config, e.g. "
        "'{\"temperature\": 0.5}' (vLLM's flag)"))
    seed: int | None = field(default=0, metadata=_opt(
        "seed of the global random generator (unseeded requests draw from it); LLM(seed=None): a random seed"))
    tensor_parallel_size: int = field(default=1, metadata=_opt(
        "split every layer over this many processes (Megatron-style, torch.distributed: gloo on CPU, NCCL on "
        "CUDA); each holds 1/N of the attention heads, the MLP and the KV cache. Sizes, budgets and --dtype "
        "are per process (per device)"))
    nnodes: int = field(default=1, metadata=_opt(
        "machines the --tensor-parallel-size processes are spread over (evenly); node 0 runs the engine"))
    node_rank: int = field(default=0, metadata=_opt(
        "this machine's index among --nnodes; a node other than 0 only runs workers (no server, no engine)"))
    master_addr: str | None = field(default=None, metadata=_opt(
        "address of node 0, where the processes meet (default: $MASTER_ADDR, else 127.0.0.1)"))
    master_port: int | None = field(default=None, metadata=_opt(
        "port on node 0 where the processes meet (default: $MASTER_PORT, else a free port on one node; "
        "required with --nnodes > 1)", type=int))

    def validate(self) -> None:
        """Check every option's type and range, touching neither the model nor the disk, so that a
        bad value fails at once with one line (ValueError) wherever the engine is built from: the
        CLI, `LLM(...)`, the server. Checks against the model (max-model-len, KV capacity) follow
        in kvserve/engine/preflight.py, still before the weights load."""
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise ValueError(f"--model must be a path or a hub id, got {self.model!r}")
        _check_device(self.device)
        for f in fields(self):
            choices = f.metadata.get("choices")
            if callable(choices):  # a registry that may grow (--attention-backend)
                choices = choices()
            value = getattr(self, f.name)
            if f.name == "kv_eviction":  # checked with --kv-budget etc. by resolve_eviction (preflight)
                continue
            if choices is not None and (not isinstance(value, type(choices[0])) or isinstance(value, bool)
                                        or value not in choices):
                raise ValueError(f"{_flag(f.name)} must be one of {', '.join(map(str, choices))}, got {value!r}")
        if self.attention_backend == "triton":
            why = triton_unavailable(_device_type(self.device))
            if why is not None:
                raise ValueError(f"--attention-backend triton: {why}")
        if self.kv_cache_memory is not None:
            _check_size("kv_cache_memory", self.kv_cache_memory)
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, (int, float)) or not 0 < utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be a number in (0, 1], got {utilization!r}")
        _check_int("max_model_len", self.max_model_len, 1, optional=True)
        _check_int("max_num_seqs", self.max_num_seqs, 1, optional=True)
        _check_int("max_cudagraph_capture_size", self.max_cudagraph_capture_size, 1, optional=True)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, optional=True)
        for name in ("kv_budget", "sink_tokens", "recent_tokens"):
            _check_int(name, getattr(self, name), 0, optional=True)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be True or False, got {self.enable_prefix_caching!r}")
        _check_int("max_logprobs", self.max_logprobs, -1)
        for name in ("kv_offloading_size", "kv_offloading_disk_size"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < (1 << 20):
                raise ValueError(f"{_flag(name)} must be a number of GiB >= 0, got {value!r}")
        if self.kv_offloading_disk_size is not None and self.kv_offloading_disk_size <= 0:
            raise ValueError(f"--kv-offloading-disk-size must be positive, got {self.kv_offloading_disk_size!r}")
        path = self.kv_offloading_disk_path
        if path is not None and (not isinstance(path, (str, os.PathLike)) or not str(path)):
            raise ValueError(f"--kv-offloading-disk-path must be a directory path, got {path!r}")
        if self.kv_offloading_disk_size is not None and path is None:
            raise ValueError("--kv-offloading-disk-size sizes the disk KV tier, which needs --kv-offloading-disk-path "
                             "(the directory it lives in)")
        key = self.kv_offloading_disk_key
        if key is not None and (path is None or not isinstance(key, str) or not key):
            raise ValueError(f"--kv-offloading-disk-key is `auto` or a key file path, and needs "
                             f"--kv-offloading-disk-path; got {key!r}")
        if (self.kv_offloading_size or path is not None) and not self.enable_prefix_caching:
            raise ValueError("the KV offload tiers (--kv-offloading-size, --kv-offloading-disk-path) hold "
                             "prefix-cache blocks: they need --enable-prefix-caching")
        if not isinstance(self.generation_config, (str, os.PathLike)) or not str(self.generation_config):
            raise ValueError(f"--generation-config must be auto, vllm or a directory, got {self.generation_config!r}")
        parse_overrides(self.override_generation_config)
        _check_int("seed", self.seed, -(1 << 63), optional=True)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        if self.tensor_parallel_size > 1 and (self.kv_offloading_size or path is not None):
            raise ValueError("the KV offload tiers (--kv-offloading-size, --kv-offloading-disk-path) copy one "
                             "process's pool: they do not work with --tensor-parallel-size > 1 yet")
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        if not self.enable_chunked_prefill and self.kv_eviction != NO_EVICTION:
            raise ValueError("--kv-eviction needs chunked prefill: its policy drops tokens between a prompt's "
                             "chunks (drop --no-enable-chunked-prefill)")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be True or False, got {self.async_scheduling!r}")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError("--async-scheduling does not work with --tensor-parallel-size > 1 yet: the other "
                             "ranks take a step's input tokens from the host")
        if SpeculativeConfig.parse(self.speculative_config) is not None and self.async_scheduling:
            raise ValueError("--speculative-config does not work with --async-scheduling yet: a decode's drafts are "
                             "looked up in tokens the host does not have until the step before is waited for")
        _check_int("nnodes", self.nnodes, 1)
        _check_int("node_rank", self.node_rank, 0)
        _check_int("master_port", self.master_port, 1, optional=True)
        if self.master_port is not None and self.master_port > 65535:
            raise ValueError(f"--master-port must be a TCP port (1 to 65535), got {self.master_port}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"--node-rank must be less than --nnodes ({self.nnodes}), got {self.node_rank}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} must be a multiple of --nnodes "
                             f"{self.nnodes} (each node runs the same number of processes)")
        if self.master_addr is not None and not isinstance(self.master_addr, str):
            raise ValueError(f"--master-addr must be a host name or address, got {self.master_addr!r}")
        if self.tensor_parallel_size == 1 and (self.master_addr is not None or self.master_port is not None):
            raise ValueError("--master-addr and --master-port are where tensor-parallel processes meet: they need "
                             "--tensor-parallel-size > 1")
        self._check_deterministic()

    def _check_deterministic(self) -> None:
        """--deterministic's limits, each one line: what it cannot make batch-invariant (yet)."""
        if not isinstance(self.deterministic, bool):
            raise ValueError(f"deterministic must be True or False, got {self.deterministic!r}")
        if not self.deterministic:
            return
        refused = [
            (self.tensor_parallel_size > 1, "--tensor-parallel-size > 1 (its sharded layers are not covered yet)"),
            (self.kv_cache_dtype == "int4_kivi", "--kv-cache-dtype int4_kivi (a block's key ranges grow as it fills, "
                                                 "so a key reads differently before and after)"),
            (self.kv_eviction != NO_EVICTION, "--kv-eviction (what is evicted depends on the attention scores)"),
            (self.attention_backend == "torch", "--attention-backend torch (its padded matmuls and SDPA change "
                                                "their order with the batch)"),
        ]
        for applies, what in refused:
            if applies:
                raise ValueError(f"--deterministic does not support {what}")

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
        group = parser.add_argument_group("engine options")
        for f in fields(cls):
            if f.name in skip:
                continue
            kwargs = dict(f.metadata)
            aliases = kwargs.pop("aliases", ())
            if callable(kwargs.get("choices")):
                kwargs["choices"] = kwargs["choices"]()
            default = f.default if f.default is not MISSING else None
            if "action" not in kwargs and "type" not in kwargs:
                kwargs["type"] = str if default is None else type(default)
            group.add_argument("--" + f.name.replace("_", "-"), *aliases, dest=f.name, default=default, **kwargs)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> "EngineArgs":
        return cls(**{f.name: getattr(namespace, f.name) for f in fields(cls) if hasattr(namespace, f.name)})
