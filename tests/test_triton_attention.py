"""The Triton attention backend against the torch backend, under Triton's interpreter on CPU
(TRITON_INTERPRET=1; on a machine with CUDA the same tests run the compiled kernels).

Every kernel is checked on small shapes: the store kernel bit for bit against each format's torch
write, and a scripted sequence of steps (prefill chunks, a chunk after a prefix hit, ragged
decodes, a context spanning many blocks cut into splits) for each KV format, block size, GQA ratio,
head size and sliding window. Then a tiny model served through the Triton backend gives the torch
backend's greedy tokens, and the kernels compile for an H100/H200 (sm_90) with the ptxas that
ships with triton, which the interpreter does not check.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported

triton = pytest.importorskip("triton", reason="the triton package is not installed (pip install -e '.[test]')")

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.cache.formats import make_kv_format  # noqa: E402
from kvserve.cache.kv_cache import KVCache, KVCacheSpec  # noqa: E402
from kvserve.model.attention import StepSequence, make_attention_backend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class Shape:
    dtype: torch.dtype
    block_size: int
    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None

    def __str__(self) -> str:
        window = f"-window{self.window}" if self.window else ""
        return (f"{str(self.dtype).removeprefix('torch.')}-bs{self.block_size}-gqa{self.heads // self.kv_heads}"
                f"-d{self.head_dim}{window}")


SHAPES = [
    Shape(torch.float32, 16, 4, 2, 64),
    Shape(torch.bfloat16, 32, 8, 1, 64),
    Shape(torch.float32, 64, 2, 2, 128, window=24),
]
FORMATS = ["auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int4_kivi"]
SPLIT_TOKENS = 32  # small, so that contexts of 33+ tokens take the split-K path
# (request id, tokens already cached, tokens this step) per step; "c" shares "a"'s first two
# blocks (a prefix-cache hit), "d" spans many blocks.
STEPS = [
    [("a", 0, 37), ("b", 0, 20), ("d", 0, 100)],
    [("c", 32, 14), ("b", 20, 30), ("a", 37, 1), ("d", 100, 1)],
    [("a", 38, 1), ("b", 50, 1), ("c", 46, 1), ("d", 101, 1)],
]


def block_tables(block_size: int) -> dict[str, np.ndarray]:
    """Scattered, non-contiguous blocks for each request; "c" starts with "a"'s first two."""
    rng = np.random.default_rng(0)
    ids = rng.permutation(np.arange(1, 64))
    need = {rid: -(-160 // block_size) for rid in "abd"}
    tables, start = {}, 0
    for rid, n in need.items():
        tables[rid] = ids[start: start + n]
        start += n
    tables["c"] = np.concatenate([tables["a"][: 32 // block_size], ids[start: start + 4]])
    return tables


def run_steps(backend_name: str, kv_cache_dtype: str, shape: Shape,
              compute_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """The attention output of each step of STEPS through one backend: inputs in shape.dtype,
    computed in compute_dtype (default: the same; float32 gives a reference for bfloat16)."""
    compute_dtype = compute_dtype or shape.dtype
    spec = KVCacheSpec(1, shape.kv_heads, shape.head_dim, shape.block_size)
    fmt = make_kv_format(kv_cache_dtype, shape.dtype if kv_cache_dtype != "auto" else compute_dtype)
    cache = KVCache(spec, fmt, 64, DEVICE)
    backend = make_attention_backend(backend_name, fmt, spec, compute_dtype, None, DEVICE)
    backend.split_tokens = SPLIT_TOKENS
    tables = block_tables(shape.block_size)
    gen = torch.Generator().manual_seed(0)
    outputs = []
    for step in sorted(STEPS, key=len):
        step = sorted(step, key=lambda s: (s[2] != 1, -s[1]))  # decodes first, longest first (packing_order)
        sequences, slots, row = [], [], 0
        for rid, cached, new in step:
            sequences.append(StepSequence(rid, row, new, cached + new, tables[rid]))
            positions = np.arange(cached, cached + new)
            slots.append(tables[rid][positions // shape.block_size] * shape.block_size + positions % shape.block_size)
            row += new
        q, k, v = (torch.randn(row, heads, shape.head_dim, generator=gen).to(shape.dtype).to(DEVICE, compute_dtype)
                   for heads in (shape.heads, shape.kv_heads, shape.kv_heads))
        meta = backend.build(sequences, torch.as_tensor(np.concatenate(slots), device=DEVICE))
        outputs.append(backend.attend(q, k, v, cache.layers[0], fmt, meta, shape.window).float().cpu())
    return outputs


# Every format on two of the three shapes and every shape under at least four formats (the kernels'
# format code and shape code are separate; all 18 pairs take 40% longer under the interpreter).
FORMAT_SHAPES = [(fmt, shape) for i, fmt in enumerate(FORMATS)
                 for j, shape in enumerate(SHAPES) if fmt == "auto" or (i + j) % 3 != 0]


@pytest.mark.parametrize("kv_cache_dtype, shape", FORMAT_SHAPES, ids=[f"{f}-{s}" for f, s in FORMAT_SHAPES])
def test_kernels_match_the_torch_backend(kv_cache_dtype, shape):
    """float32: the torch backend's outputs to float32 rounding. bfloat16: both backends against
    exact (float32) attention over the same pool, the kernels at least as close as torch ops (which
    round dequantized K/V to bfloat16 where the kernels keep float32)."""
    got = run_steps("triton", kv_cache_dtype, shape)
    if shape.dtype == torch.float32:
        for step, (want, have) in enumerate(zip(run_steps("torch", kv_cache_dtype, shape), got)):
            error = (want - have).abs().max().item()
            assert error <= 2e-5 * max(1.0, want.abs().max().item()), (step, error)
        return
    exact = run_steps("torch", kv_cache_dtype, shape, compute_dtype=torch.float32)
    torch_ops = run_steps("torch", kv_cache_dtype, shape)
    for step, (reference, ours, theirs) in enumerate(zip(exact, got, torch_ops)):
        ours_error = (reference - ours).abs().max().item()
        theirs_error = (reference - theirs).abs().max().item()
        assert ours_error <= max(theirs_error, 2e-2), (step, ours_error, theirs_error)


def test_float_pools_of_another_dtype_are_read_in_place():
    """A float16 KV cache under a float32 model: the torch backend converts what it gathers, the
    kernels convert in registers."""
    shape = Shape(torch.float32, 16, 4, 2, 64)
    for want, have in zip(run_steps("torch", "float16", shape), run_steps("triton", "float16", shape)):
        assert (want - have).abs().max().item() <= 2e-5


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4"])
def test_store_kernel_writes_what_the_format_writes(kv_cache_dtype):
    """Bit for bit the pool the format's torch write leaves: scales, codes, rounding ties and all,
    for values of very different magnitudes (and an all-zero token)."""
    spec = KVCacheSpec(1, 2, 64, 16)
    fmt = make_kv_format(kv_cache_dtype, torch.float32)
    gen = torch.Generator().manual_seed(1)
    tokens = 40
    magnitudes = torch.logspace(-6, 3, tokens)[:, None, None]
    key = torch.randn(tokens, 2, 64, generator=gen) * magnitudes
    value = torch.randn(tokens, 2, 64, generator=gen) * magnitudes.flip(0)
    key[3] = 0.0
    value[5, :, :8] = 0.5  # exact ties for the rounding
    slots = torch.randperm(16 * 8, generator=gen)[:tokens] + 16
    pools = []
    for backend_name in ("torch", "triton"):
        cache = KVCache(spec, fmt, 8, DEVICE)
        backend = make_attention_backend(backend_name, fmt, spec, torch.float32, None, DEVICE)
        if backend_name == "torch":
            fmt.write(cache.layers[0], key.to(DEVICE), value.to(DEVICE), slots.to(DEVICE))
        else:
            backend._write(key.to(DEVICE), value.to(DEVICE), cache.layers[0], fmt, slots.to(DEVICE))
        pools.append({name: t.cpu() for name, t in cache.layers[0].items()})
    for name in pools[0]:
        assert torch.equal(pools[0][name].view(torch.uint8), pools[1][name].view(torch.uint8)), name


@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32", "int8", "fp8_e4m3", "fp8_e5m2", "int4"])
def test_rope_applied_with_the_store_is_rotary_then_the_store_bit_for_bit(kv_cache_dtype, model_dtype):
    """`rope_store` (one launch) against fused_ops.rotary followed by the store kernel: the same
    rotated queries and the same pool, bit for bit, from packed q/k/v heads (GQA 3, scattered slots)."""
    from kvserve.model import fused_ops
    from kvserve.model.attention import triton_kernels as kernels

    heads, kv_heads, dim, tokens = 6, 2, 64, 21
    spec = KVCacheSpec(1, kv_heads, dim, 16)
    fmt = make_kv_format(kv_cache_dtype, model_dtype)
    backend = make_attention_backend("triton", fmt, spec, model_dtype, None, DEVICE)
    gen = torch.Generator().manual_seed(3)
    packed = (torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen) * 3).to(DEVICE, model_dtype)
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(DEVICE, model_dtype)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1).to(DEVICE, model_dtype)
    slots = (torch.randperm(16 * 7, generator=gen)[:tokens] + 16).to(DEVICE)
    fp8 = kv_cache_dtype.removeprefix("fp8_") if kv_cache_dtype.startswith("fp8") else "e4m3"
    apart, together = KVCache(spec, fmt, 8, DEVICE), KVCache(spec, fmt, 8, DEVICE)
    query, key = fused_ops.rotary(packed[:, : heads + kv_heads], cos, signed_sin).split((heads, kv_heads), dim=1)
    kernels.store_kv(backend.kind, key, packed[:, heads + kv_heads:], slots, *backend._pool_tensors(apart.layers[0]),
                     fp8)
    fused_query = kernels.rope_store(backend.kind, packed, heads, cos, signed_sin, slots,
                                     *backend._pool_tensors(together.layers[0]), fp8)
    assert torch.equal(fused_query.view(torch.uint8), query.contiguous().view(torch.uint8))
    for name, want in apart.layers[0].items():
        assert torch.equal(together.layers[0][name].view(torch.uint8), want.view(torch.uint8)), name


def attend_rows(backend_name: str, kv_cache_dtype: str, shape: Shape, steps: list[list[tuple[str, int, int]]],
                deterministic: bool, split_tokens: int = SPLIT_TOKENS) -> dict[tuple[str, int], torch.Tensor]:
    """Each (request, position)'s attention output over `steps` of (request, cached, new) in a fresh
    pool; every request's q/k/v per position are fixed (seeded by request), whatever the step."""
    spec = KVCacheSpec(1, shape.kv_heads, shape.head_dim, shape.block_size)
    fmt = make_kv_format(kv_cache_dtype, shape.dtype)
    fmt.fixed_order = deterministic
    cache = KVCache(spec, fmt, 64, DEVICE)
    backend = make_attention_backend(backend_name, fmt, spec, shape.dtype, None, DEVICE, deterministic)
    backend.split_tokens = split_tokens
    tables = block_tables(shape.block_size)
    qkv = {}
    for i, rid in enumerate("abcd"):
        gen = torch.Generator().manual_seed(i)
        qkv[rid] = [torch.randn(160, heads, shape.head_dim, generator=gen).to(shape.dtype)
                    for heads in (shape.heads, shape.kv_heads, shape.kv_heads)]
    outputs = {}
    for step in steps:
        sequences, slots, parts, keys, row = [], [], [], [], 0
        for rid, cached, new in step:
            sequences.append(StepSequence(rid, row, new, cached + new, tables[rid]))
            positions = np.arange(cached, cached + new)
            slots.append(tables[rid][positions // shape.block_size] * shape.block_size + positions % shape.block_size)
            parts.append([t[cached: cached + new] for t in qkv[rid]])
            keys += [(rid, int(p)) for p in positions]
            row += new
        q, k, v = (torch.cat([p[i] for p in parts]).to(DEVICE) for i in range(3))
        meta = backend.build(sequences, torch.as_tensor(np.concatenate(slots), device=DEVICE))
        out = backend.attend(q, k, v, cache.layers[0], fmt, meta, shape.window).cpu()
        outputs.update(zip(keys, out))
    return outputs


def test_a_decode_does_not_depend_on_the_longest_context_in_its_batch():
    """The split merge runs in split order, so a decode beside a context of many splits (and a
    merge pass) gives the bits it gives alone."""
    shape = Shape(torch.bfloat16, 16, 4, 2, 64)
    history = [[("a", 0, 20), ("d", 0, 100)]]
    alone = attend_rows("triton", "auto", shape, history + [[("a", 20, 1)]], deterministic=False)
    beside = attend_rows("triton", "auto", shape, history + [[("a", 20, 1), ("d", 100, 1)]], deterministic=False)
    assert torch.equal(alone[("a", 20)], beside[("a", 20)])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_programs_taking_several_splits_give_the_same_bits(monkeypatch, kv_cache_dtype):
    """Past DECODE_PROGRAMS a decode launch has fewer programs than splits, each taking every n-th
    split (a CUDA graph's decode, sized for the longest context allowed): same bits as a program
    per split, with a window too."""
    from kvserve.model.attention import triton_kernels

    shape = Shape(torch.float32, 16, 4, 2, 64, window=70)
    steps = [[("a", 0, 20), ("d", 0, 150)], [("a", 20, 1), ("d", 150, 1)]]
    one_each = attend_rows("triton", kv_cache_dtype, shape, steps, deterministic=False)
    assert triton_kernels.split_programs(5, 2, 2) == 5
    monkeypatch.setattr(triton_kernels, "DECODE_PROGRAMS", 8)  # 2 sequences x 2 KV heads: 2 programs for 5 splits
    assert triton_kernels.split_programs(5, 2, 2) == 2
    shared = attend_rows("triton", kv_cache_dtype, shape, steps, deterministic=False)
    for key in [("a", 20), ("d", 150)]:
        assert torch.equal(one_each[key], shared[key]), key


@pytest.mark.parametrize("window", [None, 100])
def test_a_context_past_max_splits_takes_longer_splits(monkeypatch, window):
    """Past `max_splits` splits a decode's splits grow by whole `split_tokens`: a 150-token
    context in splits of 32 capped at 2 splits is read as two splits of 96, bit for bit the uncapped
    kernel with splits of 96, close to the torch backend's, and whatever it is batched with. The
    partial sums a launch keeps are bounded by the cap (a graph sized for 131,072 tokens: 64 splits)."""
    from kvserve.model.attention import triton_backend, triton_kernels

    shape = Shape(torch.float32, 16, 4, 2, 64, window=window)
    history = [[("a", 0, 150), ("d", 0, 40)]]
    decodes = history + [[("a", 150, 1), ("d", 40, 1)]]
    uncapped = attend_rows("triton", "auto", shape, decodes, deterministic=False)
    splits_of_96 = attend_rows("triton", "auto", shape, decodes, deterministic=False, split_tokens=96)
    reference = attend_rows("torch", "auto", shape, decodes, deterministic=False)
    monkeypatch.setattr(triton_backend, "MAX_SPLITS", 2)
    capped = attend_rows("triton", "auto", shape, decodes, deterministic=False)
    alone = attend_rows("triton", "auto", shape, history + [[("a", 150, 1)]], deterministic=False)
    assert triton_kernels.split_length(151, SPLIT_TOKENS, 2) == 96
    assert torch.equal(capped[("a", 150)], splits_of_96[("a", 150)])
    assert not torch.equal(capped[("a", 150)], uncapped[("a", 150)])  # five splits of 32 sum in another order
    assert torch.equal(capped[("a", 150)], alone[("a", 150)])
    torch.testing.assert_close(capped[("a", 150)], reference[("a", 150)], rtol=1e-5, atol=1e-5)
    assert torch.equal(capped[("d", 40)], uncapped[("d", 40)])  # 41 tokens: two splits of 32 under the cap too
    # The partial sums' split dimension follows the batch's longest context (up to the cap): "d"
    # alone keeps 2 splits, beside "a" a third goes unused; the same bits either way.
    monkeypatch.setattr(triton_backend, "MAX_SPLITS", 3)
    d_alone = attend_rows("triton", "auto", shape, [[("d", 0, 40)], [("d", 40, 1)]], deterministic=False)
    d_beside = attend_rows("triton", "auto", shape, decodes, deterministic=False)
    assert torch.equal(d_alone[("d", 40)], d_beside[("d", 40)])
    assert triton_kernels.decode_splits(131_072, 512, 64) == 64


def test_a_decode_over_more_rows_than_its_partial_sums_hold_launches_in_slices(monkeypatch):
    """A decode whose split partial sums would pass PARTIALS_MAX_BYTES (a deterministic prefill's
    rows, many long contexts) launches in slices of rows: the same bits as one launch, and the
    profiling pass's reserve for it is capped."""
    from kvserve.model.attention import triton_kernels

    shape = Shape(torch.bfloat16, 16, 4, 2, 64)
    steps = [[("a", 0, 70), ("b", 0, 40), ("c", 0, 90)], [("a", 70, 1), ("b", 40, 1), ("c", 90, 1)]]
    whole = attend_rows("triton", "int8", shape, steps, deterministic=False)
    backend = make_attention_backend("triton", make_kv_format("auto", torch.bfloat16), KVCacheSpec(1, 2, 64, 16),
                                     torch.bfloat16, None, DEVICE)
    assert backend.decode_scratch_bytes(256, 4, 512) == 0  # one split: no partial sums
    assert backend.decode_scratch_bytes(2, 4, 2048) == triton_kernels.partials_bytes(2, 4, 4, 64)
    per_row = triton_kernels.partials_bytes(1, 32, 64, 64)  # 131,072 tokens: 64 splits
    slice_rows = triton_kernels.PARTIALS_MAX_BYTES // per_row
    assert 512 < slice_rows < 10_000
    reserved = backend.decode_scratch_bytes(10_000, 32, 131_072)
    assert reserved == slice_rows * per_row <= triton_kernels.PARTIALS_MAX_BYTES
    two_rows = triton_kernels.partials_bytes(2, shape.heads, 3, shape.head_dim)
    monkeypatch.setattr(triton_kernels, "PARTIALS_MAX_BYTES", two_rows)  # launches of 2 sequences, then 1
    sliced = attend_rows("triton", "int8", shape, steps, deterministic=False)
    for key in [("a", 70), ("b", 40), ("c", 90)]:
        assert torch.equal(whole[key], sliced[key]), key


@pytest.mark.parametrize("kv_cache_dtype,shape", [("auto", SHAPES[0]), ("int4", SHAPES[0]), ("fp8_e5m2", SHAPES[1])],
                         ids=lambda x: str(x))
def test_deterministic_rows_do_not_depend_on_chunks_batch_or_prefill_versus_decode(kv_cache_dtype, shape):
    """--deterministic: a token's attention output is the same bits prefilled in one chunk alone,
    prefilled in small chunks beside other sequences (one of them several splits long), or decoded
    past a split. (In float32 without the option, the decodes past a split differ in their last bits
    from the prefill kernel's single pass.)"""
    one_chunk = attend_rows("triton", kv_cache_dtype, shape, [[("a", 0, 40)]], deterministic=True)
    mixed = attend_rows("triton", kv_cache_dtype, shape, [
        [("d", 0, 70), ("a", 0, 12)],
        [("a", 12, 21), ("b", 0, 9), ("d", 70, 1)],
        [("a", 33, 1), ("b", 9, 1)],  # decodes past one split (SPLIT_TOKENS)
        [("a", 34, 1)],
        [("a", 35, 5), ("d", 71, 1)],
    ], deterministic=True)
    differing = [p for p in range(40) if not torch.equal(one_chunk[("a", p)], mixed[("a", p)])]
    assert not differing, differing


def test_the_backend_says_what_it_cannot_serve():
    spec = KVCacheSpec(1, 2, 64, 16)
    fmt = make_kv_format("auto", torch.float32)
    with pytest.raises(ValueError, match="power-of-two head_dim of 32 or more, not 48"):
        make_attention_backend("triton", fmt, KVCacheSpec(1, 2, 48, 16), torch.float32, None, DEVICE)
    with pytest.raises(ValueError, match="power-of-two block size of 16 or more, not 8"):
        make_attention_backend("triton", fmt, KVCacheSpec(1, 2, 64, 8), torch.float32, None, DEVICE)
    assert "Triton paged kernels" in make_attention_backend("triton", fmt, spec, torch.float32, None,
                                                            DEVICE).description


def test_on_cpu_without_the_interpreter_it_is_a_one_line_error(tiny_llama):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "kvserve.cli", "chat", "hi", "--model", str(tiny_llama),
                             "--device", "cpu", "--attention-backend", "triton"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("kvserve chat: error: --attention-backend triton: the Triton backend needs CUDA, or "
                           "TRITON_INTERPRET=1"), line


# ------------------------------------------------------------------------------------------ engine
PROMPTS = [
    "It is a truth universally acknowledged, that a single man in possession of a good fortune",
    "It is a truth universally acknowledged, that a single man in want of a wife",
    "Hello",
    "Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and caprice",
]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_an_engine_on_the_triton_backend_gives_the_torch_backends_tokens(tiny_llama_d32, kv_cache_dtype):
    """Chunked prefill (16 tokens a step), prefix-cache hits between the first two prompts and
    decodes of several lengths, through the whole engine."""
    greedy = SamplingParams(temperature=0, max_tokens=5)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama_d32), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16,
                  kv_cache_dtype=kv_cache_dtype, attention_backend=backend, device=str(DEVICE))
        assert llm.engine.attention_backend.name == backend
        llm.generate(PROMPTS[:1], greedy, use_tqdm=False)  # its blocks are then prefix-cache hits
        outputs = llm.generate(PROMPTS, greedy, use_tqdm=False)
        assert outputs[0].num_cached_tokens > 0 and outputs[1].num_cached_tokens > 0
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]


def test_an_engine_on_the_triton_backend_under_deterministic_gives_the_same_bits_alone_and_batched(tiny_llama_d32):
    """On CPU the linears are the CPU's fixed-order ones; with every kernel Triton's (CUDA's
    configuration): tests/test_fixed_order_triton.py."""
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    llm = LLM(str(tiny_llama_d32), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16,
              attention_backend="triton", deterministic=True, device=str(DEVICE))

    def results(outputs):
        return [(c.token_ids, [e[t].logprob for e, t in zip(c.logprobs, c.token_ids)])
                for c in (o.outputs[0] for o in outputs)]

    alone = [results(llm.generate([prompt], params, use_tqdm=False))[0] for prompt in PROMPTS]
    assert results(llm.generate(PROMPTS, params, use_tqdm=False)) == alone


def test_sequences_under_eviction_share_a_batch_with_the_kernels(tiny_llama_d32):
    """Requests under H2O (keys stored before RoPE, attention observed) take the torch path inside
    a Triton step, beside requests the kernels serve: each gives what the torch backend gives."""
    plain = SamplingParams(temperature=0, max_tokens=12)
    evicting = SamplingParams(temperature=0, max_tokens=12, kv_eviction={"policy": "h2o", "budget": 32})
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama_d32), dtype="float32", kv_cache_memory="4MiB", attention_backend=backend,
                  enable_prefix_caching=False, device=str(DEVICE))
        outputs = llm.generate(PROMPTS, [evicting, plain, evicting, plain], use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_an_engine_with_rope_applied_with_the_store_gives_the_torch_backends_tokens(tiny_llama_d32, kv_cache_dtype,
                                                                                     monkeypatch):
    """With the CUDA fused ops installed (as CudaPlatform does), the Triton backend rotates keys as
    it stores them (rope_store) through chunked prefill, prefix hits, decodes and requests under
    H2O in the same steps (their keys kept before RoPE: the unfused path for those steps). Greedy
    tokens equal the torch backend's."""
    from kvserve.model import fused_ops
    from kvserve.model.attention import triton_kernels

    launches = []
    rope_store = triton_kernels.rope_store
    monkeypatch.setattr(triton_kernels, "rope_store", lambda *a, **k: launches.append(1) or rope_store(*a, **k))
    greedy = SamplingParams(temperature=0, max_tokens=5)
    evicting = SamplingParams(temperature=0, max_tokens=5, kv_eviction={"policy": "h2o", "budget": 32})
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama_d32), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=16,
                  kv_cache_dtype=kv_cache_dtype, attention_backend=backend, device=str(DEVICE))
        llm.engine.model.use_fused_ops(fused_ops)
        llm.generate(PROMPTS[:1], greedy, use_tqdm=False)  # its blocks are then prefix-cache hits
        outputs = llm.generate(PROMPTS, [greedy, greedy, evicting, greedy], use_tqdm=False)
        assert outputs[1].num_cached_tokens > 0
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]
    assert launches


def test_formats_with_a_basis_between_rope_and_the_pool_do_not_store_with_rope():
    """fp8_e5m2 and int4 rotate K/V (Hadamard) before they are stored, and int4_kivi's keys are
    written by torch ops: their keys are rotated by RoPE apart from the store."""
    spec = KVCacheSpec(1, 2, 64, 16)
    stores = {name: make_attention_backend("triton", make_kv_format(name, torch.float32), spec, torch.float32, None,
                                           DEVICE).stores_with_rope
              for name in ("auto", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int4_kivi")}
    assert stores == {"auto": True, "bfloat16": True, "int8": True, "fp8_e4m3": True, "fp8_e5m2": False,
                      "int4": False, "int4_kivi": False}


# ------------------------------------------------------------------------------------------ GPU build
def test_kernels_compile_for_sm90():
    """Each kernel, for each layout kind, compiled to a cubin for sm_90 (H100/H200) without a GPU,
    by Triton's nvidia backend and the ptxas it ships (tests/compile_triton_kernels.py, in a
    process without the interpreter): catches what the interpreter lets through."""
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"triton's nvidia backend is missing: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "compile_triton_kernels.py")
    result = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
