// The per-layer work of a small decode batch between its quantized matmuls, fused (CPU).
//
// At batch 1 a decoder layer's arithmetic outside its four weight matmuls is a few thousand
// multiply-adds, yet as torch ops it is some fifty dispatches (residual add, RMSNorm, casts around
// the int4 kernel, RoPE's products and roll, slicing, SiLU and its product), each with its own
// allocation and, from Python, its interpreter overhead. Here a layer is two calls:
//
//   attention_input:  h = x + delta;  qkv = RoPE(W_qkv · rmsnorm(h))  (Qwen3: each q and k head RMS-normed before RoPE)
//   attention_output: h' = h + W_o · attn;  out = W_down · (silu(gate) * up) of rmsnorm(h')
//
// (the caller writes K/V into the pool and runs the paged decode kernel in between, so every KV
// format keeps its own write and read). The matmuls are quant_gemv.h's integer dot products over
// the codes the layer's QuantizedLinear holds, the same function `gemv` QuantizedLinear calls for
// small batches, so both paths multiply the same numbers; past the kernel's rows, the dense copy's
// oneDNN-packed weight, as the module path does there. The elementwise work is vector loops
// (ATen's Vectorized) in float32, rounded to the model dtype where the torch path rounds (the
// normalised row before its weight; SiLU's output; each matmul's output), split by rows across threads.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include "bf16_gemm.h"
#include "quant_gemv.h"

#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using BF16 = at::BFloat16;

// Rows one thread takes in the elementwise loops: a batch of decodes splits across threads from 8 rows.
constexpr int64_t kRowsPerTask = 4;

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// A QuantizedLinear's operands for quant_gemv::gemv (codes, scales, offsets), or a dense weight
// (cpu_linear.PrepackedLinear) alone: packed for bf16_gemm.h (4-D) or by oneDNN (2-D).
struct Linear {
  at::Tensor codes, d;
  std::optional<at::Tensor> m;
  int64_t bits;  // 0: `codes` is a oneDNN-packed dense weight; 16: a bf16_gemm.h one
};

Linear linear_of(const std::vector<at::Tensor>& parts) {
  if (parts.size() == 1) return Linear{parts[0], at::Tensor(), std::nullopt, parts[0].dim() == 4 ? 16 : 0};
  TORCH_CHECK(parts.size() == 3, "a linear is (codes, scales, offsets or an empty tensor) or (packed weight)");
  Linear out{parts[0], parts[1], std::nullopt, parts[0].scalar_type() == at::kByte ? 4 : 8};
  if (parts[2].numel() > 0) out.m = parts[2];
  return out;
}

// x W^T through oneDNN's packed weight, as PrepackedLinear runs it (mkldnn::_linear_pointwise).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                          c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

// [rows, N]: float32 from the int kernel, the model dtype from the dense weight (which rounds its
// output there, as to_model_dtype does the kernel's). `input`'s values are the model dtype's (a
// float32 tensor holds them rounded), so the dense weight takes them in that dtype exactly.
at::Tensor matmul(const at::Tensor& input, const Linear& w) {
  if (w.bits == 16) return bf16_gemm::matmul(input.to(at::kBFloat16), w.codes, std::nullopt);
  if (w.bits == 0) return packed_linear(input.to(w.codes.scalar_type()), w.codes);
  return quant_gemv::gemv(input, w.codes, w.d, w.m, w.bits);
}

// The dtype a matmul's input is handed over in: float32 for the int kernel (which quantizes it per
// group), the model dtype for a dense weight (which multiplies in it).
template <typename T>
at::ScalarType input_dtype(const Linear& w) {
  return w.bits == 0 || w.bits == 16 ? c10::CppTypeToScalarType<T>::value : at::kFloat;
}

// The elementwise loops take kPair values a step: two float vectors, or one vector of a 16-bit type.
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kPair = 2 * Vec::size();

template <typename T>
inline void load_pair(const T* src, Vec& a, Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a = Vec::loadu(src);
    b = Vec::loadu(src + Vec::size());
  } else {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src));
  }
}

template <typename T>
inline void store_pair(T* dst, const Vec& a, const Vec& b) {
  if constexpr (std::is_same_v<T, float>) {
    a.store(dst);
    b.store(dst + Vec::size());
  } else {
    at::vec::convert_from_float<T>(a, b).store(dst);
  }
}

