"""What an engine decides before it loads weights: device, dtype, max-model-len and the KV budget.

Everything here needs the options and the model's shape (read in milliseconds), never its
weights, so a bad option or a KV budget too small for one sequence fails in a second with one
line, before a load that takes tens of seconds. `LLMEngine` runs `preflight` first; an entry point
that sizes something for the engine (offline.py's pool for one prompt) runs it too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from kvserve.cache.eviction import POLICIES, EvictionSpec
from kvserve.cache.eviction.config import NO_EVICTION, resolve_eviction
from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCacheSpec, KVFormat
from kvserve.cache.sizing import blocks_for_tokens, blocks_in_budget, blocks_per_sequence, bytes_per_block
from kvserve.cache.tiers.disk import check_directory, key_path, load_key
from kvserve.engine.args import EngineArgs
from kvserve.engine.calibration import CALIBRATION_TOKENS
from kvserve.engine.generation_defaults import GenerationDefaults, load_generation_defaults
from kvserve.engine.platforms import platform_for
from kvserve.hardware import native_bf16_missing
from kvserve.model.loader import check_load_format, resolve_model_path, tokenizer_path
from kvserve.model.parallel import check_quantized_shards, check_tensor_parallel_size, kv_heads_per_rank
from kvserve.model.shape import ModelShape, read_model_shape
from kvserve.units import GiB, parse_size

logger = logging.getLogger("kvserve")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# The group width of the grouped quantized weights: --quantization int4's, and a GGUF's quantized
# layers as kvserve serves them (gguf_file.quantized_matrix).
QUANT_GROUP_SIZE = 32


def _grouped_quantization(args: EngineArgs) -> bool:
    """Whether the served weights may be quantized in groups of QUANT_GROUP_SIZE input columns:
    int4; a GGUF's quantized layers under auto; under int8 a GGUF's layers served at 8 bits, kept
    as they are (int8 from a dense or 4-bit weight is per output channel; none and a safetensors
    checkpoint under auto are dense). Reads a GGUF's header only."""
    if args.quantization == "int4":
        return True
    if args.quantization not in ("auto", "int8") or resolve_model_path(args.model).suffix != ".gguf":
        return False
    if args.quantization == "auto":
        return True
    from kvserve.model.gguf_file import read_gguf, served_bits

    layers = read_gguf(resolve_model_path(args.model)).tensors
    return any(t.name.startswith("blk.") and len(t.shape) == 2 and served_bits(t.type_id) == 8 for t in layers)


class CapacityError(ValueError):
    """The KV budget cannot hold even one sequence of max-model-len."""


def select_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_batch_limits(args: EngineArgs, serving: bool) -> tuple[EngineArgs, str]:
    """`args` with --max-num-seqs and --max-num-batched-tokens set: as given, or the platform's
    defaults for the device (vLLM's on CUDA, which depend on the GPU and on serving or offline
    use); and a line for the start-up log saying which."""
    given = "as given"
    if args.max_num_seqs is None or args.max_num_batched_tokens is None:
        args.validate()
        device = select_device(args.device)
        limits = platform_for(device).batch_limits(device, serving)
        given = f"{limits.why}, where not given"
        max_num_seqs = args.max_num_seqs or limits.max_num_seqs
        tokens = args.max_num_batched_tokens
        if tokens is None and not args.enable_chunked_prefill:  # vLLM's: a whole prompt of max-model-len fits
            longest = args.max_model_len or read_model_shape(args.model).max_position_embeddings
            tokens = min(max(limits.max_num_batched_tokens, longest), max_num_seqs * longest)
            given = f"{given}; at least --max-model-len without chunked prefill"
        args = replace(args, max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens or limits.max_num_batched_tokens)
    return args, f"Step limits: --max-num-seqs {args.max_num_seqs}, --max-num-batched-tokens " \
                 f"{args.max_num_batched_tokens} ({given})"


