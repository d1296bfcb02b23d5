// Decode attention that reads each K/V row where it lies in the paged cache (chapter 10).
// The definition it must agree with is reference.paged_decode_attention.
//
// One query token per sequence. Each (sequence, KV head) is a task for PyTorch's threads: the
// query heads sharing that KV head (grouped-query attention) walk the sequence's block table once,
// each key row read once and dotted with every query of the group, each value row read once and
// added, weighted, into every output. Nothing is gathered or padded (the reference copies each
// sequence's keys and values), and a layer's decode attention is one call. The loop for one query
// token, attend_group, attends each prefill token too (paged_prefill_attention.cpp).
//
// Numerics: scores, softmax and the weighted sum are float32 whatever the cache dtype, every sum in
// an order fixed by this source. Written once over cpu_vec.h's Vec, eight or sixteen lanes as the
// library was built: a key's score is a chain of eight-lane products summed in a fixed order
// (sixteen lanes hold two keys' chains), so both builds compute the same bits.

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace nanoengine_cpu {
namespace {

// q (float32, D) . k (the cache's dtype, D)
template <typename T>
inline float dot(const float* q, const T* k, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), load8(k + d), acc);
  float sum = horizontal_sum(acc);
  for (; d < D; ++d) sum += q[d] * static_cast<float>(k[d]);
  return sum;
}

// out (float32, D) += p * v (the cache's dtype, D)
template <typename T>
inline void axpy(float p, const T* v, float* out, int64_t D) {
  const __m256 weight = _mm256_set1_ps(p);
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(out + d, _mm256_fmadd_ps(weight, load8(v + d), _mm256_loadu_ps(out + d)));
  for (; d < D; ++d) out[d] += p * static_cast<float>(v[d]);
}

// A head's K or V rows lie block after block in whatever order the block table gives: the
// hardware prefetcher, which follows strides within a page, starts again at every block. So the
// kernel asks for rows itself, some ahead of the ones it reads (24 measured a little faster than
// 8 or 64). A prefetch changes no value.
constexpr int64_t PREFETCH_AHEAD = 24;

template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < head_dim * static_cast<int64_t>(sizeof(T)); byte += 64) {
    _mm_prefetch(p + byte, _MM_HINT_T0);
  }
}

// The largest of x[0..n), eight lanes at a time (a scalar loop waits on its previous compare at
// every element: results/README.md). A maximum is exact whatever the order: std::max_element's value.
inline float max_of(const float* x, int64_t n) {
  __m256 lanes = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) lanes = _mm256_max_ps(lanes, _mm256_loadu_ps(x + i));
  float out[8];
  _mm256_storeu_ps(out, lanes);
  float top = *std::max_element(out, out + 8);
  for (; i < n; ++i) top = std::max(top, x[i]);
  return top;
}

// One head's scores (length of them, in a row padded to stride) scaled and exponentiated after
// subtracting their maximum, in place; returns 1 / their sum, what each weight is multiplied by
// (the padding is exponentiated, never summed).
inline float softmax_numerators(float* s, int64_t length, int64_t stride, float scale) {
  for (int64_t t = 0; t < length; ++t) s[t] *= scale;
  const __m256 top = _mm256_set1_ps(max_of(s, length));
  for (int64_t t = 0; t < stride; t += 8) _mm256_storeu_ps(s + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), top)));
  // summed eight lanes at a time (a scalar loop waits on its previous add at every element), the
  // lanes as horizontal_sum adds them, then the last length % 8 in order
  __m256 lanes = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= length; t += 8) lanes = _mm256_add_ps(lanes, _mm256_loadu_ps(s + t));
  float sum = horizontal_sum(lanes);
  for (; t < length; ++t) sum += s[t];
  return 1.0f / sum;
}

// Scores of KEYS keys (k[0..KEYS)) for G query heads: four registers of eight-lane chains, kEights
// keys to a register, each key row read and widened once for all G. q holds head h's values
// 8v..8v+7 at q[h * NV + v] (repeated in each group of eight lanes); out[h] receives its KEYS scores.
constexpr int KEYS = 4 * Vec::kEights;

template <typename T, int NV, int G>
inline void score_keys(const Vec* q, const T* const* k, float* const* out) {
  Vec a[G][4];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < 4; ++j) a[h][j] = Vec::zero();
  for (int v = 0; v < NV; ++v) {
    for (int j = 0; j < 4; ++j) {
      const Vec keys = Vec::load_eights(k + j * Vec::kEights, 8 * v);
      for (int h = 0; h < G; ++h) a[h][j] = Vec::fma(q[h * NV + v], keys, a[h][j]);
    }
  }
  for (int h = 0; h < G; ++h) Vec::eight_sums4(a[h], out[h]);
}