// a and b rounded to T's precision (they stay floats), as static_cast<T> rounds (to nearest even).
template <typename T>
inline void round_pair(Vec& a, Vec& b) {
  if constexpr (!std::is_same_v<T, float>) std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
}

// out = Out(T(weight * T(x / rms(x)))) for one row of `cols` (RMSNorm as HF Llama computes it:
// normalise in float32, round to the model dtype, then scale), in Out (float32 or T).
template <typename T, typename Out>
inline void rms_row(const T* xr, const T* w, Out* orow, int64_t cols, float eps) {
  Vec squares(0.f), a, b, wa, wb;
  int64_t c = 0;
  for (; c + kPair <= cols; c += kPair) {
    load_pair(xr + c, a, b);
    squares = at::vec::fmadd(a, a, at::vec::fmadd(b, b, squares));
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& u, Vec& v) { return u + v; }, squares);
  for (int64_t t = c; t < cols; ++t) sum += static_cast<float>(xr[t]) * static_cast<float>(xr[t]);
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + eps);
  for (c = 0; c + kPair <= cols; c += kPair) {
    load_pair(xr + c, a, b);
    a = a * Vec(inv);
    b = b * Vec(inv);
    round_pair<T>(a, b);
    load_pair(w + c, wa, wb);
    a = wa * a;
    b = wb * b;
    round_pair<T>(a, b);
    store_pair(orow + c, a, b);
  }
  for (; c < cols; ++c)
    orow[c] = static_cast<Out>(round_to<T>(static_cast<float>(w[c]) * round_to<T>(static_cast<float>(xr[c]) * inv)));
}

// rms_row over `rows` rows of x [rows, cols], split across threads.
template <typename T, typename Out>
void rms_rows(const T* x, const T* w, Out* o, int64_t rows, int64_t cols, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_row(x + r * cols, w, o + r * cols, cols, eps);
  });
}

template <typename T>
at::Tensor rms_normed(const at::Tensor& h, const at::Tensor& weight, double eps, at::ScalarType out_dtype) {
  const int64_t rows = h.size(0), cols = h.size(1);
  at::Tensor out = at::empty({rows, cols}, h.options().dtype(out_dtype));
  if (out_dtype == at::kFloat)
    rms_rows(h.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<float>(), rows, cols, static_cast<float>(eps));
  else
    rms_rows(h.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(), rows, cols, static_cast<float>(eps));
  return out;
}

// h = x + delta in the model dtype (x itself when there is no delta).
template <typename T>
at::Tensor residual_add(const at::Tensor& x, const std::optional<at::Tensor>& delta) {
  if (!delta.has_value()) return x;
  at::Tensor h = at::empty_like(x);
  const T* a = x.data_ptr<T>();
  const T* b = delta->data_ptr<T>();
  T* o = h.data_ptr<T>();
  const int64_t n = x.numel();
  int64_t i = 0;
  for (Vec a0, a1, b0, b1; i + kPair <= n; i += kPair) {
    load_pair(a + i, a0, a1);
    load_pair(b + i, b0, b1);
    store_pair(o + i, a0 + b0, a1 + b1);
  }
  for (; i < n; ++i) o[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  return h;
}

// A matmul's float32 output [rows, n] in the model dtype, plus the bias (in the model dtype, as
// QuantizedLinear's y + b).
template <typename T>
at::Tensor to_model_dtype(const at::Tensor& y, const std::optional<at::Tensor>& bias) {
  at::Tensor out = std::is_same_v<T, float> ? y : y.to(c10::CppTypeToScalarType<T>::value);
  if (bias.has_value()) {
    T* o = out.data_ptr<T>();
    const T* b = bias->data_ptr<T>();
    const int64_t rows = out.size(0), n = out.size(1);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < n; ++c)
        o[r * n + c] = static_cast<T>(static_cast<float>(o[r * n + c]) + static_cast<float>(b[c]));
  }
  return out;
}

