"""Speculative decoding by n-gram lookup (prompt lookup decoding, Saxena 2023; vLLM's `ngram`
method): a decode also computes up to K draft tokens copied from the sequence's own history, and
keeps those the model would have produced. Plain Python and numpy, no model: the scheduler asks
`Drafter.drafts` for each decode it schedules.

Draft: the longest suffix of the sequence (prompt_lookup_max down to prompt_lookup_min tokens)
that occurred earlier in it; the tokens that followed its latest earlier occurrence with k tokens
after it are the draft.
Verify: the step computes the sequence's last token and its drafts as one chunk, so one forward
pass gives logits for K+1 positions (the weights are read once for all of them). Each position is
sampled as usual, with the request's own parameters; draft i is kept while the sample at position
i equals it, and the first sample that differs (or the one after the last draft) is emitted too.
A draft is one proposal (a one-hot distribution), so this is the rejection sampling of Leviathan
et al. 2023 and Chen et al. 2023: every emitted token has the model's distribution, greedy or
sampled. What a step emits stops at its first stop token (EOS, a stop token id).

The sampler sees each verification row as the request with the drafts before it appended
(`DraftRow`), so penalties and min_tokens apply at each position as one token at a time, and a
grammar masks each row as it stands after the drafts before it (llguidance computes those masks
without advancing the matcher; drafts are cut where the grammar would refuse one, and the matcher
then takes the tokens emitted). A request with a logits processor (state of its own), under KV
eviction, or whose grammar waits for its start token (reasoning) does not draft.
Drafts never cost another request its place: they are dropped when the pool cannot hold them.
With `disable_by_batch_size` no request drafts while more than that many run: a big batch keeps
the device busy without drafts, which then only add work.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field

import numpy as np

from kvserve.engine.request import Request
from kvserve.sampling_params import active_processors

METHODS = ("ngram",)
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size")
MAX_SPECULATIVE_TOKENS = 64


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's --speculative-config, for its `ngram` method."""

    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    method: str = "ngram"
    # No drafts in a step while more requests than this run (vLLM's key); None: always
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value: str | dict | None) -> SpeculativeConfig | None:
        """A JSON object (text, or a dict as `LLM(speculative_config=...)` takes it); None: off.
        Raises ValueError with one line for anything kvserve does not do."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--speculative-config must be a JSON object: {exc}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {value!r:.60}")
        unknown = sorted(str(k) for k in value if k not in _KEYS)
        if unknown:
            raise ValueError(f"--speculative-config: {', '.join(unknown)} not supported (kvserve reads "
                             f"{', '.join(_KEYS)}; draft models, EAGLE, Medusa and MTP are not built)")
        method = value.get("method")
        if method not in METHODS:
            raise ValueError(f"--speculative-config: method must be one of {', '.join(METHODS)} (prompt lookup; draft "
                             f"models, EAGLE, Medusa and MTP are not built), got {method!r}")
        k = value.get("num_speculative_tokens")
        lookup_max, lookup_min = value.get("prompt_lookup_max"), value.get("prompt_lookup_min")
        # vLLM's defaults: a missing bound takes the other's value, 5 when both are missing
        if lookup_max is None and lookup_min is None:
            lookup_max = lookup_min = 5
        lookup_max = lookup_min if lookup_max is None else lookup_max
        lookup_min = lookup_max if lookup_min is None else lookup_min
        for name, number, low in (("num_speculative_tokens", k, 1), ("prompt_lookup_max", lookup_max, 1),
                                  ("prompt_lookup_min", lookup_min, 1)):
            if isinstance(number, bool) or not isinstance(number, int) or number < low:
                raise ValueError(f"--speculative-config: {name} must be an integer >= {low}, got {number!r}")
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"--speculative-config: num_speculative_tokens must be at most "
                             f"{MAX_SPECULATIVE_TOKENS}, got {k}")
        disable = value.get("disable_by_batch_size")
        if disable is not None and (isinstance(disable, bool) or not isinstance(disable, int) or disable < 1):
            raise ValueError(f"--speculative-config: disable_by_batch_size must be an integer >= 1, got {disable!r}")
        if lookup_min > lookup_max:
            raise ValueError(f"--speculative-config: prompt_lookup_min ({lookup_min}) must not exceed "
                             f"prompt_lookup_max ({lookup_max})")
        return cls(k, lookup_max, lookup_min, disable_by_batch_size=disable)


def ngram_draft(token_ids: list[int] | np.ndarray, lookup_min: int, lookup_max: int, k: int) -> list[int]:
    """Up to k tokens that followed an earlier occurrence of the longest suffix of `token_ids`
    (between lookup_min and lookup_max tokens long); [] when no suffix recurs."""
    last = len(token_ids) - 1
    if k <= 0 or last < lookup_min:
        return []
    tokens = np.asarray(token_ids)
    # Candidate ends i < last of an earlier occurrence, grown backwards one token at a time.
    ends = np.flatnonzero(tokens[:last] == tokens[last])
    length = 1
    while ends.size and length < lookup_max:
        longer = ends[ends >= length]
        longer = longer[tokens[longer - length] == tokens[last - length]]
        if not longer.size:
            break
        ends, length = longer, length + 1
    if not ends.size or length < lookup_min:
        return []
    # The latest occurrence followed by k tokens (in a repeating span the latest one is followed
    # by one period only), else the earliest, followed by the most.
    full = ends[ends + k <= last]
    start = int(full[-1] if full.size else ends[0]) + 1
    return tokens[start:start + k].tolist()


def can_draft(request: Request) -> bool:
    """Whether the request's next tokens may be drafted (module docstring)."""
    grammar = request.grammar
    return ((grammar is None or grammar.active and request.error is None) and request.eviction is None
            and not (request.params.logits_processors and active_processors(request.params))
            and request.params.max_tokens != 0)


