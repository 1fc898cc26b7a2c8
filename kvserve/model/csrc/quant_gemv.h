// Matrix-vector products (a few rows) with group-quantized weights, in integer arithmetic (CPU).
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
// theirs; int16 pairs are summed in 32 bits (madd). Weights are read once for all rows.
//
// 4-bit codes of two consecutive groups share 32 bytes: byte j holds element j of the first group in
// its low nibble and element j of the second in its high one, so one 32-byte load, a shift and two
// masks give both groups' codes in order (a row with an odd number of groups has zeros in its last
// high nibbles).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#define KVSERVE_GEMV_AVX2 1
#endif

namespace quant_gemv {

constexpr int64_t kGroup = 32;
constexpr int64_t kMaxRows = 16;

// x [rows, K] quantized per group: codes [rows, K] (int8 for 4-bit weights, int16 for 8-bit ones),
// dx and sx [rows, K / 32].
struct QuantizedRows {
  std::vector<int8_t> codes;
  std::vector<int16_t> wide_codes;
  std::vector<float> dx, sx;
  int64_t rows, groups;
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t rows, int64_t cols, bool wide) {
  const int64_t groups = cols / kGroup;
  QuantizedRows out{std::vector<int8_t>(wide ? 0 : rows * cols), std::vector<int16_t>(wide ? rows * cols : 0),
                    std::vector<float>(rows * groups), std::vector<float>(rows * groups), rows, groups};
  const float levels = wide ? 32767.f : 127.f;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const T* src = x + r * cols + g * kGroup;
      float values[kGroup], amax = 0.f;
      for (int64_t i = 0; i < kGroup; ++i) {
        values[i] = static_cast<float>(src[i]);
        amax = std::max(amax, std::fabs(values[i]));
      }
      const float dx = amax / levels, inv = amax > 0.f ? levels / amax : 0.f;
      const int64_t at = r * cols + g * kGroup;
      int32_t sum = 0;
      for (int64_t i = 0; i < kGroup; ++i) {
        const int32_t q = static_cast<int32_t>(std::nearbyint(values[i] * inv));
        if (wide)
          out.wide_codes[at + i] = static_cast<int16_t>(q);
        else
          out.codes[at + i] = static_cast<int8_t>(q);
        sum += q;
      }
      out.dx[r * groups + g] = dx;
      out.sx[r * groups + g] = dx * static_cast<float>(sum);
    }
  }
  return out;
}

#ifdef KVSERVE_GEMV_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum over pairs of u (unsigned bytes) times x (signed bytes), as eight int32 lanes, as float.
inline __m256 dot_bytes(__m256i u, __m256i x) {
  const __m256i pairs = _mm256_maddubs_epi16(u, x);
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
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

#ifdef KVSERVE_GEMV_AVX2
// Rows [0, R) of x (at `xq` row `first`) times weight row n: out[r] = sum over groups.
template <int Bits, int R>
inline void dot_rows(const QuantizedRows& xq, int64_t first, const uint8_t* row, const float* dw, const float* mw,
                     float* out) {
  const int64_t groups = xq.groups, cols = groups * kGroup;
  // two accumulators per row (even and odd groups), so consecutive FMAs do not wait on each other
  __m256 acc[2][R];
  for (int r = 0; r < R; ++r) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
  const int8_t* x0 = xq.codes.data() + first * cols;
  const float* dx0 = xq.dx.data() + first * groups;
  const float* sx0 = xq.sx.data() + first * groups;
  if constexpr (Bits == 4) {
    auto accumulate = [&](__m256* a, __m256i u, int64_t g) {
      for (int r = 0; r < R; ++r) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + r * cols + g * kGroup));
        a[r] = _mm256_fmadd_ps(dot_bytes(u, x), _mm256_set1_ps(dw[g] * dx0[r * groups + g]), a[r]);
      }
    };
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    for (int64_t g = 0; g < groups; g += 2) {
      const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 16));
      accumulate(acc[0], _mm256_and_si256(both, low4), g);
      if (g + 1 < groups) accumulate(acc[1], _mm256_and_si256(_mm256_srli_epi16(both, 4), low4), g + 1);
    }
  } else {  // int8 codes widened to int16, times 16-bit x, summed in pairs to int32
    const int16_t* w0 = xq.wide_codes.data() + first * cols;
    for (int64_t g = 0; g < groups; ++g) {
      const int8_t* q = reinterpret_cast<const int8_t*>(row + g * kGroup);
      const __m256i lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      const __m256i hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
      __m256* a = acc[g & 1];
      for (int r = 0; r < R; ++r) {
        const int16_t* x = w0 + r * cols + g * kGroup;
        const __m256i sum = _mm256_add_epi32(
            _mm256_madd_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
            _mm256_madd_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16))));
        a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(dw[g] * dx0[r * groups + g]), a[r]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    float bias = 0.f;
    if constexpr (Bits == 4) {  // sum over groups of m sx, eight groups at a time
      const float* sx = sx0 + r * groups;
      __m256 b = _mm256_setzero_ps();
      int64_t g = 0;
      for (; g + 8 <= groups; g += 8) b = _mm256_fmadd_ps(_mm256_loadu_ps(mw + g), _mm256_loadu_ps(sx + g), b);
      bias = hsum(b);
      for (; g < groups; ++g) bias += mw[g] * sx[g];
    }
    out[r] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + bias;
  }
}
#else
template <int Bits, int R>
inline void dot_rows(const QuantizedRows& xq, int64_t first, const uint8_t* row, const float* dw, const float* mw,
                     float* out) {
  const int64_t groups = xq.groups, cols = groups * kGroup;
  for (int r = 0; r < R; ++r) {
    const int8_t* x = Bits == 4 ? xq.codes.data() + (first + r) * cols : nullptr;
    const int16_t* wide = Bits == 8 ? xq.wide_codes.data() + (first + r) * cols : nullptr;
    const float* dx = xq.dx.data() + (first + r) * groups;
    const float* sx = xq.sx.data() + (first + r) * groups;
    float acc = 0.f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t sum = 0;
      if constexpr (Bits == 4) {
        const uint8_t* w = row + (g / 2) * kGroup;  // the pair's bytes: low nibbles even g, high odd g
        const int shift = (g & 1) * 4;
        for (int64_t j = 0; j < kGroup; ++j) sum += ((w[j] >> shift) & 15) * x[g * kGroup + j];
        acc += mw[g] * sx[g];
      } else {
        const int8_t* w = reinterpret_cast<const int8_t*>(row + g * kGroup);
        for (int64_t j = 0; j < kGroup; ++j) sum += w[j] * wide[g * kGroup + j];
      }
      acc += dw[g] * dx[g] * static_cast<float>(sum);
    }
    out[r] = acc;
  }
}
#endif

