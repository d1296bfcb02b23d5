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

// `weights` (FusedLayer.arguments): the linear layers' (cpu_fused.linear_layers), then the norms'; `packed`:
// each linear layer's packed copy, or None.
enum Weight : int64_t { kQkv, kO, kGateUp, kDown, kInputNorm, kPostNorm, kNumWeights };

// `step`: the step's tensors, as CpuAttentionMetadata.layer_step lists them.
enum StepTensor : int64_t {
  kSlotMapping, kDecodeBlockTables, kDecodeContextLens, kPrefillBlockTables, kPrefillCuSeqlensQ, kPrefillContextLens,
  kNumStepTensors
};

std::tuple<at::Tensor, at::Tensor> llama_layer(
    const at::Tensor& hidden, const OptionalTensor& residual, at::TensorList weights,
    const c10::List<OptionalTensor>& packed, const OptionalTensor& qkv_bias, at::Tensor k_cache, at::Tensor v_cache,
    double eps, int64_t few_rows_max, double scale, const at::Tensor& cos, const at::Tensor& sin, at::TensorList step,
    int64_t num_decode_tokens) {
  // What each call checks, it checks itself (shapes, dtypes, the step's decode rows and prefill chunks).
  static const auto norm = operator_named<decltype(rms_norm)>("nanoengine::rms_norm");
  static const auto add_norm = operator_named<decltype(add_rms_norm)>("nanoengine::add_rms_norm");
  static const auto rotate = operator_named<decltype(rotate_half)>("nanoengine::rotate_half");
  static const auto attention = operator_named<decltype(paged_attention)>("nanoengine::paged_attention");
  static const auto activation = operator_named<decltype(silu_and_mul)>("nanoengine::silu_and_mul");
  TORCH_CHECK(weights.size() == kNumWeights && packed.size() == kInputNorm && step.size() == kNumStepTensors,
              "llama_layer: ", kNumWeights, " weights, ", kInputNorm, " packed and ", kNumStepTensors,
              " step tensors expected (FusedLayer.arguments, CpuAttentionMetadata.layer_step), got ", weights.size(),
              ", ", packed.size(), " and ", step.size());
  // head_dim and the KV heads from the cache's shape, the query heads from o_proj's input (all heads side by side)
  const int64_t tokens = hidden.size(0), num_kv_heads = k_cache.size(2), d = k_cache.size(3);
  const int64_t q_size = weights[kO].size(1), num_heads = q_size / d, kv_size = num_kv_heads * d;

  // input_layernorm, the residual add fused (the first layer has no residual yet)
  at::Tensor x, stream;
  if (residual.has_value() && residual->defined()) {
    std::tie(x, stream) = add_norm.call(hidden, *residual, weights[kInputNorm], eps);
  } else {
    x = norm.call(hidden, weights[kInputNorm], eps);
    stream = hidden;
  }

  // self_attn: qkv_proj, rotary on the query and key heads together, attention (store-KV first), o_proj
  const at::Tensor qkv = linear(x, weights[kQkv], packed.get(kQkv), qkv_bias, few_rows_max);  // (T, q | k | v)
  const at::Tensor qk =
      rotate.call(qkv.narrow(1, 0, q_size + kv_size).view({tokens, num_heads + num_kv_heads, d}), cos, sin);
  const at::Tensor q = qk.narrow(1, 0, num_heads), k = qk.narrow(1, num_heads, num_kv_heads);
  const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({tokens, num_kv_heads, d});
  const at::Tensor attended =
      attention.call(q, k, v, k_cache, v_cache, step[kSlotMapping], num_decode_tokens, step[kDecodeBlockTables],
                     step[kDecodeContextLens], step[kPrefillBlockTables], step[kPrefillCuSeqlensQ],
                     step[kPrefillContextLens], scale);
  const at::Tensor o =
      linear(attended.reshape({tokens, q_size}), weights[kO], packed.get(kO), std::nullopt, few_rows_max);

  // post_attention_layernorm with the residual add, then the MLP: down(silu(gate) * up)
  std::tie(x, stream) = add_norm.call(o, stream, weights[kPostNorm], eps);
  const at::Tensor gate_up = linear(x, weights[kGateUp], packed.get(kGateUp), std::nullopt, few_rows_max);
  return {linear(activation.call(gate_up), weights[kDown], packed.get(kDown), std::nullopt, few_rows_max), stream};
}

}  // namespace
}  // namespace nanoengine_cpu

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("llama_layer(Tensor hidden, Tensor? residual, Tensor[] weights, Tensor?[] packed, Tensor? qkv_bias, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, float eps, int few_rows_max, float scale, Tensor cos, Tensor sin, "
        "Tensor[] step, int num_decode_tokens) -> (Tensor, Tensor)",
        torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(nanoengine_cpu::llama_layer)));
}

// oneDNN's packed weights are tensors of their own kind (MkldnnCPU): a call passing them
// dispatches on that key, so the same function is registered for it.
TORCH_LIBRARY_IMPL(nanoengine, MkldnnCPU, m) {
  m.impl("llama_layer", TORCH_FN(nanoengine_cpu::llama_layer));
}
