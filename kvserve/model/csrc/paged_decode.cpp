// Decode attention read in place from the paged KV pool (CPU).
//
// One query token per request attends to its context, read block by block through the
// request's block table: no gathered copy of K/V, no padding, no mask (PagedAttention,
// Kwon et al. 2023). Work items are (request, KV head) pairs; the query heads that share a KV
// head (GQA) are scored together, so each K and V row is read and widened to float once.
// Scores, softmax and the weighted sum of V are float32, vectorised with ATen's Vectorized, a
// vector's worth of tokens at a time; rows are prefetched ahead of their use, since a request's
// blocks are scattered over the pool.
//
// Storages: K/V as floats (bfloat16, float16, float32); 1-byte codes with one scale per token (the
// fp8 and int8 KV formats, kvserve/cache/formats/token_scaled.py); 4-bit codes with a scale and a
// zero point per token (int4.py). A token's scale and zero are applied to its score and its
// probability (see RowScale) instead of to every element it holds.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace {

using Vec = at::vec::Vectorized<float>;

// The sum of a vector's lanes. ATen's generic (DEFAULT, e.g. aarch64) Vectorized::reduce_add does
// not compile in torch 2.13's headers, so that build adds the lanes itself.
inline float lane_sum(const Vec& v) {
#if defined(CPU_CAPABILITY_DEFAULT)
  float lanes[Vec::size()];
  v.store(lanes);
  float sum = 0.f;
  for (int64_t i = 0; i < Vec::size(); ++i) sum += lanes[i];
  return sum;
#else
  return v.reduce_add();
#endif
}

// lanes[i] = the sum of v[i]'s lanes, for Vec::size() vectors v: a transposing tree of shuffles and
// adds (45 instructions for 16 sums on AVX-512, where one lane_sum takes about ten).
inline Vec lane_sums(const Vec* v) {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    const __m512 a = v[2 * i], b = v[2 * i + 1];
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: [a, b, c, d], each the sum of its 4 values there
    const __m512d x = _mm512_castps_pd(pairs[2 * i]), y = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // then across the four 128-bit lanes: halves of 01 and 23, then of those
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i) {
    const __m256 a = v[2 * i], b = v[2 * i + 1];
    pairs[i] = _mm256_add_ps(_mm256_unpacklo_ps(a, b), _mm256_unpackhi_ps(a, b));
  }
  for (int i = 0; i < 2; ++i) {
    const __m256d x = _mm256_castps_pd(pairs[2 * i]), y = _mm256_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(x, y)), _mm256_castpd_ps(_mm256_unpackhi_pd(x, y)));
  }
  return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20), _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
#else
  float sums[Vec::size()];
  for (int64_t i = 0; i < Vec::size(); ++i) sums[i] = lane_sum(v[i]);
  return Vec::loadu(sums);
#endif
}

template <typename T>
inline Vec load_float(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else {
    Vec out;
    at::vec::load_to_float<T>(src, out);
    return out;
  }
}

// Asks for the cache lines of [start, start + bytes) ahead of their use.
inline void prefetch_lines(const void* start, int64_t bytes) {
  const char* p = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(p + offset);
}

// Tokens ahead of the one read whose key row is asked for (paged_decode_kernel's pass 1).
constexpr int64_t kPrefetchTokens = 48;

// A stored row is factor * row + zero (zero: asymmetric int4 only), so q.k = factor * (q.row) +
// zero * sum(q), and sum_t p_t v_t = sum_t (p_t factor_t) row_t + sum_t p_t zero_t.
struct RowScale {
  float factor, zero;
};

// Row readers: load(plane, block, offset, row) puts one token's K or V row (plane h < kv_heads is
// key head h, plane kv_heads + h its values) into `row` as floats and returns its RowScale.
template <typename T, int64_t kChunks>
struct FloatRows {
  const T* data;
  int64_t plane_stride, block_stride, dim;

  RowScale load(int64_t plane, int64_t block, int64_t offset, Vec* row) const {
    const T* src = data + plane * plane_stride + block * block_stride + offset * dim;
    for (int64_t c = 0; c < kChunks; ++c) row[c] = load_float(src + c * Vec::size());
    return {1.f, 0.f};
  }

