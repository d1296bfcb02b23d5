// Prefill attention over the paged cache for a whole step in one call (chapter 10).
// Built with the other csrc/ sources by cpu_native.py; the operator is
// torch.ops.nanoengine.paged_prefill_attention. The definition it computes is
// reference.paged_prefill_attention's: causal attention of each chunk over its sequence's
// cached tokens and its own. Two ways, chosen by the arithmetic the step asks for:
//
// * float32 arithmetic (a float32 cache, or a bfloat16 one widened): tiles written out here
//   (tiled_attention, below). PyTorch's SDPA ran a short prompt's float32 attention at a small
//   fraction of the arithmetic rate the same CPU reaches in a GEMM: its blocks are small
//   library calls, each with its own overhead. The tiles are three small matrix products
//   whose inner loops keep every operand in registers, and run such a prompt much faster
//   than SDPA (figures: results/README.md). Their bits are this source's, not SDPA's
//   (within ~1e-6 of the float32 reference); the tests hold them to it.
// * bfloat16 arithmetic (CPUs with bfloat16 instructions: CpuAttention.prefill_dtype): SDPA,
//   whose bfloat16 path runs on oneDNN's AMX/AVX512-BF16 kernels, once per sequence, with the
//   reference's bits. The reference calls it per sequence from Python, and SDPA splits one
//   short sequence's work over the threads: a 32-prompt prefill spent a good part of its
//   attention time outside SDPA, and SDPA on two threads took longer than half its one-thread
//   time (figures: results/README.md). Here the sequences are shared out instead: each thread
//   takes the next sequence not yet done (longest first, so that the last ones are short),
//   gathers its K/V rows with memcpy and runs SDPA on it alone (PyTorch runs an operator
//   called inside a parallel region on the calling thread). A lone prompt (the usual prefill
//   of a server at low load) would leave every thread but one idle, so when one sequence
//   outweighs a thread's share of the step's work by more than SDPA loses in splitting it,
//   the sequences run one after another and SDPA splits each over all the threads itself.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include "cpu_vec.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <vector>

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


// ------------------------------------------------------------ float32 arithmetic, in tiles
// For one (sequence, KV head) the keys are packed once, transposed, into panels of eight keys:
// value d of the panel's keys side by side. A task then takes up to
// TOKENS_PER_TASK query tokens of the sequence for all the heads that share the KV head
// (grouped-query attention: their queries are rows of one matrix, each key read once for all):
// * scores: a tile of query rows x one panel in registers, each score one chain of FMAs over
//   the head dimension in order d = 0, 1, ...; panels past a tile's last position are skipped;
// * softmax per row over its own positions: max, e^(score - max), their sum in a fixed order;
// * values: a block of rows x 16 output lanes in registers, each lane one chain of FMAs
//   over the positions in order, each value vector loaded once for the whole block; a row's
//   weights past its own position are 0, so rows of different lengths share the loop.
// Every number is a chain in an order fixed by this source, whatever the CPU, threads,
// batch, chunking or tiling: a prompt gets the same bits alone or in a batch, and a chunk after a cached prefix the same bits as the
// same tokens in one prefill (the tests compare each).

using nanoengine_cpu::exp8;
using nanoengine_cpu::horizontal_sum;
using nanoengine_cpu::load8;
using nanoengine_cpu::store8;

// Query tokens a task takes (for all the heads of one KV head): not tuned, no sweep is recorded.
constexpr int64_t TOKENS_PER_TASK = 16;
constexpr int64_t ROW_TILE = 12;  // 12 accumulators, the panel and a broadcast: 14 of AVX2's 16 registers
constexpr int64_t VALUE_ROWS = 6;  // 6 rows x 16 output lanes: 12 accumulators

// Where token t's K/V row of kv_head starts in the cache, for t < length.
void fill_rows(const int64_t* table, int64_t length, int64_t block_size, int64_t row_stride, int64_t kv_head,
               int64_t head_dim, std::vector<int64_t>& rows) {
  rows.resize(length);
  for (int64_t t = 0; t < length; ++t) {
    rows[t] = (table[t / block_size] * block_size + t % block_size) * row_stride + kv_head * head_dim;
  }
}