// Rotate the first `rotated_heads` heads of qkv [rows, heads * D] in place (rotate-half RoPE):
// out[i] = x[i] cos[i] + x[partner(i)] signed_sin[i], signed_sin's first half negated (rope.py).
// A head whose halves are whole vectors is rotated a vector at a time (partner vectors), others
// one value at a time.
template <typename T>
void rope_in_place(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t rotated_heads,
                   int64_t head_dim) {
  constexpr int64_t kMaxChunks = 512 / Vec::size();
  const int64_t rows = qkv.size(0), row_stride = qkv.size(1), half = head_dim / 2, chunks = head_dim / Vec::size();
  const bool by_vector = head_dim % (2 * kPair) == 0 && chunks <= kMaxChunks;
  T* base = qkv.data_ptr<T>();
  const T* cos_base = cos.data_ptr<T>();
  const T* sin_base = signed_sin.data_ptr<T>();
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> x(head_dim);
    Vec xs[kMaxChunks], cs[kMaxChunks], ss[kMaxChunks];
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos_base + r * head_dim;
      const T* s = sin_base + r * head_dim;
      if (by_vector)
        for (int64_t k = 0; k < chunks; k += 2) {
          load_pair(c + k * Vec::size(), cs[k], cs[k + 1]);
          load_pair(s + k * Vec::size(), ss[k], ss[k + 1]);
        }
      for (int64_t h = 0; h < rotated_heads; ++h) {
        T* head = base + r * row_stride + h * head_dim;
        if (by_vector) {
          for (int64_t k = 0; k < chunks; k += 2) load_pair(head + k * Vec::size(), xs[k], xs[k + 1]);
          for (int64_t k = 0; k < chunks; k += 2) {
            const int64_t p = (k + chunks / 2) % chunks;
            store_pair(head + k * Vec::size(), xs[k] * cs[k] + xs[p] * ss[k], xs[k + 1] * cs[k + 1] + xs[p + 1] * ss[k + 1]);
          }
          continue;
        }
        for (int64_t i = 0; i < head_dim; ++i) x[i] = static_cast<float>(head[i]);
        for (int64_t i = 0; i < head_dim; ++i) {
          const float partner = x[i < half ? i + half : i - half];
          head[i] = static_cast<T>(x[i] * static_cast<float>(c[i]) + partner * static_cast<float>(s[i]));
        }
      }
    }
  });
}

// act = Out(T(T(silu(T(gate))) * T(up))) per row of gate_up [rows, 2 I] (in U: float32 from the int
// kernel, T from a dense weight), as F.silu(gate) * up computes it in the model dtype; silu(x) =
// x / (1 + exp(-x)), the formula and vectorised exp torch's CPU kernel uses.
template <typename T, typename U, typename Out>
void silu_mul_rows(const U* gate_up, Out* act, int64_t rows, int64_t inter) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    const Vec one(1.f);
    for (int64_t r = begin; r < end; ++r) {
      const U* g = gate_up + r * 2 * inter;
      Out* o = act + r * inter;
      int64_t c = 0;
      for (Vec g0, g1, u0, u1; c + kPair <= inter; c += kPair) {
        load_pair(g + c, g0, g1);
        load_pair(g + inter + c, u0, u1);
        round_pair<T>(g0, g1);
        round_pair<T>(u0, u1);
        Vec s0 = g0 / (one + g0.neg().exp()), s1 = g1 / (one + g1.neg().exp());
        round_pair<T>(s0, s1);
        s0 = s0 * u0;
        s1 = s1 * u1;
        round_pair<T>(s0, s1);
        store_pair(o + c, s0, s1);
      }
      for (; c < inter; ++c) {
        const float gate = round_to<T>(static_cast<float>(g[c])), up = round_to<T>(static_cast<float>(g[inter + c]));
        const float silu = round_to<T>(gate / (1.f + std::exp(-gate)));
        o[c] = static_cast<Out>(round_to<T>(silu * up));
      }
    }
  });
}

template <typename T>
at::Tensor silu_mul(const at::Tensor& gate_up, at::ScalarType out_dtype) {
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor act = at::empty({rows, inter}, gate_up.options().dtype(out_dtype));
  auto run = [&]<typename U>(const U* gu) {
    if (out_dtype == at::kFloat) silu_mul_rows<T>(gu, act.data_ptr<float>(), rows, inter);
    else silu_mul_rows<T>(gu, act.data_ptr<T>(), rows, inter);
  };
  if (gate_up.scalar_type() == at::kFloat) run(gate_up.data_ptr<float>());
  else run(gate_up.data_ptr<T>());
  return act;
}