  void prefetch(int64_t plane, int64_t block, int64_t offset) const {
    prefetch_lines(data + plane * plane_stride + block * block_stride + offset * dim, dim * sizeof(T));
  }
};

// fp8 codes: the byte's sign and magnitude bits moved into a bfloat16 (Fp8Format.decode), whose
// value times `unit` (2^(127 - fp8 bias)) times 2^exponent (the stored int8 scale) is the value.
struct Fp8Codes {
  int16_t multiplier, mask;
  float unit;
  float value(int8_t code) const {
    const uint32_t bits = static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(code * multiplier) & mask)) << 16;
    float out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
  float factor(int8_t exponent) const { return std::ldexp(unit, exponent); }
};

// int8 codes with a float16 scale per token (Int8Format).
struct Int8Codes {
  float value(int8_t code) const { return static_cast<float>(code); }
  float factor(at::Half scale) const { return static_cast<float>(scale); }
};

template <typename Codes, typename Scale, int64_t kChunks>
struct CodeRows {
  const int8_t* codes;
  const Scale* scales;
  int64_t plane_stride, block_stride, dim, scale_plane_stride, block_size;
  Codes decoder;

  RowScale load(int64_t plane, int64_t block, int64_t offset, Vec* row) const {
    const int8_t* src = codes + plane * plane_stride + block * block_stride + offset * dim;
    alignas(64) float widened[kChunks * Vec::size()];
    for (int64_t i = 0; i < kChunks * Vec::size(); ++i) widened[i] = decoder.value(src[i]);  // vectorised by the compiler
    for (int64_t c = 0; c < kChunks; ++c) row[c] = Vec::loadu(widened + c * Vec::size());
    return {decoder.factor(scales[plane * scale_plane_stride + block * block_size + offset]), 0.f};
  }

  void prefetch(int64_t plane, int64_t block, int64_t offset) const {
    prefetch_lines(codes + plane * plane_stride + block * block_stride + offset * dim, dim);
    if (offset == 0) prefetch_lines(scales + plane * scale_plane_stride + block * block_size, block_size * sizeof(Scale));
  }
};

// int4 codes, two per byte (channel j in the low nibble, j + head_dim/2 in the high one), with a
// float16 (scale, zero) per token (Int4Format): value = code * scale + zero.
template <int64_t kChunks>
struct Int4Rows {
  static constexpr int64_t kHalf = kChunks * Vec::size() / 2;
  const uint8_t* packed;
  const at::Half* params;  // [planes, blocks, block_size, 2]
  int64_t plane_stride, block_stride, params_plane_stride, block_size;

  RowScale load(int64_t plane, int64_t block, int64_t offset, Vec* row) const {
    const uint8_t* src = packed + plane * plane_stride + block * block_stride + offset * kHalf;
    alignas(64) float widened[2 * kHalf];
    for (int64_t j = 0; j < kHalf; ++j) {  // vectorised by the compiler
      widened[j] = static_cast<float>(src[j] & 0xF);
      widened[j + kHalf] = static_cast<float>(src[j] >> 4);
    }
    for (int64_t c = 0; c < kChunks; ++c) row[c] = Vec::loadu(widened + c * Vec::size());
    const at::Half* p = params + 2 * (plane * params_plane_stride + block * block_size + offset);
    return {static_cast<float>(p[0]), static_cast<float>(p[1])};
  }

  void prefetch(int64_t plane, int64_t block, int64_t offset) const {
    prefetch_lines(packed + plane * plane_stride + block * block_stride + offset * kHalf, kHalf);
    if (offset == 0)
      prefetch_lines(params + 2 * (plane * params_plane_stride + block * block_size), 2 * block_size * sizeof(at::Half));
  }
};