def resolve_dtype(name: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The model dtype for --dtype `name` on `device`, and why (for the start-up log). auto is
    bfloat16 where it runs natively (CUDA with bf16, CPUs with AVX512-BF16 or AMX), float16 on
    older GPUs and float32 on other CPUs, where bf16 is emulated and slower than float32."""
    if name != "auto":
        return _DTYPES[name], "given by --dtype"
    return platform_for(device).auto_dtype(device)


def select_dtype(name: str, device: torch.device) -> torch.dtype:
    """resolve_dtype without the reason (for `kvserve plan` and benchmarks)."""
    return resolve_dtype(name, device)[0]


def emulated_bf16_warning(dtype: torch.dtype, device: torch.device) -> str | None:
    """The warning for bfloat16 on a CPU that only emulates it (an explicit --dtype bfloat16)."""
    if device.type != "cpu" or dtype != torch.bfloat16:
        return None
    missing = native_bf16_missing()
    if missing is None:
        return None
    return f"--dtype bfloat16 is emulated on this CPU, slower than float32 (--dtype auto picks float32 here): {missing}"


def resolve_max_model_len(requested: int | None, limit: int) -> int:
    """--max-model-len, or the model's max_position_embeddings when not given."""
    if requested is None:
        return limit
    if requested > limit:
        raise ValueError(f"--max-model-len {requested} exceeds the model's max_position_embeddings ({limit})")
    return requested


@dataclass(frozen=True)
class SequenceHold:
    """What bounds the blocks one sequence holds (cache.sizing.blocks_per_sequence): the sliding
    window every layer shares and the most tokens a step gives it; both None: all its tokens.
    `floor_tokens`: what the pool must hold whatever the window (the start-up calibration of a
    KV format that calibrates prefills that many tokens in the pool at once)."""
    window: int | None = None
    step_tokens: int | None = None
    floor_tokens: int = 0

    def blocks(self, max_model_len: int, block_size: int) -> int:
        held = blocks_per_sequence(max_model_len, block_size, self.window, self.step_tokens)
        return max(held, blocks_for_tokens(min(self.floor_tokens, max_model_len), block_size))


def sequence_hold(args: EngineArgs, shape: ModelShape, device: torch.device, dtype: torch.dtype) -> SequenceHold:
    """A sliding-window model's sequence holds its window and a step (the blocks behind go back to
    the pool), unless KV eviction is on (an evicting sequence keeps its own budget instead). A
    step's tokens: --max-num-batched-tokens, or the platform's default where chunked prefill cuts
    prompts to it (the larger of its serving and offline defaults). A KV format that calibrates
    (fp8_e4m3's key bases, int4's key centres) keeps its calibration prefill whole, so that what it
    learns does not depend on the pool's size."""
    if shape.sliding_window is None or args.kv_eviction != NO_EVICTION:
        return SequenceHold()
    step = args.max_num_batched_tokens
    if step is None and args.enable_chunked_prefill:
        platform = platform_for(device)
        step = max(platform.batch_limits(device, serving).max_num_batched_tokens for serving in (True, False))
    return SequenceHold(shape.sliding_window, step, calibration_floor(make_kv_format(args.kv_cache_dtype, dtype)))


def calibration_floor(kv_format: KVFormat) -> int:
    """The tokens a KV format's start-up calibration prefills in the pool at once (0: none)."""
    return CALIBRATION_TOKENS if kv_format.center_keys or kv_format.fit_key_basis else 0


def fit_max_model_len(budget: int, per_block: int, block_size: int, max_model_len: int, given: bool,
                      hold: SequenceHold = SequenceHold()) -> int:
    """max_model_len when one sequence of it fits in `budget`; else, when the user did not give it,
    the longest multiple of block_size that fits. Raises CapacityError when neither works."""
    num_blocks = blocks_in_budget(budget, per_block)
    needed = hold.blocks(max_model_len, block_size)
    if num_blocks >= needed:
        return max_model_len
    if not given and num_blocks > 0:
        return num_blocks * block_size
    fix = f" or use --max-model-len {num_blocks * block_size} or less" if num_blocks > 0 else ""
    held = "" if needed == blocks_for_tokens(max_model_len, block_size) else \
        f" (its sliding window of {hold.window} tokens and a step of {hold.step_tokens})"
    raise CapacityError(
        f"the KV cache budget of {budget / GiB:.3f} GiB ({budget} bytes) holds {num_blocks * block_size} tokens, "
        f"but one sequence of max-model-len {max_model_len} needs {(needed + 1) * per_block} bytes{held} "
        f"({(needed + 1) * per_block / GiB:.3f} GiB, the null block included). Raise --kv-cache-memory{fix}.")


def lowered_max_model_len_warning(max_model_len: int, limit: int, budget: int) -> str:
    return (f"the KV cache budget of {budget / GiB:.3f} GiB holds one sequence of {max_model_len} tokens, not the "
            f"model's max_position_embeddings ({limit}): max-model-len lowered to {max_model_len} "
            f"(raise --kv-cache-memory or set --max-model-len to choose)")


def kv_budget_before_load(args: EngineArgs, device: torch.device) -> int | None:
    """The KV budget in bytes when it is known before the weights load: --kv-cache-memory, or
    on CPU min(4 GiB, RAM/4 shared by the engine processes on the machine). None on CUDA without it
    (a profiling pass measures it after)."""
    budget = None if args.kv_cache_memory is None else parse_size(args.kv_cache_memory)
    return platform_for(device).kv_budget_before_load(args, budget, device)


@dataclass(frozen=True)
class Preflight:
    """The start-up decisions made before the weights load."""

    device: torch.device
    dtype: torch.dtype
    dtype_reason: str
    shape: ModelShape
    max_model_len: int
    lowered: bool  # max_model_len is below the model's because the budget holds no more
    kv_spec: KVCacheSpec
    bytes_per_block: int  # all layers, in the --kv-cache-dtype format
    kv_budget: int | None  # None: measured on CUDA after loading
    generation_defaults: GenerationDefaults  # the model's sampling defaults (--generation-config)
    hold: SequenceHold  # what one sequence holds at most (a sliding window: the window and a step)


def preflight(args: EngineArgs, shape: ModelShape | None = None) -> Preflight:
    """Check `args` (EngineArgs.validate) and against the model's shape (read from `args.model`
    unless given): max-model-len within max_position_embeddings, a KV budget that holds one
    sequence, the eviction flags. Raises ValueError (CapacityError) with one line."""
    args.validate()
    device = select_device(args.device)
    dtype, reason = resolve_dtype(args.dtype, device)
    shape = shape or read_model_shape(args.model)
    max_model_len = resolve_max_model_len(args.max_model_len, shape.max_position_embeddings)
    tp = args.tensor_parallel_size
    check_tensor_parallel_size(tp, shape.num_heads, shape.num_kv_heads, shape.intermediate_size)
    if tp > 1 and _grouped_quantization(args):
        check_quantized_shards(tp, shape.num_heads, shape.head_dim, shape.intermediate_size, QUANT_GROUP_SIZE)
    # Under tensor parallelism the pool, its budget and its blocks are per rank (per device).
    kv_spec = KVCacheSpec(shape.num_layers, kv_heads_per_rank(shape.num_kv_heads, tp), shape.head_dim,
                          args.block_size)
    per_block = bytes_per_block(kv_spec, make_kv_format(args.kv_cache_dtype, dtype))
    budget = kv_budget_before_load(args, device)
    if budget is None and tp > 1:
        raise ValueError("--tensor-parallel-size > 1 on CUDA needs --kv-cache-memory (the KV budget of each "
                         "device): the profiling pass that measures it runs in one process")
    hold = sequence_hold(args, shape, device, dtype)
    if budget is not None:
        max_model_len = fit_max_model_len(budget, per_block, args.block_size, max_model_len,
                                          given=args.max_model_len is not None, hold=hold)
    if not args.enable_chunked_prefill and args.max_num_batched_tokens is not None \
            and args.max_num_batched_tokens < max_model_len:  # vLLM's text
        raise ValueError(f"max_num_batched_tokens ({args.max_num_batched_tokens}) is smaller than max_model_len "
                         f"({max_model_len}). This effectively limits the maximum sequence length to "
                         f"max_num_batched_tokens and makes kvserve reject longer sequences. Please increase "
                         f"max_num_batched_tokens or decrease max_model_len (or keep chunked prefill on).")
    resolve_eviction(None, EvictionSpec(args.kv_eviction, args.kv_budget, args.sink_tokens, args.recent_tokens),
                     max_model_len, POLICIES)
    check_load_format(resolve_model_path(args.model), args.load_format)
    if args.tokenizer is not None:
        tokenizer_path(args.tokenizer)  # a --tokenizer that names nothing fails before the weights load
    if args.kv_offloading_size and args.kv_offloading_size * GiB < per_block:
        raise ValueError(f"--kv-offloading-size {args.kv_offloading_size:g} GiB holds no KV block: one block "
                         f"takes {per_block:,} bytes")
    if args.kv_offloading_disk_path is not None:
        check_directory(args.kv_offloading_disk_path)
        if args.kv_offloading_disk_key is not None:
            load_key(key_path(args.kv_offloading_disk_path, args.kv_offloading_disk_key))
    lowered = args.max_model_len is None and max_model_len < shape.max_position_embeddings
    generation = load_generation_defaults(str(args.generation_config), resolve_model_path(args.model),
                                          args.override_generation_config)
    return Preflight(device, dtype, reason, shape, max_model_len, lowered, kv_spec, per_block, budget, generation,
                     hold)
