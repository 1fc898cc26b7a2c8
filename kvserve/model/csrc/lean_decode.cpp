// The per-layer work of a small decode batch between its int4 matmuls, fused (CPU).
//
// At batch 1 a decoder layer's arithmetic outside its four weight matmuls is a few thousand
// multiply-adds, yet as torch ops it is some fifty dispatches (residual add, RMSNorm, casts to the
// int4 kernel's bfloat16 input and back, RoPE's products and roll, slicing, SiLU and its product),
// each with its own allocation and, from Python, its interpreter overhead. Here a layer is two calls:
//
//   attention_input:  h = x + delta;  qkv = RoPE(W_qkv · rmsnorm(h))
//   attention_output: h' = h + W_o · attn;  out = W_down · (silu(gate) * up) of rmsnorm(h')
//
// (the caller writes K/V into the pool and runs the paged decode kernel in between, so every KV
// format keeps its own write and read). The matmuls call torch's int4 kernel
// (aten::_weight_int4pack_mm_for_cpu) on the same packed weights the layer's QuantizedLinear holds;
// an 8-bit matrix is packed as its two nibbles over a doubled input (quant_linear.py), so its input
// row is written twice. The elementwise work is plain loops in float32, rounded to the model dtype
// where the torch path rounds (the normalised row before its weight; SiLU's output), so a bfloat16
// model gets the torch path's numbers up to the order of a sum, and a float32 model is rounded to
// bfloat16 only where the kernel needs it.
#include <torch/extension.h>

#include <cmath>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kGroup = 32;  // the group size QuantizedLinear packs its weights with
using BF16 = at::BFloat16;

template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

at::Tensor int4_mm(const at::Tensor& input, const at::Tensor& packed, const at::Tensor& scales_zeros) {
  return at::_weight_int4pack_mm_for_cpu(input, packed, kGroup, scales_zeros);
}

// The kernel's bfloat16 input rows [rows, cols] (twice side by side when `doubled`).
at::Tensor kernel_input(int64_t rows, int64_t cols, bool doubled, const at::Tensor& like) {
  return at::empty({rows, doubled ? 2 * cols : cols}, like.options().dtype(at::kBFloat16));
}

inline void store_input(BF16* row, int64_t cols, bool doubled, int64_t c, float v) {
  const BF16 b(v);
  row[c] = b;
  if (doubled) row[cols + c] = b;
}

// out = bf16(weight * T(x / rms(x))) per row (RMSNorm as HF Llama computes it: normalise in float32,
// round to the model dtype, then scale).
template <typename T>
void rms_norm_into(const T* x, const T* weight, int64_t rows, int64_t cols, double eps, BF16* out, bool doubled) {
  const int64_t stride = doubled ? 2 * cols : cols;
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * cols;
    float sum = 0.f;
    for (int64_t c = 0; c < cols; ++c) {
      const float v = static_cast<float>(xr[c]);
      sum += v * v;
    }
    const float inv = 1.f / std::sqrt(sum / static_cast<float>(cols) + static_cast<float>(eps));
    BF16* orow = out + r * stride;
    for (int64_t c = 0; c < cols; ++c) {
      const float normed = round_to<T>(static_cast<float>(xr[c]) * inv);
      store_input(orow, cols, doubled, c, round_to<T>(static_cast<float>(weight[c]) * normed));
    }
  }
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
  for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  return h;
}

template <typename T>
at::Tensor rms_normed_input(const at::Tensor& h, const at::Tensor& weight, double eps, bool doubled) {
  const int64_t rows = h.size(0), cols = h.size(1);
  at::Tensor input = kernel_input(rows, cols, doubled, h);
  rms_norm_into<T>(h.data_ptr<T>(), weight.data_ptr<T>(), rows, cols, eps, input.data_ptr<BF16>(), doubled);
  return input;
}

