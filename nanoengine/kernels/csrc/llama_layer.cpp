// A Llama decoder layer's step in one call from Python (chapter 10), used by backends/cpu_fused.py
// (why: its docstring). It must agree, bit for bit, with models/llama.py's LlamaDecoderLayer.forward
// as the CPU backend runs it eagerly: it makes that forward's operator calls -- the native norms,
// the rotary embedding, the GEMM rule of CpuLinearMethod, one paged_attention call, silu_and_mul --
// in the same order, from C++, through the dispatcher (so the profiler still names each).
//
// What it does not take: steps with a token that has no cache slot, tensor parallelism, Qwen3's
// per-head norms, a bias on o_proj. backends/cpu_fused.py checks those before it routes a step here.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace nanoengine_cpu {
namespace {

using OptionalTensor = std::optional<at::Tensor>;

// oneDNN's product with a weight reordered ahead (kernels/cpu_gemm.py's packed_linear).
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const OptionalTensor& bias) {
  static const auto op = operator_named<at::Tensor(const at::Tensor&, const at::Tensor&, const OptionalTensor&,
                                                   c10::string_view, c10::List<std::optional<at::Scalar>>,
                                                   std::optional<c10::string_view>)>("mkldnn::_linear_pointwise");
  return op.call(x, packed, bias, "none", c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
}

// CpuLinearMethod's rule: up to few_rows_max rows the few-rows kernel, more oneDNN's packed GEMM.
at::Tensor linear(const at::Tensor& x, const at::Tensor& weight, const OptionalTensor& packed,
                  const OptionalTensor& bias, int64_t few_rows_max) {
  static const auto few_rows = operator_named<decltype(few_rows_linear)>("nanoengine::few_rows_linear");
  if (x.size(0) <= few_rows_max) return few_rows.call(x.contiguous(), weight, bias);
  if (packed.has_value() && packed->defined()) return packed_linear(x.contiguous(), *packed, bias);
  return at::linear(x, weight, bias);
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
  static const auto norm = operator_named<decltype(rms_norm)>("nanoengine::rms_norm");
  static const auto add_norm = operator_named<decltype(add_rms_norm)>("nanoengine::add_rms_norm");
  static const auto rotate = operator_named<decltype(rotate_half)>("nanoengine::rotate_half");
  static const auto attention = operator_named<decltype(paged_attention)>("nanoengine::paged_attention");
  static const auto activation = operator_named<decltype(silu_and_mul)>("nanoengine::silu_and_mul");
  const int64_t tokens = hidden.size(0), d = k_cache.size(3);
  const int64_t q_size = num_heads * d, kv_size = num_kv_heads * d;

  // input_layernorm, the residual add fused (the first layer has no residual yet)
  at::Tensor x, stream;
  if (residual.has_value() && residual->defined()) {
    std::tie(x, stream) = add_norm.call(hidden, *residual, input_norm, eps);
  } else {
    x = norm.call(hidden, input_norm, eps);
    stream = hidden;
  }

  // self_attn: qkv_proj, rotary on the query and key heads together, attention (store-KV first), o_proj
  const at::Tensor qkv = linear(x, qkv_weight, qkv_packed, qkv_bias, few_rows_max);  // (T, q | k | v)
  const at::Tensor qk =
      rotate.call(qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, d}), cos, sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, d});
  const at::Tensor attended =
      attention.call(q, k, v, k_cache, v_cache, slot_mapping, num_decode_tokens, decode_block_tables,
                     decode_context_lens, prefill_block_tables, prefill_cu_seqlens_q, prefill_context_lens, scale,
                     widen);
  const at::Tensor o = linear(attended.reshape({tokens, q_size}), o_weight, o_packed, std::nullopt, few_rows_max);

  // post_attention_layernorm with the residual add, then the MLP: down(silu(gate) * up)
  std::tie(x, stream) = add_norm.call(o, stream, post_norm, eps);
  const at::Tensor gate_up = linear(x, gate_up_weight, gate_up_packed, std::nullopt, few_rows_max);
  return {linear(activation.call(gate_up), down_weight, down_packed, std::nullopt, few_rows_max), stream};
}

}  // namespace
}  // namespace nanoengine_cpu

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("llama_layer(Tensor hidden, Tensor? residual, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv_weight, Tensor? qkv_packed, Tensor? qkv_bias, Tensor o_weight, Tensor? o_packed, "
        "Tensor gate_up_weight, Tensor? gate_up_packed, Tensor down_weight, Tensor? down_packed, int few_rows_max, "
        "Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, int num_decode_tokens, "
        "Tensor decode_block_tables, Tensor decode_context_lens, Tensor prefill_block_tables, "
        "Tensor prefill_cu_seqlens_q, Tensor prefill_context_lens, bool widen, int num_heads, int num_kv_heads, "
        "float scale) -> (Tensor, Tensor)",
        torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(nanoengine_cpu::llama_layer)));
}

// oneDNN's packed weights are tensors of their own kind (MkldnnCPU): a call passing them
// dispatches on that key, so the same function is registered for it.
TORCH_LIBRARY_IMPL(nanoengine, MkldnnCPU, m) {
  m.impl("llama_layer", TORCH_FN(nanoengine_cpu::llama_layer));
}
