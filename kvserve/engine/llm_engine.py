"""The engine: load the model, size the KV pool once, then step: schedule -> run -> sample -> detokenize.

    add_request ──> Scheduler.waiting ──schedule()──> ModelRunner.execute ──> Scheduler.update
                                                                            └─> detokenize, stop strings
"""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from kvserve.cache.eviction import POLICIES, EvictionConfig, EvictionSpec
from kvserve.cache.eviction.config import resolve_eviction
from kvserve.cache.eviction.evictor import Evictor
from kvserve.cache.eviction.moves import move_tokens
from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCache
from kvserve.cache.kv_cache_manager import KVCacheManager
from kvserve.cache.sizing import GiB, blocks_for_tokens, blocks_in_budget, bytes_per_block
from kvserve.engine.args import EngineArgs
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.key_basis import calibrate_key_bases
from kvserve.engine.key_centering import calibrate_key_centers
from kvserve.engine.model_runner import ModelRunner
# CapacityError, select_device and select_dtype are imported from here by the CLI, plan and benchmarks.
from kvserve.engine.preflight import (CapacityError, emulated_bf16_warning, fit_max_model_len,  # noqa: F401
                                      Preflight, lowered_max_model_len_warning, preflight, select_device,
                                      select_dtype)
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerConfig
from kvserve.model.attention_backend import make_attention_backend
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.loader import LoadedModel, load_model
from kvserve.model.shape import ModelShape
from kvserve.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger("kvserve")

@dataclass
class _Child:
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[Logprob] | None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.request.status.finished for c in self.children)