// The kernel's bfloat16 output [rows, n] in the model dtype, plus the bias (in the model dtype, as
// F.linear's y + b there).
template <typename T>
at::Tensor from_kernel(const at::Tensor& y, const std::optional<at::Tensor>& bias) {
  at::Tensor out = std::is_same_v<T, BF16> ? y : y.to(c10::CppTypeToScalarType<T>::value);
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

// Rotate the first `rotated_heads` heads of qkv [rows, heads, D] in place (rotate-half RoPE):
// out[i] = x[i] cos[i] + x[partner(i)] signed_sin[i], signed_sin's first half negated (rope.py).
template <typename T>
void rope_in_place(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& signed_sin, int64_t rotated_heads,
                   int64_t head_dim) {
  const int64_t rows = qkv.size(0), row_stride = qkv.size(1), half = head_dim / 2;
  T* base = qkv.data_ptr<T>();
  const T* cos_base = cos.data_ptr<T>();
  const T* sin_base = signed_sin.data_ptr<T>();
  std::vector<float> x(head_dim);
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos_base + r * head_dim;
    const T* s = sin_base + r * head_dim;
    for (int64_t h = 0; h < rotated_heads; ++h) {
      T* head = base + r * row_stride + h * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) x[i] = static_cast<float>(head[i]);
      for (int64_t i = 0; i < head_dim; ++i) {
        const float partner = x[i < half ? i + half : i - half];
        head[i] = static_cast<T>(x[i] * static_cast<float>(c[i]) + partner * static_cast<float>(s[i]));
      }
    }
  }
}

template <typename T>
std::vector<at::Tensor> attention_input_impl(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                                             const at::Tensor& norm_weight, double eps, const at::Tensor& packed,
                                             const at::Tensor& scales_zeros, const std::optional<at::Tensor>& bias,
                                             bool doubled, const at::Tensor& cos, const at::Tensor& signed_sin,
                                             int64_t rotated_heads, int64_t head_dim) {
  at::Tensor h = residual_add<T>(x, delta);
  at::Tensor qkv = from_kernel<T>(int4_mm(rms_normed_input<T>(h, norm_weight, eps, doubled), packed, scales_zeros),
                                  bias);
  rope_in_place<T>(qkv, cos, signed_sin, rotated_heads, head_dim);
  return {h, qkv.view({qkv.size(0), -1, head_dim})};
}

template <typename T>
std::vector<at::Tensor> attention_output_impl(const at::Tensor& attn, const at::Tensor& h, const at::Tensor& o_packed,
                                              const at::Tensor& o_scales_zeros, bool o_doubled,
                                              const at::Tensor& norm_weight, double eps,
                                              const at::Tensor& gate_up_packed, const at::Tensor& gate_up_scales_zeros,
                                              bool gate_up_doubled, const at::Tensor& down_packed,
                                              const at::Tensor& down_scales_zeros, bool down_doubled) {
  const int64_t rows = attn.size(0), width = attn.size(1);
  at::Tensor o_input = kernel_input(rows, width, o_doubled, attn);
  {
    const T* a = attn.data_ptr<T>();
    BF16* in = o_input.data_ptr<BF16>();
    const int64_t stride = o_input.size(1);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < width; ++c) store_input(in + r * stride, width, o_doubled, c, static_cast<float>(a[r * width + c]));
  }
  at::Tensor o = from_kernel<T>(int4_mm(o_input, o_packed, o_scales_zeros), std::nullopt);
  at::Tensor h2 = residual_add<T>(h, o);
  at::Tensor gate_up = int4_mm(rms_normed_input<T>(h2, norm_weight, eps, gate_up_doubled), gate_up_packed,
                               gate_up_scales_zeros);  // bfloat16 [rows, 2 I]
  const int64_t inter = gate_up.size(1) / 2;
  at::Tensor act = kernel_input(rows, inter, down_doubled, attn);
  {
    const BF16* gu = gate_up.data_ptr<BF16>();
    BF16* out = act.data_ptr<BF16>();
    const int64_t stride = act.size(1);
    for (int64_t r = 0; r < rows; ++r) {
      const BF16* g = gu + r * 2 * inter;
      for (int64_t c = 0; c < inter; ++c) {
        const float gate = round_to<T>(static_cast<float>(g[c])), up = round_to<T>(static_cast<float>(g[inter + c]));
        const float silu = round_to<T>(gate / (1.f + std::exp(-gate)));
        store_input(out + r * stride, inter, down_doubled, c, round_to<T>(silu * up));
      }
    }
  }
  at::Tensor down = from_kernel<T>(int4_mm(act, down_packed, down_scales_zeros), std::nullopt);
  return {h2, down};
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.device().is_cpu(), name, " must be a contiguous 2-D CPU tensor");
}