// Every key's score for the query heads g0..g0+G-1 (NV eight-lane vectors each); the last keys
// that do not fill a score_keys call one by one, by dot(), with the same bits.
template <typename T, int NV, int G>
void score_heads(const float* q, const T* k_cache, const T* v_cache, const int64_t* rows, int64_t length, int64_t g0,
                 int64_t head_dim, float* scores, int64_t stride) {
  Vec qv[G * NV];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < NV; ++v) qv[h * NV + v] = Vec::repeat_eight(q + (g0 + h) * head_dim + 8 * v);
  int64_t t = 0;
  for (; t + KEYS <= length; t += KEYS) {
    if (g0 == 0) {  // the first pass over the rows asks for the keys ahead and the values it will need
      for (int64_t i = t + PREFETCH_AHEAD; i < std::min(t + PREFETCH_AHEAD + KEYS, length); ++i) {
        prefetch_row(k_cache + rows[i], head_dim);
      }
      for (int64_t i = t; i < t + KEYS; ++i) prefetch_row(v_cache + rows[i], head_dim);
    }
    const T* k[KEYS];
    for (int i = 0; i < KEYS; ++i) k[i] = k_cache + rows[t + i];
    float* out[G];
    for (int h = 0; h < G; ++h) out[h] = scores + (g0 + h) * stride + t;
    score_keys<T, NV, G>(qv, k, out);
  }
  for (; t < length; ++t) {
    for (int h = 0; h < G; ++h) scores[(g0 + h) * stride + t] = dot(q + (g0 + h) * head_dim, k_cache + rows[t], head_dim);
  }
}

// out[h] = sum over t of weights[h][t] * value row t, for G heads: each value row read once, each
// output lane a chain of fused multiply-adds in token order (the same bits at any width).
template <typename T, int NW, int G>
void add_values(const float* weights, int64_t stride, const T* v_cache, const int64_t* rows, int64_t length, float* out,
                int64_t head_dim) {
  Vec a[G][NW];
  for (int h = 0; h < G; ++h)
    for (int w = 0; w < NW; ++w) a[h][w] = Vec::zero();
  for (int64_t t = 0; t < length; ++t) {
    Vec value[NW];
    for (int w = 0; w < NW; ++w) value[w] = Vec::load(v_cache + rows[t] + Vec::kLanes * w);
    for (int h = 0; h < G; ++h) {
      const Vec weight = Vec::splat(weights[h * stride + t]);
      for (int w = 0; w < NW; ++w) a[h][w] = Vec::fma(weight, value[w], a[h][w]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int w = 0; w < NW; ++w) a[h][w].store(out + h * head_dim + Vec::kLanes * w);
}

// How many heads one call takes: as many as the group has left, at most MAX_HEADS, while their
// accumulators fill at most half of the registers (more spill to memory and run slower).
template <int PER_HEAD, int MAX_HEADS>
constexpr bool fits(int heads) {
  return heads <= MAX_HEADS && heads * PER_HEAD <= Vec::kRegisters / 2;
}

// The attention of one (sequence, KV head) task for head_dim = NV * 8: the group's query heads in
// q (float32), their outputs into acc. Scores of as many heads at a time as fit, each head's
// softmax, then the weighted values.
template <typename T, int NV>
void attend(const float* q, const T* k_cache, const T* v_cache, const int64_t* rows, int64_t length, int64_t group,
            int64_t head_dim, float scale, std::vector<float>& scores, float* acc) {
  static_assert(NV % Vec::kEights == 0, "whole vectors of output");
  constexpr int NW = NV / Vec::kEights;  // vectors in one head's output
  const int64_t stride = (length + 7) / 8 * 8;  // a row of scores, padded to whole vectors
  scores.assign(group * stride, 0.0f);          // scores[g * stride + t]
  for (int64_t g = 0; g < group;) {
    const int64_t left = group - g;
    if constexpr (fits<4, 3>(3)) {
      if (left >= 3) { score_heads<T, NV, 3>(q, k_cache, v_cache, rows, length, g, head_dim, scores.data(), stride); g += 3; continue; }
    }
    if (left >= 2) { score_heads<T, NV, 2>(q, k_cache, v_cache, rows, length, g, head_dim, scores.data(), stride); g += 2; continue; }
    score_heads<T, NV, 1>(q, k_cache, v_cache, rows, length, g, head_dim, scores.data(), stride);
    g += 1;
  }
  for (int64_t g = 0; g < group; ++g) {  // each score becomes its value row's weight
    float* s = scores.data() + g * stride;
    const float inv_sum = softmax_numerators(s, length, stride, scale);
    for (int64_t t = 0; t < length; ++t) s[t] *= inv_sum;
  }
  for (int64_t g = 0; g < group;) {
    const int64_t left = group - g;
    const float* w = scores.data() + g * stride;
    float* out = acc + g * head_dim;
    if constexpr (fits<NW, 4>(4)) {
      if (left >= 4) { add_values<T, NW, 4>(w, stride, v_cache, rows, length, out, head_dim); g += 4; continue; }
    }
    if constexpr (fits<NW, 3>(3)) {
      if (left >= 3) { add_values<T, NW, 3>(w, stride, v_cache, rows, length, out, head_dim); g += 3; continue; }
    }
    if constexpr (fits<NW, 2>(2)) {
      if (left >= 2) { add_values<T, NW, 2>(w, stride, v_cache, rows, length, out, head_dim); g += 2; continue; }
    }
    add_values<T, NW, 1>(w, stride, v_cache, rows, length, out, head_dim);
    g += 1;
  }
}

// Any other head_dim: one head at a time, accumulators in memory, eight lanes and a scalar tail.
template <typename T>
void attend_any(const float* q, const T* k_cache, const T* v_cache, const int64_t* rows, int64_t length, int64_t group,
                int64_t head_dim, float scale, std::vector<float>& scores, float* acc) {
  const int64_t stride = (length + 7) / 8 * 8;
  scores.assign(stride, 0.0f);
  for (int64_t g = 0; g < group; ++g) {
    for (int64_t t = 0; t < length; ++t) scores[t] = dot(q + g * head_dim, k_cache + rows[t], head_dim);
    const float inv_sum = softmax_numerators(scores.data(), length, stride, scale);
    float* out = acc + g * head_dim;
    std::fill(out, out + head_dim, 0.0f);
    for (int64_t t = 0; t < length; ++t) axpy(scores[t] * inv_sum, v_cache + rows[t], out, head_dim);
  }
}

template <typename T, typename Index>
void decode_kernel(const T* query, const T* k_cache, const T* v_cache, const Index* block_tables,
                   const Index* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale) {
  const int64_t group = num_heads / num_kv_heads;
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    AttendScratch scratch;
    std::vector<int64_t> rows;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t length = static_cast<int64_t>(context_lens[seq]);
      kv_rows(block_tables + seq * max_blocks, length, block_size, num_kv_heads, kv_head, head_dim, rows);
      const int64_t first = (seq * num_heads + kv_head * group) * head_dim;  // the group's heads are adjacent
      attend_group(query + first, k_cache, v_cache, rows.data(), length, group, head_dim, scale, scratch, out + first);
    }
  });
}

}  // namespace