// kChunks = head_dim / Vec::size(), a compile-time constant so that a row's vectors and the loops
// over them unroll into registers (~1.5x faster than a runtime count at head_dim 64).
template <typename Q, int64_t kChunks, typename Rows>
void paged_decode_kernel(const at::Tensor& query, const Rows& rows, int64_t kv_heads, int64_t block_size,
                         const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window, double scale,
                         at::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t group = heads / kv_heads, table_width = block_tables.size(1);
  const Q* q_ptr = query.data_ptr<Q>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  Q* out_ptr = out.data_ptr<Q>();

  // The runner sorts decodes longest context first, so contiguous ranges of items would give one
  // thread all the long requests: each thread takes every `threads`-th item instead.
  const int64_t items = batch * kv_heads, threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t end_thread) {
    std::vector<Vec> q(group * kChunks), acc(group * kChunks), partial(group * Vec::size());
    Vec row[kChunks], values[Vec::size() * kChunks];
    std::vector<float> scores;
    for (int64_t thread = first_thread; thread < end_thread; ++thread)
    for (int64_t item = thread; item < items; item += threads) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* table = tables + b * table_width;
      float q_sum[64];  // for zero points
      for (int64_t g = 0; g < group; ++g) {
        const Q* qg = q_ptr + (b * heads + h * group + g) * dim;
        Vec sum(0.f);
        for (int64_t c = 0; c < kChunks; ++c) {
          q[g * kChunks + c] = load_float(qg + c * Vec::size()) * Vec(scale);
          sum = sum + q[g * kChunks + c];
        }
        q_sum[g] = lane_sum(sum);
      }
      scores.resize(group * n);
      // Pass 1: scores[g][t] = (q_g . k_t) * scale, Vec::size() tokens at a time: each key row is
      // read once for the group's heads, and each head's products are summed across lanes together
      // (lane_sums).
      constexpr int64_t kTokens = Vec::size();
      int64_t block = first / block_size, offset = first % block_size;  // of token t (no division per token)
      // Blocks sit anywhere in the pool, beyond the hardware prefetcher's reach: while token t's key
      // is read, the key row kPrefetchTokens later and t's value row (for pass 2) are asked for.
      const int64_t ahead_first = std::min(first + kPrefetchTokens, len);
      int64_t ahead_block = ahead_first / block_size, ahead_offset = ahead_first % block_size;
      for (int64_t t = first; t < ahead_first; ++t) rows.prefetch(h, table[t / block_size], t % block_size);
      for (int64_t t0 = first; t0 < len; t0 += kTokens) {
        const int64_t span = std::min<int64_t>(kTokens, len - t0);
        alignas(64) float factor[kTokens] = {}, zero[kTokens] = {};
        for (int64_t i = 0; i < span; ++i) {
          if (t0 + i + kPrefetchTokens < len) {
            rows.prefetch(h, table[ahead_block], ahead_offset);
            if (++ahead_offset == block_size) ahead_offset = 0, ++ahead_block;
          }
          rows.prefetch(kv_heads + h, table[block], offset);
          const RowScale k = rows.load(h, table[block], offset, row);
          if (++offset == block_size) offset = 0, ++block;
          factor[i] = k.factor;
          zero[i] = k.zero;
          for (int64_t g = 0; g < group; ++g) {
            Vec s = q[g * kChunks] * row[0];
            for (int64_t c = 1; c < kChunks; ++c) s = at::vec::fmadd(q[g * kChunks + c], row[c], s);
            partial[g * kTokens + i] = s;
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          for (int64_t i = span; i < kTokens; ++i) partial[g * kTokens + i] = Vec(0.f);
          const Vec sums = at::vec::fmadd(lane_sums(&partial[g * kTokens]), Vec::loadu(factor),
                                          Vec::loadu(zero) * Vec(q_sum[g]));
          sums.store(scores.data() + g * n + (t0 - first), span);
        }
      }
      // Softmax numerators exp(s - max) in place, and 1 / their sum, per query head.
      float inv_sum[64];
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * n;
        const float peak = at::vec::reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, s, n);
        at::vec::map([peak](Vec x) { return (x - Vec(peak)).exp_u20(); }, s, s, n);
        inv_sum[g] = 1.f / at::vec::reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s, n);
      }
      // Pass 2: acc[g] = sum_t p[g][t] v_t, kTokens rows at a time: widened once into `values`,
      // then each head's sum runs in registers over them.
      std::fill(acc.begin(), acc.end(), Vec(0.f));
      float zero_acc[64] = {};
      block = first / block_size, offset = first % block_size;
      for (int64_t t0 = first; t0 < len; t0 += kTokens) {
        const int64_t span = std::min<int64_t>(kTokens, len - t0);
        float factor[kTokens];
        for (int64_t i = 0; i < span; ++i) {
          const RowScale v = rows.load(kv_heads + h, table[block], offset, values + i * kChunks);
          if (++offset == block_size) offset = 0, ++block;
          factor[i] = v.factor;
          for (int64_t g = 0; g < group; ++g) zero_acc[g] += scores[g * n + (t0 + i - first)] * v.zero;
        }
        for (int64_t g = 0; g < group; ++g) {
          const float* p = scores.data() + g * n + (t0 - first);
          Vec sum[kChunks];
          for (int64_t c = 0; c < kChunks; ++c) sum[c] = acc[g * kChunks + c];
          for (int64_t i = 0; i < span; ++i) {
            const Vec weight(p[i] * factor[i]);
            for (int64_t c = 0; c < kChunks; ++c) sum[c] = at::vec::fmadd(weight, values[i * kChunks + c], sum[c]);
          }
          for (int64_t c = 0; c < kChunks; ++c) acc[g * kChunks + c] = sum[c];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        Q* o = out_ptr + (b * heads + h * group + g) * dim;
        float tmp[Vec::size()];
        for (int64_t c = 0; c < kChunks; ++c) {
          ((acc[g * kChunks + c] + Vec(zero_acc[g])) * Vec(inv_sum[g])).store(tmp);
          for (int64_t i = 0; i < Vec::size(); ++i) o[c * Vec::size() + i] = static_cast<Q>(tmp[i]);
        }
      }
    }
  });
}