std::vector<at::Tensor> attention_input(const at::Tensor& x, const std::optional<at::Tensor>& delta,
                                        const at::Tensor& norm_weight, double eps, const at::Tensor& packed,
                                        const at::Tensor& scales_zeros, const std::optional<at::Tensor>& bias,
                                        bool doubled, const at::Tensor& cos, const at::Tensor& signed_sin,
                                        int64_t rotated_heads, int64_t head_dim) {
  check_rows(x, "x");
  TORCH_CHECK(!delta.has_value() || (delta->sizes() == x.sizes() && delta->scalar_type() == x.scalar_type() &&
                                     delta->is_contiguous()), "delta must match x");
  TORCH_CHECK(cos.is_contiguous() && signed_sin.is_contiguous() && cos.numel() == x.size(0) * head_dim &&
              cos.scalar_type() == x.scalar_type() && signed_sin.scalar_type() == x.scalar_type(),
              "cos and signed_sin must be [rows, head_dim] in x's dtype");
  TORCH_CHECK(norm_weight.scalar_type() == x.scalar_type() && norm_weight.numel() == x.size(1), "bad norm weight");
  if (x.scalar_type() == at::kBFloat16)
    return attention_input_impl<BF16>(x, delta, norm_weight, eps, packed, scales_zeros, bias, doubled, cos,
                                      signed_sin, rotated_heads, head_dim);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "the lean decode step runs bfloat16 and float32 models");
  return attention_input_impl<float>(x, delta, norm_weight, eps, packed, scales_zeros, bias, doubled, cos, signed_sin,
                                     rotated_heads, head_dim);
}

std::vector<at::Tensor> attention_output(const at::Tensor& attn, const at::Tensor& h, const at::Tensor& o_packed,
                                         const at::Tensor& o_scales_zeros, bool o_doubled,
                                         const at::Tensor& norm_weight, double eps, const at::Tensor& gate_up_packed,
                                         const at::Tensor& gate_up_scales_zeros, bool gate_up_doubled,
                                         const at::Tensor& down_packed, const at::Tensor& down_scales_zeros,
                                         bool down_doubled) {
  check_rows(attn, "attn");
  check_rows(h, "h");
  TORCH_CHECK(attn.scalar_type() == h.scalar_type() && norm_weight.scalar_type() == h.scalar_type() &&
              norm_weight.numel() == h.size(1), "attn, h and the norm weight must share the model dtype");
  if (h.scalar_type() == at::kBFloat16)
    return attention_output_impl<BF16>(attn, h, o_packed, o_scales_zeros, o_doubled, norm_weight, eps, gate_up_packed,
                                       gate_up_scales_zeros, gate_up_doubled, down_packed, down_scales_zeros,
                                       down_doubled);
  TORCH_CHECK(h.scalar_type() == at::kFloat, "the lean decode step runs bfloat16 and float32 models");
  return attention_output_impl<float>(attn, h, o_packed, o_scales_zeros, o_doubled, norm_weight, eps, gate_up_packed,
                                      gate_up_scales_zeros, gate_up_doubled, down_packed, down_scales_zeros,
                                      down_doubled);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attention_input", &attention_input,
        "h = x + delta; RoPE'd q, k and v [rows, heads, D] of the int4 qkv matmul of rmsnorm(h)");
  m.def("attention_output", &attention_output,
        "h' = h + W_o attn; the MLP's output W_down (silu(gate) * up) of rmsnorm(h')");
}
