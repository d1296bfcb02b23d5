// Prefill attention over the paged cache for a whole step in one call (chapter 10). The definition
// it must agree with is reference.paged_prefill_attention (causal: the chunk's token j, at position
// p = context_len - q_len + j, sees the keys 0..p).
//
// Each query token of a chunk is attended exactly as decode attends its one token, by the loop
// paged_decode_attention.cpp writes (attend_group) over the token's first p + 1 K/V rows: the same
// bits a decode step would give it, in either build, whatever else the step holds. A prefill token
// is only a decode token that has company, so no second attention loop is written; and on the
// prompts of a few hundred tokens this engine serves, it is faster than PyTorch's SDPA called once
// per sequence, which it replaced (measured: results/README.md).
//
// Work is shared as (sequence, KV head, slab of query tokens) tasks, taken one at a time by
// whichever thread is free, costliest first (a slab's work grows with its tokens x context), so a
// lone long prompt keeps every thread busy and a step of many short ones does too.

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "ops.h"

#include <algorithm>
#include <atomic>
#include <vector>

namespace nanoengine_cpu {
namespace {

// Query tokens per task: enough that a task's setup (its rows' cache positions) is small beside its
// attention, few enough that the last tasks even out the threads (4, 16 and 64 measured alike, 2 threads).
constexpr int64_t kSlabTokens = 16;

struct Slab {
  int64_t seq, kv_head, first, end;  // the chunk's query tokens first..end-1
  int64_t cost;
};

template <typename T>
void prefill_kernel(const T* query, const T* k_cache, const T* v_cache, const int64_t* table, const int64_t* start,
                    const int64_t* length, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                    int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  std::vector<Slab> slabs;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = start[s + 1] - start[s], cached = length[s] - q_len;  // tokens before the chunk
    for (int64_t first = 0; first < q_len; first += kSlabTokens) {
      const int64_t end = std::min(first + kSlabTokens, q_len);
      for (int64_t h = 0; h < num_kv_heads; ++h) slabs.push_back({s, h, first, end, (end - first) * (cached + end)});
    }
  }
  std::stable_sort(slabs.begin(), slabs.end(), [](const Slab& a, const Slab& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(slabs.size());
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    AttendScratch scratch;
    std::vector<int64_t> rows;
    for (int64_t i = next++; i < count; i = next++) {
      const Slab& slab = slabs[i];
      const int64_t cached = length[slab.seq] - (start[slab.seq + 1] - start[slab.seq]);
      kv_rows(table + slab.seq * max_blocks, cached + slab.end, block_size, num_kv_heads, slab.kv_head, head_dim, rows);
      for (int64_t j = slab.first; j < slab.end; ++j) {  // token j sees its own row and those before it
        const int64_t first = ((start[slab.seq] + j) * num_heads + slab.kv_head * group) * head_dim;
        attend_group(query + first, k_cache, v_cache, rows.data(), cached + j + 1, group, head_dim, scale, scratch,
                     out + first);
      }
    }
  });
}

}  // namespace

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                   const at::Tensor& context_lens, double scale) {
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
  dispatch_float_or_bfloat16(query.scalar_type(), "paged_prefill_attention", [&](auto zero) {
    using T = decltype(zero);
    prefill_kernel<T>(query.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), table, start, length,
                      out.data_ptr<T>(), num_seqs, query.size(1), k_cache.size(2), query.size(2), block_size,
                      max_blocks, static_cast<float>(scale));
  });
  return out;
}

}  // namespace nanoengine_cpu

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("paged_prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor cu_seqlens_q, Tensor context_lens, float scale) -> Tensor",
        torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(nanoengine_cpu::paged_prefill_attention)));
}