// keys (length of them, by their rows) as panels of `lanes` keys: packed[(p * D + d) * lanes + j] =
// key p * lanes + j, value d, as float32; zero past the last key.
template <typename T>
void pack_keys(const T* k_cache, const std::vector<int64_t>& rows, int64_t head_dim, int64_t lanes, float* packed) {
  const int64_t length = static_cast<int64_t>(rows.size()), panels = (length + lanes - 1) / lanes;
  std::fill(packed, packed + panels * head_dim * lanes, 0.0f);
  for (int64_t t = 0; t < length; ++t) {
    const T* row = k_cache + rows[t];
    float* dst = packed + (t / lanes) * head_dim * lanes + t % lanes;
    for (int64_t d = 0; d < head_dim; ++d) dst[d * lanes] = static_cast<float>(row[d]);
  }
}

// How many floats one KV head's keys take packed: whole panels.
inline int64_t panel_floats(int64_t length, int64_t head_dim, int64_t lanes) {
  return (length + lanes - 1) / lanes * lanes * head_dim;
}

// scores[i][8p + j] (`stride` apart) for ROW_TILE query rows against panels [0, panels); q holds the
// rows transposed, q[d * ROW_TILE + i] value d of row i.
void score_tile(const float* q, const float* packed, int64_t panels, int64_t head_dim, float* scores,
                int64_t stride) {
  for (int64_t p = 0; p < panels; ++p) {
    const float* k = packed + p * head_dim * 8;
    __m256 acc[ROW_TILE];
    #pragma GCC unroll 32
    for (int i = 0; i < ROW_TILE; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < head_dim; ++d) {
      const __m256 keys = _mm256_loadu_ps(k + d * 8);
      #pragma GCC unroll 32
      for (int i = 0; i < ROW_TILE; ++i) acc[i] = _mm256_fmadd_ps(_mm256_set1_ps(q[d * ROW_TILE + i]), keys, acc[i]);
    }
    #pragma GCC unroll 32
    for (int i = 0; i < ROW_TILE; ++i) _mm256_storeu_ps(scores + i * stride + p * 8, acc[i]);
  }
}

// The largest of a row's first `length` scores (exact in any order).
inline float row_max(const float* s, int64_t length) {
  const int64_t whole = length / 8 * 8;
  __m256 top8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t t = 0; t < whole; t += 8) top8 = _mm256_max_ps(top8, _mm256_loadu_ps(s + t));
  float lanes[8];
  _mm256_storeu_ps(lanes, top8);
  float top = *std::max_element(lanes, lanes + 8);
  for (int64_t t = whole; t < length; ++t) top = std::max(top, s[t]);
  return top;
}

// Lanes [0, 8) of positions t..t+7 that lie before `length`.
inline __m256 inside8(int64_t t, int64_t length) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int64_t left = std::min<int64_t>(std::max<int64_t>(length - t, 0), 8);
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(left)), lane));
}

// One row's (scaled) scores over its first `length` positions become e^(score - max) in place,
// zero past `length` up to the next multiple of 16; returns 1 / their sum, the outputs' factor.
// The sum's order: sixteen running sums, position t into sum t % 16, then sums j and j + 8 added
// and the eight added as horizontal_sum adds them.
float softmax_row(float* s, int64_t length) {
  const __m256 top = _mm256_set1_ps(row_max(s, length));
  __m256 sum_low = _mm256_setzero_ps(), sum_high = _mm256_setzero_ps();
  for (int64_t t = 0; t < length; t += 16) {
    __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), top));
    if (t + 8 > length) e = _mm256_and_ps(e, inside8(t, length));
    _mm256_storeu_ps(s + t, e);
    sum_low = _mm256_add_ps(sum_low, e);
    e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t + 8), top));
    if (t + 16 > length) e = _mm256_and_ps(e, inside8(t + 8, length));
    _mm256_storeu_ps(s + t + 8, e);
    sum_high = _mm256_add_ps(sum_high, e);
  }
  return 1.0f / horizontal_sum(_mm256_add_ps(sum_low, sum_high));
}

// out_r = inv_r * sum over t < length of e_r[t] * value row t for R rows (e `stride` apart; a
// row's weights past its own length are 0), 16 output lanes at a time: R x 2 accumulators, each
// value vector loaded once for all R rows. A row whose out is null is computed and dropped.
template <typename T, int R>
void add_values(const float* e, int64_t stride, const float* inv, const T* v_cache, const int64_t* rows,
                int64_t length, int64_t head_dim, T* const* out) {
  for (int64_t c = 0; c < head_dim; c += 16) {
    __m256 acc[R][2];
    #pragma GCC unroll 32
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t t = 0; t < length; ++t) {
      const T* v = v_cache + rows[t] + c;
      const __m256 v0 = load8(v), v1 = load8(v + 8);
      #pragma GCC unroll 32
      for (int r = 0; r < R; ++r) {
        const __m256 weight = _mm256_set1_ps(e[r * stride + t]);
        acc[r][0] = _mm256_fmadd_ps(weight, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(weight, v1, acc[r][1]);
      }
    }
    #pragma GCC unroll 32
    for (int r = 0; r < R; ++r) {
      if (out[r] == nullptr) continue;
      const __m256 factor = _mm256_set1_ps(inv[r]);
      store8(out[r] + c, _mm256_mul_ps(acc[r][0], factor));
      store8(out[r] + c + 8, _mm256_mul_ps(acc[r][1], factor));
    }
  }
}


