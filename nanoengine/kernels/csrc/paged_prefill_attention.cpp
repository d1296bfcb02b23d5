// Prefill attention over the paged cache for a whole step in one call (chapter 10), with the bits
// of reference.paged_prefill_attention: PyTorch's SDPA once per sequence, in float32 (a float32
// cache, or a bfloat16 one widened) or in bfloat16 (CpuAttention.prefill_dtype). What this file
// adds is how a step's sequences share the threads. SDPA splits one short sequence badly over the
// threads (results/README.md), so each thread takes the next sequence not yet done (costliest
// first), gathers its K/V rows with memcpy and runs SDPA on it alone (an operator called inside a
// parallel region runs on the calling thread). When one sequence outweighs a thread's share of the
// step by more than SDPA loses in splitting it (a lone prompt), the sequences run one after
// another and SDPA splits each over all the threads itself.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <numeric>
#include <vector>

namespace nanoengine_cpu {
namespace {

// How much longer SDPA takes to split one sequence over the threads than its work divided by
// their number: measured, SDPA on short prompts with two threads against one (results/README.md).
constexpr double kSplitCost = 1.15;

// One sequence's first `length` cached vectors in token order: (length, kv_heads, head_dim),
// what reference.gather_kv returns.
at::Tensor gather_rows(const at::Tensor& cache, const int64_t* table, int64_t length) {
  const int64_t block_size = cache.size(1), row = cache.size(2) * cache.size(3);
  const int64_t bytes_per_row = row * static_cast<int64_t>(cache.element_size());
  at::Tensor out = at::empty({length, cache.size(2), cache.size(3)}, cache.options());
  const char* src = static_cast<const char*>(cache.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t t = 0; t < length;) {  // a block's tokens are adjacent: one copy per block
    const int64_t offset = t % block_size, n = std::min(block_size - offset, length - t);
    const int64_t slot = table[t / block_size] * block_size + offset;
    std::memcpy(dst + t * bytes_per_row, src + slot * bytes_per_row, n * bytes_per_row);
    t += n;
  }
  return out;
}

// What the reference computes, with its bits: a sequence per thread, or one after another with
// SDPA splitting each over the threads when one outweighs the rest (see the top of this file).
void sdpa_per_sequence(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const int64_t* table, const int64_t* start, const int64_t* length, int64_t num_seqs,
                       int64_t max_blocks, double scale, bool widen, at::Tensor& out) {
  const bool gqa = query.size(1) != k_cache.size(2);
  const at::ScalarType compute = widen ? at::kFloat : query.scalar_type();
  // the costliest sequences first (SDPA's work grows with query tokens x context), taken one at a time
  std::vector<int64_t> order(num_seqs);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return (start[a + 1] - start[a]) * length[a] > (start[b + 1] - start[b]) * length[b];
  });
  auto attend = [&](int64_t s) {  // one sequence, as the reference computes it
    const int64_t q_start = start[s], q_len = start[s + 1] - q_start, context = length[s];
    if (q_len == 0) return;
    const at::Tensor keys = gather_rows(k_cache, table + s * max_blocks, context);
    const at::Tensor values = gather_rows(v_cache, table + s * max_blocks, context);
    const at::Tensor q = query.narrow(0, q_start, q_len).to(compute).transpose(0, 1).unsqueeze(0);
    const at::Tensor k = keys.to(compute).transpose(0, 1).unsqueeze(0);
    const at::Tensor v = values.to(compute).transpose(0, 1).unsqueeze(0);
    std::optional<at::Tensor> mask;
    if (q_len != context) {  // cached tokens before the chunk: query i sees keys up to its own position
      const at::Tensor q_pos = at::arange(context - q_len, context, at::kLong);
      mask = at::arange(context, at::kLong).unsqueeze(0) <= q_pos.unsqueeze(1);
    }
    const at::Tensor attended = at::scaled_dot_product_attention(q, k, v, mask, 0.0, !mask.has_value(), scale, gqa);
    out.narrow(0, q_start, q_len).copy_(attended.select(0, 0).transpose(0, 1));
  };
  const int64_t threads = at::get_num_threads();
  int64_t total = 0;
  for (int64_t s = 0; s < num_seqs; ++s) total += (start[s + 1] - start[s]) * length[s];
  const int64_t largest = num_seqs ? (start[order[0] + 1] - start[order[0]]) * length[order[0]] : 0;
  if (threads == 1 || static_cast<double>(largest) * threads > kSplitCost * static_cast<double>(total)) {
    for (int64_t i = 0; i < num_seqs; ++i) attend(order[i]);  // SDPA shares each one over the threads
    return;
  }
  std::atomic<int64_t> next{0};
  const at::ThreadLocalState caller;  // inference mode and the rest: the workers' PyTorch calls run as the caller's
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    at::ThreadLocalStateGuard as_the_caller(caller);
    for (int64_t i = next++; i < num_seqs; i = next++) attend(order[i]);
  });
}

}  // namespace

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                   const at::Tensor& context_lens, double scale, bool widen) {
  check_query_and_caches("paged_prefill_attention", query, k_cache, v_cache);
  const at::Tensor tables = block_tables.to(at::kLong).contiguous();
  const at::Tensor starts = cu_seqlens_q.to(at::kLong).contiguous(), lengths = context_lens.to(at::kLong).contiguous();
  const int64_t num_seqs = lengths.size(0), max_blocks = tables.dim() == 2 ? tables.size(1) : 0;
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == num_seqs && starts.dim() == 1 && starts.size(0) == num_seqs + 1,
              "paged_prefill_attention: block_tables (seqs, max_blocks), cu_seqlens_q (seqs + 1,) and context_lens "
              "(seqs,) expected, got ", block_tables.sizes(), ", ", cu_seqlens_q.sizes(), " and ", context_lens.sizes());
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* length = lengths.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), num_blocks = k_cache.size(0);
  TORCH_CHECK(start[0] == 0 && start[num_seqs] == query.size(0), "paged_prefill_attention: cu_seqlens_q must run from 0 "
              "to the query's ", query.size(0), " tokens");
  for (int64_t s = 0; s < num_seqs; ++s) {  // everything checked before any thread reads the cache
    const int64_t q_len = start[s + 1] - start[s];
    TORCH_CHECK(q_len >= 0 && q_len <= length[s], "paged_prefill_attention: sequence ", s, " has ", q_len,
                " query tokens and context length ", length[s], "; allowed 0 <= query tokens <= context length");
    check_block_table("paged_prefill_attention", s, table + s * max_blocks, length[s], 0, max_blocks, block_size,
                      num_blocks);
  }
  at::Tensor out = at::empty_like(query);
  sdpa_per_sequence(query, k_cache, v_cache, table, start, length, num_seqs, max_blocks, scale, widen, out);
  return out;
}

}  // namespace nanoengine_cpu

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("paged_prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor cu_seqlens_q, Tensor context_lens, float scale, bool widen) -> Tensor",
        torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(nanoengine_cpu::paged_prefill_attention)));
}