template <typename T>
void attend_group(const T* query, const T* k_cache, const T* v_cache, const int64_t* rows, int64_t length, int64_t group,
                  int64_t head_dim, float scale, AttendScratch& scratch, T* out) {
  std::vector<float>& q = scratch.query;
  std::vector<float>& acc = scratch.out;
  q.resize(group * head_dim);
  acc.resize(group * head_dim);
  for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(query[i]);
  switch (head_dim) {  // the common head sizes keep their accumulators in registers
    case 64: attend<T, 8>(q.data(), k_cache, v_cache, rows, length, group, head_dim, scale, scratch.scores, acc.data()); break;
    case 128: attend<T, 16>(q.data(), k_cache, v_cache, rows, length, group, head_dim, scale, scratch.scores, acc.data()); break;
    case 32: attend<T, 4>(q.data(), k_cache, v_cache, rows, length, group, head_dim, scale, scratch.scores, acc.data()); break;
    default: attend_any<T>(q.data(), k_cache, v_cache, rows, length, group, head_dim, scale, scratch.scores, acc.data()); break;
  }
  for (int64_t i = 0; i < group * head_dim; ++i) out[i] = static_cast<T>(acc[i]);
}

template void attend_group(const float*, const float*, const float*, const int64_t*, int64_t, int64_t, int64_t, float,
                           AttendScratch&, float*);
template void attend_group(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, const int64_t*, int64_t,
                           int64_t, int64_t, float, AttendScratch&, c10::BFloat16*);

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale) {
  check_query_and_caches("paged_decode_attention", query, k_cache, v_cache);
  check_cpu_contiguous("paged_decode_attention", {&block_tables, &context_lens});
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && block_tables.size(0) == query.size(0) &&
                  context_lens.size(0) == query.size(0) && block_tables.scalar_type() == context_lens.scalar_type(),
              "paged_decode_attention: block_tables (seqs, max_blocks) and context_lens (seqs,) of one integer dtype");
  at::Tensor out = at::empty_like(query);
  if (query.size(0) == 0) return out;
  const int64_t num_seqs = query.size(0), num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t max_blocks = block_tables.size(1);
  dispatch_float_or_bfloat16(query.scalar_type(), "paged_decode_attention", [&](auto zero) {
    using T = decltype(zero);
    dispatch_index(block_tables.scalar_type(), "paged_decode_attention", [&](auto index_zero) {
      using Index = decltype(index_zero);
      const Index* tables = block_tables.data_ptr<Index>();
      const Index* lens = context_lens.data_ptr<Index>();
      for (int64_t seq = 0; seq < num_seqs; ++seq) {
        check_block_table("paged_decode_attention", seq, tables + seq * max_blocks, static_cast<int64_t>(lens[seq]),
                          1, max_blocks, block_size, num_blocks);
      }
      decode_kernel<T, Index>(query.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), tables, lens,
                              out.data_ptr<T>(), num_seqs, query.size(1), k_cache.size(2), query.size(2), block_size,
                              max_blocks, static_cast<float>(scale));
    });
  });
  return out;
}

}  // namespace nanoengine_cpu

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale) -> Tensor",
        torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(nanoengine_cpu::paged_decode_attention)));
}
