"""Compile kvserve's Triton kernels (attention, fused ops, the fixed-order GEMM) for sm_90
(H100/H200) without a GPU, with the ptxas that ships with triton: what the interpreter does not
check (constexpr globals, branch types, dot shapes).
Run by tests/test_triton_attention.py in a process without TRITON_INTERPRET; exits 1 on a failure."""
from __future__ import annotations

import os
import sys

os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from kvserve import fixed_order_triton as G  # noqa: E402
from kvserve.model import fused_ops as F  # noqa: E402
from kvserve.model.attention import triton_kernels as K  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# Pointer types of (K/V codes, their per-token scales, int4_kivi's key params) per layout kind.
POOLS = {K.FLOAT: ("*bf16", "*bf16", "*bf16"), K.INT8: ("*i8", "*fp16", "*fp16"), K.FP8: ("*i8", "*i8", "*i8"),
         K.INT4: ("*u8", "*fp16", "*fp16"), K.INT4_KIVI: ("*u8", "*fp16", "*fp16")}


def signature(fn, types: dict[str, str], constants: dict) -> dict[str, str]:
    """Every argument of `fn`: its type from `types` (pointers) or int32, constexpr for `constants`."""
    return {name: "constexpr" if name in constants else types.get(name, "i32") for name in fn.arg_names}


def compile_kernel(label: str, fn, types: dict[str, str], constants: dict, divisible: tuple[str, ...] = ()) -> bool:
    """`divisible`: arguments marked divisible by 16, as Triton marks pointers and integers at launch."""
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    try:
        triton.compile(ASTSource(fn, signature(fn, types, constants), constants, attrs), target=TARGET)
        print(label, "ok")
        return True
    except Exception as exc:  # report every kernel, then fail
        print(label, "FAILED", str(exc)[-3000:])
        return False


def main() -> int:
    ok = True
    for kind, (codes, scales, key_params) in POOLS.items():
        pool = {"k_ptr": codes, "v_ptr": codes, "k_aux_ptr": scales, "v_aux_ptr": scales, "kp_ptr": key_params,
                "table_ptr": "*i64", "seq_lens_ptr": "*i64", "q_ptr": "*bf16", "out_ptr": "*bf16",
                "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "qk_scale": "fp32", "tile_chunk_ptr": "*i64",
                "tile_start_ptr": "*i64", "chunk_row_ptr": "*i64", "chunk_queries_ptr": "*i64",
                "chunk_context_ptr": "*i64"}
        common = {"BLOCK_SIZE": 16, "HALF": 64, "KIND": kind, "MANT": 3, "BIAS": 7, "DOT_DTYPE": tl.bfloat16}
        if kind != K.INT4_KIVI:
            ok &= compile_kernel(f"store kind {kind}", K._store_kernel,
                                 {"key_ptr": "*bf16", "value_ptr": "*bf16", "slot_ptr": "*i64", "kv_ptr": codes,
                                  "aux_ptr": scales},
                                 {"HALF": 64, "KIND": kind, "MANT": 3, "BIAS": 7, "FMAX": 448.0})
            ok &= compile_kernel(f"rope_store kind {kind}", K._rope_store_kernel,
                                 {"heads_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "q_ptr": "*bf16",
                                  "slot_ptr": "*i64", "kv_ptr": codes, "aux_ptr": scales},
                                 {"HALF": 64, "KIND": kind, "MANT": 3, "BIAS": 7, "FMAX": 448.0})
        for split in (False, True):
            ok &= compile_kernel(f"decode kind {kind} split {split}", K._decode_kernel, pool,
                                 {**common, "GROUP": 4, "GROUP_PAD": 16, "PRECISE": False, "SPLIT": split})
        ok &= compile_kernel(f"prefill kind {kind}", K._prefill_kernel, pool,
                             {**common, "GROUP": 4, "BLOCK_M": 32, "PRECISE": True})
        # Integer arguments equal to 1 become constants at launch (Triton's specialisation).
        ones = {"window": 1, "num_kv_heads": 1, "v_row_offset": 1, "num_heads": 1}
        ok &= compile_kernel(f"decode kind {kind}, integers 1", K._decode_kernel, pool,
                             {**common, **ones, "GROUP": 1, "GROUP_PAD": 16, "PRECISE": True, "SPLIT": False})
        ok &= compile_kernel(f"prefill kind {kind}, integers 1", K._prefill_kernel, pool,
                             {**common, "window": 1, "v_row_offset": 1, "GROUP": 1, "BLOCK_M": 32,
                              "PRECISE": False})
    ok &= compile_kernel("combine", K._combine_splits,
                         {"out_ptr": "*bf16", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "seq_lens_ptr": "*i64"},
                         {"D": 128})
    bf16 = {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
            "gate_up_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "eps": "fp32"}
    for residual in (False, True):
        ok &= compile_kernel(f"add_rms_norm residual {residual}", F._add_rms_norm_kernel, bf16,
                             {"HAS_RESIDUAL": residual, "BLOCK": 2048})
    ok &= compile_kernel("silu_mul", F._silu_mul_kernel, bf16, {"BLOCK": 1024})
    ok &= compile_kernel("rotary", F._rotary_kernel, bf16, {"HALF": 32})
    # The GEMM as a model's linears launch it (contiguous weight: stride_wk 1; aligned pointers and
    # shapes divisible by 16), at both tile widths, and with nothing specialised.
    aligned = ("x_ptr", "w_ptr", "bias_ptr", "out_ptr", "N", "K", "stride_xm", "stride_wn", "stride_om")
    for dtype, ieee in (("bf16", False), ("fp16", False), ("fp32", True)):
        for bias in (False, True):
            for block_n in (32, 64):
                gemm = {"HAS_BIAS": bias, "IEEE": ieee, "BLOCK_M": G.BLOCK_M, "BLOCK_N": block_n,
                        "BLOCK_K": G.BLOCK_K}
                pointers = {name: f"*{dtype}" for name in ("x_ptr", "w_ptr", "bias_ptr", "out_ptr")}
                ok &= compile_kernel(f"fixed-order GEMM {dtype} bias {bias} BLOCK_N {block_n}", G._gemm_kernel,
                                     pointers, {**gemm, "stride_wk": 1}, divisible=aligned)
            ok &= compile_kernel(f"fixed-order GEMM {dtype} bias {bias}, unspecialised", G._gemm_kernel,
                                 pointers, gemm)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
