// A Llama decoder layer's step in one call from Python (chapter 10: where a step's time goes
// when it is not in the GEMMs).
// Built with the other csrc/ sources by cpu_native.py; the operator is
// torch.ops.nanoengine.llama_layer, used by backends/cpu_fused.py. The definition it must
// agree with, bit for bit, is models/llama.py's LlamaDecoderLayer.forward as the CPU backend
// runs it eagerly (backends/cpu.py's CpuAttention for the attention).
//
// Why: SmolLM2's 30 layers make about 25 operator calls each from Python: module calls, views,
// the norms, the rotary embedding, store-KV, attention, four GEMMs, the activation. Each costs
// a few microseconds of interpreter and argument parsing: decoding one sequence, together a
// large share of a token's time beside the GEMMs that read the weights (results/README.md); a
// prefill pays them once per step too. Here the same sequence of operators runs from C++: the
// GEMMs, norms and attention are the same registered operators the eager path calls (through
// the dispatcher, so the profiler still sees each one by name), the activation is ATen's own
// silu and mul, and the rotary embedding is a loop computing eager's products and sum in
// eager's order. So the bits are eager's.
//
// A step's tokens are its decodes first, then its prefill chunks (layers/attention.py's
// AttentionMetadata); decode rows go to the paged decode kernel, prefill chunks to the native
// prefill attention, as CpuAttention.forward splits them. What it does not take: steps with a
// token that has no cache slot, tensor parallelism, Qwen3's per-head norms, a bias on o_proj.
// backends/cpu_fused.py checks those before it routes a step here.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "avx2_vec.h"

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using nanoengine_cpu::load8;
using nanoengine_cpu::store8;
using OptionalTensor = std::optional<at::Tensor>;

// ---------------------------------------------------------------- the operators it calls
c10::OperatorHandle operator_named(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& bias) {
  static auto op = operator_named("nanoengine::few_rows_linear")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&)>();
  return op.call(x, weight, bias);
}

// oneDNN's product with a weight reordered ahead (kernels/cpu_gemm.py's packed_linear).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const OptionalTensor& bias) {
  static auto op = operator_named("mkldnn::_linear_pointwise")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&, c10::string_view,
                                         c10::List<std::optional<at::Scalar>>, std::optional<c10::string_view>)>();
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  static auto op = operator_named("nanoengine::rms_norm").typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op.call(x, weight, eps);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  static auto op = operator_named("nanoengine::add_rms_norm")
                       .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                 const at::Tensor&, double)>();
  return op.call(x, residual, weight, eps);
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  static auto op = operator_named("nanoengine::paged_decode_attention")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, double, bool)>();
  return op.call(query, k_cache, v_cache, block_tables, context_lens, scale, /*avx512=*/true);
}

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                   const at::Tensor& context_lens, double scale, bool widen) {
  static auto op = operator_named("nanoengine::paged_prefill_attention")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, double, bool)>();
  return op.call(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, widen);
}

// backends/cpu.py's cpu_product for a 2-D x: up to few_rows_max rows by the few-rows kernel,
// more by oneDNN with the packed weight, or F.linear where there is none.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& packed,
                  const OptionalTensor& bias, int64_t few_rows_max) {
  if (x.size(0) <= few_rows_max) return few_rows_linear(x.contiguous(), weight, bias);
  if (packed.has_value() && packed->defined()) return packed_linear(x.contiguous(), *packed, bias);
  return at::linear(x, weight, bias);
}

// ---------------------------------------------------------------- the rotary embedding
// One head: out_i = x_i cos_i + x_(i +- d/2) sin_i (sin is signed, [-sin | sin]), each product
// rounded and then the sum, in float32: layers/rotary.py's rotate_half, operation by operation.
template <typename T>
inline void rotate_head(const T* x, const float* cos, const float* sin, T* out, int64_t d) {
  const int64_t half = d / 2;
  if (half % 8 == 0) {
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 lo = load8(x + i), hi = load8(x + half + i);
      store8(out + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                    _mm256_mul_ps(hi, _mm256_loadu_ps(sin + i))));
      store8(out + half + i, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + i)),
                                           _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + i))));
    }
    return;
  }
  for (int64_t i = 0; i < d; ++i) {
    const float a = static_cast<float>(x[i]) * cos[i];
    const float b = static_cast<float>(x[i < half ? i + half : i - half]) * sin[i];
    out[i] = static_cast<T>(a + b);
  }
}

// x (T, heads, d) with each token's heads contiguous; cos, sin (T, 1, d) float32 -> a rotated copy.
template <typename T>
void rotate_into(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), token_stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  // A (token, head) pair is a task; one decoding sequence's 20 heads are too few to split.
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / heads, h = w % heads;
      rotate_head(xp + t * token_stride + h * d, cp + t * d, sp + t * d, op + w * d, d);
    }
  });
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.scalar_type() == at::kFloat) rotate_into<float>(x, cos, sin, out);
  else rotate_into<c10::BFloat16>(x, cos, sin, out);
  return out;
}

