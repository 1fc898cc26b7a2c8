"""kvserve against the reference implementation (HF transformers): same weights, same greedy
tokens, logits within tolerance, with continuous batching, chunked prefill and preemption."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.model.loader import resolve_model_path

PROMPTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "Hello",
    "Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and caprice, that the "
    "experience of three-and-twenty years had been insufficient to make his wife understand his character.",
    "The capital of France is",
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with a full HF forward pass per token: the model's own definition of
    attention (HF's sliding-window cache in generate() can disagree with it at the window edge),
    and no EOS handling, so it matches kvserve's ignore_eos (which never masks EOS)."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


def hf_logits(model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([token_ids])).logits[0].float()


# ---------------------------------------------------------------------------- tiny random checkpoints
@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
               "rope_theta": 500000.0}),
    ("mistral", {"sliding_window": 8}),  # shorter than every prompt but "Hello"
    ("qwen2", {}),
    ("qwen3", {}),  # per-head q/k norms; heads wider than hidden / heads
])
@pytest.mark.parametrize("attention_backend", ["cpu_paged", "torch"])
@pytest.mark.torch_path
def test_tiny_models_match_hf_greedy_and_logits(request, tiny_model_factory, arch, overrides, attention_backend):
    from transformers import AutoModelForCausalLM

    if attention_backend == "cpu_paged":
        request.getfixturevalue("cpu_kernel")  # skipped with the reason where the kernel cannot run

    path = tiny_model_factory(arch, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # A token budget of 16 per step forces chunked prefill of the longer prompts while the
    # shorter ones are already decoding in the same batches.
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16,
              enable_prefix_caching=False, attention_backend=attention_backend)
    assert llm.engine.attention_backend.reads_decodes_in_place == (attention_backend == "cpu_paged")
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, GREEDY.max_tokens), out.prompt
        full = out.prompt_token_ids + out.outputs[0].token_ids
        ours = llm.engine.score(full, chunk_size=7)
        ref = hf_logits(hf, full)
        assert (ours - ref).abs().max().item() <= 1e-3


def test_decodes_split_into_length_groups_match_hf(tiny_model_factory, monkeypatch):
    """Decodes of different context lengths padded in separate groups (forced here: every length
    its own group) give HF's greedy tokens, sliding window included. (Groups exist only where
    decodes gather their blocks: the torch attention backend.)"""
    from transformers import AutoModelForCausalLM

    import kvserve.model.attention.torch_backend as attention_backend

    monkeypatch.setattr(attention_backend, "GROUP_COST_TOKENS", 0)
    path = tiny_model_factory("mistral", sliding_window=8)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", enable_prefix_caching=False,
              attention_backend="torch")
    for out in llm.generate(PROMPTS, GREEDY, use_tqdm=False):
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, GREEDY.max_tokens), out.prompt


@pytest.mark.parametrize("attention_backend", ["cpu_paged", "torch"])
def test_sliding_window_blocks_go_back_to_the_pool_and_tokens_match_hf(request, tiny_model_factory,
                                                                       attention_backend):
    """Every layer windowed (Mistral v0.1): a sequence holds only the blocks its window and one
    step need, the others back in the pool as it goes (vLLM's sliding-window manager), and the
    tokens stay HF's, through chunked prefill, decodes and a second request hitting the first's
    prefix (whose blocks out of its window it does not take)."""
    from transformers import AutoModelForCausalLM

    if attention_backend == "cpu_paged":
        request.getfixturevalue("cpu_kernel")
    path = tiny_model_factory("mistral", sliding_window=8)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", max_num_batched_tokens=16, block_size=8,
              attention_backend=attention_backend)
    core, kv = llm.engine, llm.engine.kv_manager
    assert kv.window == 8
    prompt = llm.get_tokenizer().encode(PROMPTS[2])
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    core.add_request({"prompt_token_ids": prompt}, params, request_id="first")
    held, finished = [], {}

    def run() -> None:
        while core.has_unfinished_requests():
            finished.update((o.request_id, o) for o in core.step() if o.finished)
            held.extend(len(kv.held_block_ids(r.request_id)) for r in core.scheduler.running)

    run()
    core.add_request({"prompt_token_ids": prompt[:30] + [7, 8, 9]}, params, request_id="second")
    run()
    # window 8 + a chunk of 16 in blocks of 8, a block spare: never more than 4 (the whole table: 10)
    assert max(held) <= 4 and len(kv.block_table("first")) == 0
    assert kv.stats.hits >= 24  # the second reused the first's cached blocks inside its window
    for rid, ids in (("first", prompt), ("second", prompt[:30] + [7, 8, 9])):
        assert finished[rid].outputs[0].token_ids == hf_greedy(hf, ids, 40), rid
    assert core.num_free_blocks == core.num_blocks


def test_a_sliding_window_model_needs_a_pool_for_its_window_not_for_max_model_len(tiny_model_factory):
    """Every layer windowed: a sequence holds its window and a step (the blocks behind go back), so
    the pool need hold only that, not a sequence of max-model-len (vLLM sizes sliding-window layers
    so): with 5 blocks of 8 (window 8 + a step of 16, a block a boundary splits and a spare) the
    model starts at its full 1,024 tokens, and a 70-token sequence still gives HF's tokens. One
    block fewer is refused naming the window; KV eviction (an evicting sequence keeps its budget,
    not a window) is refused on such a pool; scoring takes chunks of a step there."""
    from transformers import AutoModelForCausalLM

    from kvserve.engine.args import EngineArgs
    from kvserve.engine.preflight import CapacityError, preflight

    path = tiny_model_factory("mistral", sliding_window=8)
    options = dict(dtype="float32", max_num_batched_tokens=16, block_size=8, enable_prefix_caching=False)
    per_block = preflight(EngineArgs(model=str(path), kv_cache_memory="8MiB", **options)).bytes_per_block
    with pytest.raises(CapacityError, match="its sliding window of 8 tokens and a step of 16"):
        LLM(str(path), kv_cache_memory=5 * per_block, max_model_len=1024, **options)
    llm = LLM(str(path), kv_cache_memory=6 * per_block, **options)  # 5 blocks and the null block
    assert (llm.engine.max_model_len, llm.engine.num_blocks) == (1024, 5)
    prompt = llm.get_tokenizer().encode(PROMPTS[2])[:30]
    [out] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                         use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert out.outputs[0].token_ids == hf_greedy(hf, prompt, 40)
    sequence = prompt + out.outputs[0].token_ids  # scored in chunks of at most a step, whatever is asked
    assert torch.allclose(llm.engine.score(sequence, chunk_size=64), hf_logits(hf, sequence), atol=1e-3)
    # a KV format that calibrates prefills 1,024 tokens in the pool at start-up: the pool holds them
    # (what it learns must not depend on the pool's size), so 5 blocks hold a max-model-len of 40
    int4 = dict(options, kv_cache_dtype="int4")
    int4_block = preflight(EngineArgs(model=str(path), kv_cache_memory="8MiB", **int4)).bytes_per_block
    assert preflight(EngineArgs(model=str(path), kv_cache_memory=6 * int4_block, **int4)).max_model_len == 40
    with pytest.raises(ValueError, match="KV eviction needs a KV pool that holds one sequence of max-model-len"):
        llm.generate([{"prompt_token_ids": prompt}],
                     SamplingParams(max_tokens=4, kv_eviction={"policy": "streaming", "budget": 32}), use_tqdm=False)


def test_same_shape_chunks_after_a_cached_prefix_match_hf(tiny_llama):
    """Requests sharing a cached prefix, each computing a question of the same length in one step:
    their chunks go through one batched attention call and still give HF's greedy tokens."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    prefix = list(range(10, 50))
    prompts = [{"prompt_token_ids": prefix + [100 + 10 * i + j for j in range(8)]} for i in range(4)]
    llm = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.kv_manager.stats.hits >= 3 * 32  # three requests reused the two full prefix blocks
    for out in outputs:
        assert out.outputs[0].token_ids == hf_greedy(hf, out.prompt_token_ids, GREEDY.max_tokens)


def test_split_by_length_pads_less_and_covers_the_batch():
    from kvserve.model.attention.torch_backend import GROUP_COST_TOKENS, split_by_length

    same = [8] * 64
    assert split_by_length(same, 16) == [(0, 64)]  # nothing to save
    assert split_by_length([], 16) == []
    # One long context among many short ones: padding the short ones to it would cost
    # 63 * 96 blocks, far more than a second group.
    mixed = [100] + [4] * 63
    assert split_by_length(mixed, 16) == [(0, 1), (1, 64)]
    lengths = sorted(range(2, 130, 2), reverse=True)
    runs = split_by_length(lengths, 16)
    assert runs[0][0] == 0 and runs[-1][1] == len(lengths)
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    padded = sum(lengths[start] * (end - start) * 16 for start, end in runs) + GROUP_COST_TOKENS * len(runs)
    assert padded < lengths[0] * len(lengths) * 16 + GROUP_COST_TOKENS


@pytest.mark.torch_path
def test_preemption_keeps_greedy_output(tiny_llama):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    roomy = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB")
    expected = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    # 20 blocks of 16 tokens: enough for any one request, far too few for all eight at once.
    per_block = roomy.engine.kv_cache.nbytes // roomy.engine.num_blocks
    tight = LLM(str(tiny_llama), dtype="float32", kv_cache_memory=str(20 * per_block), max_model_len=256)
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    assert tight.engine.num_free_blocks == tight.engine.num_blocks


def test_sliding_window_is_used_not_ignored(tiny_model_factory):
    """Same weights with and without a window: logits agree while the sequence fits in the
    window and differ once it is longer (the window is applied, not silently dropped)."""
    engines = [LLM(str(tiny_model_factory("mistral", sliding_window=w)), dtype="float32",
                   kv_cache_memory="8MiB").engine for w in (4, None)]
    ids = engines[0].tokenizer.encode(PROMPTS[2])[:12]
    windowed, full = (e.score(ids) for e in engines)
    assert torch.allclose(windowed[:4], full[:4], atol=1e-5)
    assert not torch.allclose(windowed[4:], full[4:], atol=1e-2)


# ---------------------------------------------------------------------------- the real default model
def test_default_model_matches_hf_float32(default_fp32, hf_default_fp32):
    tok = default_fp32.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   tokenize=False, add_generation_prompt=True)
    prompts = PROMPTS + [chat]
    params = SamplingParams(temperature=0, max_tokens=16)
    outputs = default_fp32.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        ours = out.outputs[0].token_ids
        ref = hf_greedy(hf_default_fp32, out.prompt_token_ids, len(ours))
        assert ours == ref, out.prompt
        logits = default_fp32.engine.score(out.prompt_token_ids, chunk_size=32)
        ref_logits = hf_logits(hf_default_fp32, out.prompt_token_ids)
        assert (logits[-1] - ref_logits[-1]).abs().max().item() <= 1e-3
    assert "Paris" in outputs[-1].outputs[0].text


