"""`kvserve plan [MODEL]`: how much memory the KV cache takes, and what fits in a budget."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields

import torch

from kvserve.engine.args import EngineArgs
from kvserve.units import GiB

EPILOG = """presets: {presets}

examples:
  kvserve plan llama-2-70b --max-model-len 32768 --kv-cache-dtype float16,fp8
  kvserve plan llama-3-70b --gpu-memory 80GiB --tensor-parallel-size 2 --max-model-len 8192
  kvserve plan --kv-cache-memory 1GiB --json          (the bundled default model)
  kvserve plan --kv-cache-memory 256MiB --kv-offloading-size 2 --kv-offloading-disk-size 50"""

# The engine options that change KV sizes or the budget; plan takes only these (any other engine
# flag is refused as unknown rather than accepted and ignored). --kv-cache-dtype is the planner's
# own (a comma-separated list of the engine's formats), MODEL is positional, and plan has its own
# --tensor-parallel-size (devices to plan for) and offload-tier sizes (it needs no directory).
_PLANNED_ENGINE_ARGS = ("dtype", "quantization", "device", "block_size", "kv_cache_memory",
                        "gpu_memory_utilization", "max_model_len", "max_num_batched_tokens")


def _default_step_tokens(device: torch.device, gpu_memory: int | None) -> int:
    """The engine's --max-num-batched-tokens where not given (the larger of its serving and offline
    defaults, as preflight takes it): the CPU's, or vLLM's for a GPU of --gpu-memory (a large
    one when not given)."""
    from kvserve.engine.platforms.cpu import CPU_BATCH_LIMITS
    from kvserve.engine.platforms.cuda import cuda_batch_limits

    if device.type == "cpu":
        return CPU_BATCH_LIMITS.max_num_batched_tokens
    memory = gpu_memory if gpu_memory is not None else 80 * GiB
    return max(cuda_batch_limits(memory, "", serving).max_num_batched_tokens for serving in (True, False))


def register(subparsers) -> None:
    from kvserve.plan.calculator import PLAN_KV_CACHE_DTYPES
    from kvserve.plan.presets import PRESETS

    parser = subparsers.add_parser(
        "plan", help="KV-cache memory calculator and capacity planner",
        description="KV-cache bytes of a model (the formula, and kvserve's own paged layout with its scales),\n"
                    "and how many tokens and sequences fit in a memory budget. Reads configs only; loads no weights.",
        epilog=EPILOG.format(presets=", ".join(PRESETS)), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="preset name, config.json, HF model directory or GGUF file (default: the bundled model)")
    group = parser.add_argument_group("planning options")
    group.add_argument("--batch-size", type=int, default=1, help="concurrent sequences of --max-model-len (default 1)")
    group.add_argument("--kv-cache-dtype", default="auto",
                       help=f"one or more, comma-separated, of {', '.join(PLAN_KV_CACHE_DTYPES)} "
                            "(auto = the weight dtype)")
    group.add_argument("--gpu-memory", default=None,
                       help="memory of one GPU (80GiB, 24GB): the KV budget is then what "
                            "--gpu-memory-utilization of it leaves after the weights")
    group.add_argument("--tensor-parallel-size", type=int, default=1,
                       help="devices sharing the KV heads and the weights (planning only)")
    group.add_argument("--kv-offloading-size", default=None, metavar="GIB",
                       help="host-memory offload tier in GiB (or with a unit: 512MiB), total over the "
                            "tensor-parallel devices: the tokens and sequences it holds")
    group.add_argument("--kv-offloading-disk-size", default=None, metavar="GIB",
                       help="disk offload tier in GiB (or with a unit), the same way")
    group.add_argument("--json", action="store_true", help="print the plan as JSON (keys: see kvserve/plan/report.py)")
    group.add_argument("--plot", metavar="PNG", default=None,
                       help="draw KV bytes against context length for the chosen dtypes, with the budget line")
    EngineArgs.add_cli_args(parser, skip=tuple(f.name for f in fields(EngineArgs) if f.name not in _PLANNED_ENGINE_ARGS))
    parser.set_defaults(func=run_plan, gpu_memory_utilization=None)  # None: not given (the engine's default)


def _planning_dtype(name: str, device: torch.device) -> torch.dtype:
    """The engine's dtype rule (select_dtype); for a GPU this machine does not have, auto assumes a
    bfloat16-capable one, as every data-centre GPU since Ampere is."""
    from kvserve.engine.llm_engine import select_dtype

    if name == "auto" and device.type == "cuda" and not torch.cuda.is_available():
        return torch.bfloat16
    return select_dtype(name, device)


def _size_arg(value: str | None, flag: str) -> int | None:
    from kvserve.units import parse_size

    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def _gib_arg(value: str | None, flag: str) -> int | None:
    """vLLM's GiB number (`4`, `0.5`), or a size with its unit (`512MiB`); bytes, positive."""
    from kvserve.units import GiB

    if value is None:
        return None
    text = str(value).strip()
    try:
        gib = float(text)
    except ValueError:
        return _size_arg(text, flag)
    if not 0 < gib < float("inf") or int(gib * GiB) == 0:
        raise ValueError(f"{flag} must be a positive number of GiB, got {value!r}")
    return int(gib * GiB)