struct TileScratch {
  std::vector<float> queries, scores;
  std::vector<int64_t> rows;
};

// Query tokens [first, last) of one sequence (q_start its first token in the step, `cached` tokens
// before its chunk) for the heads sharing kv_head, against its packed keys.
template <typename T>
void attend_tokens(const T* query, const T* v_cache, const float* packed, const int64_t* table, int64_t q_start,
                   int64_t cached, int64_t first, int64_t last, int64_t kv_head, int64_t num_heads,
                   int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, TileScratch& scratch,
                   T* out) {
  const int64_t group = num_heads / num_kv_heads, D = head_dim;
  constexpr int64_t lanes = 8, tile = ROW_TILE;
  const int64_t rows = (last - first) * group, padded = (rows + tile - 1) / tile * tile;
  const int64_t stride = (cached + last + 15) / 16 * 16;  // the longest row, in whole panels and softmax vectors
  fill_rows(table, cached + last, block_size, num_kv_heads * D, kv_head, D, scratch.rows);
  // Row r = (token - first) * group + g is head kv_head * group + g's query, scaled (so are the scores);
  // each tile of rows is stored transposed, value d of its rows side by side.
  scratch.queries.assign(padded * D, 0.0f);
  for (int64_t r = 0; r < rows; ++r) {
    const T* q = query + ((q_start + first + r / group) * num_heads + kv_head * group + r % group) * D;
    float* dst = scratch.queries.data() + (r / tile) * tile * D + r % tile;
    for (int64_t d = 0; d < D; ++d) dst[d * tile] = static_cast<float>(q[d]) * scale;
  }
  scratch.scores.resize(padded * stride);
  for (int64_t r0 = 0; r0 < padded; r0 += tile) {  // a tile's panels end at its last row's position
    const int64_t last_token = std::min(first + (r0 + tile - 1) / group, last - 1);
    const int64_t panels = (cached + last_token + 1 + lanes - 1) / lanes;
    score_tile(scratch.queries.data() + r0 * D, packed, panels, D, scratch.scores.data() + r0 * stride, stride);
  }
  // Weights and values, VALUE_ROWS rows (tokens x heads) at a time: a row's weights are zero
  // from its own length to the block's longest, so one loop over positions serves them all.
  constexpr int64_t block = VALUE_ROWS;
  float inv[VALUE_ROWS];
  T* outs[VALUE_ROWS];
  for (int64_t r0 = 0; r0 < rows; r0 += block) {
    const int64_t longest = cached + first + (std::min(r0 + block, rows) - 1) / group + 1;
    for (int64_t i = 0; i < block; ++i) {
      const int64_t r = r0 + i;
      float* e = scratch.scores.data() + r * stride;
      if (r >= rows) {  // padding: zero queries, computed and dropped
        inv[i] = 0.0f;
        outs[i] = nullptr;
        continue;
      }
      const int64_t t = first + r / group, length = cached + t + 1;
      inv[i] = softmax_row(e, length);
      std::fill(e + length, e + longest, 0.0f);
      outs[i] = out + ((q_start + t) * num_heads + kv_head * group + r % group) * D;
    }
    const float* e = scratch.scores.data() + r0 * stride;
    add_values<T, VALUE_ROWS>(e, stride, inv, v_cache, scratch.rows.data(), longest, D, outs);
  }
}

