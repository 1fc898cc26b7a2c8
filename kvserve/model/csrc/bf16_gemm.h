// bfloat16 matmul on AVX512-BF16 dot products (CPU): y = x W^T (+ b), the linears of a bf16 model.
//
// A decode step's bf16 linear (1-32 rows) is one pass over its weight with little arithmetic per
// byte. There oneDNN's GEMM, tuned for large M, does not hide its weight reads behind its compute,
// and torch's GEMV for one row reads the weights below bandwidth. Here the weight is packed once,
// at load, in the pair layout AVX512-BF16's `vdpbf16ps` multiplies: for each block of 16 output
// rows, the K/2 column pairs in turn, each pair of the 16 rows in one 64-byte vector,
// [N/16, K/2, 16, 2]. One instruction adds a broadcast pair of x's columns times its two weights into
// 16 float32 outputs at once (no horizontal sums). A register tile of kTileRows rows of x by up to
// kTileBlocks blocks of 16 outputs loads each weight vector once per tile. Each thread takes its
// columns in panels, each panel's weight read once from memory while every row tile of x passes over
// it, so the weight streams front to back once per call. Measured faster than oneDNN at decode
// batches and on par from 128 to 2,048 rows (BENCHMARKS.md, issue 26, eighth pass), so a layer on
// it needs no second copy. Sums are float32 and the output is rounded to bf16 once, as oneDNN's and
// torch's bf16 kernels do (in another order).
//
// The AVX512 build level does not include AVX512-BF16 (Cooper Lake, Sapphire Rapids on; AMD Zen 4
// on), so the kernel is compiled for it alone (a target attribute) and offered where the CPU has it.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
#include <immintrin.h>
#define KVSERVE_BF16_DOT 1
#endif

namespace bf16_gemm {

constexpr int64_t kOutBlock = 16;   // output rows a packed block holds (one float32 vector of sums)
constexpr int64_t kTileRows = 4;    // rows of x a register tile multiplies
constexpr int64_t kTileBlocks = 6;  // blocks of 16 outputs a register tile holds (4 x 6 sums + 6 weights)

inline bool available() {
#ifdef KVSERVE_BF16_DOT
  static const bool has = __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
  return has;
#else
  return false;
#endif
}

// Whether a [N, K] weight fits the packed layout.
inline bool fits(int64_t out_features, int64_t in_features) {
  return out_features > 0 && out_features % kOutBlock == 0 && in_features > 0 && in_features % 2 == 0;
}

// W [N, K] bf16 -> [N/16, K/2, 16, 2]: block b, pair p, row i holds W[16 b + i, 2 p .. 2 p + 1].
inline at::Tensor pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.device().is_cpu(),
              "the weight must be a 2-D bfloat16 CPU tensor");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(fits(n, k), "the weight's rows must be a multiple of 16 and its columns even, not ", n, " x ", k);
  const at::Tensor w = weight.contiguous();
  at::Tensor out = at::empty({n / kOutBlock, k / 2, kOutBlock, 2}, w.options());
  const auto* src = reinterpret_cast<const uint32_t*>(w.data_ptr());  // column pairs of a row
  auto* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  const int64_t pairs = k / 2;
  at::parallel_for(0, n / kOutBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t p = 0; p < pairs; ++p)
        for (int64_t i = 0; i < kOutBlock; ++i) dst[(b * pairs + p) * kOutBlock + i] = src[(b * kOutBlock + i) * pairs + p];
  });
  return out;
}

#ifdef KVSERVE_BF16_DOT
// y[ROWS, 16 BLOCKS] = x[ROWS, K] times the BLOCKS packed blocks at w (+ bias), rounded to bf16.
template <int ROWS, int BLOCKS>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void tile(
    const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t pairs, const uint16_t* bias, uint16_t* y,
    int64_t ldy) {
  __m512 sum[ROWS][BLOCKS];
  for (int b = 0; b < BLOCKS; ++b) {
    // bf16 -> float32 is a 16-bit shift; the bias starts the sums, as oneDNN adds it in float32
    const __m512 start = bias == nullptr ? _mm512_setzero_ps()
        : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + b * kOutBlock))), 16));
    for (int r = 0; r < ROWS; ++r) sum[r][b] = start;
  }
  for (int64_t p = 0; p < pairs; ++p) {
    __m512bh wv[BLOCKS];
    for (int b = 0; b < BLOCKS; ++b)
      wv[b] = (__m512bh)_mm512_loadu_si512(w + (b * pairs + p) * 2 * kOutBlock);
    for (int r = 0; r < ROWS; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int b = 0; b < BLOCKS; ++b) sum[r][b] = _mm512_dpbf16_ps(sum[r][b], xv, wv[b]);
    }
  }
  for (int r = 0; r < ROWS; ++r)
    for (int b = 0; b < BLOCKS; ++b)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + b * kOutBlock), (__m256i)_mm512_cvtneps_pbh(sum[r][b]));
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t);

template <int ROWS, int... B>
constexpr std::array<TileFn, sizeof...(B)> tiles_of(std::integer_sequence<int, B...>) {
  return {&tile<ROWS, B + 1>...};
}

// TILES[rows - 1][blocks - 1]
inline const std::array<std::array<TileFn, kTileBlocks>, kTileRows>& tiles() {
  using Blocks = std::make_integer_sequence<int, kTileBlocks>;
  static const std::array<std::array<TileFn, kTileBlocks>, kTileRows> table{
      tiles_of<1>(Blocks{}), tiles_of<2>(Blocks{}), tiles_of<3>(Blocks{}), tiles_of<4>(Blocks{})};
  return table;
}
#endif

// x [rows, K] bf16 times the packed W^T (+ bias) -> [rows, N] bf16. Threads split the output columns.
inline at::Tensor matmul(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(), "this CPU has no AVX512-BF16 (or this build of the kernel lacks it)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu(), "x must be 2-D bfloat16 on CPU");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kOutBlock && packed.size(3) == 2 &&
              packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(), "not a packed bf16 weight");
  const int64_t rows = x.size(0), k = x.size(1), blocks = packed.size(0), pairs = packed.size(1), n = blocks * kOutBlock;
  TORCH_CHECK(k == 2 * pairs, "x has ", k, " columns, the weight ", 2 * pairs);
  TORCH_CHECK(!bias.has_value() || (bias->numel() == n && bias->scalar_type() == at::kBFloat16 && bias->is_contiguous()),
              "the bias must be [N] bfloat16");
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({rows, n}, x.options());
#ifdef KVSERVE_BF16_DOT
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* bp = bias.has_value() ? reinterpret_cast<const uint16_t*>(bias->data_ptr()) : nullptr;
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const auto& table = tiles();
  // a thread's share of the columns goes in panels of up to kTileBlocks blocks, each panel's
  // weight read once while every row tile of x passes over it
  at::parallel_for(0, blocks, kTileBlocks, [&](int64_t begin, int64_t end) {
    for (int64_t b0 = begin; b0 < end; b0 += kTileBlocks) {
      const int64_t width = std::min<int64_t>(kTileBlocks, end - b0);
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
        const int64_t height = std::min<int64_t>(kTileRows, rows - r0);
        table[height - 1][width - 1](xp + r0 * k, k, wp + b0 * pairs * 2 * kOutBlock, pairs,
                                     bp == nullptr ? nullptr : bp + b0 * kOutBlock, yp + r0 * n + b0 * kOutBlock, n);
      }
    }
  });
#endif
  return y;
}

}  // namespace bf16_gemm