template <typename T>
std::vector<at::Tensor> attention_input_impl(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                                             const at::Tensor& norm_weight, double eps, const Linear& qkv_proj,
                                             const std::optional<at::Tensor>& bias, const at::Tensor& cos,
                                             const at::Tensor& signed_sin, int64_t rotated_heads, int64_t head_dim,
                                             const std::optional<at::Tensor>& qk_norm, int64_t query_heads) {
  at::Tensor h = residual_add<T>(x, delta);
  at::Tensor qkv = to_model_dtype<T>(matmul(rms_normed<T>(h, norm_weight, eps, input_dtype<T>(qkv_proj)), qkv_proj), bias);
  if (qk_norm.has_value()) {  // Qwen3: every query head by qk_norm[0], every key head by qk_norm[1], in place
    T* base = qkv.data_ptr<T>();
    const T* weights = qk_norm->data_ptr<T>();
    const float e = static_cast<float>(eps);
    const int64_t row_stride = qkv.size(1);
    at::parallel_for(0, qkv.size(0), kRowsPerTask, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t h = 0; h < rotated_heads; ++h) {
          T* head = base + r * row_stride + h * head_dim;
          rms_row(head, h < query_heads ? weights : weights + head_dim, head, head_dim, e);
        }
    });
  }
  rope_in_place<T>(qkv, cos, signed_sin, rotated_heads, head_dim);
  return {h, qkv.view({qkv.size(0), -1, head_dim})};
}

template <typename T>
std::vector<at::Tensor> attention_output_impl(const at::Tensor& attn, const at::Tensor& h, const Linear& o_proj,
                                              const at::Tensor& norm_weight, double eps, const Linear& gate_up_proj,
                                              const Linear& down_proj) {
  at::Tensor o = to_model_dtype<T>(matmul(attn, o_proj), std::nullopt);
  at::Tensor h2 = residual_add<T>(h, o);
  // [rows, 2 I]: float32 from the int kernel, the model dtype from the dense weight
  at::Tensor gate_up = matmul(rms_normed<T>(h2, norm_weight, eps, input_dtype<T>(gate_up_proj)), gate_up_proj);
  at::Tensor act = silu_mul<T>(gate_up, input_dtype<T>(down_proj));
  return {h2, to_model_dtype<T>(matmul(act, down_proj), std::nullopt)};
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(), name, " must be a contiguous 2-D CPU tensor");
}

std::vector<at::Tensor> attention_input(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                                        const at::Tensor& norm_weight, double eps,
                                        const std::vector<at::Tensor>& qkv_proj, const std::optional<at::Tensor>& bias,
                                        const at::Tensor& cos, const at::Tensor& signed_sin, int64_t rotated_heads,
                                        int64_t head_dim, const std::optional<at::Tensor>& qk_norm, int64_t query_heads) {
  check_rows(x, "x");
  TORCH_CHECK(!delta.has_value() || (delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type() &&
                                     delta->is_contiguous()), "delta must match x");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.numel() == x.size(0) * head_dim &&
              cos.scalar_type() == x.scalar_type() && signed_sin.scalar_type() == x.scalar_type(),
              "cos and signed_sin must be [rows, head_dim] in x's dtype");
  TORCH_CHECK(norm_weight.scalar_type() == x.scalar_type() && norm_weight.numel() == x.size(1), "bad norm weight");
  TORCH_CHECK(!qk_norm.has_value() || (qk_norm->scalar_type() == x.scalar_type() && qk_norm->is_contiguous() &&
                                       qk_norm->numel() == 2 * head_dim && 0 < query_heads &&
                                       query_heads < rotated_heads), "qk_norm must be [2, head_dim] in x's dtype");
  const Linear w = linear_of(qkv_proj);
  if (x.scalar_type() == at::kBFloat16)
    return attention_input_impl<BF16>(x, delta, norm_weight, eps, w, bias, cos, signed_sin, rotated_heads, head_dim,
                                      qk_norm, query_heads);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "the lean decode step runs bfloat16 and float32 models");
  return attention_input_impl<float>(x, delta, norm_weight, eps, w, bias, cos, signed_sin, rotated_heads, head_dim,
                                     qk_norm, query_heads);
}

