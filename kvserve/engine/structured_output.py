"""Structured outputs: decoding constrained to a JSON schema, a regex, a choice or a grammar.

The grammar engine is llguidance (the Earley parser + token trie of Microsoft's Guidance, also one
of vLLM's backends): it compiles a constraint into a matcher that, at each step, says which tokens
may come next as a bitmask, one bit per vocabulary entry. Three pieces:

- `GrammarCompiler` (one per engine): llguidance's view of the tokenizer, built on first use, and
  compiled grammars cached by (kind, spec, options), so a schema is compiled once however many
  requests use it. Compiling is also the check: a bad schema, regex or grammar is a ValueError
  before the request is queued.
- `GrammarMatcher` (one per sequence, n > 1 gives each sample its own): follows the sequence's
  output tokens, whatever happens to its KV (prefix hits, eviction, recompute after preemption).
- `GrammarMasks` (the sampler's): each step, the bitmasks of the constrained rows only, filled in
  one call, unpacked for the logits' device and applied as -inf before sampling.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.transfers import host_to_device

# JSON separators when free whitespace is off: one space after ":" and "," (json.dumps' defaults,
# the way models saw JSON written), never more.
SEPARATORS = {"key_separator": ": ", "item_separator": ", "}
# Compiled grammars kept per engine (least recently used dropped first).
GRAMMAR_CACHE_SIZE = 256


def grammar_key(spec: StructuredOutputsParams) -> tuple[str, str, bool]:
    """What a compiled grammar depends on: the kind, the spec as text, and the whitespace option."""
    kind = spec.kind
    value = {"json": spec.json, "regex": spec.regex, "choice": spec.choice, "grammar": spec.grammar,
             "json_object": True}[kind]
    text = value if isinstance(value, str) else json.dumps(value)
    return kind, text, bool(spec.disable_any_whitespace)


# The characters a regex's counted repetitions may unroll to: llguidance's lexer builds its states
# lazily, so "(a{1000}){1000}" compiles, then fails at the first tokens ("too many expressions").
MAX_REGEX_EXPANSION = 100_000


def _regex_parser() -> tuple[Any, Any]:
    """Python's regex parser and its constants (re._parser from 3.11, sre_parse before)."""
    try:
        from re import _constants, _parser
        return _parser, _constants
    except ImportError:  # Python 3.10
        import sre_constants
        import sre_parse
        return sre_parse, sre_constants


def _expansion(parsed) -> int:
    """The most characters a parsed regex unrolls its counted repetitions to; an unbounded repeat
    counts its minimum (a lexer loops over it instead of unrolling)."""
    c = _regex_parser()[1]
    total = 0
    for op, arg in parsed:
        if op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
            low, high, sub = arg
            total += (max(low, 1) if high == c.MAXREPEAT else high) * _expansion(sub)
        elif op == c.SUBPATTERN:
            total += _expansion(arg[-1])
        elif op == c.BRANCH:
            total += max((_expansion(branch) for branch in arg[1]), default=0)
        elif op == getattr(c, "ATOMIC_GROUP", None):
            total += _expansion(arg)
        else:
            total += 1
        if total > MAX_REGEX_EXPANSION:
            return total
    return total


def check_regex_budget(pattern: str) -> None:
    """ValueError naming the limit for a regex whose counted repetitions unroll past
    MAX_REGEX_EXPANSION characters. A pattern Python's parser does not read is left to llguidance."""
    import re

    try:
        parsed = _regex_parser()[0].parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return
    size = _expansion(parsed)
    if size > MAX_REGEX_EXPANSION:
        raise ValueError(f"the regex's counted repetitions unroll to more than {MAX_REGEX_EXPANSION} characters "
                         f"(the grammar engine's budget); write the repetition with * or +, or a smaller count")


