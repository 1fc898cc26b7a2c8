"""Benchmark workloads: lists of prompts with their token lengths and requested output lengths.

Every generator is seeded (numpy `Generator`), so the same arguments give the same requests on
every run and against every server configuration. Prompt text is made so that it re-encodes to
the length it claims (random tokens are decoded, re-encoded and trimmed, as vLLM's generators do).

    random             random tokens, lengths uniform around a centre (vLLM's --random-* flags)
    prefix-repetition  a few shared random prefixes, each followed by a random suffix
    sharegpt           the first human/gpt turn of a local ShareGPT JSON file, or a synthetic set
    book               spans of the bundled novel (or any text file)
    multi-turn         chat sessions whose every turn resends the whole conversation; closed-loop,
                       so it is a workload of its own (kvserve/bench/multi_turn.py), not a list
"""
from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

BOOK_PATH = Path(__file__).resolve().parent.parent / "data" / "pride-and-prejudice.txt"
DATASET_NAMES = ("random", "prefix-repetition", "sharegpt", "book")
MULTI_TURN = "multi-turn"  # only for the online benchmarks (`bench serve`, `bench compare`)

# ShareGPT filters (as in vLLM's benchmark): drop turns too short to time, or too long for a
# 2k-context model.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048
# Mean prompt and output lengths of ShareGPT conversations in tokens, as published in the vLLM
# paper (Kwon et al., "Efficient Memory Management for Large Language Model Serving with
# PagedAttention", SOSP 2023, Fig. 11: input 161.31, output 337.99). The paper gives the
# histograms, not a fitted law: we draw log-normal lengths with those means; sigma = 1.0 (a long
# right tail like the histograms') is our choice.
SHAREGPT_MEAN_INPUT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99
SHAREGPT_SIGMA = 1.0


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens of `prompt` under the benchmark's tokenizer (no special tokens)
    expected_output_len: int  # sent as max_tokens
    # chat endpoints: the conversation to send (None: `prompt` as one user message)
    messages: list[dict[str, str]] | None = None


