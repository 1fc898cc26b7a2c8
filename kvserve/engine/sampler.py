"""Batched token sampling: logits processors, logit bias, token bans (allowed_token_ids,
bad_words), grammar masks (structured outputs), penalties, temperature, top-k, top-p, min-p,
greedy, seeds, logprobs.

Every transformation is a tensor op over the whole batch; per-request values arrive as
[batch] tensors. Only seeded requests draw their noise one by one (each owns a generator, seeded
anew for each output position from the request's seed and the position, so its output depends
neither on what else is in the batch nor on how many draws came before), and only requests with
logits processors (SamplingParams.logits_processors) have their row handed to Python code. Only rows under a
grammar (SamplingParams.structured_outputs) get a token bitmask; a batch without any costs nothing.

Which transformations a batch needs is decided from the requests' parameters on the host, and
each per-row parameter reaches the device in one copy. The sampled ids and the logprobs asked for
stay on the device (`sample_on_device`): the model runner copies them to the host without
blocking, so on a GPU a step's only wait for the device is for that copy.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kvserve.engine.logprobs import packed_token_logprobs, unpack_token_logprobs
from kvserve.engine.request import Request
from kvserve.engine.speculative import DraftRow
from kvserve.engine.structured_output import GrammarMasks
from kvserve.engine.token_bans import banned_next
from kvserve.sampling_params import active_processors
from kvserve.transfers import host_to_device

logger = logging.getLogger(__name__)

# Temperatures below this sample greedily, as in vLLM: dividing logits by them overflows to inf.
SAMPLING_EPS = 1e-5

# Columns per block of row_argmax's first level.
_ARGMAX_BLOCK = 128


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) of a 2-D tensor, the same index (the first maximum; NaN counts as the
    maximum). On CPU torch's argmax reduces one element at a time while amax is vectorised, so a
    wide row goes in two levels: the block holding the maximum (amax per block, argmax over those),
    then the argmax inside it (BENCHMARKS.md, "The decode step at 32 rows")."""
    rows, width = x.shape
    if x.device.type != "cpu" or width % _ARGMAX_BLOCK or width < 8 * _ARGMAX_BLOCK:
        return x.argmax(dim=-1)
    blocks = x.view(rows, width // _ARGMAX_BLOCK, _ARGMAX_BLOCK)
    best = blocks.amax(dim=-1).argmax(dim=-1)
    inside = blocks[torch.arange(rows, device=x.device), best].argmax(dim=-1)
    return best * _ARGMAX_BLOCK + inside


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per request, when logprobs were asked: (chosen token's logprob, its rank, [(token, logprob)] top-k).
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]
    # Speculative decoding (speculative.py): per request, the drafts emitted before token_ids[i]
    # and their logprobs; None when nothing was drafted.
    drafts: list[list[int]] | None = None
    draft_logprobs: list[list] | None = None


@dataclass
class LogprobsOnDevice:
    """The logprobs a batch asked for, still on the device: rows `rows` packed as
    `packed_token_logprobs` makes them; `wanted[i]`: the alternatives row i asked for (None: no
    logprobs). `on_host` unpacks them once they are copied."""

    packed: torch.Tensor
    rows: list[int]
    wanted: list[int | None]

    def on_host(self, packed: np.ndarray) -> list[tuple[float, int, list[tuple[int, float]]] | None]:
        found = unpack_token_logprobs(packed)
        result: list = [None] * len(self.wanted)
        for j, i in enumerate(self.rows):
            w = self.wanted[i]
            top = list(zip(found.top_ids[j][:w], found.top_logprobs[j][:w]))
            result[i] = (found.logprobs[j], found.ranks[j], top)
        return result


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device):
        self.vocab_size = vocab_size
        self.device = device
        self._generators: dict[str, torch.Generator] = {}
        # allowed_token_ids as a row of the vocabulary (True: allowed), built on a request's first step
        self._allowed_rows: dict[str, torch.Tensor] = {}
        self._grammar_masks: GrammarMasks | None = None  # made on the first constrained row

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._allowed_rows.pop(request_id, None)

    def _generator(self, request: Request | DraftRow) -> torch.Generator:
        """The seeded request's generator, seeded for the output position it samples now."""
        gen = self._generators.get(request.request_id)
        if gen is None:
            gen = self._generators[request.request_id] = torch.Generator(device=self.device)
        gen.manual_seed(position_seed(request.params.seed, request.num_output_tokens))
        return gen

    def finish(self, requests: list[Request], token_list: list[int], logprobs: list) -> SampleResult:
        """The host's part, once the sampled ids are there: grammars take their tokens."""
        self._advance_grammars(requests, token_list)
        return SampleResult(token_list, logprobs)

    def sample_on_device(self, logits: torch.Tensor,
                         requests: list[Request]) -> tuple[torch.Tensor, LogprobsOnDevice | None]:
        """The sampled ids as a device tensor [batch] and the logprobs asked for (None: none), both
        left on the device: the caller copies them to the host when it chooses, then calls
        `finish`. logits: float32 [batch, vocab] (vocab may exceed the tokenizer's; padded rows are
        real logits of the checkpoint and stay eligible only if the model gives them mass). A
        request whose logits processor fails gets `error` set; its token is to be discarded. A
        request that finished meanwhile (async scheduling: its token will be dropped) gets no
        logits processor, grammar or seeded draw."""
        params = [r.params for r in requests]
        raw = logits
        logits = self._apply_processors(logits, requests)
        logits = self._apply_logit_bias(logits, requests, cloned=logits is not raw)
        logits = self._apply_token_bans(logits, requests, cloned=logits is not raw)
        logits = self._apply_grammars(logits, requests, cloned=logits is not raw)
        logits = self._apply_penalties(logits, requests)
        logits = self._mask_min_tokens(logits, requests)

        greedy = [p.temperature < SAMPLING_EPS for p in params]
        # torch's CPU argmax over bfloat16 takes twice as long as the float32 copy and argmax together
        tokens = row_argmax(logits if logits.dtype == torch.float32 else logits.float())
        if not all(greedy):
            temperature = self._per_row([1.0 if g else p.temperature for g, p in zip(greedy, params)])
            probs = self._truncate(logits / temperature.unsqueeze(1), params).softmax(dim=-1)
            sampled = self._draw(probs, requests)
            tokens = torch.where(self._per_row(greedy, torch.bool), tokens, sampled) if any(greedy) else sampled

        return tokens, self._logprobs(raw, tokens, params)

    def _per_row(self, values: list, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """One value per row, on the device in one copy (float32 as torch.tensor makes Python floats)."""
        return host_to_device(values, self.device, dtype)

    # ------------------------------------------------------------------ transformations
    def _apply_processors(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Each request's logits processors, in order, on a copy of its row (the model's logits
        stay as they were, for logprobs). A processor that raises or returns something else than
        a row fails only its request: `request.error` says why and its row is left unprocessed."""
        rows = [(i, r, active) for i, r in enumerate(requests)
                if r.params.logits_processors and not r.status.finished and (active := active_processors(r.params))]
        if not rows:
            return logits
        processed = logits.clone()
        for i, r, active in rows:
            row = processed[i]
            for processor in active:
                try:
                    row = processor(list(r.output_token_ids), row)
                    if not isinstance(row, torch.Tensor) or row.shape != logits[i].shape:
                        raise TypeError(f"returned {_describe(row)}, expected a tensor of shape "
                                        f"{tuple(logits[i].shape)}")
                except Exception as exc:
                    r.error = f"logits processor {_name(processor)} failed: {type(exc).__name__}: {exc}"
                    logger.warning("request %s: %s", r.request_id, r.error, exc_info=exc)
                    processed[i] = logits[i]
                    break
            else:
                processed[i] = row
        return processed

    def _apply_logit_bias(self, logits: torch.Tensor, requests: list[Request], cloned: bool) -> torch.Tensor:
        """Each request's logit_bias added to its row (on a copy unless `cloned`), in one indexed add."""
        rows, ids, biases = [], [], []
        for i, r in enumerate(requests):
            for token, bias in (r.params.logit_bias or {}).items():
                rows.append(i)
                ids.append(token)
                biases.append(bias)
        if not rows:
            return logits
        if not cloned:
            logits = logits.clone()
        where = self._per_row([rows, ids], torch.long)
        logits.index_put_((where[0], where[1]), self._per_row(biases, logits.dtype), accumulate=True)
        return logits

    def _apply_token_bans(self, logits: torch.Tensor, requests: list[Request | DraftRow],
                          cloned: bool) -> torch.Tensor:
        """allowed_token_ids and bad_words (token_bans.py): the tokens a request may not sample
        next become -inf (on a copy unless `cloned`). A verification row (DraftRow) matches bad
        words against the output with the drafts before it."""
        allowed = [(i, r.params.allowed_token_ids) for i, r in enumerate(requests)
                   if r.params.allowed_token_ids is not None and not r.status.finished]
        banned: list[list[int]] = [[], []]
        for i, r in enumerate(requests):
            if r.bad_word_ids and not r.status.finished:
                tokens = banned_next(r.bad_word_ids, r.output_token_ids)
                banned[0] += [i] * len(tokens)
                banned[1] += tokens
        if not allowed and not banned[0]:
            return logits
        if not cloned:
            logits = logits.clone()
        if allowed:
            keep = torch.stack([self._allowed_row(requests[i].request_id, ids, logits.shape[1]) for i, ids in allowed])
            index = self._per_row([i for i, _ in allowed], torch.long)
            logits.index_copy_(0, index, logits.index_select(0, index).masked_fill(~keep, float("-inf")))
        if banned[0]:
            where = self._per_row(banned, torch.long)
            logits.index_put_((where[0], where[1]), logits.new_full((), float("-inf")))
        return logits

    def _allowed_row(self, request_id: str, ids: list[int], vocab: int) -> torch.Tensor:
        """A request's allowed_token_ids as a boolean row of the vocabulary, made once (the list
        may be long: each step then costs a row's copy, not the list's)."""
        row = self._allowed_rows.get(request_id)
        if row is None:
            row = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            row[self._per_row(ids, torch.long)] = True
            self._allowed_rows[request_id] = row
        return row

    def _apply_grammars(self, logits: torch.Tensor, requests: list[Request | DraftRow],
                        cloned: bool) -> torch.Tensor:
        """Tokens a request's grammar does not allow next become -inf (on a copy unless `cloned`:
        the raw logits stay as they are, for logprobs). A request's verification rows (DraftRow,
        speculative decoding) take the masks after the drafts before them."""
        rows = [i for i, r in enumerate(requests) if r.grammar is not None and r.grammar.active and r.error is None
                and not r.status.finished]
        if not rows:
            return logits
        if self._grammar_masks is None:
            self._grammar_masks = GrammarMasks(self.vocab_size, logits.device)
        if not cloned:
            logits = logits.clone()
        drafted = [requests[i] for i in rows if isinstance(requests[i], DraftRow)]
        firsts = [i for i in rows if not isinstance(requests[i], DraftRow)]
        if not drafted:
            self._grammar_masks.apply(logits, rows, [requests[i].grammar for i in rows])
            return logits
        # a request's rows are consecutive: its own, then one per draft (the last holds them all)
        last = {id(row.request): row.drafts for row in drafted}
        drafts = [last.get(id(requests[i]), []) for i in firsts]
        self._grammar_masks.apply(logits, rows, [requests[i].grammar for i in firsts], drafts)
        return logits

    def advance_grammars(self, requests: list[Request], emitted: list[list[int]]) -> None:
        """Speculative decoding: each constrained request's matcher takes every token it emitted."""
        for r, tokens in zip(requests, emitted):
            for token in tokens:
                if self._advance_grammar(r, token):
                    break

    def _advance_grammars(self, requests: list[Request], tokens: list[int]) -> None:
        """Each constrained request's matcher takes its sampled token; one it refuses (only possible
        when every token was masked) fails that request."""
        for r, token in zip(requests, tokens):
            self._advance_grammar(r, token)

    @staticmethod
    def _advance_grammar(r: Request, token: int) -> bool:
        """The request's matcher takes `token`; True if it failed the request."""
        if r.grammar is None or r.error is not None or r.status.finished:
            return False
        refused = r.grammar.accept(token)
        if refused is not None:
            r.error = f"structured output: {refused}"
            logger.warning("request %s: %s", r.request_id, r.error)
        return refused is not None

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        params = [r.params for r in requests]
        if not any(p.has_penalties for p in params):
            return logits
        batch, vocab = logits.shape
        dev = logits.device
        # Every (row, token) pair in one copy: output tokens (counted), then all tokens (seen).
        outputs = [r.output_token_ids for r in requests]
        everything = [r.token_ids for r in requests]
        num_out = sum(len(o) for o in outputs)
        pairs = np.empty((2, num_out + sum(len(t) for t in everything)), dtype=np.int64)
        pairs[0] = np.concatenate([np.repeat(np.arange(batch), [len(o) for o in outputs]),
                                   np.repeat(np.arange(batch), [len(t) for t in everything])])
        pairs[1] = np.fromiter(chain(chain.from_iterable(outputs), chain.from_iterable(everything)),
                               dtype=np.int64, count=pairs.shape[1])
        pairs = self._per_row(pairs, torch.long)
        out_counts = torch.zeros(batch, vocab, device=dev)
        out_counts.index_put_((pairs[0, :num_out], pairs[1, :num_out]), torch.ones(num_out, device=dev),
                              accumulate=True)
        rep, freq, pres = self._per_row([[p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                                         [p.presence_penalty for p in params]]).unsqueeze(2)
        # float32 turns penalties below its smallest normal number into 0 (a division by zero) and
        # huge ones into overflow; both are clamped so every accepted value stays finite.
        finite = torch.finfo(logits.dtype)
        rep = rep.clamp(min=finite.tiny, max=finite.max)
        # Repetition penalty (Keskar et al. 2019, as in HF/vLLM) over prompt and output tokens: at
        # the seen (row, token) pairs only (a pair seen twice is written twice with one value).
        rows, tokens = pairs[0, num_out:], pairs[1, num_out:]
        seen, row_rep = logits[rows, tokens], rep[rows, 0]
        penalised = torch.where(seen > 0, seen / row_rep, seen * row_rep).clamp(min=-finite.max, max=finite.max)
        # (a masked token, -inf, stays masked: clamped, it could win a row whose tokens are all masked)
        logits = logits.index_put((rows, tokens), torch.where(seen.isneginf(), seen, penalised))
        # OpenAI's presence/frequency penalties count generated tokens only.
        return logits - freq * out_counts - pres * (out_counts > 0).float()

    def _mask_min_tokens(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        rows = [(i, r) for i, r in enumerate(requests) if r.num_output_tokens < r.params.min_tokens]
        if not rows:
            return logits
        where = [[], []]
        for i, r in rows:
            banned = set(r.params.stop_token_ids)
            if not r.params.ignore_eos:
                banned.update(r.eos_token_ids)
            where[0] += [i] * len(banned)
            where[1] += sorted(banned)
        if not where[0]:
            return logits
        where = self._per_row(where, torch.long)
        return logits.index_put((where[0], where[1]), logits.new_full((), float("-inf")))

    def _truncate(self, logits: torch.Tensor, params) -> torch.Tensor:
        """Top-k, then top-p (nucleus, Holtzman et al. 2019), then min-p, as -inf masks."""
        dev, vocab = logits.device, logits.shape[1]
        top_k = [min(p.top_k or vocab, vocab) for p in params]
        if any(k < vocab for k in top_k) or any(p.top_p < 1 for p in params):
            # A row without top_p gets 2, which no cumulative mass reaches: float32's cumulative
            # mass can round to 1 before a peaked row's end, which cut its tail whenever another
            # row of the batch asked for top_p.
            top_k, top_p = self._per_row(top_k, torch.long), self._per_row([p.top_p if p.top_p < 1 else 2.0
                                                                             for p in params])
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ranks = torch.arange(vocab, device=dev)
            drop = ranks[None, :] >= top_k[:, None]
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            probs = sorted_logits.softmax(dim=-1)
            # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
            mass_before = probs.cumsum(dim=-1) - probs
            sorted_logits = sorted_logits.masked_fill(mass_before >= top_p[:, None], float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
        if any(p.min_p > 0 for p in params):
            min_p = self._per_row([p.min_p for p in params])
            probs = logits.softmax(dim=-1)
            threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < threshold, float("-inf"))
        return logits

    def _draw(self, probs: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Sample via the exponential race: argmax(p / E) with E ~ Exp(1) picks i with prob p_i."""
        noise = torch.empty_like(probs).exponential_()
        for i, r in enumerate(requests):
            if r.params.seed is not None and not r.status.finished:
                noise[i].exponential_(generator=self._generator(r))
        return row_argmax(probs / noise)

    def _logprobs(self, raw: torch.Tensor, tokens: torch.Tensor, params) -> LogprobsOnDevice | None:
        """The rows that asked for logprobs: the sampled token's logprob and the top alternatives,
        from the raw logits, packed on the device."""
        wanted = [p.logprobs for p in params]
        rows = [i for i, w in enumerate(wanted) if w is not None]
        if not rows:
            return None
        if len(rows) < len(params):
            index = self._per_row(rows, torch.long)
            raw, tokens = raw.index_select(0, index), tokens.index_select(0, index)
        return LogprobsOnDevice(packed_token_logprobs(raw, tokens, max(wanted[i] for i in rows)), rows, wanted)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """SplitMix64's output function (Steele, Lea and Flood 2014): a 64-bit integer mixed."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def position_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draw for its output token `position`: the draw depends on
    the request's seed and the position only, not on the draws made before (a step that samples
    positions it then discards, as speculative decoding's verification does, changes nothing)."""
    return _splitmix64((seed & _MASK64) ^ _splitmix64(position))


def _name(processor) -> str:
    return getattr(processor, "__qualname__", None) or type(processor).__qualname__


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__}"
