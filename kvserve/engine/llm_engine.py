"""The engine: a short loop over the scheduler, the model runner and the output processor.

    add_request ──> OutputProcessor (tokenize, n > 1 fan-out) ──> Scheduler.waiting
    step: Scheduler.schedule ──> ModelRunner.execute ──> Scheduler.update ──> OutputProcessor.process
                                                                             (detokenize, stop strings, logprobs)

With --async-scheduling (vLLM v1's async scheduling), step N+1 is scheduled and launched before
step N's tokens are waited for, so on a GPU the host's part of a step (scheduling, inputs,
detokenizing, stop checks) runs while the device computes:

    step: schedule N+1 ──> ModelRunner.launch N+1 (forward) ──> wait for N ──> update, process N
          ──> ModelRunner.sample N+1 ──> Scheduler.advance

Start-up is three functions of its own: loading.py (options checked, model built, KV format
and attention backend chosen), pool_sizing.py (blocks for the budget, or the CUDA profiling pass) and
key_transforms.py (the calibration the KV format asks for, run through the runner). Scoring
(scoring.py) also drives the model through the runner. Under tensor parallelism (parallel/)
this process is rank 0: it starts the workers, and its runner sends them each forward pass.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import replace

import torch

from kvserve.cache.eviction import POLICIES, EvictionConfig, EvictionSpec
from kvserve.cache.eviction.config import resolve_eviction
from kvserve.cache.eviction.evictor import Evictor
from kvserve.cache.kv_cache import KVCache
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.sizing import blocks_for_tokens
from kvserve.cache.tiers import TierConfig, TieredStore
from kvserve.engine import scoring
from kvserve.engine.args import DEFAULT_DISK_TIER_GIB, EngineArgs
from kvserve.engine.key_transforms import calibrate_key_transforms
from kvserve.engine.kv_identity import kv_namespace
from kvserve.engine.loading import load_engine_model, select_attention
from kvserve.engine.model_runner import InFlightStep, ModelRunner
from kvserve.engine.parallel.executor import TensorParallelExecutor
from kvserve.engine.parallel.rank_zero import start_rank_zero
from kvserve.engine.output_processor import OutputProcessor, apply_chat_template, tokenize
# CapacityError, select_device and select_dtype are imported from here by the CLI, plan and benchmarks.
from kvserve.engine.preflight import CapacityError, select_device, select_dtype  # noqa: F401
from kvserve.engine.preflight import preflight, resolve_batch_limits
from kvserve.engine.platforms import platform_for
from kvserve.engine.pool_sizing import size_kv_pool
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampler import SampleResult
from kvserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from kvserve.engine.speculative import Drafter, SpeculativeConfig
from kvserve.engine.structured_output import GrammarCompiler
from kvserve.engine.token_bans import bad_word_sequences
from kvserve.model.batch_invariant import make_batch_invariant
from kvserve.model.loader import LoadedModel
from kvserve.model.shape import ModelShape
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams, check_truncate_prompt_tokens
from kvserve.units import GiB, format_size

logger = logging.getLogger("kvserve")


def _make_tiers(args: EngineArgs, kv_cache: KVCache, namespace: str) -> TieredStore | None:
    """The KV offload tiers the options ask for (None: none); logs their sizes in blocks."""
    config = TierConfig(int((args.kv_offloading_size or 0) * GiB), args.kv_offloading_disk_path,
                        int((args.kv_offloading_disk_size or DEFAULT_DISK_TIER_GIB) * GiB), args.kv_offloading_disk_key)
    if not config.enabled:
        return None
    tiers = TieredStore(config, kv_cache, namespace)
    block = kv_cache.block_nbytes
    if tiers.host is not None:
        logger.info("KV host tier: %s, %d blocks of %d tokens", format_size(tiers.host.capacity_bytes),
                    tiers.host.max_blocks, kv_cache.spec.block_size)
    if tiers.disk is not None:
        logger.info("KV disk tier: %s in %s, up to %d blocks (%s in use)", format_size(config.disk_bytes),
                    tiers.disk.root, config.disk_bytes // (block + 128), format_size(tiers.disk.used_bytes))
    return tiers


class LLMEngine:
    closed = False  # set by close(): the engine takes no more work

    def __init__(self, args: EngineArgs, loaded_model: LoadedModel | None = None, serving: bool = False):
        """`loaded_model`: a checkpoint already read by `load_model(args.model)`, so that several
        engines (e.g. one per KV-cache dtype in `kvserve eval`) share one load; its tensors are
        only read. `serving`: built by `kvserve serve` (some defaults differ, as in vLLM)."""
        args, self._limits_line = resolve_batch_limits(args, serving)  # logged once the model loads
        self.args = args
        self.parallel: TensorParallelExecutor | None = None
        self.tiers: TieredStore | None = None
        self._cuda_index: int | None = None
        tp = args.tensor_parallel_size
        if tp > 1:  # the workers load while this process does; a bad option fails before they start
            plan = preflight(args, ModelShape.of(loaded_model.config) if loaded_model else None)
            self.parallel = TensorParallelExecutor(args, plan.device)
        try:
            self._start(args, loaded_model)
        except BaseException:
            self.close()
            raise

    def _start(self, args: EngineArgs, loaded_model: LoadedModel | None) -> None:
        built = load_engine_model(args, loaded_model, prepack=self.parallel is None)
        self.device, self.dtype = built.plan.device, built.plan.dtype
        self.generation_defaults = built.plan.generation_defaults
        if self.generation_defaults.sampling or self.generation_defaults.max_tokens is not None:
            logger.info("Default sampling parameters from the generation config: %s%s (--generation-config vllm "
                        "ignores the model's)", self.generation_defaults.sampling,
                        f", max_tokens at most {self.generation_defaults.max_tokens}"
                        if self.generation_defaults.max_tokens is not None else "")
        self._cuda_index = self.device.index if self.device.type == "cuda" else None
        if self._cuda_index is not None:
            self._bind_cuda_device()
        self.model, self.model_config, self.model_path = built.model, built.config, built.path
        if args.deterministic:
            make_batch_invariant(self.model)
            logger.info("--deterministic: every layer on a fixed-order path (batch-invariant)")
        self.tokenizer, self.eos_token_ids = built.tokenizer, built.eos_token_ids
        self.kv_format, self.attention_backend = select_attention(args, built)
        self.kv_spec = built.plan.kv_spec
        # before the pool is sized: CUDA's profiling pass measures the step that will run (fused ops)
        platform_for(self.device).prepare_model(self.model, self.attention_backend, self.parallel is not None)
        pool = size_kv_pool(args, self.model, self.kv_spec, self.kv_format, self.attention_backend,
                            built.plan.max_model_len, built.plan.kv_budget, built.plan.hold)
        self.max_model_len = pool.max_model_len
        logger.info(self._limits_line)
        if self.parallel is not None:
            self.device = self.parallel.device
            start_rank_zero(self.parallel, built, self.kv_format, self.attention_backend, pool.num_blocks,
                            self.max_model_len, args.quantization)
        self.kv_cache = KVCache(self.kv_spec, self.kv_format, pool.num_blocks, self.device)
        if self.parallel is not None:  # the pool's real size, for describe()
            self.parallel.local_stats = replace(self.parallel.local_stats, kv_pool_bytes=self.kv_cache.nbytes)
        # block_size is the pool's (KVCacheSpec, made once by preflight from --block-size); the
        # block manager and its evictor count in the same blocks.
        self.evictor = Evictor(self.kv_spec.block_size, self.max_model_len, self.device)
        self.runner = ModelRunner(self.model, self.kv_cache, self.attention_backend, self.evictor, self.parallel)
        if self.parallel is None:  # under tensor parallelism, calibrated on the full model (start_rank_zero)
            calibrate_key_transforms(self.runner, self.max_model_len, built.calibration_file)
        # after calibration: a graph holds the key transforms as they are when it is captured
        platform_for(self.device).capture_decode_graphs(self.runner, args, self.max_model_len)
        self.eviction_defaults = EvictionSpec(args.kv_eviction, args.kv_budget, args.sink_tokens, args.recent_tokens)
        # A sliding-window model's pool may hold less than a sequence of max-model-len (preflight's
        # SequenceHold); an evicting sequence keeps its budget instead of its window.
        self._pool_blocks_short = max(0, blocks_for_tokens(self.max_model_len, self.kv_spec.block_size)
                                      - pool.num_blocks)
        self.resolve_eviction(None)  # bad --kv-eviction flags fail at start-up
        namespace = kv_namespace(self.kv_cache, self.model_config, self.model_path, self.dtype, self.model,
                                 args.deterministic, dummy_weights=args.load_format == "dummy")
        self.tiers = _make_tiers(args, self.kv_cache, namespace)
        self.kv_manager = KVCacheManager(pool.num_blocks, self.kv_spec.block_size, args.enable_prefix_caching,
                                         namespace=namespace, evictor=self.evictor, tiers=self.tiers,
                                         window=built.plan.shape.sliding_window)
        self.kv_manager.carry_out_moves = self.runner.move_tokens
        speculative = SpeculativeConfig.parse(args.speculative_config)
        self.drafter = None if speculative is None else Drafter(speculative, self.max_model_len)
        if speculative is not None:
            logger.info("Speculative decoding: up to %d draft tokens a decode by n-gram lookup (%d to %d tokens)",
                        speculative.num_speculative_tokens, speculative.prompt_lookup_min,
                        speculative.prompt_lookup_max)
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len, args.scheduling_policy,
                            args.enable_chunked_prefill, args.long_prefill_token_threshold), self.kv_manager,
            self.drafter)
        self.grammars = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler.finish, self.runner.sampler.forget)
        self._ids = itertools.count()
        self._in_flight: InFlightStep | None = None  # async scheduling: the launched step not waited for yet
        self.salvaged_outputs: list[RequestOutput] = []  # take_salvaged_outputs
        if args.async_scheduling and self.device.type == "cpu":
            logger.info("--async-scheduling: on CPU the forward pass runs in this thread, so steps do not overlap")

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        return tokenize(self.tokenizer, prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False,
                            template_kwargs: dict | None = None, chat_template: str | None = None,
                            add_special_tokens: bool = False, fields: dict | None = None) -> list[int]:
        """Render a conversation (and tool definitions, for templates that use them) with
        `chat_template` or the tokenizer's, then tokenize it (the template already holds the special
        tokens, so none are added unless asked); output_processor.apply_chat_template says the rest."""
        return apply_chat_template(self.tokenizer, messages, add_generation_prompt, tools, continue_final_message,
                                   template_kwargs, chat_template, add_special_tokens, fields)

    def resolve_eviction(self, spec: EvictionSpec | None) -> EvictionConfig | None:
        """A request's KV eviction settings (its `kv_eviction` over the engine's flags), checked;
        None without eviction. Raises ValueError for bad values."""
        config = resolve_eviction(spec, self.eviction_defaults, self.max_model_len, POLICIES)
        if config is not None and self._pool_blocks_short:
            raise ValueError(f"KV eviction needs a KV pool that holds one sequence of max-model-len "
                             f"{self.max_model_len}, and this one, sized for the model's sliding window, is "
                             f"{self._pool_blocks_short} blocks short: raise --kv-cache-memory or lower --max-model-len")
        return config

    def validate(self, prompt_token_ids: list[int], params: SamplingParams, up_to_context: bool = False) -> int:
        """Check a request against the model; returns the resolved max_tokens. `up_to_context`: a
        max_tokens past max-model-len is cut to it (the sequence ends there, "length": vLLM's
        offline LLM) instead of refused (its server's 400)."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("The prompt cannot be empty.")
        vocab = self.model_config.vocab_size
        bad = next((t for t in [*prompt_token_ids, *params.stop_token_ids]
                    if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None and not isinstance(bad, int):
            raise ValueError(f"token ids are integers, got {bad!r:.40} ({type(bad).__name__})")
        if bad is not None:
            raise ValueError(f"Token id {bad} is out of vocabulary (the model has {vocab} tokens).")
        if self.args.deterministic and params.kv_eviction is not None \
                and self.resolve_eviction(params.kv_eviction) is not None:
            raise ValueError("kv_eviction is not available under --deterministic: what a policy evicts depends on "
                             "attention scores, so the request's tokens would depend on it")
        if not self.args.enable_chunked_prefill and params.kv_eviction is not None \
                and self.resolve_eviction(params.kv_eviction) is not None:
            raise ValueError("kv_eviction needs chunked prefill (its policy drops tokens between a prompt's chunks, "
                             "and such a prompt may be longer than a step): the server runs "
                             "--no-enable-chunked-prefill")
        if self.resolve_eviction(params.kv_eviction) is not None:
            # Under eviction max-model-len bounds the cache, not the sequence; "up to the context
            # limit" (no max_tokens) then means max-model-len new tokens.
            max_tokens = params.max_tokens if params.max_tokens is not None \
                else self.generation_defaults.cap(self.max_model_len)
        else:
            # No max_tokens: up to the context limit, and at most the generation config's max_new_tokens.
            max_tokens = params.max_tokens if params.max_tokens is not None \
                else self.generation_defaults.cap(max(self.max_model_len - n, 1))
            if up_to_context and n < self.max_model_len:
                max_tokens = min(max_tokens, self.max_model_len - n)
            if n + max_tokens > self.max_model_len:
                raise ValueError(
                    f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                    f"{n + max_tokens} tokens ({n} in the messages, {max_tokens} in the completion). "
                    f"Please reduce the length of the messages or completion.")
        limit = self.args.max_logprobs if self.args.max_logprobs >= 0 else vocab
        for kind, wanted in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            wanted = vocab if wanted == -1 else wanted  # -1: the whole vocabulary (vLLM's)
            if wanted is not None and wanted > limit:  # vLLM's text
                raise ValueError(f"Requested {kind} logprobs of {wanted}, which is greater than max allowed: {limit}")
        outside = sorted(t for t in (params.logit_bias or {}) if not 0 <= t < vocab)
        if outside:  # vLLM's text
            raise ValueError(f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. "
                             f"Vocabulary size: {vocab}")
        outside = sorted({t for t in params.allowed_token_ids or () if not 0 <= t < vocab})
        if outside:
            raise ValueError(f"allowed_token_ids contains out-of-vocab token ids {outside[:8]}. "
                             f"Vocabulary size: {vocab}")
        if params.min_tokens > max_tokens:  # without max_tokens, SamplingParams could not check it
            raise ValueError(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                             f"got {params.min_tokens}.")
        if params.structured_outputs is not None:
            after = params.structured_outputs.starts_after_token_id
            if after is not None and not (isinstance(after, int) and 0 <= after < vocab):
                raise ValueError(f"structured_outputs.starts_after_token_id must be a token id, got {after!r}")
            self.grammars.compile(params.structured_outputs)  # a bad schema/regex/grammar fails here
        return max_tokens

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None, final_only: bool = False, priority: int = 0,
                    up_to_context: bool = False) -> str:
        """Queue a prompt (text, token ids or {"prompt_token_ids": [...]}, whose "cache_salt" is
        `cache_salt`'s). Raises ValueError for bad input.
        `final_only`: `step()` reports the request once, when it finishes (vLLM's FINAL_ONLY output
        kind, what offline generation reads), not after every token.
        `priority`: its place under --scheduling-policy priority (lower first).
        `up_to_context`: see `validate`."""
        self.check_open()
        self.check_priority(priority)
        if isinstance(prompt, dict) and prompt.get("cache_salt") is not None:
            if cache_salt is not None and cache_salt != prompt["cache_salt"]:
                raise ValueError("the prompt's cache_salt and the cache_salt argument differ")
            cache_salt = prompt["cache_salt"]
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r:.40}")
        request_id = request_id or self.new_request_id()
        if request_id in self.output_processor:
            raise ValueError(f"duplicate request id {request_id!r}")
        text, token_ids = self.tokenize(prompt)
        token_ids = self.truncated(token_ids, params.truncate_prompt_tokens)
        max_tokens = self.validate(token_ids, params, up_to_context)
        eviction = self.resolve_eviction(params.kv_eviction)
        bad_word_ids = self.bad_word_ids(params)
        sequences = []
        vocab = self.model_config.vocab_size  # logprobs -1: the whole vocabulary (validate checked it)
        for index in range(params.n):  # n > 1: one sequence per sample, sharing the prompt
            child_params = params.for_child(index)
            child_params.max_tokens = max_tokens
            child_params.logprobs = vocab if params.logprobs == -1 else params.logprobs
            child_params.prompt_logprobs = vocab if params.prompt_logprobs == -1 else params.prompt_logprobs
            if index > 0:  # the first sample computes the prompt logprobs for all
                child_params.prompt_logprobs = None
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            grammar = None if params.structured_outputs is None else self.grammars.matcher(params.structured_outputs)
            sequences.append(Request(child_id, token_ids, child_params, self.eos_token_ids, cache_salt,
                                     priority=priority, eviction=eviction, grammar=grammar,
                                     bad_word_ids=bad_word_ids))
        self.output_processor.add(request_id, text, token_ids, sequences, final_only)
        for request in sequences:
            self.scheduler.add(request)
        return request_id

    def bad_word_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """The request's bad_words as token sequences (token_bans.py); ValueError when they, or
        min_tokens holding back EOS and stop_token_ids, leave none of its allowed_token_ids (every
        logit masked: the sampler would pick an arbitrary token)."""
        vocab = self.model_config.vocab_size  # a tokenizer's token past the model's is never sampled
        sequences = tuple(s for s in bad_word_sequences(self.tokenizer, params.bad_words or []) if max(s) < vocab)
        if params.allowed_token_ids is not None:
            left = set(params.allowed_token_ids) - {s[0] for s in sequences if len(s) == 1}
            if not left:
                raise ValueError("bad_words ban every token of allowed_token_ids: nothing could be generated.")
            held = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
            if params.min_tokens and left <= held:
                raise ValueError("min_tokens holds back every token of allowed_token_ids (EOS and stop_token_ids) "
                                 "for its first tokens: nothing could be generated.")
        return sequences

    def truncated(self, token_ids: list[int], keep: int | None) -> list[int]:
        """The prompt's last `keep` tokens (vLLM's truncate_prompt_tokens; -1: max-model-len; None:
        all of them). ValueError when `keep` is none of those, or over max-model-len."""
        check_truncate_prompt_tokens(keep)
        if keep is None:
            return token_ids
        if keep > self.max_model_len:  # vLLM's text
            raise ValueError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len "
                             f"({self.max_model_len}). Please, select a smaller truncation size.")
        return token_ids[-(self.max_model_len if keep == -1 else keep):]

    def check_priority(self, priority: object) -> None:
        """A request's priority: an integer (int64, as vLLM's field), and 0 unless the scheduler
        orders by it (vLLM's text, from its V0 engine; vLLM v1 ignores it under fcfs, kvserve
        refuses what it would ignore)."""
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(1 << 63) <= priority < (1 << 63):
            raise ValueError(f"priority must be a 64-bit integer, got {priority!r:.40}")
        if priority != 0 and self.args.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled "
                             f"(--scheduling-policy priority).")

    def abort_request(self, request_id: str,
                      status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> RequestOutput | None:
        """Stop a request now (finish reason `status`: abort, or error when a step failed); its
        blocks go back to the pool immediately."""
        for request in self.output_processor.sequences(request_id):
            self.scheduler.finish(request, status)
        return self.output_processor.output(request_id)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached prefix in the pool (vLLM's `reset_prefix_cache`), e.g. for a cold-cache
        measurement or after the weights change. Only possible while no request holds blocks: False,
        nothing changed, otherwise, unless `reset_running_requests` preempts the running ones first
        (they recompute). The offload tiers keep their blocks."""
        if reset_running_requests:
            self.scheduler.preempt_running()
        return self.kv_manager.pool.reset_prefix_cache()

    def is_queued(self, request_id: str) -> bool:
        """True while every sequence of the request waits in the queue, holding no blocks (never
        scheduled, or preempted); False once one runs or finished, or for an unknown id."""
        sequences = self.output_processor.sequences(request_id)
        return bool(sequences) and all(r.status == RequestStatus.WAITING for r in sequences)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ------------------------------------------------------------------ the loop
    def _bind_cuda_device(self) -> None:
        """Make `--device cuda:N` this thread's current CUDA device. Triton kernels and CUDA events
        go to the current device, not to their tensors' one, and the current device is per thread
        (the server steps the engine in a thread of its own)."""
        if torch.cuda.current_device() != self._cuda_index:
            torch.cuda.set_device(self._cuda_index)

    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the state of every request that advanced or finished
        (under --async-scheduling: that the step before advanced)."""
        if self._cuda_index is not None:
            self._bind_cuda_device()
        self.salvaged_outputs = []
        if self.args.async_scheduling:
            try:
                return self._overlapped_step()
            except BaseException:
                self._drop_in_flight()
                raise
        return self._step()

    def _scheduled(self) -> tuple[list[ScheduledRequest], dict[str, list[int]]]:
        scheduled = self.scheduler.schedule()
        self.runner.move_tokens(*self.kv_manager.take_moves())  # compactions planned by schedule()
        return scheduled, {s.request.request_id: self.kv_manager.block_table(s.request.request_id) for s in scheduled}

    def _step(self) -> list[RequestOutput]:
        scheduled, tables = self._scheduled()
        if not scheduled:
            return []
        step = self.runner.execute(scheduled, tables)
        accepted = None
        if step.result.drafts is not None:  # speculative decoding
            self.drafter.record([item.draft_token_ids for item in step.sampled], step.result.drafts)
            accepted = {item.request.request_id: kept for item, kept in zip(step.sampled, step.result.drafts)}
        finished = self.scheduler.update(scheduled, {item.request.request_id: token
                                                     for item, token in zip(step.sampled, step.result.token_ids)},
                                         accepted=accepted)
        prefill_only = [r for r in finished if r.max_tokens == 0]
        return self.output_processor.process(step.sampled, step.result, step.prompt_logprobs, prefill_only)

    def _overlapped_step(self) -> list[RequestOutput]:
        """Launch the next step, then wait for the one in flight (module docstring). While any
        request needs its tokens on the host (Request.needs_host_tokens), steps run one at a time.
        If this step fails after the step before was reported (or while launching, the step before
        being complete), that step's outputs wait in `take_salvaged_outputs`: the requests it
        finished did finish."""
        if self.scheduler.num_needing_host_tokens:
            previous, self._in_flight = self._in_flight, None
            outputs = self._complete(previous) if previous is not None else []
            return outputs + self._salvaging(outputs, self._step)
        scheduled, tables = self._scheduled()
        previous, self._in_flight = self._in_flight, None
        try:
            forward = self.runner.launch(scheduled, tables, previous) if scheduled else None
        except BaseException:
            if previous is not None:  # its tokens are sampled already: report them
                self.salvaged_outputs = self._complete(previous)
            raise
        outputs = self._complete(previous) if previous is not None else []
        if forward is not None:
            # Sampled once the step before is reported: penalties, logits processors and grammars
            # see every earlier token, as they do one step at a time.
            self._in_flight = self._salvaging(outputs, self.runner.sample, forward)
            self.scheduler.advance(scheduled)
        return outputs

    def _salvaging(self, outputs: list[RequestOutput], fn, *args):
        """`fn(*args)`; if it raises, keep `outputs` (already reported by the scheduler) for
        `take_salvaged_outputs`."""
        try:
            return fn(*args)
        except BaseException:
            self.salvaged_outputs = outputs
            raise

    def take_salvaged_outputs(self) -> list[RequestOutput]:
        """After `step` raised: the outputs of the requests that advanced in a step completed
        before the failure (async scheduling; none otherwise). Each is handed out once."""
        outputs, self.salvaged_outputs = self.salvaged_outputs, []
        return outputs

    def _complete(self, launched: InFlightStep) -> list[RequestOutput]:
        """Wait for a launched step's tokens; update the requests it advanced and report them.
        A request that finished meanwhile (aborted, or stopped by the step before) is not reported."""
        live = [not item.request.status.finished for item in launched.sampled]
        step = self.runner.wait(launched)
        finished = self.scheduler.update(launched.scheduled, {item.request.request_id: token for item, token
                                                              in zip(step.sampled, step.result.token_ids)},
                                         advanced=True)
        if not all(live):
            kept = [i for i, alive in enumerate(live) if alive]
            step.sampled = [step.sampled[i] for i in kept]
            step.result = SampleResult([step.result.token_ids[i] for i in kept],
                                       [step.result.logprobs[i] for i in kept])
        prefill_only = [r for r in finished if r.max_tokens == 0]
        return self.output_processor.process(step.sampled, step.result, step.prompt_logprobs, prefill_only)

    def _drop_in_flight(self) -> None:
        """After a failed step: forget the step in flight. Pending tokens are lost, so a running
        request that had one goes back to computing its last known token."""
        self._in_flight = None
        for request in [*self.scheduler.running, *self.scheduler.waiting]:
            if request.num_pending_tokens:
                request.num_pending_tokens = 0
                if request.status == RequestStatus.RUNNING:
                    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)

    # ------------------------------------------------------------------ scoring
    def score(self, token_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
        """Teacher-forced float32 logits [len(token_ids), vocab] computed through the paged KV cache:
        the sequence is fed in chunks, so each chunk attends to the K/V the earlier chunks stored
        (in whatever format the cache stores them). Needs no free sequence slot; uses free blocks."""
        return torch.cat(list(self.score_chunks(token_ids, chunk_size)))

    def score_chunks(self, token_ids: list[int], chunk_size: int | None = None,
                     kv_eviction: EvictionSpec | dict | str | None = None) -> Iterator[torch.Tensor]:
        """`score`, one chunk's logits [chunk tokens, vocab] at a time. With `kv_eviction` (as in
        SamplingParams) the sequence evicts between chunks and may be longer than max-model-len;
        a chunk is then at most budget - sinks tokens. On a pool sized for a sliding window and a
        step (preflight.SequenceHold) a chunk is at most a step."""
        self.check_open()
        chunk_size = chunk_size or self.args.max_num_batched_tokens
        if self._pool_blocks_short:
            chunk_size = min(chunk_size, self.args.max_num_batched_tokens)
        eviction = self.resolve_eviction(EvictionSpec.parse(kv_eviction))
        if eviction is None and len(token_ids) > self.max_model_len:
            raise ValueError(f"cannot score {len(token_ids)} tokens with max-model-len {self.max_model_len}")
        request = Request(f"score-{next(self._ids)}", token_ids, SamplingParams(max_tokens=1), eviction=eviction)
        return scoring.score_chunks(self.runner, self.kv_manager, request, chunk_size)

    def embed(self, token_ids: list[int], normalize: bool = True) -> torch.Tensor:
        """The sequence's embedding: its final-normed hidden states pooled (--pooling-type: the last
        token's, or the mean over all tokens) and L2-normalised unless not `normalize`, float32
        [hidden size] (vLLM's pooling of a decoder model). Computed like `score`, through the paged
        cache in chunks; the blocks go back to the pool as soon as it is done."""
        self.check_open()
        if not token_ids:
            raise ValueError("the input to embed must not be empty")
        if not all(0 <= t < self.model_config.vocab_size for t in token_ids):
            raise ValueError(f"token ids must be in [0, {self.model_config.vocab_size}), the model's vocabulary")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                             f"requested {len(token_ids)} tokens in the input for embedding generation. Please "
                             f"reduce the length of the input.")
        request = Request(f"embed-{next(self._ids)}", token_ids, SamplingParams(max_tokens=1))
        chunks = scoring.score_chunks(self.runner, self.kv_manager, request, self.args.max_num_batched_tokens,
                                      hidden=True)
        if self.args.pooling_type == "MEAN":
            total = sum(chunk.float().sum(dim=0) for chunk in chunks)
            pooled = total / len(token_ids)
        else:
            *_, last = chunks
            pooled = last[-1].float()
        return (torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled).cpu()

    def embed_when_room(self, token_ids: list[int], normalize: bool, waiter: str) -> torch.Tensor | None:
        """`embed`, or None while running requests hold the blocks the input needs: new requests
        are then held back for `waiter` (Scheduler.held_for) until the running ones free them, and
        the caller (the server, between steps) asks again. With nothing running, `embed`'s own
        CapacityError stands (the input does not fit the pool). `release_waiter` ends the hold."""
        busy = bool(self.scheduler.running) or self._in_flight is not None
        needed = min(blocks_for_tokens(len(token_ids), self.kv_spec.block_size), self.num_blocks - 1)
        if not busy or needed <= self.num_free_blocks:
            try:
                vector = self.embed(token_ids, normalize)
            except CapacityError:
                if not busy:
                    self.release_waiter(waiter)
                    raise
            else:
                self.release_waiter(waiter)
                return vector
        self.scheduler.held_for.add(waiter)
        return None

    def release_waiter(self, waiter: str) -> None:
        self.scheduler.held_for.discard(waiter)

    def close(self) -> None:
        """With KV tiers: abort what is unfinished, flush the tiers (the pool's prefix-cache blocks
        and the host tier to the disk tier, so a restart finds them) and stop their writer. Then
        stop the tensor-parallel workers, if any. Idempotent (also on an engine whose start-up
        failed); the engine must not step after."""
        if self.tiers is not None:
            if hasattr(self, "scheduler"):
                # Unfinished requests end first: blocks published for a step that never ran (it
                # failed) leave the prefix cache as they are freed, so the flush never writes them.
                for request in [*self.scheduler.running, *self.scheduler.waiting]:
                    self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            start = time.monotonic()
            written = self.kv_manager.flush_tiers() if hasattr(self, "kv_manager") else 0
            has_disk = self.tiers.disk is not None
            self.tiers.close()
            self.tiers = None
            if has_disk:
                logger.info("KV disk tier: wrote %d blocks at shutdown in %.1f s", written, time.monotonic() - start)
        if self.parallel is not None:
            self.parallel.close()
        self.closed = True

    def check_open(self) -> None:
        """RuntimeError once the engine is closed (its tiers flushed, its workers stopped: a request
        would run without them, or fail deep in a collective)."""
        if self.closed:
            raise RuntimeError("this engine is closed (LLM.close(), or the end of its `with` block): create a new one")

    # ------------------------------------------------------------------ introspection
    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.pool.num_free_blocks
