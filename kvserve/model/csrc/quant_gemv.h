// Matrix products with group-quantized weights, in integer arithmetic (CPU), for any number of rows.
//
// Weights in groups of 32 input columns: 4-bit unsigned codes u with w = d u + m (GGUF Q4_0/Q4_1),
// or 8-bit signed codes q with w = d q (Q8_0, per-channel int8), d and m in float16. Each row of x is
// quantized per group of 32 too: xq = round(x / dx) with dx = max|x| / L and sx = dx sum(xq), so that
// a group's contribution is
//   d dx sum(u xq) + m sx     (sum(w x) = d sum(u x) + m sum(x))
// with sum(u xq) an integer dot product. Against 4-bit weights x takes 8 bits (L = 127, what
// llama.cpp does for its Q4 dot products, Q8_1): the pairs are multiplied and summed in 16 bits
// (maddubs, unsigned times signed), then in 32. Against 8-bit weights x takes 16 bits (L = 32767): the
// weights are the precise ones there, and int8 x int8 would add an activation rounding as large as
// theirs; int16 pairs are summed in 32 bits (madd).
//
// 4-bit weights are stored eight output rows interleaved (the repacking llama.cpp's CPU backend does
// for its Q4_0 8x8 GEMM), so that one 256-bit lane holds the same four input columns of eight rows:
// for block b of rows 8b..8b+7 and group g, 128 bytes at (b * groups + g) * 128, chunk c (0..3) at
// byte 32 c, row i at bytes 4 i..4 i+3 of the chunk, holding columns 4c..4c+3 of the group in its low
// nibbles and columns 16+4c..16+4c+3 in its high ones. d and m are [blocks, groups, 8] likewise. One
// broadcast of four activation bytes then multiplies all eight rows, the eight lanes of a sum are the
// eight outputs (no horizontal sums), the group scales multiply as vectors, and a block's codes stay
// in L1 while every row of x passes. A group's sixteen products per lane stay within 16 bits
// (8 x 2 x 15 x 127 = 30,480), so they are widened to 32 bits once per group, not per product.
// The 8-bit matrices (the LM head) keep one row per output, each row read once for all rows of x.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define KVSERVE_GEMV_AVX2 1
#endif
// AVX512-VNNI (Cascade Lake, Ice Lake, Sapphire Rapids, Zen 4 on): its dpbusd sums four u8 x s8
// products into each 32-bit lane in one instruction, where AVX2 needs maddubs, a 16-bit add and a
// madd. The AVX512 build level does not include VNNI, so that variant is compiled for it alone
// (a target attribute) and chosen at run time where the CPU has it.
#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__)
#define KVSERVE_GEMV_VNNI 1
#endif

namespace quant_gemv {

constexpr int64_t kGroup = 32;
constexpr int64_t kBlock = 8;  // output rows interleaved in a 4-bit block
constexpr int64_t kTile = 4;   // rows of x one pass over a block's codes multiplies

// x [rows, K] quantized per group: codes [rows, K] (int8 for 4-bit weights, int16 for 8-bit ones),
// dx and sx [rows, K / 32].
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<int16_t> wide_codes;
  std::vector<float> dx, sx;
  int64_t rows, groups;
};

// One group of 32 values: codes, dx and sx as defined above (q = nearbyint(x * (L / amax))).
template <typename Code>
inline void quantize_group(const float* values, float levels, Code* codes, float* dx, float* sx) {
  float amax = 0.f;
  for (int64_t i = 0; i < kGroup; ++i) amax = std::max(amax, std::fabs(values[i]));
  const float inv = amax > 0.f ? levels / amax : 0.f;
  int32_t sum = 0;
#ifdef KVSERVE_GEMV_AVX2
  if constexpr (sizeof(Code) == 1) {  // eight at a time: the same products, rounded to nearest even
    const __m256 scale = _mm256_set1_ps(inv);
    __m256i q[4];
    for (int k = 0; k < 4; ++k) q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(values + 8 * k), scale));
    __m256i total = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    s = _mm_hadd_epi32(s, s);
    s = _mm_hadd_epi32(s, s);
    sum = _mm_cvtsi128_si32(s);
    // int32 -> int8 (|q| <= 127): pack pairs, then restore the order the lane-wise packs scramble
    const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i bytes = _mm256_packs_epi16(w01, w23);
    const __m256i ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes), ordered);
  } else