// out [rows, N] (float32) = x W^T for output rows [begin, end) of W; x's rows four at a time, each
// weight row read once from memory (then from L1 for the next four).
template <int Bits>
void gemv_rows(const QuantizedRows& xq, const uint8_t* codes, const at::Half* d, const at::Half* m, int64_t n_out,
               int64_t begin, int64_t end, float* out) {
  const int64_t rows = xq.rows, groups = xq.groups;
  const int64_t row_bytes = Bits == 4 ? (groups + 1) / 2 * kGroup : groups * kGroup;
  std::vector<float> dw(groups), mw(groups);
  float results[4];
  for (int64_t n = begin; n < end; ++n) {
    const uint8_t* row = codes + n * row_bytes;
    halves_to_floats(d + n * groups, groups, dw.data());
    if (Bits == 4) halves_to_floats(m + n * groups, groups, mw.data());
    for (int64_t first = 0; first < rows; first += 4) {
      const int64_t count = std::min<int64_t>(4, rows - first);
      switch (count) {
        case 1: dot_rows<Bits, 1>(xq, first, row, dw.data(), mw.data(), results); break;
        case 2: dot_rows<Bits, 2>(xq, first, row, dw.data(), mw.data(), results); break;
        case 3: dot_rows<Bits, 3>(xq, first, row, dw.data(), mw.data(), results); break;
        default: dot_rows<Bits, 4>(xq, first, row, dw.data(), mw.data(), results); break;
      }
      for (int64_t r = 0; r < count; ++r) out[(first + r) * n_out + n] = results[r];
    }
  }
}

// x [rows, K] (float32 or bfloat16, contiguous) -> float32 [rows, N].
inline at::Tensor gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                       const std::optional<at::Tensor>& m, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % kGroup == 0, "x must be contiguous [rows, K], K % 32 == 0");
  TORCH_CHECK(x.size(0) <= kMaxRows, "at most ", kMaxRows, " rows");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(codes.is_contiguous() && codes.scalar_type() == (bits == 4 ? at::kByte : at::kChar) &&
              codes.size(1) == (bits == 4 ? (x.size(1) / kGroup + 1) / 2 * kGroup : x.size(1)),
              "codes do not match x");
  const int64_t n_out = codes.size(0), groups = x.size(1) / kGroup;
  TORCH_CHECK(d.is_contiguous() && d.scalar_type() == at::kHalf && d.numel() == n_out * groups, "bad scales");
  TORCH_CHECK(bits == 8 || (m.has_value() && m->is_contiguous() && m->scalar_type() == at::kHalf &&
                            m->numel() == n_out * groups), "4-bit codes need float16 offsets");
  const QuantizedRows xq = x.scalar_type() == at::kBFloat16
                               ? quantize_rows(x.data_ptr<at::BFloat16>(), x.size(0), x.size(1), bits == 8)
                               : quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1), bits == 8);
  at::Tensor out = at::empty({x.size(0), n_out}, x.options().dtype(at::kFloat));
  const uint8_t* w = reinterpret_cast<const uint8_t*>(codes.data_ptr());
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = bits == 4 ? m->data_ptr<at::Half>() : nullptr;
  float* o = out.data_ptr<float>();
  at::parallel_for(0, n_out, 16, [&](int64_t begin, int64_t end) {
    if (bits == 4)
      gemv_rows<4>(xq, w, dp, mp, n_out, begin, end, o);
    else
      gemv_rows<8>(xq, w, dp, mp, n_out, begin, end, o);
  });
  return out;
}

}  // namespace quant_gemv