// The operator nanoengine::rotate_half: layers/rotary.py's rotate_half for any step (prefill
// rows too), one pass over the heads instead of eager's upcast, two products, a concatenation,
// a sum and a downcast, each a pass of its own over the step's queries and keys.
at::Tensor rotate_half_op(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotate_half: x (tokens, heads, head_dim) on the CPU with each token's heads contiguous expected, got "
              "sizes ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rotate_half: float32 or bfloat16 x only, got ", x.scalar_type());
  TORCH_CHECK(x.size(2) % 2 == 0, "rotate_half: head_dim must be even, got ", x.size(2));
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == x.size(0) &&
                    t->size(1) == 1 && t->size(2) == x.size(2),
                "rotate_half: cos and sin (tokens, 1, head_dim) contiguous float32 expected, got ", t->sizes());
  }
  return rotate(x, cos, sin);
}

// ---------------------------------------------------------------- the layer
void check(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
           const at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_decode_tokens,
           const at::Tensor& decode_block_tables, const at::Tensor& prefill_cu_seqlens_q, int64_t num_prefills,
           int64_t num_heads, int64_t num_kv_heads) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.device().is_cpu(), "llama_layer: hidden (tokens, hidden) on the CPU "
              "expected, got ", hidden.sizes());
  TORCH_CHECK(hidden.scalar_type() == at::kFloat || hidden.scalar_type() == at::kBFloat16,
              "llama_layer: float32 or bfloat16 activations only, got ", hidden.scalar_type());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == num_kv_heads &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && num_heads % num_kv_heads == 0,
              "llama_layer: contiguous caches (blocks, block_size, ", num_kv_heads, ", head_dim) expected, got ",
              k_cache.sizes());
  const int64_t tokens = hidden.size(0), d = k_cache.size(3);
  TORCH_CHECK(d % 2 == 0, "llama_layer: head_dim must be even, got ", d);
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == at::kFloat && table->is_contiguous() && table->dim() == 3 &&
                    table->size(0) == tokens && table->size(1) == 1 && table->size(2) == d,
                "llama_layer: cos and sin rows must be contiguous float32 (", tokens, ", 1, ", d, "), got ",
                table->sizes(), " ", table->scalar_type());
  }
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens && slot_mapping.scalar_type() == at::kLong,
              "llama_layer: slot_mapping (tokens,) int64 expected, got ", slot_mapping.sizes());
  TORCH_CHECK(0 <= num_decode_tokens && num_decode_tokens <= tokens && decode_block_tables.dim() == 2 &&
                  decode_block_tables.size(0) == num_decode_tokens,
              "llama_layer: one decode block-table row for each of the first ", num_decode_tokens, " of ", tokens,
              " tokens expected, got ", decode_block_tables.sizes());
  // The chunks must be the step's other tokens; the prefill operator checks the rest of their
  // layout, but only after store-KV has written, so this is checked here, before anything is.
  const at::Tensor& cu = prefill_cu_seqlens_q;
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) == num_prefills + 1 && cu.device().is_cpu() &&
                  (cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong),
              "llama_layer: prefill_cu_seqlens_q (", num_prefills, " prefills + 1,) int32 or int64 on the CPU "
              "expected, got ", cu.sizes(), " ", cu.scalar_type());
  // Read in place, not through indexing and item(): no tensors made, 30 layers a step.
  const auto at_index = [&cu](int64_t i) -> int64_t {
    return cu.scalar_type() == at::kInt ? cu.const_data_ptr<int32_t>()[i * cu.stride(0)]
                                        : cu.const_data_ptr<int64_t>()[i * cu.stride(0)];
  };
  const int64_t first = at_index(0), prefill_tokens = at_index(cu.size(0) - 1);
  TORCH_CHECK(first == 0 && num_decode_tokens + prefill_tokens == tokens, "llama_layer: ", num_decode_tokens,
              " decode tokens and prefill chunks from ", first, " to ", prefill_tokens, " do not make the step's ",
              tokens, " tokens");
}

// backends/cpu.py's CpuAttention.forward after store-KV: decode rows, then the prefill chunks.
at::Tensor attend(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, int64_t num_decode_tokens,
                  const at::Tensor& decode_block_tables, const at::Tensor& decode_context_lens,
                  const at::Tensor& prefill_block_tables, const at::Tensor& prefill_cu_seqlens_q,
                  const at::Tensor& prefill_context_lens, bool widen, double scale) {
  if (prefill_context_lens.size(0) == 0) {
    return paged_decode_attention(q.contiguous(), k_cache, v_cache, decode_block_tables, decode_context_lens, scale);
  }
  const at::Tensor prefill =
      paged_prefill_attention(q.narrow(0, num_decode_tokens, q.size(0) - num_decode_tokens).contiguous(), k_cache,
                              v_cache, prefill_block_tables, prefill_cu_seqlens_q, prefill_context_lens, scale, widen);
  if (num_decode_tokens == 0) return prefill;
  const at::Tensor decode = paged_decode_attention(q.narrow(0, 0, num_decode_tokens).contiguous(), k_cache, v_cache,
                                                   decode_block_tables, decode_context_lens, scale);
  return at::cat({decode, prefill}, 0);
}

