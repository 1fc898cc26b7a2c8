"""`kvserve generate PROMPT` (raw continuation) and `kvserve chat [MESSAGE]` (chat template;
interactive when no message is given). Answers go to stdout, logs to stderr."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from kvserve.engine.args import EMBEDDING_ARGS, EngineArgs
from kvserve.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int | None) -> None:
    group = parser.add_argument_group("sampling options")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens,
                       help="tokens to generate (default: %(default)s; None = up to the context limit)")
    group.add_argument("--temperature", type=float, default=None,
                       help="0 = greedy (default: the model's generation config, else 0)")
    group.add_argument("--top-p", type=float, default=None, help="default: the model's generation config, else 1")
    group.add_argument("--top-k", type=int, default=None, help="default: the model's generation config, else 0 (off)")
    group.add_argument("--seed", dest="sampling_seed", type=int, default=None, help="per-request sampling seed")
    group.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def sampling_params_from_args(args: argparse.Namespace, defaults: dict[str, Any] | None = None) -> SamplingParams:
    """The sampling flags given, over `defaults` (the model's generation config), over greedy."""
    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k") if getattr(args, name) is not None}
    return SamplingParams(max_tokens=args.max_tokens, seed=args.sampling_seed, ignore_eos=args.ignore_eos,
                          **{"temperature": 0.0, **(defaults or {}), **given})


def register(subparsers) -> None:
    gen = subparsers.add_parser("generate", help="continue a raw text prompt (no chat template)")
    gen.add_argument("prompt", help="the text to continue")
    EngineArgs.add_cli_args(gen, skip=("seed", *EMBEDDING_ARGS))
    add_sampling_args(gen, default_max_tokens=64)
    gen.set_defaults(func=run_generate)

    chat = subparsers.add_parser("chat", help="answer one message through the chat template, or chat interactively")
    chat.add_argument("message", nargs="?", help="the user message; omit for an interactive session")
    chat.add_argument("--system", default=None, help="system prompt")
    EngineArgs.add_cli_args(chat, skip=("seed", *EMBEDDING_ARGS))
    add_sampling_args(chat, default_max_tokens=None)
    chat.set_defaults(func=run_chat)


def one_sequence_kv_budget(engine_args: EngineArgs) -> int | None:
    """The KV budget for a command that runs one sequence at a time (`generate`, `chat`): one
    sequence of max-model-len (of a sliding-window model: its window and a step), instead of the
    default CPU pool (up to 4 GiB) that is sized for a server's many sequences. max-model-len is
    the model's, or what the default budget holds. None (the engine's default) on CUDA, where the
    pool comes from a profiling pass."""
    from kvserve.engine.preflight import preflight

    plan = preflight(engine_args)
    if plan.device.type != "cpu":
        return None
    return (plan.hold.blocks(plan.max_model_len, engine_args.block_size) + 1) * plan.bytes_per_block  # + the null block


def _make_llm(args: argparse.Namespace):
    from kvserve.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    if engine_args.kv_cache_memory is None:
        engine_args.kv_cache_memory = one_sequence_kv_budget(engine_args)
    return LLM(**vars(engine_args))


def run_generate(args: argparse.Namespace) -> int:
    sampling_params_from_args(args)  # bad values fail before the model loads
    llm = _make_llm(args)
    params = sampling_params_from_args(args, llm.engine.generation_defaults.sampling)
    output = llm.generate([args.prompt], params, use_tqdm=False)[0]
    print(output.outputs[0].text)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    sampling_params_from_args(args)  # bad values fail before the model loads
    llm = _make_llm(args)
    params = sampling_params_from_args(args, llm.engine.generation_defaults.sampling)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    if args.message is not None:
        messages.append({"role": "user", "content": args.message})
        print(llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text)
        return 0
    print("Interactive chat; an empty line or Ctrl-D ends it.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        answer = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        print(answer, flush=True)
        messages.append({"role": "assistant", "content": answer})
    return 0