def test_default_model_bfloat16_top1_agreement(hf_default_fp32):
    """kvserve's bf16 model picks the tokens HF's bf16 model picks, or, where HF's own bf16 run
    departs from the float32 reference (oneDNN's AMX GEMM on plain bf16 weights: 95% top-1 with
    HF float32 on a Sapphire Rapids, where kvserve's bf16 had 98%), is at least as close to that
    float32 reference as HF's bf16 is."""
    from transformers import AutoModelForCausalLM

    from kvserve.hardware import native_bf16_missing

    if (missing := native_bf16_missing()) is not None:
        # Emulated bf16 rounds differently from the native kernels this agreement is measured on.
        pytest.skip(f"bfloat16 runs emulated here: {missing}")

    from tiny_models import BOOK

    path = resolve_model_path(None)
    # Loaded in bfloat16 directly: an fp32 HF model cast with .to(bfloat16) afterwards is itself
    # only ~96% top-1 consistent with this one.
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.bfloat16).eval()
    llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory="1GiB", max_model_len=2048)
    ids = llm.get_tokenizer().encode(BOOK.read_text()[5000:9000])[:320]
    ref = hf_logits(hf_bf16, ids).argmax(-1)
    ours = llm.engine.score(ids, chunk_size=64).argmax(-1)
    agreement = (ours == ref).float().mean().item()
    if agreement < 0.99:
        exact = hf_logits(hf_default_fp32, ids).argmax(-1)
        ours_to_fp32, hf_to_fp32 = ((tokens == exact).float().mean().item() for tokens in (ours, ref))
        assert ours_to_fp32 >= max(hf_to_fp32, 0.95), (agreement, ours_to_fp32, hf_to_fp32)