def serialize_grammar(kind: str, text: str, disable_any_whitespace: bool) -> str:
    """llguidance's grammar text for a constraint. JSON without free whitespace when asked
    (`whitespace_flexible` off, SEPARATORS fixed), else with any whitespace between tokens. Raises
    ValueError for a spec that cannot even be read (e.g. a schema that is not JSON)."""
    import llguidance

    options = {"whitespace_flexible": False, **SEPARATORS} if disable_any_whitespace else {"whitespace_flexible": True}
    try:
        if kind == "json":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
        if kind == "regex":
            check_regex_budget(text)
            return llguidance.grammar_from("regex", text)
        if kind == "choice":
            return llguidance.grammar_from("choice", json.loads(text))
        if kind == "grammar":
            return llguidance.grammar_from("grammar", text)  # Lark, or GBNF converted to Lark
    except (ValueError, TypeError, KeyError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"Invalid grammar specification: {exc}") from None
    raise ValueError(f"unknown structured outputs kind {kind!r}")


class GrammarMatcher:
    """One sequence's place in its grammar: which tokens may come next, advanced token by token.
    With `starts_after` (a token id) the grammar waits: tokens pass freely until that one has
    been sampled, then the grammar applies to the tokens after it (`active`)."""

    __slots__ = ("matcher", "starts_after", "active")

    def __init__(self, matcher: Any, starts_after: int | None = None):
        self.matcher = matcher
        self.starts_after = starts_after
        self.active = starts_after is None

    def draftable_prefix(self, token_ids: list[int]) -> int:
        """How many of `token_ids` the grammar would take in a row from here, short of one that
        completes it (nothing consumed): sampled one at a time, the request stops at that token,
        so as a draft it would be followed by a sampled EOS the plain engine never emits."""
        if not self.active:
            return 0
        valid = self.matcher.validate_tokens(token_ids)
        for taken, token in enumerate(token_ids[:valid], start=1):
            self.matcher.consume_token(token)
            if self.matcher.is_stopped():
                self.matcher.rollback(taken)
                return taken - 1
        self.matcher.rollback(valid)
        return valid

    def accept(self, token_id: int) -> str | None:
        """Advance past a sampled token; returns why it was refused (None when accepted)."""
        if not self.active:
            self.active = token_id == self.starts_after
            return None
        if self.matcher.consume_token(token_id):
            return None
        error = self.matcher.get_error() or f"token {token_id} is not allowed by the grammar"
        return error.strip().splitlines()[-1][:300]  # llguidance's error ends a multi-line parser dump

    @property
    def finished(self) -> bool:
        """True once the grammar is complete and nothing but EOS may follow."""
        return self.active and self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles structured-output constraints for one tokenizer and caches the results.

    Thread-safe (a lock around the cache), so a server may compile outside the engine thread.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: tuple[int, ...],
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._cache_size = cache_size
        self._cache: OrderedDict[tuple[str, str, bool], Any] = OrderedDict()
        self._ll_tokenizer: Any = None
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self) -> Any:
        """llguidance's tokenizer (its token trie), built once on first use: a model vocabulary
        padded past the tokenizer's gets entries no grammar allows."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf

                try:
                    self._ll_tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_ids or None)
                except ValueError as exc:
                    raise ValueError(f"structured outputs need a fast (Rust) tokenizer: {exc}") from None
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar for `spec` (an llguidance matcher at its start, shared: never
        advance it, copy it with `matcher`). Raises ValueError with llguidance's reason (which
        names an unsupported JSON schema feature) for a constraint that does not compile.
        Compiling happens outside the lock, so a slow schema does not hold up cache hits."""
        import llguidance

        key = grammar_key(spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        compiled = llguidance.LLMatcher(self.ll_tokenizer, serialize_grammar(*key), log_level=0)
        if compiled.is_error():
            raise ValueError(f"Grammar error: {compiled.get_error()}")
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for one sequence (a copy of the cached compiled grammar)."""
        return GrammarMatcher(self.compile(spec).deep_copy(), spec.starts_after_token_id)

    @property
    def num_cached(self) -> int:
        return len(self._cache)


def unpack_banned(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bitmask words [rows, words] (int32, any device) -> [rows, vocab_size] bool, True where the
    token's bit is clear (not allowed). Torch ops only, so it runs where the words are."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [rows, words, 32]: token 32 * w + b at [w, b]
    return bits.reshape(words.shape[0], -1)[:, :vocab_size] == 0


class GrammarMasks:
    """Applies the constrained rows' token bitmasks to a step's logits.

    llguidance writes each matcher's mask (bit t of 32-bit word t // 32 set = token t allowed) into
    one CPU buffer, all rows in one parallel call. On CPU the words are unpacked by numpy's
    `unpackbits` (little-endian bit order, as the words are laid out in memory) and applied with a
    masked copy; on another device they are copied there (from pinned memory), unpacked with shifts
    and applied with masked_fill. Disallowed tokens, padded
    vocabulary rows included, become -inf; unconstrained rows are not touched.
    """

    def __init__(self, vocab_size: int, device: torch.device):
        import llguidance

        self.vocab_size = vocab_size
        self.device = device
        self.words = (vocab_size + 31) // 32
        self._executor = llguidance.LLExecutor()
        self._buffer = torch.empty(0, self.words, dtype=torch.int32)

    def _buffer_for(self, rows: int) -> torch.Tensor:
        if self._buffer.shape[0] < rows:
            size = max(rows, 2 * self._buffer.shape[0])
            self._buffer = torch.empty(size, self.words, dtype=torch.int32,
                                       pin_memory=self.device.type == "cuda")
        return self._buffer[:rows]

    def banned(self, matchers: list[GrammarMatcher], drafts: list[list[int]] | None = None) -> torch.Tensor:
        """[rows, vocab_size] bool on the device: True where the token may NOT come next. One row per
        matcher, and with `drafts` (speculative decoding; drafts the grammar accepts) one more per
        draft: the mask after it, the matchers left where they were."""
        from llguidance.torch import fill_next_token_bitmask_par, fill_next_token_bitmask_par_with_draft_tokens

        if drafts is None or not any(drafts):
            masks = self._buffer_for(len(matchers))
            fill_next_token_bitmask_par(self._executor, [(m.matcher, i) for i, m in enumerate(matchers)], masks)
        else:
            plain, drafted, row = [], [], 0
            for matcher, proposed in zip(matchers, drafts):
                if proposed:  # (llguidance takes no empty draft list)
                    drafted.append((matcher.matcher, row, list(proposed)))
                else:
                    plain.append((matcher.matcher, row))
                row += 1 + len(proposed)
            masks = self._buffer_for(row)
            fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, masks)
            if plain:
                fill_next_token_bitmask_par(self._executor, plain, masks)
        if self.device.type == "cpu":
            inverted = np.invert(masks.numpy()).view(np.uint8)  # [rows, 4 * words], low byte first
            bits = np.unpackbits(inverted, axis=1, count=self.vocab_size, bitorder="little")
            return torch.from_numpy(bits).view(torch.bool)
        return unpack_banned(masks.to(self.device, non_blocking=True), self.vocab_size)

    def allowed(self, matchers: list[GrammarMatcher]) -> torch.Tensor:
        """[len(matchers), vocab_size] bool on the device: True where the token may come next."""
        return ~self.banned(matchers)

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[GrammarMatcher],
              drafts: list[list[int]] | None = None) -> None:
        """Set the disallowed tokens of `rows` of `logits` [batch, vocab] to -inf, in place (with
        `drafts`, each matcher's rows are its row and one per draft, in order)."""
        banned = self.banned(matchers, drafts)
        if logits.device.type == "cpu" and logits.is_contiguous():
            # numpy's masked copy, one row view at a time: single-threaded and much cheaper than
            # torch's masked_fill_ on a few cores (no thread fan-out for a 1-D memory pass).
            values, masks = logits.numpy(), banned.numpy()
            for i, row in enumerate(rows):
                np.copyto(values[row], -np.inf, where=masks[i])
            return
        index = host_to_device(rows, logits.device)
        logits.index_copy_(0, index, logits.index_select(0, index).masked_fill_(banned, float("-inf")))
