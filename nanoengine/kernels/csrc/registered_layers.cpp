// A model's decoder layers registered once, so that a compiled graph calls each with only what
// changes inside a step (chapter 10: the model compiled whole).
// Built with the other csrc/ sources by cpu_native.py; used by backends/cpu_graph.py.
//
// nanoengine::llama_layer (llama_layer.cpp) takes thirty arguments: the layer's norms, weights,
// packed weights and cache, and the step's metadata (slots, block tables, context lengths). In a
// graph compiled by torch.compile every one of them would be an input that Dynamo guards on, and
// the metadata tensors change shape every step (one decode or many, a prefill or none), which
// would compile a graph per combination. So, as vLLM's attention reads its "forward context":
//
//   * the layers' constant arguments are registered once per engine, under a handle
//     (registered_model_new, registered_model_add_layer, registered_model_free);
//   * the step's metadata is set once per step, outside the graph (registered_model_set_step,
//     registered_model_clear_step);
//   * inside the graph, registered_layer(hidden, residual, cos, sin, layer) looks both up and
//     calls nanoengine::llama_layer: one opaque operator a layer whose inputs are the hidden
//     states, the residual stream and the rotary rows, and nothing else.
//
// The handle is an engine's own, and which model a thread is stepping is the thread's own (set
// with the step): two engines in one process never see each other's layers or steps, and the
// graph holds no handle, so a second engine of the same model reuses the first one's graph.
// Writing the KV cache is a side effect the graph does not see (the cache is not an argument),
// as with vLLM's attention operator; nothing else in the graph reads the cache.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

using OptionalTensor = std::optional<at::Tensor>;

// What a layer's call needs that does not change from step to step.
struct LayerArguments {
  at::Tensor input_norm, post_norm;
  double eps;
  at::Tensor qkv_weight;
  OptionalTensor qkv_packed, qkv_bias;
  at::Tensor o_weight;
  OptionalTensor o_packed;
  at::Tensor gate_up_weight;
  OptionalTensor gate_up_packed;
  at::Tensor down_weight;
  OptionalTensor down_packed;
  int64_t few_rows_max;
  at::Tensor k_cache, v_cache;
  int64_t num_heads, num_kv_heads;
  double scale;
};

// The step's metadata (layers/attention.py's AttentionMetadata, the fields the layer reads).
struct StepArguments {
  at::Tensor slot_mapping;
  int64_t num_decode_tokens;
  at::Tensor decode_block_tables, decode_context_lens, prefill_block_tables, prefill_cu_seqlens_q,
      prefill_context_lens;
  bool widen;
};

struct RegisteredModel {
  std::vector<LayerArguments> layers;
  std::optional<StepArguments> step;
};

std::mutex registry_mutex;
std::unordered_map<int64_t, RegisteredModel> registry;
int64_t next_handle = 1;
thread_local int64_t stepping = 0;  // the handle whose step this thread set (0: none)

RegisteredModel& model_at(int64_t handle, const char* caller) {  // registry_mutex held
  const auto found = registry.find(handle);
  TORCH_CHECK(found != registry.end(), caller, ": no registered model has handle ", handle,
              " (freed, or never made by registered_model_new)");
  return found->second;
}

int64_t registered_model_new() {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.emplace(next_handle, RegisteredModel{});
  return next_handle++;
}

void registered_model_free(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry.erase(handle);
  if (stepping == handle) stepping = 0;
}

// Appends a layer; returns its index (the layer argument of registered_layer).
int64_t registered_model_add_layer(int64_t handle, const at::Tensor& input_norm, const at::Tensor& post_norm,
                                   double eps, const at::Tensor& qkv_weight, const OptionalTensor& qkv_packed,
                                   const OptionalTensor& qkv_bias, const at::Tensor& o_weight,
                                   const OptionalTensor& o_packed, const at::Tensor& gate_up_weight,
                                   const OptionalTensor& gate_up_packed, const at::Tensor& down_weight,
                                   const OptionalTensor& down_packed, int64_t few_rows_max, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, int64_t num_heads, int64_t num_kv_heads, double scale) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  RegisteredModel& model = model_at(handle, "registered_model_add_layer");
  model.layers.push_back(LayerArguments{input_norm, post_norm, eps, qkv_weight, qkv_packed, qkv_bias, o_weight,
                                        o_packed, gate_up_weight, gate_up_packed, down_weight, down_packed,
                                        few_rows_max, k_cache, v_cache, num_heads, num_kv_heads, scale});
  return static_cast<int64_t>(model.layers.size()) - 1;
}