// hidden (T, H): this layer's input; residual: the residual stream (None before the first layer).
// The step's first num_decode_tokens tokens are decodes, the rest prefill chunks (AttentionMetadata).
// Returns (the layer's output, the residual stream), as LlamaDecoderLayer.forward does.
std::tuple<at::Tensor, at::Tensor> llama_layer(
    const at::Tensor& hidden, const OptionalTensor& residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv_weight, const OptionalTensor& qkv_packed,
    const OptionalTensor& qkv_bias, const at::Tensor& o_weight, const OptionalTensor& o_packed,
    const at::Tensor& gate_up_weight, const OptionalTensor& gate_up_packed, const at::Tensor& down_weight,
    const OptionalTensor& down_packed, int64_t few_rows_max, const at::Tensor& cos, const at::Tensor& sin,
    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slot_mapping, int64_t num_decode_tokens,
    const at::Tensor& decode_block_tables, const at::Tensor& decode_context_lens,
    const at::Tensor& prefill_block_tables, const at::Tensor& prefill_cu_seqlens_q,
    const at::Tensor& prefill_context_lens, bool widen, int64_t num_heads, int64_t num_kv_heads, double scale) {
  check(hidden, cos, sin, k_cache, v_cache, slot_mapping, num_decode_tokens, decode_block_tables,
        prefill_cu_seqlens_q, prefill_context_lens.size(0), num_heads, num_kv_heads);
  const int64_t tokens = hidden.size(0), d = k_cache.size(3);
  const int64_t q_size = num_heads * d, kv_size = num_kv_heads * d;

  // input_layernorm, the residual add fused (the first layer has no residual yet)
  at::Tensor x, stream;
  if (residual.has_value() && residual->defined()) {
    std::tie(x, stream) = add_rms_norm(hidden, *residual, input_norm, eps);
  } else {
    x = rms_norm(hidden, input_norm, eps);
    stream = hidden;
  }

  // self_attn: qkv_proj, rotary on the query and key heads together, store-KV, attention, o_proj
  const at::Tensor qkv = linear(x, qkv_weight, qkv_packed, qkv_bias, few_rows_max);  // (T, q | k | v)
  const at::Tensor qk = rotate(qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, d}), cos, sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, d});
  const int64_t slots = k_cache.size(0) * k_cache.size(1);
  k_cache.view({slots, num_kv_heads, d}).index_copy_(0, slot_mapping, k);
  v_cache.view({slots, num_kv_heads, d}).index_copy_(0, slot_mapping, v);
  const at::Tensor attended = attend(q, k_cache, v_cache, num_decode_tokens, decode_block_tables, decode_context_lens,
                                     prefill_block_tables, prefill_cu_seqlens_q, prefill_context_lens, widen, scale);
  const at::Tensor o = linear(attended.reshape({tokens, q_size}), o_weight, o_packed, std::nullopt, few_rows_max);

  // post_attention_layernorm with the residual add, then the MLP: down(silu(gate) * up)
  std::tie(x, stream) = add_rms_norm(o, stream, post_norm, eps);
  const at::Tensor gate_up = linear(x, gate_up_weight, gate_up_packed, std::nullopt, few_rows_max);
  const int64_t inter = gate_up.size(1) / 2;
  const at::Tensor act = at::mul(at::silu(gate_up.narrow(1, 0, inter)), gate_up.narrow(1, inter, inter));
  return {linear(act, down_weight, down_packed, std::nullopt, few_rows_max), stream};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("rotate_half(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("llama_layer(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv_weight, Tensor? qkv_packed, Tensor? qkv_bias, Tensor o_weight, Tensor? o_packed, "
        "Tensor gate_up_weight, Tensor? gate_up_packed, Tensor down_weight, Tensor? down_packed, int few_rows_max, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, int num_decode_tokens, "
        "Tensor decode_block_tables, Tensor decode_context_lens, Tensor prefill_block_tables, "
        "Tensor prefill_cu_seqlens_q, Tensor prefill_context_lens, bool widen, int num_heads, int num_kv_heads, "
        "float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(nanoengine, CPU, m) {
  m.impl("rotate_half", &rotate_half_op);
  m.impl("llama_layer", &llama_layer);
}

// oneDNN's packed weights are tensors of their own kind (MkldnnCPU): a call passing them
// dispatches on that key, so the same function is registered for it.
TORCH_LIBRARY_IMPL(nanoengine, MkldnnCPU, m) {
  m.impl("llama_layer", &llama_layer);
}