#endif
  {
    for (int64_t i = 0; i < kGroup; ++i) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(values[i] * inv));
      codes[i] = static_cast<Code>(q);
      sum += q;
    }
  }
  *dx = amax / levels;
  *sx = *dx * static_cast<float>(sum);
}

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t cols, bool wide) {
  const int64_t groups = cols / kGroup;
  QuantizedRows out{std::vector<int8_t>(wide ? 0 : rows * cols), std::vector<int16_t>(wide ? rows * cols : 0),
                    std::vector<float>(rows * groups), std::vector<float>(rows * groups), rows, groups};
  const float levels = wide ? 32767.f : 127.f;
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t begin, int64_t end) {
    float values[kGroup];
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const T* src = x + r * cols + g * kGroup;
        for (int64_t i = 0; i < kGroup; ++i) values[i] = static_cast<float>(src[i]);
        const int64_t at = r * cols + g * kGroup, k = r * groups + g;
        if (wide)
          quantize_group(values, levels, out.wide_codes.data() + at, &out.dx[k], &out.sx[k]);
        else
          quantize_group(values, levels, out.codes.data() + at, &out.dx[k], &out.sx[k]);
      }
    }
  });
  return out;
}

#ifdef KVSERVE_GEMV_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// float16 -> float32 for n values (F16C eight at a time where built for it).
inline void halves_to_floats(const at::Half* src, int64_t n, float* dst) {
  int64_t i = 0;
#ifdef KVSERVE_GEMV_AVX2
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// ---- 4-bit weights, eight rows interleaved ----

#ifdef KVSERVE_GEMV_AVX2
// acc[r] += d dx_r dot_r + m sx_r for group g of a block, the eight outputs as one vector: dots[r]
// are row r's integer sums sum(u xq) for the eight outputs.
template <int R>
inline void scale_group_sums(__m256* acc, const __m256i* dots, const at::Half* d, const at::Half* m,
                             const float* dx0, const float* sx0, int64_t groups, int64_t g) {
  const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * kBlock)));
  const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + g * kBlock)));
  for (int r = 0; r < R; ++r) {
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots[r]), _mm256_mul_ps(dv, _mm256_set1_ps(dx0[r * groups + g])),
                             acc[r]);
    acc[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(sx0[r * groups + g]), acc[r]);
  }
}

// The four activation bytes of row r that chunk c's low (high: `+ 16`) nibbles multiply, in every lane.
inline __m256i broadcast4(const int8_t* xg, int64_t offset) {
  int32_t four;
  std::memcpy(&four, xg + offset, 4);
  return _mm256_set1_epi32(four);
}
#endif

// Rows [first, first + R) of x times block b (its codes at `w`, scales and offsets at `d`, `m`):
// out[r][i] for the block's eight outputs i.
template <int R>
inline void block_rows(const QuantizedRows& xq, int64_t first, const uint8_t* w, const at::Half* d,
                       const at::Half* m, float* out, int64_t out_stride) {
  const int64_t groups = xq.groups, cols = groups * kGroup;
  const int8_t* x0 = xq.codes.data() + first * cols;
  const float* dx0 = xq.dx.data() + first * groups;
  const float* sx0 = xq.sx.data() + first * groups;
#ifdef KVSERVE_GEMV_AVX2
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * 128;
    const int8_t* xg = x0 + g * kGroup;
    __m256i sums[R];
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * c));
      const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      for (int r = 0; r < R; ++r) {
        const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, broadcast4(xg, r * cols + 4 * c)),
                                           _mm256_maddubs_epi16(hi, broadcast4(xg, r * cols + 16 + 4 * c)));
        sums[r] = c == 0 ? p : _mm256_add_epi16(sums[r], p);
      }
    }
    for (int r = 0; r < R; ++r) sums[r] = _mm256_madd_epi16(sums[r], ones);  // 16-bit pairs -> 32-bit sums
    scale_group_sums<R>(acc, sums, d, m, dx0, sx0, groups, g);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * out_stride, acc[r]);