void registered_model_set_step(int64_t handle, const at::Tensor& slot_mapping, int64_t num_decode_tokens,
                               const at::Tensor& decode_block_tables, const at::Tensor& decode_context_lens,
                               const at::Tensor& prefill_block_tables, const at::Tensor& prefill_cu_seqlens_q,
                               const at::Tensor& prefill_context_lens, bool widen) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  model_at(handle, "registered_model_set_step").step =
      StepArguments{slot_mapping,         num_decode_tokens,    decode_block_tables, decode_context_lens,
                    prefill_block_tables, prefill_cu_seqlens_q, prefill_context_lens, widen};
  stepping = handle;
}

void registered_model_clear_step(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  const auto found = registry.find(handle);
  if (found != registry.end()) found->second.step.reset();
  if (stepping == handle) stepping = 0;
}

// Layer ``layer`` of the model whose step this thread set: nanoengine::llama_layer's
// (output, residual stream). Before the first layer (no residual) the stream returned is a copy of
// ``hidden``, never ``hidden`` itself: a compiled graph's operator must not return its input.
std::tuple<at::Tensor, at::Tensor> registered_layer(const at::Tensor& hidden, const OptionalTensor& residual,
                                                    const at::Tensor& cos, const at::Tensor& sin, int64_t layer) {
  LayerArguments args;
  StepArguments step;
  {  // the tensors' references copied out: the layer runs without the lock
    std::lock_guard<std::mutex> lock(registry_mutex);
    TORCH_CHECK(stepping != 0, "registered_layer: this thread set no step (call registered_model_set_step "
                "before the forward pass)");
    const RegisteredModel& model = model_at(stepping, "registered_layer");
    TORCH_CHECK(0 <= layer && layer < static_cast<int64_t>(model.layers.size()), "registered_layer: model ",
                stepping, " has ", model.layers.size(), " layers, asked for layer ", layer);
    args = model.layers[layer];
    step = *model.step;  // set: ``stepping`` names only a model whose step is set
  }
  // The types are llama_layer's own parameters' (the caches by value), as the dispatcher checks.
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("nanoengine::llama_layer", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const OptionalTensor&, const at::Tensor&, const at::Tensor&, double,
              const at::Tensor&, const OptionalTensor&, const OptionalTensor&, const at::Tensor&,
              const OptionalTensor&, const at::Tensor&, const OptionalTensor&, const at::Tensor&,
              const OptionalTensor&, int64_t, const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor,
              const at::Tensor&, int64_t, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, bool, int64_t, int64_t, double)>();
  auto [out, stream] = op.call(hidden, residual, args.input_norm, args.post_norm, args.eps, args.qkv_weight,
                               args.qkv_packed, args.qkv_bias, args.o_weight, args.o_packed, args.gate_up_weight,
                               args.gate_up_packed, args.down_weight, args.down_packed, args.few_rows_max, cos, sin,
                               args.k_cache, args.v_cache, step.slot_mapping, step.num_decode_tokens,
                               step.decode_block_tables, step.decode_context_lens, step.prefill_block_tables,
                               step.prefill_cu_seqlens_q, step.prefill_context_lens, step.widen, args.num_heads,
                               args.num_kv_heads, args.scale);
  if (stream.is_same(hidden)) stream = hidden.clone();
  return {out, stream};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  // Called from Python around the graph, never inside it: one kernel for every dispatch key.
  m.def("registered_model_new() -> int", &registered_model_new);
  m.def("registered_model_free(int handle) -> ()", &registered_model_free);
  m.def("registered_model_add_layer(int handle, Tensor input_norm, Tensor post_norm, float eps, Tensor qkv_weight, "
        "Tensor? qkv_packed, Tensor? qkv_bias, Tensor o_weight, Tensor? o_packed, Tensor gate_up_weight, "
        "Tensor? gate_up_packed, Tensor down_weight, Tensor? down_packed, int few_rows_max, Tensor k_cache, "
        "Tensor v_cache, int num_heads, int num_kv_heads, float scale) -> int",
        &registered_model_add_layer);
  m.def("registered_model_set_step(int handle, Tensor slot_mapping, int num_decode_tokens, "
        "Tensor decode_block_tables, Tensor decode_context_lens, Tensor prefill_block_tables, "
        "Tensor prefill_cu_seqlens_q, Tensor prefill_context_lens, bool widen) -> ()",
        &registered_model_set_step);
  m.def("registered_model_clear_step(int handle) -> ()", &registered_model_clear_step);
  // Inside the graph: a CPU kernel, opaque to Dynamo and Inductor (its fake is in cpu_native.py).
  m.def("registered_layer(Tensor hidden, Tensor? residual, Tensor cos, Tensor sin, int layer) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(nanoengine, CPU, m) {
  m.impl("registered_layer", &registered_layer);
}