class LLMEngine:
    def __init__(self, args: EngineArgs, loaded_model: LoadedModel | None = None):
        """`loaded_model`: a checkpoint already read by `load_model(args.model)`, so that several
        engines (e.g. one per KV-cache dtype in `kvserve eval`) share one load; its tensors are
        only read."""
        self.args = args
        # First, args.validate() and the checks against the model's shape: a bad option fails
        # with one line before the weights load.
        plan = preflight(args, ModelShape.of(loaded_model.config) if loaded_model else None)
        self.device, self.dtype = plan.device, plan.dtype
        torch.manual_seed(args.seed)
        start = time.monotonic()
        loaded = loaded_model or load_model(args.model)
        if ModelShape.of(loaded.config) != plan.shape:  # the quick read disagreed: check with the real config
            plan = preflight(args, ModelShape.of(loaded.config))
        self._log_dtype(plan)  # after the load, so that a bad model file still fails with one line
        if plan.lowered:
            logger.warning(lowered_max_model_len_warning(plan.max_model_len, plan.shape.max_position_embeddings,
                                                         plan.kv_budget))
        self.model_config = loaded.config
        self.model_path = loaded.path
        self.tokenizer = loaded.tokenizer
        self.max_model_len = plan.max_model_len
        self.model = LlamaForCausalLM.from_hf_weights(
            loaded.config, loaded.weights, self.max_model_len, self.dtype, self.device)
        del loaded
        logger.info("Loaded %s (%s, %s, %s) in %.1f s", self.model_path, self.model_config.architecture,
                    str(self.dtype).removeprefix("torch."), self.device, time.monotonic() - start)
        self.eos_token_ids = self._eos_token_ids()

        self.kv_format = make_kv_format(args.kv_cache_dtype, self.dtype)
        self.kv_spec = plan.kv_spec
        self.attention_backend = make_attention_backend(args.attention_backend, self.kv_format, self.kv_spec,
                                                        self.dtype, self.model.rope, self.device)
        num_blocks = self._size_kv_pool(plan.kv_budget)
        self.kv_cache = KVCache(self.kv_spec, self.kv_format, num_blocks, self.device)
        if self.kv_format.center_keys:
            start = time.monotonic()
            self.model.set_key_centers(calibrate_key_centers(self.model, self.kv_cache, self.max_model_len, self.model_path))
            logger.info("Calibrated %s key centres in %.1f s", self.kv_format.name, time.monotonic() - start)
        if self.kv_format.fit_key_basis:
            start = time.monotonic()
            bases, share = calibrate_key_bases(self.model, self.kv_cache, self.max_model_len, self.model_path)
            self.model.set_key_bases(bases)
            logger.info("Fitted %s key bases in %.1f s: modelled score error %.2fx of a Hadamard rotation's",
                        self.kv_format.name, time.monotonic() - start, share)
        self.eviction_defaults = EvictionSpec(args.kv_eviction, args.kv_budget, args.sink_tokens, args.recent_tokens)
        self.resolve_eviction(None)  # bad --kv-eviction flags fail at start-up
        self.evictor = Evictor(args.block_size, self.max_model_len, self.device)
        self.kv_manager = KVCacheManager(num_blocks, args.block_size, args.enable_prefix_caching,
                                         namespace=self.kv_format.name, evictor=self.evictor)
        self.scheduler = Scheduler(
            SchedulerConfig(args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len), self.kv_manager)
        self.runner = ModelRunner(self.model, self.kv_cache, self.attention_backend, self.evictor)
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Child]] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ start-up
    def _log_dtype(self, plan: Preflight) -> None:
        """The dtype decision, once at start-up: auto's choice and why, or a warning for an
        explicit bfloat16 that this CPU only emulates."""
        name = str(plan.dtype).removeprefix("torch.")
        if self.args.dtype == "auto":
            logger.info("dtype auto -> %s: %s", name, plan.dtype_reason)
        elif (warning := emulated_bf16_warning(plan.dtype, plan.device)) is not None:
            logger.warning(warning)

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def _profile_cuda_budget(self) -> int:
        """vLLM's recipe: run one forward pass of the largest step with a throw-away pool, take
        the peak memory it needed, and give the KV pool what is left of the utilisation target."""
        block_size = self.args.block_size
        tokens = min(self.args.max_num_batched_tokens, self.max_model_len)
        scratch = KVCache(self.kv_spec, self.kv_format, blocks_for_tokens(tokens, block_size), self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        probe = Request("profile", [0] * tokens, SamplingParams(max_tokens=1))
        runner = ModelRunner(self.model, scratch, self.attention_backend)
        runner.execute([ScheduledRequest(probe, tokens)], {"profile": list(range(1, scratch.num_blocks + 1))})
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - scratch.nbytes
        del scratch, runner
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.args.gpu_memory_utilization) - peak
        if budget <= 0:
            raise CapacityError(f"no memory left for the KV cache: the model and activations peak at "
                                f"{peak / GiB:.2f} GiB of a {self.args.gpu_memory_utilization:.0%} target of "
                                f"{total / GiB:.2f} GiB; raise --gpu-memory-utilization or lower "
                                f"--max-num-batched-tokens")
        return budget

    def _size_kv_pool(self, budget: int | None) -> int:
        """Blocks for `budget` bytes (None: what the CUDA profiling pass leaves). A measured budget
        is checked here like preflight checks a known one: max-model-len is lowered to fit when the
        user gave none, else too small a budget raises CapacityError."""
        per_block = bytes_per_block(self.kv_spec, self.kv_format)
        bs = self.args.block_size
        if budget is None:
            budget = self._profile_cuda_budget()
            fitted = fit_max_model_len(budget, per_block, bs, self.max_model_len, self.args.max_model_len is not None)
            if fitted < self.max_model_len:
                logger.warning(lowered_max_model_len_warning(fitted, self.max_model_len, budget))
                self.max_model_len = fitted
        num_blocks = blocks_in_budget(budget, per_block)
        per_token = per_block / bs
        logger.info("Available KV cache memory: %.2f GiB (%s, %.0f bytes per token)",
                    num_blocks * per_block / GiB, self.kv_format.name, per_token)
        logger.info("KV cache size: %s tokens (%d blocks of %d)", f"{num_blocks * bs:,}", num_blocks, bs)
        logger.info("Maximum concurrency for %s tokens per request: %.2fx", f"{self.max_model_len:,}",
                    num_blocks * bs / self.max_model_len)
        return num_blocks

    # ------------------------------------------------------------------ requests
    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}"

    def tokenize(self, prompt: str | list[int] | dict) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Render a conversation with the tokenizer's chat template, then tokenize it (the template
        already holds the special tokens, so none are added)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use the completions API")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def resolve_eviction(self, spec: EvictionSpec | None) -> EvictionConfig | None:
        """A request's KV eviction settings (its `kv_eviction` over the engine's flags), checked;
        None without eviction. Raises ValueError for bad values."""
        return resolve_eviction(spec, self.eviction_defaults, self.max_model_len, POLICIES)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Check a request against the model; returns the resolved max_tokens."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("The prompt cannot be empty.")
        vocab = self.model_config.vocab_size
        bad = next((t for t in [*prompt_token_ids, *params.stop_token_ids]
                    if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"Token id {bad} is out of vocabulary (the model has {vocab} tokens).")
        if self.resolve_eviction(params.kv_eviction) is not None:
            # Under eviction max-model-len bounds the cache, not the sequence; "up to the context
            # limit" (no max_tokens) then means max-model-len new tokens.
            return params.max_tokens if params.max_tokens is not None else self.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len or max_tokens < 1:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n + max(max_tokens, 1)} tokens ({n} in the messages, {max(max_tokens, 1)} in the completion). "
                f"Please reduce the length of the messages or completion.")
        return max_tokens

    def add_request(self, prompt: str | list[int] | dict, params: SamplingParams, request_id: str | None = None,
                    cache_salt: str | None = None) -> str:
        """Queue a prompt (text, token ids or {"prompt_token_ids": [...]}). Raises ValueError for bad input."""
        request_id = request_id or self.new_request_id()
        if request_id in self._parents:
            raise ValueError(f"duplicate request id {request_id!r}")
        text, token_ids = self.tokenize(prompt)
        max_tokens = self.validate(token_ids, params)
        eviction = self.resolve_eviction(params.kv_eviction)
        parent = _Parent(request_id, text, token_ids)
        for index in range(params.n):
            child_params = params.for_child(index)
            child_params.max_tokens = max_tokens
            child_id = request_id if params.n == 1 else f"{index}_{request_id}"
            request = Request(child_id, token_ids, child_params, self.eos_token_ids, cache_salt, eviction=eviction)
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, child_params.stop,
                                           child_params.include_stop_str_in_output, child_params.skip_special_tokens)
            child = _Child(request, detok, [] if child_params.logprobs is not None else None)
            parent.children.append(child)
            self._children[child_id] = (parent, child)
            self.scheduler.add(request)
        self._parents[request_id] = parent
        return request_id

    def abort_request(self, request_id: str,
                      status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> RequestOutput | None:
        """Stop a request now (finish reason `status`: abort, or error when a step failed); its
        blocks go back to the pool immediately."""
        parent = self._parents.get(request_id)
        if parent is None:
            return None
        for child in parent.children:
            self.scheduler.finish(child.request, status)
        return self._output(parent)

    def is_queued(self, request_id: str) -> bool:
        """True while every sequence of the request waits in the queue, holding no blocks (never
        scheduled, or preempted); False once one runs or finished, or for an unknown id."""
        parent = self._parents.get(request_id)
        return parent is not None and all(c.request.status == RequestStatus.WAITING for c in parent.children)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """Run one scheduling step; return the state of every request that advanced or finished."""
        scheduled = self.scheduler.schedule()
        move_tokens(self.kv_cache, *self.kv_manager.take_moves())  # compactions planned by schedule()
        if not scheduled:
            return []
        tables = {s.request.request_id: self.kv_manager.block_ids(s.request.request_id) for s in scheduled}
        sampled_items, result = self.runner.execute(scheduled, tables)
        sampled = {item.request.request_id: tok for item, tok in zip(sampled_items, result.token_ids)}
        self.scheduler.update(scheduled, sampled)

        touched: dict[str, _Parent] = {}
        for item, token, logprob in zip(sampled_items, result.token_ids, result.logprobs):
            parent, child = self._children[item.request.request_id]
            request = child.request
            child.detokenizer.add_token(token)
            if child.logprobs is not None and logprob is not None:
                child.logprobs.append(Logprob(token, logprob[0], logprob[1]))
            if child.detokenizer.stop_string is not None and not request.status.finished:
                request.stop_reason = child.detokenizer.stop_string
                self.scheduler.finish(request, RequestStatus.FINISHED_STOPPED)
            touched[parent.request_id] = parent
        return [self._output(parent) for parent in touched.values()]

    def _output(self, parent: _Parent) -> RequestOutput:
        outputs = []
        for index, child in enumerate(parent.children):
            request = child.request
            done = request.status.finished
            if done:
                self.runner.sampler.forget(request.request_id)
            outputs.append(CompletionOutput(
                index=index,
                text=child.detokenizer.visible_text(done),
                token_ids=list(request.output_token_ids),
                finish_reason=request.status.value if done else None,
                stop_reason=request.stop_reason,
                logprobs=list(child.logprobs) if child.logprobs is not None else None,
            ))
        finished = parent.finished
        if finished:
            del self._parents[parent.request_id]
            for child in parent.children:
                self._children.pop(child.request.request_id, None)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outputs, finished,
                             num_cached_tokens=parent.children[0].request.num_cached_tokens)

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
        a chunk is then at most budget - sinks tokens."""
        chunk_size = chunk_size or self.args.max_num_batched_tokens
        eviction = self.resolve_eviction(EvictionSpec.parse(kv_eviction))
        if eviction is None and len(token_ids) > self.max_model_len:
            raise ValueError(f"cannot score {len(token_ids)} tokens with max-model-len {self.max_model_len}")
        request = Request(f"score-{next(self._ids)}", token_ids, SamplingParams(max_tokens=1), eviction=eviction)
        try:
            while request.num_computed_tokens < request.num_tokens:
                n = min(chunk_size, request.num_tokens - request.num_computed_tokens,
                        self.kv_manager.max_new_tokens(request))
                if not self.kv_manager.allocate(request, n):
                    raise CapacityError("not enough free KV blocks to score this sequence")
                move_tokens(self.kv_cache, *self.kv_manager.take_moves())
                item = ScheduledRequest(request, n)
                inputs = self.runner.prepare([item], {request.request_id: self.kv_manager.block_ids(request.request_id)},
                                             all_logits=True)
                logits = self.runner.forward(inputs)
                request.num_computed_tokens += n
                yield logits
        finally:
            self.kv_manager.free(request)

    # ------------------------------------------------------------------ introspection
    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.kv_manager.pool.num_free_blocks