// The head_dim / Vec::size() values compiled: head_dim 16-256 in the common sizes (64, 80, 96, 128...).
#define KVSERVE_CHUNK_COUNTS 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 32

// Calls make_and_run.template operator()<kChunks>() for the compiled count equal to `chunks`.
template <int64_t... kCounts, typename F>
bool with_chunks(int64_t chunks, F&& make_and_run) {
  return ((chunks == kCounts && (make_and_run.template operator()<kCounts>(), true)) || ...);
}

template <int64_t... kCounts>
bool is_compiled(int64_t chunks) { return ((chunks == kCounts) || ...); }

bool supports_head_dim(int64_t head_dim) {
  return head_dim % Vec::size() == 0 && is_compiled<KVSERVE_CHUNK_COUNTS>(head_dim / Vec::size());
}

void check_common(const at::Tensor& query, const at::Tensor& pool, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens) {
  TORCH_CHECK(query.dim() == 3 && pool.dim() == 4, "query [B, H, D], pool [2*KVH, blocks, block_size, D]");
  TORCH_CHECK(query.is_contiguous() && pool.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous());
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  TORCH_CHECK(supports_head_dim(query.size(2)), "head_dim ", query.size(2), " is not compiled in the paged decode kernel");
  TORCH_CHECK(query.size(1) % (pool.size(0) / 2) == 0 && query.size(1) / (pool.size(0) / 2) <= 64);
}

// Calls attend.template operator()<Q, kChunks>() with Q the query's dtype (float16 only where
// kHalfQueries) and kChunks its head_dim / Vec::size().
template <bool kHalfQueries, typename F>
void for_query(const at::Tensor& query, const char* name, F&& attend) {
  auto run = [&]<typename Q>() {
    with_chunks<KVSERVE_CHUNK_COUNTS>(query.size(2) / Vec::size(),
                                      [&]<int64_t kChunks>() { attend.template operator()<Q, kChunks>(); });
  };
  switch (query.scalar_type()) {
    case at::kFloat: run.template operator()<float>(); return;
    case at::kBFloat16: run.template operator()<at::BFloat16>(); return;
    case at::kHalf:
      if constexpr (kHalfQueries) {
        run.template operator()<at::Half>();
        return;
      }
      break;
    default: break;
  }
  TORCH_CHECK(false, name, ": unsupported query dtype ", query.scalar_type());
}

}  // namespace