std::vector<at::Tensor> attention_output(const at::Tensor& attn, const at::Tensor& h,
                                         const std::vector<at::Tensor>& o_proj, const at::Tensor& norm_weight,
                                         double eps, const std::vector<at::Tensor>& gate_up_proj,
                                         const std::vector<at::Tensor>& down_proj) {
  check_rows(attn, "attn");
  check_rows(h, "h");
  TORCH_CHECK(attn.scalar_type() == h.scalar_type() && norm_weight.scalar_type() == h.scalar_type() &&
              norm_weight.numel() == h.size(1), "attn, h and the norm weight must share the model dtype");
  const Linear o = linear_of(o_proj), gate_up = linear_of(gate_up_proj), down = linear_of(down_proj);
  if (h.scalar_type() == at::kBFloat16)
    return attention_output_impl<BF16>(attn, h, o, norm_weight, eps, gate_up, down);
  TORCH_CHECK(h.scalar_type() == at::kFloat, "the lean decode step runs bfloat16 and float32 models");
  return attention_output_impl<float>(attn, h, o, norm_weight, eps, gate_up, down);
}

// The step's keys and values, heads [first, first + planes) of qkv [rows, heads, D], copied into a
// full-precision pool [planes, blocks, block_size, D] of the same dtype at each row's slot (what
// FullPrecisionFormat.write does, without its concatenation, transpose and index_copy).
void write_kv(at::Tensor& pool, const at::Tensor& qkv, const at::Tensor& slots, int64_t first) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous() && qkv.dim() == 3 && qkv.is_contiguous() &&
              pool.scalar_type() == qkv.scalar_type() && pool.size(3) == qkv.size(2), "pool and qkv do not match");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == qkv.size(0), "one int64 slot per row");
  const int64_t planes = pool.size(0), dim = pool.size(3), slots_per_plane = pool.size(1) * pool.size(2);
  TORCH_CHECK(first + planes <= qkv.size(1), "not enough heads");
  const int64_t bytes = dim * qkv.element_size();
  const auto* slot = slots.data_ptr<int64_t>();
  auto* dst = static_cast<char*>(pool.data_ptr());
  const auto* src = static_cast<const char*>(qkv.data_ptr());
  for (int64_t r = 0; r < qkv.size(0); ++r) {
    TORCH_CHECK(slot[r] >= 0 && slot[r] < slots_per_plane, "slot out of range");
    for (int64_t p = 0; p < planes; ++p)
      std::memcpy(dst + (p * slots_per_plane + slot[r]) * bytes, src + ((r * qkv.size(1)) + first + p) * bytes, bytes);
  }
}

// QuantizedLinear's small-batch matmul: x [rows, K] (float32 or bfloat16) -> float32 [rows, N].
at::Tensor gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const std::optional<at::Tensor>& m) {
  check_rows(x, "x");
  return quant_gemv::gemv(x, codes, d, m, codes.scalar_type() == at::kByte ? 4 : 8);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention_input", &attention_input,
        "h = x + delta; RoPE'd q, k and v [rows, heads, D] of the qkv matmul of rmsnorm(h) (q/k heads normed by "
        "qk_norm [2, D] first, where given)");
  m.def("attention_output", &attention_output,
        "h' = h + W_o attn; the MLP's output W_down (silu(gate) * up) of rmsnorm(h')");
  m.def("write_kv", &write_kv, "copy the step's K/V heads of qkv into a full-precision pool at their slots");
  m.def("gemv", &gemv, "x [rows, K] times group-quantized W^T [K, N] -> float32 [rows, N] (quant_gemv.h)");
  m.def("bf16_available", &bf16_gemm::available, "whether this CPU and build run bf16_gemm.h (AVX512-BF16)");
  m.def("bf16_fits", &bf16_gemm::fits, "whether an [N, K] weight fits bf16_gemm.h's layout");
  m.def("bf16_pack", &bf16_gemm::pack, "W [N, K] bf16 -> bf16_gemm.h's layout [N/16, K/2, 16, 2]");
  m.def("bf16_matmul", &bf16_gemm::matmul, "x [rows, K] bf16 times a bf16_pack'ed W^T (+ bias) -> bf16 [rows, N]");
}