// The whole step: keys packed per (sequence, KV head), then tasks of TOKENS_PER_TASK query tokens
// for one KV head, the costliest first, each thread taking the next.
template <typename T>
void tiled_attention(const T* query, const T* k_cache, const T* v_cache, const int64_t* table, const int64_t* start,
                     const int64_t* length, int64_t num_seqs, int64_t max_blocks, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, T* out) {
  constexpr int64_t lanes = 8;
  std::vector<int64_t> offset(num_seqs + 1, 0);  // where each sequence's packed keys start
  for (int64_t s = 0; s < num_seqs; ++s) {
    offset[s + 1] = offset[s] + panel_floats(length[s], head_dim, lanes) * num_kv_heads;
  }
  std::vector<float> packed(offset[num_seqs]);
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> rows;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t s = i / num_kv_heads, h = i % num_kv_heads;
      if (start[s + 1] == start[s]) continue;
      fill_rows(table + s * max_blocks, length[s], block_size, num_kv_heads * head_dim, h, head_dim, rows);
      float* keys = packed.data() + offset[s] + h * panel_floats(length[s], head_dim, lanes);
      pack_keys(k_cache, rows, head_dim, lanes, keys);
    }
  });
  struct Task {
    int64_t seq, kv_head, first, last, cost;
  };
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t q_len = start[s + 1] - start[s], cached = length[s] - q_len;
    for (int64_t first = 0; first < q_len; first += TOKENS_PER_TASK) {
      const int64_t last = std::min(first + TOKENS_PER_TASK, q_len);
      const int64_t cost = (last - first) * (cached + (first + last + 1) / 2);  // positions attended, summed
      for (int64_t h = 0; h < num_kv_heads; ++h) tasks.push_back({s, h, first, last, cost});
    }
  }
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  const int64_t count = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    TileScratch scratch;
    for (int64_t i = next++; i < count; i = next++) {
      const Task& task = tasks[i];
      const int64_t s = task.seq, cached = length[s] - (start[s + 1] - start[s]);
      const float* keys = packed.data() + offset[s] + task.kv_head * panel_floats(length[s], head_dim, lanes);
      attend_tokens(query, v_cache, keys, table + s * max_blocks, start[s], cached, task.first, task.last,
                    task.kv_head, num_heads, num_kv_heads, head_dim, block_size, scale, scratch, out);
    }
  });
}

// ------------------------------------------------------------ other arithmetic: SDPA per sequence
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

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                   const at::Tensor& block_tables, const at::Tensor& cu_seqlens_q,
                                   const at::Tensor& context_lens, double scale, bool widen) {
  for (const at::Tensor* t : {&query, &k_cache, &v_cache}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "paged_prefill_attention: contiguous CPU tensors only");
  }
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  query.size(2) == k_cache.size(3) && k_cache.size(2) > 0 && query.size(1) % k_cache.size(2) == 0,
              "paged_prefill_attention: query (tokens, heads, head_dim) and caches (blocks, block_size, kv_heads, "
              "head_dim) with heads a multiple of kv_heads expected, got ", query.sizes(), " and ", k_cache.sizes());
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_prefill_attention: query and caches must share a dtype");
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
    TORCH_CHECK(q_len >= 0 && q_len <= length[s] && length[s] <= max_blocks * block_size,
                "paged_prefill_attention: sequence ", s, " has ", q_len, " query tokens and context length ", length[s],
                "; allowed 0 <= query tokens <= context length <= ", max_blocks * block_size);
    for (int64_t b = 0; b < (length[s] + block_size - 1) / block_size; ++b) {
      const int64_t block = table[s * max_blocks + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_prefill_attention: sequence ", s, " block ", b, " is ", block,
                  "; the cache has blocks 0..", num_blocks - 1);
    }
  }
  at::Tensor out = at::empty_like(query);
  const bool float32_arithmetic = query.scalar_type() == at::kFloat || (widen && query.scalar_type() == at::kBFloat16);
  if (float32_arithmetic && query.size(2) % 32 == 0) {
    const float f_scale = static_cast<float>(scale);
    if (query.scalar_type() == at::kFloat) {
      tiled_attention<float>(query.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), table,
                             start, length, num_seqs, max_blocks, query.size(1), k_cache.size(2), query.size(2),
                             block_size, f_scale, out.data_ptr<float>());
    } else {
      using B = c10::BFloat16;
      tiled_attention<B>(query.data_ptr<B>(), k_cache.data_ptr<B>(), v_cache.data_ptr<B>(), table, start, length,
                         num_seqs, max_blocks, query.size(1), k_cache.size(2), query.size(2), block_size, f_scale,
                         out.data_ptr<B>());
    }
  } else {
    sdpa_per_sequence(query, k_cache, v_cache, table, start, length, num_seqs, max_blocks, scale, widen, out);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("paged_prefill_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor cu_seqlens_q, Tensor context_lens, float scale, bool widen) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoengine, CPU, m) {
  m.impl("paged_prefill_attention", &paged_prefill_attention);
}
