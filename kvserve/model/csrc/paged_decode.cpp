// Decode attention read in place from the paged KV pool (CPU).
//
// One query token per request attends to its context, read block by block through the
// request's block table: no gathered copy of K/V, no padding, no mask (PagedAttention,
// Kwon et al. 2023). Work items are (request, KV head) pairs; the query heads that share a KV
// head (GQA) are scored together, so each K and V row is read and widened to float once.
// Scores, softmax and the weighted sum of V are float32, vectorised with ATen's Vectorized.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

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

// kChunks = head_dim / Vec::size(), a compile-time constant so that a row's vectors and the loops
// over them unroll into registers (~1.5x faster than a runtime count at head_dim 64).
template <typename T, int64_t kChunks>
void paged_decode_kernel(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, int64_t window, double scale, at::Tensor& out) {
  const int64_t batch = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = kv_cache.size(0) / 2, num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t group = heads / kv_heads, table_width = block_tables.size(1);
  const T* q_ptr = query.data_ptr<T>();
  const T* cache = kv_cache.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const int64_t head_stride = num_blocks * block_size * dim;  // one KV head's plane of the pool
  const int64_t block_stride = block_size * dim;

  // The runner sorts decodes longest context first, so contiguous ranges of items would give one
  // thread all the long requests: each thread takes every `threads`-th item instead.
  const int64_t items = batch * kv_heads, threads = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, threads, 1, [&](int64_t first_thread, int64_t end_thread) {
    std::vector<Vec> q(group * kChunks), acc(group * kChunks);
    Vec row[kChunks];
    std::vector<float> scores;
    for (int64_t thread = first_thread; thread < end_thread; ++thread)
    for (int64_t item = thread; item < items; item += threads) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const int64_t n = len - first;
      const int64_t* table = tables + b * table_width;
      const T* keys = cache + h * head_stride;
      const T* values = cache + (kv_heads + h) * head_stride;
      for (int64_t g = 0; g < group; ++g) {
        const T* qg = q_ptr + (b * heads + h * group + g) * dim;
        for (int64_t c = 0; c < kChunks; ++c) q[g * kChunks + c] = load_float(qg + c * Vec::size()) * Vec(scale);
      }
      scores.resize(group * n);
      // Pass 1: scores[g][t] = (q_g . k_t) * scale
      for (int64_t t = first; t < len; ++t) {
        const T* k = keys + table[t / block_size] * block_stride + (t % block_size) * dim;
        for (int64_t c = 0; c < kChunks; ++c) row[c] = load_float(k + c * Vec::size());
        for (int64_t g = 0; g < group; ++g) {
          Vec s = q[g * kChunks] * row[0];
          for (int64_t c = 1; c < kChunks; ++c) s = at::vec::fmadd(q[g * kChunks + c], row[c], s);
          scores[g * n + (t - first)] = s.reduce_add();
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
      // Pass 2: acc[g] = sum_t p[g][t] v_t
      std::fill(acc.begin(), acc.end(), Vec(0.f));
      for (int64_t t = first; t < len; ++t) {
        const T* v = values + table[t / block_size] * block_stride + (t % block_size) * dim;
        for (int64_t c = 0; c < kChunks; ++c) row[c] = load_float(v + c * Vec::size());
        for (int64_t g = 0; g < group; ++g) {
          const Vec p(scores[g * n + (t - first)]);
          for (int64_t c = 0; c < kChunks; ++c) acc[g * kChunks + c] = at::vec::fmadd(p, row[c], acc[g * kChunks + c]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* o = out_ptr + (b * heads + h * group + g) * dim;
        float tmp[Vec::size()];
        for (int64_t c = 0; c < kChunks; ++c) {
          (acc[g * kChunks + c] * Vec(inv_sum[g])).store(tmp);
          for (int64_t i = 0; i < Vec::size(); ++i) o[c * Vec::size() + i] = static_cast<T>(tmp[i]);
        }
      }
    }
  });
}

// The head_dim / Vec::size() values compiled: head_dim 16-256 in the common sizes (64, 80, 96, 128...).
#define KVSERVE_CHUNK_COUNTS 1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 32

template <typename T, int64_t... kCounts>
bool run_compiled(int64_t chunks, const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, int64_t window, double scale, at::Tensor& out) {
  return ((chunks == kCounts &&
           (paged_decode_kernel<T, kCounts>(query, kv_cache, block_tables, seq_lens, window, scale, out), true)) || ...);
}

template <int64_t... kCounts>
bool is_compiled(int64_t chunks) { return ((chunks == kCounts) || ...); }

bool supports_head_dim(int64_t head_dim) {
  return head_dim % Vec::size() == 0 && is_compiled<KVSERVE_CHUNK_COUNTS>(head_dim / Vec::size());
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& query, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                        const at::Tensor& seq_lens, int64_t window, double scale) {
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 4, "query [B, H, D], kv_cache [2*KVH, blocks, block_size, D]");
  TORCH_CHECK(query.is_contiguous() && kv_cache.is_contiguous() && block_tables.is_contiguous() && seq_lens.is_contiguous());
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type(), "query and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong);
  TORCH_CHECK(supports_head_dim(query.size(2)), "head_dim ", query.size(2), " is not compiled in the paged decode kernel");
  TORCH_CHECK(query.size(1) % (kv_cache.size(0) / 2) == 0 && query.size(1) / (kv_cache.size(0) / 2) <= 64);
  at::Tensor out = at::empty_like(query);
  const int64_t chunks = query.size(2) / Vec::size();
  AT_DISPATCH_SWITCH(query.scalar_type(), "paged_decode",
      AT_DISPATCH_CASE(at::kFloat, [&] { run_compiled<float, KVSERVE_CHUNK_COUNTS>(chunks, query, kv_cache, block_tables, seq_lens, window, scale, out); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] { run_compiled<at::BFloat16, KVSERVE_CHUNK_COUNTS>(chunks, query, kv_cache, block_tables, seq_lens, window, scale, out); })
      AT_DISPATCH_CASE(at::kHalf, [&] { run_compiled<at::Half, KVSERVE_CHUNK_COUNTS>(chunks, query, kv_cache, block_tables, seq_lens, window, scale, out); }));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode);
  m.def("supports_head_dim", &supports_head_dim);
}