def run_plan(args: argparse.Namespace) -> int:
    from rich.console import Console

    from kvserve.cache.sizing import default_cpu_budget
    from kvserve.engine.llm_engine import CapacityError
    from kvserve.figures import check_chart_path
    from kvserve.plan.calculator import PlanInputs, make_plan
    from kvserve.plan.report import render, to_dict
    from kvserve.plan.source import load_arch

    check_chart_path(args.plot)
    kv_dtypes = [d.strip() for d in args.kv_cache_dtype.split(",") if d.strip()]
    if not kv_dtypes:
        raise ValueError("--kv-cache-dtype: give at least one dtype")
    kv_cache_memory = _size_arg(args.kv_cache_memory, "--kv-cache-memory")
    gpu_memory = _size_arg(args.gpu_memory, "--gpu-memory")
    if gpu_memory is None and args.gpu_memory_utilization is not None:
        raise ValueError("--gpu-memory-utilization is the share of --gpu-memory the plan may use: it needs "
                         "--gpu-memory")
    utilization = EngineArgs.gpu_memory_utilization if args.gpu_memory_utilization is None \
        else args.gpu_memory_utilization
    if args.device == "auto":
        device = torch.device("cuda" if gpu_memory is not None or torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            raise ValueError(f"--device: expected cpu, cuda, cuda:N or auto, got {args.device!r}") from None
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len must be positive, got {args.max_model_len}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise ValueError(f"--max-num-batched-tokens must be positive, got {args.max_num_batched_tokens}")
    arch = load_arch(args.model)
    inputs = PlanInputs(
        max_model_len=args.max_model_len if args.max_model_len is not None else arch.max_position_embeddings,
        batch_size=args.batch_size, block_size=args.block_size, weight_dtype=_planning_dtype(args.dtype, device),
        tensor_parallel_size=args.tensor_parallel_size, kv_cache_memory=kv_cache_memory, gpu_memory=gpu_memory,
        gpu_memory_utilization=utilization, quantization=args.quantization,
        kv_offloading_size=_gib_arg(args.kv_offloading_size, "--kv-offloading-size"),
        kv_offloading_disk_size=_gib_arg(args.kv_offloading_disk_size, "--kv-offloading-disk-size"),
        step_tokens=args.max_num_batched_tokens or _default_step_tokens(device, gpu_memory))
    plan = make_plan(arch, inputs, kv_dtypes,
                     default_cpu_budget(args.tensor_parallel_size) if device.type == "cpu" else None)

    if args.json:
        print(json.dumps(to_dict(plan), indent=2))
    else:
        render(plan, Console(width=max(120, Console().width)))
    if args.plot:
        from kvserve.plan.plot import plot_plan

        out = plot_plan(plan, kv_dtypes, args.plot)
        print(f"plot written to {out}", file=sys.stderr)

    # A budget the user gave that cannot hold one sequence is an error, as it is for the engine;
    # the CPU default budget is only informative when planning for other hardware.
    short = [fp for fp in plan.footprints if fp.capacity is not None and fp.capacity.max_concurrent_sequences == 0]
    if short and (kv_cache_memory is not None or gpu_memory is not None):
        fp = short[0]
        null_block = 1 if fp.capacity.layout == "kvserve" else 0  # kvserve's pool pays for its null block
        need = (fp.capacity.blocks_per_sequence + null_block) * fp.capacity.bytes_per_block
        if fp.capacity.num_blocks == 0:
            raise CapacityError(f"the KV budget of {plan.budget.bytes:,} bytes is smaller than one block of "
                                f"{fp.kv_cache_dtype} ({fp.capacity.bytes_per_block:,} bytes) beside the null block")
        raise CapacityError(
            f"the KV budget of {plan.budget.bytes:,} bytes holds {fp.capacity.kv_tokens:,} tokens of "
            f"{fp.kv_cache_dtype}, but one sequence of max-model-len {inputs.max_model_len:,} needs {need:,} bytes: "
            f"raise the budget or use --max-model-len {fp.capacity.largest_max_model_len} or less")
    return 0
