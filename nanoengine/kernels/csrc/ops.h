// What the operator files share besides cpu_vec.h's vector code: the common includes; each
// operator's C++ signature, said once here and registered in the file of its name, so that a file
// calling another operator takes its type from here; the input checks several operators make; the
// one dtype dispatch.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <tuple>
#include <vector>

namespace nanoengine_cpu {

// The operators torch.ops.nanoengine.* (their schemas, with argument names: each file's TORCH_LIBRARY_FRAGMENT).
at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
at::Tensor rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale);
at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                   const at::Tensor& context_lens, double scale);
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t num_decode_tokens,
                           const at::Tensor& decode_block_tables, const at::Tensor& decode_context_lens,
                           const at::Tensor& prefill_block_tables, const at::Tensor& prefill_cu_seqlens_q,
                           const at::Tensor& prefill_context_lens, double scale);

// The attention loop decode and prefill share (paged_decode_attention.cpp): one query token's group
// of heads (the query heads that share one KV head, adjacent in `query`) over the first `length`
// cached K/V rows of that KV head, rows[t] being where token t's row starts in either cache (kv_rows). Scores,
// softmax and the weighted sum in float32, every sum in an order this source fixes: a query token
// gets the same bits whether decode or prefill asks, and whatever else is in the step.
struct AttendScratch {  // one thread's float32 working memory, reused from call to call
  std::vector<float> query, scores, out;
};

template <typename T>
void attend_group(const T* query, const T* k_cache, const T* v_cache, const int64_t* rows, int64_t length, int64_t group,
                  int64_t head_dim, float scale, AttendScratch& scratch, T* out);

// Where each of a sequence's first `length` tokens' K/V rows for `kv_head` starts in the caches
// (blocks, block_size, kv_heads, head_dim), through its block-table row: into rows[0..length).
template <typename Index>
void kv_rows(const Index* table, int64_t length, int64_t block_size, int64_t num_kv_heads, int64_t kv_head,
             int64_t head_dim, std::vector<int64_t>& rows) {
  rows.resize(length);
  const int64_t row_stride = num_kv_heads * head_dim;  // from one token to the next within a block
  for (int64_t t = 0, b = 0; t < length; ++b) {  // block by block: no division per token
    int64_t row = (static_cast<int64_t>(table[b]) * block_size * num_kv_heads + kv_head) * head_dim;
    for (const int64_t end = std::min(t + block_size, length); t < end; ++t, row += row_stride) rows[t] = row;
  }
}

// The registered operator `name`, to call through the dispatcher (so the profiler names each call,
// and a tensor of another dispatch key, such as a packed weight, finds its kernel). Looked up once:
//   static const auto op = operator_named<decltype(rms_norm)>("nanoengine::rms_norm");
template <typename Signature>
c10::TypedOperatorHandle<Signature> operator_named(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

inline void check_cpu_contiguous(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), op, ": contiguous CPU tensors only");
  }
}

// A query (tokens, heads, head_dim) and the paged caches (blocks, block_size, kv_heads, head_dim) it
// attends over: contiguous, on the CPU, of one dtype, each query head with a KV head to share.
inline void check_query_and_caches(const char* op, const at::Tensor& query, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache) {
  check_cpu_contiguous(op, {&query, &k_cache, &v_cache});
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(), op,
              ": query (tokens, heads, head_dim) and caches (blocks, block_size, kv_heads, head_dim) expected, got ",
              query.sizes(), ", ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(query.size(1) > 0 && query.size(2) > 0 && k_cache.size(1) > 0 && k_cache.size(2) > 0, op,
              ": heads, head_dim, block_size and kv_heads must be >= 1, got query ", query.sizes(), " and cache ",
              k_cache.sizes());
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0, op,
              ": head_dim must match and heads must be a multiple of kv_heads, got query ", query.sizes(),
              " and cache ", k_cache.sizes());
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(), op,
              ": query and caches must share a dtype");
}

// f(T{}) with T the C++ type of `type`: float32 or bfloat16, the activation dtypes the kernels take.
template <typename F>
void dispatch_float_or_bfloat16(at::ScalarType type, const char* op, F&& f) {
  if (type == at::kFloat) f(float{});
  else if (type == at::kBFloat16) f(c10::BFloat16{});
  else TORCH_CHECK(false, op, ": float32 or bfloat16 only, got ", type);
}

// f(I{}) with I the C++ type of an index tensor's `type`: int32 or int64.
template <typename F>
void dispatch_index(at::ScalarType type, const char* op, F&& f) {
  if (type == at::kInt) f(int32_t{});
  else if (type == at::kLong) f(int64_t{});
  else TORCH_CHECK(false, op, ": int32 or int64 block tables and lengths only, got ", type);
}

// One sequence's block-table row, checked before any thread reads the cache through it: a context
// length from min_length to the row's capacity, and each block it uses one of the cache's.
template <typename Index>
void check_block_table(const char* op, int64_t seq, const Index* table, int64_t length, int64_t min_length,
                       int64_t max_blocks, int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(length >= min_length && length <= max_blocks * block_size, op, ": sequence ", seq,
              " has context length ", length, "; allowed ", min_length, "..", max_blocks * block_size,
              " (its block table's capacity)");
  for (int64_t b = 0; b < (length + block_size - 1) / block_size; ++b) {
    const int64_t block = static_cast<int64_t>(table[b]);
    TORCH_CHECK(block >= 0 && block < num_blocks, op, ": sequence ", seq, " block ", b, " is ", block,
                "; the cache has blocks 0..", num_blocks - 1);
  }
}

}  // namespace nanoengine_cpu