class DraftRow:
    """A request as the sampler sees it at the verification row after `drafts`: the drafts before
    the row count as its tokens (the row's sample is kept only if they are all confirmed), so
    penalties and min_tokens apply there as they would one token at a time. Everything else is
    the request's."""

    __slots__ = ("request", "drafts")

    def __init__(self, request: Request, drafts: list[int]):
        self.request = request
        self.drafts = drafts

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)

    def __getattr__(self, name: str):
        return getattr(self.request, name)


@dataclass
class SpeculationStats:
    """Counts since start (vLLM's spec_decode_* metrics)."""

    num_drafts: int = 0  # decodes that carried drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def copy(self) -> SpeculationStats:
        return SpeculationStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                list(self.accepted_per_position))


class _TokenArray:
    """A request's token ids as a growing int64 array, extended by the tokens added since the
    last look: the lookup then reads an array without converting the whole list each step."""

    def __init__(self) -> None:
        self.array = np.empty(256, dtype=np.int64)
        self.length = 0

    def of(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n < self.length:  # (never while a request decodes; kept correct anyway)
            self.length = 0
        if n > self.array.shape[0]:
            grown = np.empty(max(n, 2 * self.array.shape[0]), dtype=np.int64)
            grown[:self.length] = self.array[:self.length]
            self.array = grown
        self.array[self.length:n] = token_ids[self.length:n]
        self.length = n
        return self.array[:n]


class Drafter:
    """Proposes each decode's drafts (the scheduler's side) and counts what was accepted."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)
        # (keyed by the request itself, compared by identity: an entry goes with its request)
        self._arrays: weakref.WeakKeyDictionary[Request, _TokenArray] = weakref.WeakKeyDictionary()

    def drafts(self, request: Request, budget: int) -> list[int]:
        """The drafts for a decode with `budget` tokens left in the step besides its own: at most
        what the request can still emit (max_tokens, max-model-len) less the token it samples anyway."""
        if not can_draft(request):
            return []
        limit = min(self.config.num_speculative_tokens, budget,
                    request.max_tokens - request.num_output_tokens - 1,
                    self.max_model_len - request.num_tokens - 1)
        if limit <= 0:
            return []
        tokens = self._arrays.get(request)
        if tokens is None:
            tokens = self._arrays[request] = _TokenArray()
        c = self.config
        drafts = ngram_draft(tokens.of(request.token_ids), c.prompt_lookup_min, c.prompt_lookup_max, limit)
        if drafts and request.grammar is not None:  # only what the grammar would take
            del drafts[request.grammar.draftable_prefix(drafts):]
        return drafts

    def record(self, proposed: list[list[int]], accepted: list[list[int]]) -> None:
        stats = self.stats
        for drafts, kept in zip(proposed, accepted):
            if not drafts:
                continue
            stats.num_drafts += 1
            stats.num_draft_tokens += len(drafts)
            stats.num_accepted_tokens += len(kept)
            for position in range(len(kept)):
                stats.accepted_per_position[position] += 1


@dataclass
class Verified:
    """What a step's verification emits per request: `drafts[i]`, the drafts confirmed (with their
    `draft_logprobs[i]`), then `token_ids[i]` (with `logprobs[i]`), the first sample that is not one."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    draft_logprobs: list[list] = field(default_factory=list)


def accept_drafts(requests: list[Request], drafts: list[list[int]], tokens: list[int], logprobs: list) -> Verified:
    """From the samples of every verified position (request i's 1 + len(drafts[i]) rows, in
    order), what each request emits, cut after its first stop token."""
    result = Verified()
    row = 0
    for request, proposed in zip(requests, drafts):
        kept = 0
        while (kept < len(proposed) and tokens[row + kept] == proposed[kept]
               and not request.is_stop_token(proposed[kept])):
            kept += 1
        result.token_ids.append(tokens[row + kept])
        result.logprobs.append(logprobs[row + kept])
        result.drafts.append(list(proposed[:kept]))
        result.draft_logprobs.append(logprobs[row:row + kept])
        row += 1 + len(proposed)
    return result