@dataclass(frozen=True)
class LengthRange:
    """A token length: exactly `low` when low == high, else uniform over [low, high]."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str | int, ratio: float = 0.0) -> "LengthRange":
        """'N' (spread by `ratio`: [floor(N(1-r)), ceil(N(1+r))], vLLM's --random-range-ratio)
        or 'MIN:MAX' (taken as is)."""
        text = str(text).strip()
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1), got {ratio}")
        try:
            if ":" in text:
                low, high = (int(part) for part in text.split(":", 1))
            else:
                centre = int(text)
                low, high = math.floor(centre * (1 - ratio)), math.ceil(centre * (1 + ratio))
        except ValueError:
            raise ValueError(f"a length must be N or MIN:MAX (integers), got {text!r}") from None
        if low < 0 or high < low:
            raise ValueError(f"a length range needs 0 <= MIN <= MAX, got {text!r}")
        return cls(low, high)

    def sample(self, rng: np.random.Generator, n: int) -> list[int]:
        return [int(x) for x in rng.integers(self.low, self.high + 1, size=n)]


def load_tokenizer(name: str | None) -> Any:
    """The tokenizer of a model as kvserve finds it (a directory with tokenizer files, a GGUF file,
    a cached hub id, or the bundled default when `name` is None); nothing is downloaded."""
    from transformers import AutoTokenizer

    from kvserve.model.loader import resolve_model_path

    path = Path(name).expanduser() if name and Path(name).expanduser().is_dir() else resolve_model_path(name)
    if path.suffix == ".gguf":
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _fit_text(tokenizer: Any, ids: list[int], target: int, extend: Callable[[int], list[int]],
              head: str = "") -> tuple[str, int]:
    """`head` + text for `ids` that re-encodes to `target` tokens in all. Decoding then re-encoding
    arbitrary ids can merge or split tokens (and a word can merge across the join with `head`), so
    trim or extend the canonical re-encoding of the tail until the count is stable; `head` is kept
    verbatim so that shared prefixes stay byte-identical. Returns the text and its token count."""
    base = len(_encode(tokenizer, head))
    text = head + tokenizer.decode(ids)
    for _ in range(8):
        canonical = _encode(tokenizer, text)
        if len(canonical) == target:
            return text, target
        tail, need = canonical[base:], target - base
        tail = tail[:need] if len(tail) > need else tail + extend(need - len(tail))
        text = head + tokenizer.decode(tail)
    # Rare: no stable re-encoding (e.g. a split multi-byte character). Never exceed the target.
    while len(text) > len(head) and len(_encode(tokenizer, text)) > target:
        text = text[:-1]
    return text, len(_encode(tokenizer, text))


class _RandomTokens:
    """Uniform draws from the tokenizer's ordinary vocabulary: special and added tokens are excluded
    (random text must never spell a control token), and so are lone byte tokens that are not valid
    UTF-8 by themselves (they decode to U+FFFD, whose re-encoding never settles)."""

    def __init__(self, tokenizer: Any, rng: np.random.Generator):
        excluded = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
        ids = [i for i in range(tokenizer.vocab_size) if i not in excluded]
        pieces = tokenizer.batch_decode([[i] for i in ids])
        self.vocab = np.array([i for i, p in zip(ids, pieces) if p and "\ufffd" not in p], dtype=np.int64)
        self.rng = rng

    def __call__(self, n: int) -> list[int]:
        return [int(i) for i in self.rng.choice(self.vocab, size=n)]


def random_dataset(tokenizer: Any, num_prompts: int, input_len: LengthRange, output_len: LengthRange,
                   prefix_len: int = 0, seed: int = 0) -> list[SampleRequest]:
    """vLLM's `random`: each prompt is `prefix_len` shared random tokens plus a random body whose
    length is drawn from `input_len`; output lengths are drawn from `output_len`."""
    rng = np.random.default_rng(seed)
    draw = _RandomTokens(tokenizer, rng)
    prefix, base = _fit_text(tokenizer, draw(prefix_len), prefix_len, draw) if prefix_len else ("", 0)
    inputs, outputs = input_len.sample(rng, num_prompts), output_len.sample(rng, num_prompts)
    requests = []
    for n_in, n_out in zip(inputs, outputs):
        text, n = _fit_text(tokenizer, draw(n_in), base + n_in, draw, head=prefix)
        requests.append(SampleRequest(text, n, max(n_out, 1)))
    return requests


def prefix_repetition_dataset(tokenizer: Any, num_prompts: int, prefix_len: int, suffix_len: int,
                              num_prefixes: int, output_len: int, seed: int = 0) -> list[SampleRequest]:
    """vLLM's `prefix-repetition`: `num_prefixes` random prefixes of `prefix_len` tokens, each
    shared by num_prompts / num_prefixes prompts that differ in a random `suffix_len`-token tail;
    prompts are shuffled so that requests sharing a prefix do not arrive back to back."""
    if num_prefixes < 1:
        raise ValueError(f"--prefix-repetition-num-prefixes must be at least 1, got {num_prefixes}")
    rng = np.random.default_rng(seed)
    draw = _RandomTokens(tokenizer, rng)
    prefixes = [_fit_text(tokenizer, draw(prefix_len), prefix_len, draw) for _ in range(num_prefixes)]
    requests = []
    for i in range(num_prompts):
        prefix, base = prefixes[i % num_prefixes]
        prompt, n = _fit_text(tokenizer, draw(suffix_len), base + suffix_len, draw, head=prefix)
        requests.append(SampleRequest(prompt, n, max(output_len, 1)))
    order = rng.permutation(num_prompts)
    return [requests[i] for i in order]


class BookText:
    """A text tokenized once; spans are cut at random token offsets."""

    def __init__(self, tokenizer: Any, path: str | os.PathLike | None):
        self.path = Path(path) if path else BOOK_PATH
        if not self.path.is_file():
            raise FileNotFoundError(f"--dataset-path {self.path}: no such file")
        self.tokenizer = tokenizer
        self.ids = _encode(tokenizer, self.path.read_text(encoding="utf-8", errors="replace"))

    def span(self, rng: np.random.Generator, length: int) -> tuple[str, int]:
        if length + 1 > len(self.ids):
            raise ValueError(f"{self.path} has only {len(self.ids)} tokens; cannot cut a {length}-token span")
        start = int(rng.integers(0, len(self.ids) - length))
        end = start + length

        def extend(k: int) -> list[int]:  # continue with the book's own next tokens
            nonlocal end
            more = self.ids[end:end + k]
            end += k
            return more

        return _fit_text(self.tokenizer, self.ids[start:start + length], length, extend)


def book_dataset(tokenizer: Any, num_prompts: int, input_len: LengthRange, output_len: LengthRange,
                 path: str | os.PathLike | None = None, seed: int = 0) -> list[SampleRequest]:
    """Spans of real prose: the bundled novel, or any UTF-8 text file."""
    rng = np.random.default_rng(seed)
    book = BookText(tokenizer, path)
    inputs, outputs = input_len.sample(rng, num_prompts), output_len.sample(rng, num_prompts)
    requests = []
    for n_in, n_out in zip(inputs, outputs):
        text, n = book.span(rng, max(n_in, 1))
        requests.append(SampleRequest(text, n, max(n_out, 1)))
    return requests


def sharegpt_file_dataset(tokenizer: Any, path: str | os.PathLike, num_prompts: int,
                          output_len: int | None = None, seed: int = 0) -> list[SampleRequest]:
    """The first human turn (prompt) and the first reply (its length is the output length, unless
    `output_len` is given) of conversations in a ShareGPT-format JSON list."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"--dataset-path {path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"--dataset-path {path}: not a ShareGPT JSON file ({exc})") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path {path}: expected a JSON list of conversations")
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) and "value" in t for t in turns[:2]):
            pairs.append((str(turns[0]["value"]), str(turns[1]["value"])))
    order = np.random.default_rng(seed).permutation(len(pairs))
    requests = []
    for i in order:
        prompt, reply = pairs[i]
        n_in = len(_encode(tokenizer, prompt))
        n_out = output_len if output_len is not None else len(_encode(tokenizer, reply))
        if n_in < SHAREGPT_MIN_LEN or n_out < SHAREGPT_MIN_LEN:
            continue
        if n_in > SHAREGPT_MAX_PROMPT_LEN or n_in + n_out > SHAREGPT_MAX_TOTAL_LEN:
            continue
        requests.append(SampleRequest(prompt, n_in, n_out))
        if len(requests) == num_prompts:
            break
    if not requests:
        raise ValueError(f"--dataset-path {path}: no usable conversations (need a human turn and a reply, "
                         f"{SHAREGPT_MIN_LEN}..{SHAREGPT_MAX_PROMPT_LEN} prompt tokens)")
    return requests