// Decode attention over a float pool [2 * kv_heads, blocks, block_size, head_dim] of the query's dtype.
at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, int64_t window, double scale) {
  check_common(query, kv_cache, block_tables, seq_lens);
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "query and cache dtypes differ");
  at::Tensor out = at::empty_like(query);
  const int64_t kv_heads = kv_cache.size(0) / 2, block_size = kv_cache.size(2), dim = query.size(2);
  for_query<true>(query, "paged_decode", [&]<typename Q, int64_t kChunks>() {
    const FloatRows<Q, kChunks> rows{kv_cache.data_ptr<Q>(), kv_cache.size(1) * block_size * dim, block_size * dim, dim};
    paged_decode_kernel<Q, kChunks>(query, rows, kv_heads, block_size, block_tables, seq_lens, window, scale, out);
  });
  return out;
}

// Decode attention over 1-byte codes [2 * kv_heads, blocks, block_size, head_dim] (int8 view) with
// per-token scales [2 * kv_heads, blocks, block_size]: fp8 (fp8_multiplier > 0; int8 exponents) or
// int8 (fp8_multiplier == 0; float16 scales).
at::Tensor paged_decode_codes(const at::Tensor& query, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window, double scale,
                              int64_t fp8_multiplier, int64_t fp8_mask, double fp8_unit) {
  check_common(query, codes, block_tables, seq_lens);
  TORCH_CHECK(codes.scalar_type() == at::kChar && scales.is_contiguous());
  TORCH_CHECK(scales.scalar_type() == (fp8_multiplier > 0 ? at::kChar : at::kHalf), "unexpected scale dtype");
  at::Tensor out = at::empty_like(query);
  const int64_t kv_heads = codes.size(0) / 2, block_size = codes.size(2), dim = query.size(2);
  const int64_t plane_stride = codes.size(1) * block_size * dim, scale_plane_stride = codes.size(1) * block_size;
  for_query<false>(query, "paged_decode_codes", [&]<typename Q, int64_t kChunks>() {
    if (fp8_multiplier > 0) {
      const Fp8Codes decoder{static_cast<int16_t>(fp8_multiplier), static_cast<int16_t>(fp8_mask),
                             static_cast<float>(fp8_unit)};
      const CodeRows<Fp8Codes, int8_t, kChunks> rows{codes.data_ptr<int8_t>(), scales.data_ptr<int8_t>(), plane_stride,
                                                    block_size * dim, dim, scale_plane_stride, block_size, decoder};
      paged_decode_kernel<Q, kChunks>(query, rows, kv_heads, block_size, block_tables, seq_lens, window, scale, out);
    } else {
      const CodeRows<Int8Codes, at::Half, kChunks> rows{codes.data_ptr<int8_t>(), scales.data_ptr<at::Half>(),
                                                       plane_stride, block_size * dim, dim, scale_plane_stride,
                                                       block_size, Int8Codes{}};
      paged_decode_kernel<Q, kChunks>(query, rows, kv_heads, block_size, block_tables, seq_lens, window, scale, out);
    }
  });
  return out;
}

// Decode attention over int4 codes [2 * kv_heads, blocks, block_size, head_dim / 2] (uint8, two per
// byte) with float16 (scale, zero) per token [2 * kv_heads, blocks, block_size, 2].
at::Tensor paged_decode_int4(const at::Tensor& query, const at::Tensor& packed, const at::Tensor& params,
                             const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t window, double scale) {
  check_common(query, packed, block_tables, seq_lens);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.size(3) * 2 == query.size(2));
  TORCH_CHECK(params.scalar_type() == at::kHalf && params.is_contiguous() && params.size(3) == 2);
  at::Tensor out = at::empty_like(query);
  const int64_t kv_heads = packed.size(0) / 2, block_size = packed.size(2), half = packed.size(3);
  for_query<false>(query, "paged_decode_int4", [&]<typename Q, int64_t kChunks>() {
    const Int4Rows<kChunks> rows{packed.data_ptr<uint8_t>(), params.data_ptr<at::Half>(),
                                 packed.size(1) * block_size * half, block_size * half, packed.size(1) * block_size,
                                 block_size};
    paged_decode_kernel<Q, kChunks>(query, rows, kv_heads, block_size, block_tables, seq_lens, window, scale, out);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("paged_decode_codes", &paged_decode_codes);
  m.def("paged_decode_int4", &paged_decode_int4);
  m.def("supports_head_dim", &supports_head_dim);
}
