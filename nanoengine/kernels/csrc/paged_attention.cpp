// One attention layer's step over the paged cache in one call from Python (chapter 10), for
// backends/cpu.py's CpuAttention.forward. It must agree, bit for bit, with layers/attention.py's
// AttentionImpl.forward as CpuAttention runs it: store this step's keys and values at their slots,
// then the decode kernel for the decode rows and the prefill attention for the prefill chunks.
// From Python that is about a dozen operator calls a layer, each paying the interpreter; here the
// same operators run from C++, through the dispatcher, in the same order: the same bits.
//
// The schema says which arguments it writes: k_cache and v_cache (Tensor(a!), Tensor(b!)).
// Every token must have a slot (no -1 in slot_mapping): CpuAttention sends a step with a warm-up
// row (slot -1) through its Python path, which skips those rows.

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

namespace nanoengine_cpu {

at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_decode_tokens,
                           const at::Tensor& decode_block_tables, const at::Tensor& decode_context_lens,
                           const at::Tensor& prefill_block_tables, const at::Tensor& prefill_cu_seqlens_q,
                           const at::Tensor& prefill_context_lens, double scale) {
  // Everything checked before the caches are written.
  const int64_t tokens = query.size(0), num_prefills = prefill_context_lens.size(0);
  TORCH_CHECK(query.dim() == 3 && key.dim() == 3 && value.sizes() == key.sizes() && key.size(0) == tokens &&
                  query.device().is_cpu(),
              "paged_attention: query (tokens, heads, head_dim) and key, value (tokens, kv_heads, head_dim) on the "
              "CPU expected, got ", query.sizes(), ", ", key.sizes(), " and ", value.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && k_cache.size(2) == key.size(1) && k_cache.size(3) == key.size(2),
              "paged_attention: contiguous caches (blocks, block_size, ", key.size(1), ", ", key.size(2),
              ") expected, got ", k_cache.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == tokens && slot_mapping.scalar_type() == at::kLong,
              "paged_attention: slot_mapping (tokens,) int64 expected, got ", slot_mapping.sizes());
  TORCH_CHECK(0 <= num_decode_tokens && num_decode_tokens <= tokens && decode_block_tables.dim() == 2 &&
                  decode_block_tables.size(0) == num_decode_tokens,
              "paged_attention: one decode block-table row for each of the first ", num_decode_tokens, " of ", tokens,
              " tokens expected, got ", decode_block_tables.sizes());
  const at::Tensor& cu = prefill_cu_seqlens_q;
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) == num_prefills + 1 && cu.device().is_cpu() &&
                  (cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong),
              "paged_attention: prefill_cu_seqlens_q (", num_prefills, " prefills + 1,) int32 or int64 on the CPU "
              "expected, got ", cu.sizes(), " ", cu.scalar_type());
  int64_t first = 0, prefill_tokens = 0;
  dispatch_index(cu.scalar_type(), "paged_attention", [&](auto zero) {
    const auto* bounds = cu.const_data_ptr<decltype(zero)>();
    first = bounds[0];
    prefill_tokens = bounds[(cu.size(0) - 1) * cu.stride(0)];
  });
  TORCH_CHECK(first == 0 && num_decode_tokens + prefill_tokens == tokens, "paged_attention: ", num_decode_tokens,
              " decode tokens and prefill chunks from ", first, " to ", prefill_tokens, " do not make the step's ",
              tokens, " tokens");
  // Store-KV: each token's key and value rows copied to its slot (AttentionImpl.store_kv).
  const int64_t slots = k_cache.size(0) * k_cache.size(1), kv_heads = k_cache.size(2), d = k_cache.size(3);
  k_cache.view({slots, kv_heads, d}).index_copy_(0, slot_mapping, key);
  v_cache.view({slots, kv_heads, d}).index_copy_(0, slot_mapping, value);
  // Attention: decode rows first, then the prefill chunks (AttentionImpl.forward's split).
  static const auto decode_op = operator_named<decltype(paged_decode_attention)>("nanoengine::paged_decode_attention");
  static const auto prefill_op =
      operator_named<decltype(paged_prefill_attention)>("nanoengine::paged_prefill_attention");
  if (num_prefills == 0) {
    return decode_op.call(query.contiguous(), k_cache, v_cache, decode_block_tables.contiguous(),
                          decode_context_lens.contiguous(), scale);
  }
  const at::Tensor prefill = prefill_op.call(
      query.narrow(0, num_decode_tokens, tokens - num_decode_tokens).contiguous(), k_cache, v_cache,
      prefill_block_tables, prefill_cu_seqlens_q, prefill_context_lens, scale);
  if (num_decode_tokens == 0) return prefill;
  const at::Tensor decode = decode_op.call(query.narrow(0, 0, num_decode_tokens).contiguous(), k_cache, v_cache,
                                           decode_block_tables.contiguous(), decode_context_lens.contiguous(), scale);
  return at::cat({decode, prefill}, 0);
}

}  // namespace nanoengine_cpu

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("paged_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, int num_decode_tokens, Tensor decode_block_tables, Tensor decode_context_lens, "
        "Tensor prefill_block_tables, Tensor prefill_cu_seqlens_q, Tensor prefill_context_lens, float scale) "
        "-> Tensor",
        torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(nanoengine_cpu::paged_attention)));
}