def sharegpt_lengths(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    """(prompt, output) token lengths with ShareGPT's published means, under vLLM's filters."""
    def lognormal(mean: float) -> np.ndarray:
        mu = math.log(mean) - SHAREGPT_SIGMA ** 2 / 2  # E[X] = exp(mu + sigma^2 / 2)
        return rng.lognormal(mu, SHAREGPT_SIGMA, size=n)

    prompts = np.clip(np.rint(lognormal(SHAREGPT_MEAN_INPUT)), SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT_LEN)
    outputs = np.maximum(np.rint(lognormal(SHAREGPT_MEAN_OUTPUT)), SHAREGPT_MIN_LEN)
    outputs = np.minimum(outputs, SHAREGPT_MAX_TOTAL_LEN - prompts)
    return [(int(p), int(o)) for p, o in zip(prompts, outputs)]


def synthetic_sharegpt_dataset(tokenizer: Any, num_prompts: int, output_len: int | None = None,
                               seed: int = 0) -> list[SampleRequest]:
    """ShareGPT-like lengths with prompts cut from the bundled novel (no download needed)."""
    rng = np.random.default_rng(seed)
    book = BookText(tokenizer, None)
    requests = []
    for n_in, n_out in sharegpt_lengths(rng, num_prompts):
        text, n = book.span(rng, n_in)
        requests.append(SampleRequest(text, n, output_len if output_len is not None else n_out))
    return requests


def check_workload_flags(args: Any) -> None:
    """ValueError for a workload flag given with a --dataset-name that does not read it."""
    offered = getattr(args, "dataset_names", DATASET_NAMES + (MULTI_TURN,))  # this command's (add_dataset_args)
    for dest, owners in DATASET_FLAGS.items():
        if getattr(args, f"{dest}_given", False) and args.dataset_name not in owners:
            flag, names = "--" + dest.replace("_", "-"), [name for name in owners if name in offered]
            workloads = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
            raise ValueError(f"{flag} describes the {workloads} workload{'s' if len(names) > 1 else ''}, "
                             f"not --dataset-name {args.dataset_name}")


def check_dataset_args(args: Any) -> None:
    """ValueError for workload flags that cannot describe a workload, before anything is loaded
    (`build_dataset` needs the tokenizer; `bench throughput` loads the model for it)."""
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    check_workload_flags(args)
    if args.dataset_name == "random":
        for value in (args.random_input_len, args.random_output_len):
            LengthRange.parse(value, args.random_range_ratio)
        if LengthRange.parse(args.random_input_len, args.random_range_ratio).low + args.random_prefix_len < 1:
            raise ValueError(f"--random-input-len {args.random_input_len} makes empty prompts: a prompt needs a token")
    elif args.dataset_name == "book":
        for value in (args.book_input_len, args.book_output_len):
            LengthRange.parse(value)
    elif args.dataset_name == MULTI_TURN:
        raise ValueError("--dataset-name multi-turn is a closed-loop chat workload: "
                         "only `kvserve bench serve` and `kvserve bench compare` run it")


def build_dataset(args: Any, tokenizer: Any) -> list[SampleRequest]:
    """The requests the CLI flags describe (see `add_dataset_args`)."""
    check_dataset_args(args)
    name, n, seed = args.dataset_name, args.num_prompts, args.seed
    if name == "random":
        return random_dataset(tokenizer, n, LengthRange.parse(args.random_input_len, args.random_range_ratio),
                              LengthRange.parse(args.random_output_len, args.random_range_ratio),
                              args.random_prefix_len, seed)
    if name == "prefix-repetition":
        return prefix_repetition_dataset(tokenizer, n, args.prefix_repetition_prefix_len,
                                         args.prefix_repetition_suffix_len, args.prefix_repetition_num_prefixes,
                                         args.prefix_repetition_output_len, seed)
    if name == "sharegpt":
        if args.dataset_path:
            return sharegpt_file_dataset(tokenizer, args.dataset_path, n, args.sharegpt_output_len, seed)
        return synthetic_sharegpt_dataset(tokenizer, n, args.sharegpt_output_len, seed)
    if name == "book":
        return book_dataset(tokenizer, n, LengthRange.parse(args.book_input_len),
                            LengthRange.parse(args.book_output_len), args.dataset_path, seed)
    raise ValueError(f"unknown dataset {name!r}; choose from {', '.join(DATASET_NAMES)}")


# Which workloads read each workload flag: a flag given for another workload is refused, not ignored.
DATASET_FLAGS = {
    "dataset_path": ("sharegpt", "book", MULTI_TURN),
    **{f"random_{x}": ("random",) for x in ("input_len", "output_len", "range_ratio", "prefix_len")},
    **{f"prefix_repetition_{x}": ("prefix-repetition",) for x in ("prefix_len", "suffix_len", "num_prefixes",
                                                                  "output_len")},
    "sharegpt_output_len": ("sharegpt",),
    **{f"book_{x}": ("book",) for x in ("input_len", "output_len")},
    **{f"multi_turn_{x}": (MULTI_TURN,) for x in ("sessions", "turns", "system_prompt_len", "user_len", "output_len",
                                                 "think_time")},
}


class GivenAction(argparse.Action):
    """Stores the value and records that the flag was given (`<dest>_given`), so that a workload it
    does not apply to can refuse it rather than ignore it."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, values)
        setattr(namespace, f"{self.dest}_given", True)


def add_dataset_args(parser: Any, num_prompts: int = 1000, input_len: str = "1024", output_len: str = "128",
                     multi_turn: bool = False) -> None:
    """The workload flags (vLLM's names), shared by `bench serve`, `compare`, `throughput`; with
    `multi_turn`, also the multi-turn chat workload and its flags."""
    g = parser.add_argument_group("workload")
    names = DATASET_NAMES + ((MULTI_TURN,) if multi_turn else ())
    g.add_argument("--dataset-name", default="random", choices=names)
    parser.set_defaults(dataset_names=names)
    g.add_argument("--dataset-path", action=GivenAction, default=None,
                   help="sharegpt: a ShareGPT-format JSON file (default: synthetic ShareGPT-like set); "
                        "book" + (", multi-turn" if multi_turn else "") + ": a text file (default: the bundled novel)")
    g.add_argument("--num-prompts", type=int, default=num_prompts, action=GivenAction,
                   help="requests to send" + (" (not with multi-turn: it sends S x T)" if multi_turn else ""))
    g.add_argument("--seed", type=int, default=0, help="seed of the workload and of the arrival times")
    g.add_argument("--random-input-len", action=GivenAction, default=input_len,
                   help="random: prompt tokens, N (spread by --random-range-ratio) or MIN:MAX")
    g.add_argument("--random-output-len", action=GivenAction, default=output_len,
                   help="random: output tokens, N or MIN:MAX")
    g.add_argument("--random-range-ratio", action=GivenAction, type=float, default=0.0,
                   help="random: lengths uniform in [N(1-r), N(1+r)], 0 <= r < 1")
    g.add_argument("--random-prefix-len", action=GivenAction, type=int, default=0,
                   help="random: tokens of a prefix shared by all prompts")
    g.add_argument("--prefix-repetition-prefix-len", action=GivenAction, type=int, default=256)
    g.add_argument("--prefix-repetition-suffix-len", action=GivenAction, type=int, default=256)
    g.add_argument("--prefix-repetition-num-prefixes", action=GivenAction, type=int, default=10)
    g.add_argument("--prefix-repetition-output-len", action=GivenAction, type=int, default=128)
    g.add_argument("--sharegpt-output-len", action=GivenAction, type=int, default=None,
                   help="sharegpt: fixed output length instead of each reply's length")
    g.add_argument("--book-input-len", action=GivenAction, default="512",
                   help="book: span length in tokens, N or MIN:MAX")
    g.add_argument("--book-output-len", action=GivenAction, default="128", help="book: output tokens, N or MIN:MAX")
    if multi_turn:
        from kvserve.bench.multi_turn import add_multi_turn_args

        add_multi_turn_args(parser)