#else
  float acc[R][kBlock] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * 128;
    for (int r = 0; r < R; ++r) {
      const int8_t* xg = x0 + r * cols + g * kGroup;
      for (int64_t i = 0; i < kBlock; ++i) {
        int32_t sum = 0;
        for (int c = 0; c < 4; ++c)
          for (int j = 0; j < 4; ++j) {
            const uint8_t byte = wg[32 * c + 4 * i + j];
            sum += (byte & 15) * xg[4 * c + j] + (byte >> 4) * xg[16 + 4 * c + j];
          }
        const float dw = static_cast<float>(d[g * kBlock + i]), mw = static_cast<float>(m[g * kBlock + i]);
        acc[r][i] += dw * dx0[r * groups + g] * static_cast<float>(sum) + mw * sx0[r * groups + g];
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int64_t i = 0; i < kBlock; ++i) out[r * out_stride + i] = acc[r][i];
#endif
}

#ifdef KVSERVE_GEMV_VNNI
// block_rows with dpbusd: a lane's four products of a chunk go straight into its 32-bit sum.
template <int R>
__attribute__((target("avx512vnni"))) void block_rows_vnni(const QuantizedRows& xq, int64_t first,
                                                           const uint8_t* w, const at::Half* d, const at::Half* m,
                                                           float* out, int64_t out_stride) {
  const int64_t groups = xq.groups, cols = groups * kGroup;
  const int8_t* x0 = xq.codes.data() + first * cols;
  const float* dx0 = xq.dx.data() + first * groups;
  const float* sx0 = xq.sx.data() + first * groups;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* wg = w + g * 128;
    const int8_t* xg = x0 + g * kGroup;
    __m256i sums[R];
    for (int r = 0; r < R; ++r) sums[r] = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * c));
      const __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      for (int r = 0; r < R; ++r)
        sums[r] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(sums[r], lo, broadcast4(xg, r * cols + 4 * c)), hi,
                                      broadcast4(xg, r * cols + 16 + 4 * c));
    }
    scale_group_sums<R>(acc, sums, d, m, dx0, sx0, groups, g);
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * out_stride, acc[r]);
}

inline bool cpu_has_vnni() {
  static const bool has = __builtin_cpu_supports("avx512vnni");
  return has;
}
#endif

template <int R>
inline void block_rows_best(const QuantizedRows& xq, int64_t first, const uint8_t* w, const at::Half* d,
                            const at::Half* m, float* out, int64_t out_stride) {
#ifdef KVSERVE_GEMV_VNNI
  if (cpu_has_vnni()) return block_rows_vnni<R>(xq, first, w, d, m, out, out_stride);
#endif
  block_rows<R>(xq, first, w, d, m, out, out_stride);
}

// out [rows, N] for blocks [begin, end): each block's codes read from memory once, then from L1 for
// every tile of rows.
inline void gemm_blocks_4bit(const QuantizedRows& xq, const uint8_t* codes, const at::Half* d, const at::Half* m,
                             int64_t n_out, int64_t begin, int64_t end, float* out) {
  const int64_t rows = xq.rows, groups = xq.groups;
  for (int64_t b = begin; b < end; ++b) {
    const uint8_t* w = codes + b * groups * 128;
    const at::Half* db = d + b * groups * kBlock;
    const at::Half* mb = m + b * groups * kBlock;
    for (int64_t first = 0; first < rows; first += kTile) {
      float* o = out + first * n_out + b * kBlock;
      switch (std::min<int64_t>(kTile, rows - first)) {
        case 1: block_rows_best<1>(xq, first, w, db, mb, o, n_out); break;
        case 2: block_rows_best<2>(xq, first, w, db, mb, o, n_out); break;
        case 3: block_rows_best<3>(xq, first, w, db, mb, o, n_out); break;
        default: block_rows_best<4>(xq, first, w, db, mb, o, n_out); break;
      }
    }
  }
}

// ---- 8-bit weights, one row per output ----

