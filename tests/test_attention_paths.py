"""The decode of a lone request (one exact-length SDPA call) against the padded, masked matmul path
it replaces and against attention written out head by head (HF's GQA mapping: query head h reads
KV head h // (heads / kv_heads)), with sliding windows shorter and longer than the context; and
the CPU paged decode kernel against the same definition."""
from __future__ import annotations

import functools
import math

import pytest
import torch

from kvserve.cache.formats import make_kv_format
from kvserve.cache.kv_cache import KVCacheSpec
from kvserve.model.attention import AttentionGroup, make_attention_backend
from kvserve.model.attention.torch_ops import _decode, _decode_attention, _single_decode
from kvserve.model.attention.cpu_paged import PagedDecodeKernel, load_paged_decode_module, paged_decode_kernel

pytestmark = pytest.mark.torch_path  # CI runs this module again with the kernel disabled

SPEC = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=16, block_size=8)
HEADS = 6  # three query heads per KV head
SEQ_LEN = 37  # not a multiple of the block size: the padded path masks the last block's tail
BLOCKS = torch.tensor([7, 2, 9, 0, 4])


def by_hand(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [H, d], k/v [L, kv_heads, d] in float32 -> [H, d]."""
    start = 0 if window is None else max(0, k.shape[0] - window)
    group = HEADS // SPEC.num_kv_heads
    out = []
    for h in range(HEADS):
        keys, values = k[start:, h // group], v[start:, h // group]
        probs = torch.softmax(keys @ q[h] / math.sqrt(q.shape[-1]), dim=0)
        out.append(probs @ values)
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5, 36, 37, 1000])
def test_single_request_decode_matches_the_padded_path_and_the_definition(dtype, window):
    fmt = make_kv_format("auto", dtype)
    pool = fmt.allocate(SPEC, 10, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(SEQ_LEN, SPEC.num_kv_heads, SPEC.head_dim, generator=gen).to(dtype) for _ in range(2))
    slots = (BLOCKS[:, None] * SPEC.block_size + torch.arange(SPEC.block_size)).reshape(-1)[:SEQ_LEN]
    fmt.write(pool, k, v, slots)
    group = AttentionGroup(block_ids=BLOCKS, seq_lens=torch.tensor([SEQ_LEN]),
                           context_len=BLOCKS.numel() * SPEC.block_size, max_seq_len=SEQ_LEN)
    q = torch.randn(1, 1, HEADS, SPEC.head_dim, generator=gen).to(dtype)

    got = _single_decode(q, group, pool, fmt, window)[0, 0].float()
    k_ctx, v_ctx = fmt.gather(pool, BLOCKS, 1, dtype)
    padded = _decode_attention(q, k_ctx, v_ctx, group, window)[0, 0].float()
    expected = by_hand(q[0, 0].float(), k.float(), v.float(), window)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    assert torch.allclose(got, expected, atol=tolerance), (got - expected).abs().max()
    assert torch.allclose(padded, expected, atol=tolerance), (padded - expected).abs().max()


@pytest.mark.parametrize("dtype,kv_cache_dtype", [
    (torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float16, "auto"),
    (torch.bfloat16, "fp8_e4m3"), (torch.bfloat16, "fp8_e5m2"), (torch.bfloat16, "int8"), (torch.float32, "int8"),
    (torch.bfloat16, "int4"),
])
@pytest.mark.parametrize("window", [None, 5, 36])
def test_paged_decode_kernel_matches_the_definition_for_a_mixed_batch(cpu_kernel, dtype, kv_cache_dtype, window):
    """The CPU kernel (attention backend cpu_paged) reads each request's blocks in place through its
    block table: requests of different lengths, tables in no order and padded with block 0, with the
    unused slots of the pool holding garbage it must not read. Quantized pools are compared with
    attention by hand over the values their own gather decodes (the stored, rounded K/V)."""
    check_kernel_against_the_definition(PagedDecodeKernel(cpu_kernel, 1 / math.sqrt(SPEC.head_dim)), dtype,
                                        kv_cache_dtype, window)


def check_kernel_against_the_definition(kernel: PagedDecodeKernel, dtype: torch.dtype, kv_cache_dtype: str,
                                        window: int | None) -> None:
    fmt = make_kv_format(kv_cache_dtype, dtype)
    layout = fmt.in_place_layout(dtype)
    assert layout is not None
    pool = fmt.allocate(SPEC, 16, torch.device("cpu"))
    for name, tensor in pool.items():  # anything read beyond a request's length would swamp its output
        if name == "kv_scale" and tensor.dtype == torch.int8:
            tensor.fill_(7)  # an fp8 exponent: 2^7
        elif tensor.dtype == torch.float16 and name != "kv":
            tensor.fill_(512.0)  # int8's scale, int4's scale and zero
        else:
            tensor.view(torch.int8 if tensor.element_size() == 1 else tensor.dtype).fill_(100 if tensor.element_size() == 1 else 1e4)
    gen = torch.Generator().manual_seed(1)
    seq_lens = [37, 1, 16, 9]
    tables = [[7, 2, 9, 0, 4], [11], [3, 5], [15, 6]]
    for length, table in zip(seq_lens, tables):
        k, v = (torch.randn(length, SPEC.num_kv_heads, SPEC.head_dim, generator=gen).to(dtype) for _ in range(2))
        slots = (torch.tensor(table)[:, None] * SPEC.block_size + torch.arange(SPEC.block_size)).reshape(-1)[:length]
        fmt.write(pool, k, v, slots)
    width = max(len(t) for t in tables)
    block_ids = torch.tensor([t + [0] * (width - len(t)) for t in tables]).reshape(-1)
    group = AttentionGroup(block_ids=block_ids, seq_lens=torch.tensor(seq_lens),
                           context_len=width * SPEC.block_size, max_seq_len=max(seq_lens))
    q = torch.randn(len(seq_lens), 1, HEADS, SPEC.head_dim, generator=gen).to(dtype)

    in_place = functools.partial(kernel.decode, layout)
    got = _decode(q, group, pool, fmt, window, in_place)[:, 0].float()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    for i, (length, table) in enumerate(zip(seq_lens, tables)):
        # The stored K/V as the format's gather decodes them (the written values, rounded).
        k, v = fmt.gather(pool, torch.tensor(table), 1, torch.float32)
        k, v = (x[:, 0, :length].transpose(0, 1) for x in (k, v))
        expected = by_hand(q[i, 0].float(), k, v, window)
        assert torch.allclose(got[i], expected, atol=tolerance), (i, (got[i] - expected).abs().max())


def backend(name: str, kv_cache_dtype: str = "auto", dtype: torch.dtype = torch.bfloat16,
            device: str = "cpu", head_dim: int = 64):
    spec = KVCacheSpec(SPEC.num_layers, SPEC.num_kv_heads, head_dim, SPEC.block_size)
    return make_attention_backend(name, make_kv_format(kv_cache_dtype, dtype), spec, dtype, None, torch.device(device))


def test_attention_backend_choice(cpu_kernel):
    assert backend("torch").name == "torch"
    assert backend("auto").name == "cpu_paged"  # where the kernel runs, auto takes it
    assert backend("auto", device="meta").name == "torch"  # not a CPU: the torch path
    with pytest.raises(ValueError, match="CPU only"):
        backend("cpu_paged", device="meta")
    with pytest.raises(ValueError, match="head_dim 12 is not one"):
        backend("cpu_paged", head_dim=12)
    with pytest.raises(ValueError, match="unknown attention backend"):
        backend("flash")
    # The format describes its layout, the backend decides: int4_kivi, a float cache dtype other
    # than the model's, and quantized caches under a float16 model keep gathering.
    for kv_cache_dtype in ("int4_kivi", "float32"):
        assert not backend("auto", kv_cache_dtype).reads_decodes_in_place
        with pytest.raises(ValueError, match="--attention-backend cpu_paged: the cpu_paged backend reads"):
            backend("cpu_paged", kv_cache_dtype)
    assert not backend("auto", "fp8", torch.float16).reads_decodes_in_place
    for kv_cache_dtype in ("auto", "bfloat16", "fp8", "fp8_e5m2", "int8", "int4"):
        assert backend("auto", kv_cache_dtype).reads_decodes_in_place
        assert not backend("torch", kv_cache_dtype).reads_decodes_in_place


def test_without_the_kernel_auto_takes_the_torch_path_and_cpu_paged_says_why():
    """Where the kernel cannot run (here: whenever the fixture above would skip), `auto` still
    serves through torch ops and `cpu_paged` is a one-line error with the reason."""
    module, why = load_paged_decode_module()
    if module is not None:
        pytest.skip("the kernel runs here; tests/test_kernel_build.py covers its absence")
    assert paged_decode_kernel(64)[0] is None
    assert backend("auto").name == "torch"
    with pytest.raises(ValueError, match="not available: .+"):
        backend("cpu_paged")