def test_without_chunked_prefill_each_prompt_is_one_step_and_gives_the_same_tokens(tiny_llama):
    """--no-enable-chunked-prefill: a 300-token prompt is computed in the first step (its first
    token comes out of it), and greedy tokens equal those of the same prompts prefilled in chunks of
    24 tokens (--long-prefill-token-threshold) in steps of 64, with continuous batching."""
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 10 for j in range(300 - 40 * i)]} for i in range(3)]
    whole = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_model_len=512,
                enable_chunked_prefill=False, enable_prefix_caching=False)
    assert whole.engine.args.max_num_batched_tokens >= 512
    whole.engine.add_request(prompts[0], SamplingParams(temperature=0, max_tokens=1))
    [first] = whole.engine.step()
    assert first.finished and len(first.outputs[0].token_ids) == 1
    chunked = LLM(str(tiny_llama), dtype="float32", kv_cache_memory="8MiB", max_model_len=512,
                  max_num_batched_tokens=64, long_prefill_token_threshold=24, enable_prefix_caching=False)
    assert chunked.engine.scheduler.config.long_prefill_token_threshold == 24  # chunks of 24 while batched
    expected = [o.outputs[0].token_ids for o in chunked.generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.outputs[0].token_ids for o in whole.generate(prompts, GREEDY, use_tqdm=False)] == expected
    with pytest.raises(ValueError, match="kv_eviction needs chunked prefill"):  # a policy works between chunks
        whole.generate(prompts[:1], SamplingParams(max_tokens=2, kv_eviction={"policy": "streaming", "budget": 64}),
                       use_tqdm=False)