// Rows [0, R) of x (at `xq` row `first`) times weight row n: out[r] = sum over groups.
template <int R>
inline void dot_rows_8bit(const QuantizedRows& xq, int64_t first, const int8_t* row, const float* dw, float* out) {
  const int64_t groups = xq.groups, cols = groups * kGroup;
  const int16_t* x0 = xq.wide_codes.data() + first * cols;
  const float* dx0 = xq.dx.data() + first * groups;
#ifdef KVSERVE_GEMV_AVX2
  // two accumulators per row (even and odd groups), so consecutive FMAs do not wait on each other
  __m256 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {  // int8 codes widened to int16, times 16-bit x, pairs summed to int32
    const int8_t* q = row + g * kGroup;
    const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
    const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    __m256* a = acc[g & 1];
    for (int r = 0; r < R; ++r) {
      const int16_t* x = x0 + r * cols + g * kGroup;
      const __m256i sum = _mm256_add_epi32(
          _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
          _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
      a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(dw[g] * dx0[r * groups + g]), a[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(acc[0][r], acc[1][r]));
#else
  for (int r = 0; r < R; ++r) {
    const int16_t* x = x0 + r * cols;
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      for (int64_t j = 0; j < kGroup; ++j) sum += row[g * kGroup + j] * x[g * kGroup + j];
      acc += dw[g] * dx0[r * groups + g] * static_cast<float>(sum);
    }
    out[r] = acc;
  }
#endif
}

// out [rows, N] (float32) = x W^T for output rows [begin, end) of W; x's rows four at a time, each
// weight row read once from memory (then from L1 for the next four).
inline void gemv_rows_8bit(const QuantizedRows& xq, const int8_t* codes, const at::Half* d, int64_t n_out,
                           int64_t begin, int64_t end, float* out) {
  const int64_t rows = xq.rows, groups = xq.groups;
  std::vector<float> dw(groups);
  float results[4];
  for (int64_t n = begin; n < end; ++n) {
    const int8_t* row = codes + n * groups * kGroup;
    halves_to_floats(d + n * groups, groups, dw.data());
    for (int64_t first = 0; first < rows; first += 4) {
      const int64_t count = std::min<int64_t>(4, rows - first);
      switch (count) {
        case 1: dot_rows_8bit<1>(xq, first, row, dw.data(), results); break;
        case 2: dot_rows_8bit<2>(xq, first, row, dw.data(), results); break;
        case 3: dot_rows_8bit<3>(xq, first, row, dw.data(), results); break;
        default: dot_rows_8bit<4>(xq, first, row, dw.data(), results); break;
      }
      for (int64_t r = 0; r < count; ++r) out[(first + r) * n_out + n] = results[r];
    }
  }
}

// x [rows, K] (float32 or bfloat16, contiguous) -> float32 [rows, N]. 4-bit codes [N, K / 2] in the
// interleaved layout above (N a multiple of 8), 8-bit codes [N, K].
inline at::Tensor gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                       const std::optional<at::Tensor>& m, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kGroup == 0, "x must be contiguous [rows, K], K % 32 == 0");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == (bits == 4 ? at::kByte : at::kChar) &&
              codes.size(1) == (bits == 4 ? x.size(1) / 2 : x.size(1)) && (bits == 8 || codes.size(0) % kBlock == 0),
              "codes do not match x");
  const int64_t n_out = codes.size(0), groups = x.size(1) / kGroup;
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kHalf && d.numel() == n_out * groups, "bad scales");
  TORCH_CHECK(bits == 8 || (m.has_value() && m->is_contiguous() && m->scalar_type() == at::kHalf &&
                            m->numel() == n_out * groups), "4-bit codes need float16 offsets");
  const QuantizedRows xq = x.scalar_type() == at::kBFloat16
                               ? quantize_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), bits == 8)
                               : quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), bits == 8);
  at::Tensor out = at::empty({x.size(0), n_out}, x.options().dtype(at::kFloat));
  const at::Half* dp = d.data_ptr<at::Half>();
  float* o = out.data_ptr<float>();
  if (bits == 4) {
    const uint8_t* w = codes.data_ptr<uint8_t>();
    const at::Half* mp = m->data_ptr<at::Half>();
    at::parallel_for(0, n_out / kBlock, 2, [&](int64_t begin, int64_t end) {
      gemm_blocks_4bit(xq, w, dp, mp, n_out, begin, end, o);
    });
  } else {
    const int8_t* w = codes.data_ptr<int8_t>();
    at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) { gemv_rows_8bit(xq, w, dp, n_out, begin, end, o); });
  }
  return out;
}

}  // namespace quant_gemv
