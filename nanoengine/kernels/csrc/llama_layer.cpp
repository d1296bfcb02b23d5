// A Llama decoder layer's step in one call from Python (chapter 10: where a step's time goes
// when it is not in the GEMMs).
// Built with the other csrc/ sources by cpu_native.py; the operator is
// torch.ops.nanoengine.llama_layer, used by backends/cpu_fused.py. The definition it must
// agree with, bit for bit, is models/llama.py's LlamaDecoderLayer.forward as the CPU backend
// runs it eagerly (backends/cpu.py's CpuAttention for the attention).
//
// Why: from Python, SmolLM2's 30 layers make about 25 operator calls and module calls each. Each
// costs a few microseconds of interpreter and argument parsing; decoding one sequence, the
// layers' Python forward was measured 10-15% slower per step than this one call
// (results/README.md, engine v4's choice of one CPU fast path), and a prefill pays the calls
// once per step too. This file adds no operator of its own: it makes the Python forward's
// operator calls -- the native norms, the rotary embedding, the GEMM rule of CpuLinearMethod,
// one paged_attention call (store-KV, decode rows, prefill chunks), silu_and_mul -- in the same
// order, from C++, through the dispatcher (so the profiler still names each). So the bits are
// the Python forward's, and a reader can set the two side by side line by line.
//
// What it does not take: steps with a token that has no cache slot, tensor parallelism, Qwen3's
// per-head norms, a bias on o_proj. backends/cpu_fused.py checks those before it routes a step here.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>

namespace {

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

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& packed,
                  const OptionalTensor& bias, int64_t few_rows_max) {
  if (x.size(0) <= few_rows_max) return few_rows_linear(x.contiguous(), weight, bias);
  if (packed.has_value() && packed->defined()) return packed_linear(x.contiguous(), *packed, bias);
  return at::linear(x, weight, bias);
}

// ---------------------------------------------------------------- the rotary embedding
// One head: out_i = x_i cos_i + x_(i +- d/2) sin_i (sin is signed, [-sin | sin]), each product
// rounded and then the sum, in float32: layers/rotary.py's rotate_half, operation by operation.
at::Tensor rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  static auto op = operator_named("nanoengine::rotate_half")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(x, cos, sin);
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  static auto op = operator_named("nanoengine::silu_and_mul").typed<at::Tensor(const at::Tensor&)>();
  return op.call(x);
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_decode_tokens,
                           const at::Tensor& decode_block_tables, const at::Tensor& decode_context_lens,
                           const at::Tensor& prefill_block_tables, const at::Tensor& prefill_cu_seqlens_q,
                           const at::Tensor& prefill_context_lens, double scale, bool widen) {
  static auto op = operator_named("nanoengine::paged_attention")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                                         at::Tensor&, const at::Tensor&, int64_t, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         double, bool)>();
  return op.call(q, k, v, k_cache, v_cache, slot_mapping, num_decode_tokens, decode_block_tables, decode_context_lens,
                 prefill_block_tables, prefill_cu_seqlens_q, prefill_context_lens, scale, widen);
}

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
  // What each call checks, it checks itself (shapes, dtypes, the step's decode rows and prefill chunks).
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

  // self_attn: qkv_proj, rotary on the query and key heads together, attention (store-KV first), o_proj
  const at::Tensor qkv = linear(x, qkv_weight, qkv_packed, qkv_bias, few_rows_max);  // (T, q | k | v)
  const at::Tensor qk =
      rotate_half(qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, d}), cos, sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, d});
  const at::Tensor attended =
      paged_attention(q, k, v, k_cache, v_cache, slot_mapping, num_decode_tokens, decode_block_tables,
                      decode_context_lens, prefill_block_tables, prefill_cu_seqlens_q, prefill_context_lens, scale, widen);
  const at::Tensor o = linear(attended.reshape({tokens, q_size}), o_weight, o_packed, std::nullopt, few_rows_max);

  // post_attention_layernorm with the residual add, then the MLP: down(silu(gate) * up)
  std::tie(x, stream) = add_rms_norm(o, stream, post_norm, eps);
  const at::Tensor gate_up = linear(x, gate_up_weight, gate_up_packed, std::nullopt, few_rows_max);
  return {linear(silu_and_mul(gate_up), down_weight, down_packed, std::nullopt, few_rows_max), stream};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("llama_layer(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv_weight, Tensor? qkv_packed, Tensor? qkv_bias, Tensor o_weight, Tensor? o_packed, "
        "Tensor gate_up_weight, Tensor? gate_up_packed, Tensor down_weight, Tensor? down_packed, int few_rows_max, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, int num_decode_tokens, "
        "Tensor decode_block_tables, Tensor decode_context_lens, Tensor prefill_block_tables, "
        "Tensor prefill_cu_seqlens_q, Tensor prefill_context_lens, bool widen, int num_heads, int num_kv_heads, "
        "float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(nanoengine, CPU, m) {
  m.impl("llama_layer", &llama_layer);
}

// oneDNN's packed weights are tensors of their own kind (MkldnnCPU): a call passing them
// dispatches on that key, so the same function is registered for it.
TORCH_LIBRARY_IMPL(nanoengine, MkldnnCPU, m) {
  m.impl("llama_layer", &llama_layer);
}
