// Decode attention that reads each K/V row where it lies in the paged cache (chapter 10).
// Built with few_rows_linear.cpp by cpu_native.py; the operator is
// torch.ops.nanoengine.paged_decode_attention. The definition it must agree with is
// reference.paged_decode_attention.
//
// One query token per sequence. For each (sequence, KV head) -- one task for PyTorch's
// threads -- the query heads that share that KV head (grouped-query attention) walk the
// sequence's block table once: each key row is read once and dotted with every query of the
// group, each value row is read once and added, weighted, into every query's output. Nothing
// is gathered or padded: the batched PyTorch version (cpu_attention.py) copies each group's
// keys into one tensor and pays a dozen tensor ops per layer, which is most of a one-sequence
// decode step's attention time.
//
// Numerics: scores, softmax and the weighted sum are float32 whatever the cache dtype; the
// order of every sum is fixed by this source (not by the CPU, the threads or the batch).
//
// Two paths with one result: attend() in AVX2 runs everywhere; attend_wide() runs on CPUs with
// AVX-512 and computes the same bits with fewer instructions, reading each K and V row once
// for all the query heads that share it (faster on batch-32 decode attention, bf16 most:
// results/README.md). tests/engine/test_cpu_native.py compares the two bit for bit.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "avx2_vec.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

using nanoengine_cpu::exp8;
using nanoengine_cpu::horizontal_sum;
using nanoengine_cpu::cpu_has_avx512;
using nanoengine_cpu::load8;
using nanoengine_cpu::load16;

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

// Four key rows against one query (float32, NV * 8 values): four independent chains of FMAs
// (one chain, as in dot(), waits on itself every step). Each result has dot()'s bits.
template <typename T, int NV>
inline void dot4(const float* q, const T* k0, const T* k1, const T* k2, const T* k3, float* out) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int v = 0; v < NV; ++v) {
    const __m256 qv = _mm256_loadu_ps(q + 8 * v);
    a0 = _mm256_fmadd_ps(qv, load8(k0 + 8 * v), a0);
    a1 = _mm256_fmadd_ps(qv, load8(k1 + 8 * v), a1);
    a2 = _mm256_fmadd_ps(qv, load8(k2 + 8 * v), a2);
    a3 = _mm256_fmadd_ps(qv, load8(k3 + 8 * v), a3);
  }
  out[0] = horizontal_sum(a0);
  out[1] = horizontal_sum(a1);
  out[2] = horizontal_sum(a2);
  out[3] = horizontal_sum(a3);
}

// A head's K or V row lies in cache lines of its own, one block of the cache after another
// in whatever order the block table gives: the hardware prefetcher, which follows strides
// within a page, starts again at every block. So the kernel asks for rows itself, some
// ahead of the ones it reads (24 rows measured a little faster than 8 or 64 with batch-32
// contexts of 100-320 tokens). A prefetch changes no value.
constexpr int64_t PREFETCH_AHEAD = 24;

template <typename T>
inline void prefetch_row(const T* row, int64_t head_dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t byte = 0; byte < head_dim * static_cast<int64_t>(sizeof(T)); byte += 64) {
    _mm_prefetch(p + byte, _MM_HINT_T0);
  }
}

// The largest of x[0..n): eight lanes at a time. A maximum is exact whatever the order, so
// this is std::max_element's value; a scalar loop waited on its previous compare at every
// element (a measurable share of a decode's attention time, with perf: results/README.md).
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
  float sum = 0.0f;
  for (int64_t t = 0; t < length; ++t) sum += s[t];
  return 1.0f / sum;
}

// The attention of one (sequence, KV head) task. NV > 0: head_dim is NV * 8 and the output
// accumulators stay in registers; NV == 0: any head_dim, accumulators in memory. Both add
// in the same order, so they give the same bits.
template <typename T, int NV>
void attend(const float* q, const T* k_cache, const T* v_cache, const std::vector<int64_t>& rows, int64_t group,
            int64_t head_dim, float scale, std::vector<float>& scores, float* acc) {
  const int64_t length = static_cast<int64_t>(rows.size());
  const int64_t stride = (length + 7) / 8 * 8;  // a row of scores, padded to whole vectors
  scores.assign(group * stride, 0.0f);          // scores[g * stride + t]
  for (int64_t g = 0; g < group; ++g) {
    const float* qg = q + g * head_dim;
    float* s = scores.data() + g * stride;
    int64_t t = 0;
    if (NV > 0) {
      for (; t + 4 <= length; t += 4) {
        if (g == 0) {  // the first pass over the rows asks for the keys ahead and the values it will need
          for (int64_t i = t + PREFETCH_AHEAD; i < std::min(t + PREFETCH_AHEAD + 4, length); ++i) {
            prefetch_row(k_cache + rows[i], head_dim);
          }
          for (int64_t i = t; i < t + 4; ++i) prefetch_row(v_cache + rows[i], head_dim);
        }
        dot4<T, NV>(qg, k_cache + rows[t], k_cache + rows[t + 1], k_cache + rows[t + 2], k_cache + rows[t + 3], s + t);
      }
    }
    for (; t < length; ++t) s[t] = dot(qg, k_cache + rows[t], head_dim);
    const float inv_sum = softmax_numerators(s, length, stride, scale);
    float* out = acc + g * head_dim;
    if (NV > 0) {
      __m256 a[NV > 0 ? NV : 1];
      for (int v = 0; v < NV; ++v) a[v] = _mm256_setzero_ps();
      for (t = 0; t < length; ++t) {
        const __m256 weight = _mm256_set1_ps(s[t] * inv_sum);
        const T* row = v_cache + rows[t];
        for (int v = 0; v < NV; ++v) a[v] = _mm256_fmadd_ps(weight, load8(row + 8 * v), a[v]);
      }
      for (int v = 0; v < NV; ++v) _mm256_storeu_ps(out + 8 * v, a[v]);
    } else {
      std::fill(out, out + head_dim, 0.0f);
      for (t = 0; t < length; ++t) axpy(s[t] * inv_sum, v_cache + rows[t], out, head_dim);
    }
  }
}

// ---------------------------------------------------------------- the same, sixteen lanes wide
// On a CPU with AVX-512 the attention of one task runs in registers twice as wide, and computes
// exactly what attend() computes: every lane holds the same value, summed in the same order.
// * Scores: one 512-bit accumulator holds two keys, eight lanes each, so each half is dot()'s
//   chain for its key (the query is repeated in both halves); eight keys' chains are then added
//   across lanes in horizontal_sum's order, four keys per register at every step.
// * Softmax: attend()'s own (softmax_numerators), eight lanes wide: a small share of the task.
// * Values: each output lane's chain of FMAs over the tokens, sixteen output lanes per register.
// So the bits do not depend on which path ran (tests compare both), only the time: fewer
// instructions, and each K/V row loaded and widened once for all the heads that share it.
// Compiled for AVX-512 by a target pragma on these functions alone (the rest of the library
// stays AVX2) and called only when the CPU reports AVX-512F, BW and DQ.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl")

// Eight values of row a in lanes 0-7 and eight of row b in lanes 8-15.
inline __m512 load_pair(const float* a, const float* b) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(a)), _mm256_loadu_ps(b), 1);
}

inline __m512 load_pair(const c10::BFloat16* a, const c10::BFloat16* b) {
  const __m256i halves = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a))),
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(b)), 1);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// Four keys' eight-lane chains (two per register: ab = [key 0 | key 1], cd = [key 2 | key 3])
// added as horizontal_sum adds one: the halves (lanes i + i+4), then lanes 0+2 and 1+3, then
// those two. The four sums come back in lanes 0, 4, 8 and 12.
inline __m512 horizontal_sums4(__m512 ab, __m512 cd) {
  const __m512 lows = _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0));   // each key's lanes 0-3
  const __m512 highs = _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1));  // each key's lanes 4-7
  __m512 s = _mm512_add_ps(lows, highs);
  s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(3, 2, 3, 2)));  // movehl: lanes 0+2, 1+3
  return _mm512_add_ps(s, _mm512_movehdup_ps(s));                       // movehdup: (0+2) + (1+3)
}

// Eight key rows against G queries (the heads that share them), each result with dot()'s bits:
// a pair of rows is read and widened once for all G. q2[h * NV + v] holds query h's values
// 8v..8v+7 in both halves; out[h] receives query h's eight scores.
template <typename T, int NV, int G>
inline void dot8_wide(const __m512* q2, const T* const* k, float* const* out) {
  __m512 a[G][4];
  for (int h = 0; h < G; ++h)
    for (int j = 0; j < 4; ++j) a[h][j] = _mm512_setzero_ps();
  for (int v = 0; v < NV; ++v) {
    for (int j = 0; j < 4; ++j) {
      const __m512 pair = load_pair(k[2 * j] + 8 * v, k[2 * j + 1] + 8 * v);
      for (int h = 0; h < G; ++h) a[h][j] = _mm512_fmadd_ps(q2[h * NV + v], pair, a[h][j]);
    }
  }
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int h = 0; h < G; ++h) {
    const __m512 sums = _mm512_permutex2var_ps(horizontal_sums4(a[h][0], a[h][1]), firsts,
                                               horizontal_sums4(a[h][2], a[h][3]));
    _mm256_storeu_ps(out[h], _mm512_castps512_ps256(sums));
  }
}

// Every key's score for the group's queries g0..g0+G-1, eight keys at a time (the rest: dot4, dot).
template <typename T, int NV, int G>
inline void scores_wide(const float* q, const T* k_cache, const T* v_cache, const std::vector<int64_t>& rows,
                        int64_t g0, int64_t head_dim, float* scores, int64_t stride) {
  const int64_t length = static_cast<int64_t>(rows.size());
  alignas(64) __m512 q2[G * NV];
  for (int h = 0; h < G; ++h)
    for (int v = 0; v < NV; ++v) q2[h * NV + v] = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + (g0 + h) * head_dim + 8 * v));
  int64_t t = 0;
  for (; t + 8 <= length; t += 8) {
    if (g0 == 0) {  // the first pass over the rows asks for the keys ahead and the values it will need
      for (int64_t i = t + PREFETCH_AHEAD; i < std::min(t + PREFETCH_AHEAD + 8, length); ++i) {
        prefetch_row(k_cache + rows[i], head_dim);
      }
      for (int64_t i = t; i < t + 8; ++i) prefetch_row(v_cache + rows[i], head_dim);
    }
    const T* k[8];
    for (int i = 0; i < 8; ++i) k[i] = k_cache + rows[t + i];
    float* out[G];
    for (int h = 0; h < G; ++h) out[h] = scores + (g0 + h) * stride + t;
    dot8_wide<T, NV, G>(q2, k, out);
  }
  for (int h = 0; h < G; ++h) {
    const float* qg = q + (g0 + h) * head_dim;
    float* s = scores + (g0 + h) * stride;
    int64_t r = t;
    for (; r + 4 <= length; r += 4) {
      if (g0 == 0 && h == 0) for (int64_t i = r; i < r + 4; ++i) prefetch_row(v_cache + rows[i], head_dim);
      dot4<T, NV>(qg, k_cache + rows[r], k_cache + rows[r + 1], k_cache + rows[r + 2], k_cache + rows[r + 3], s + r);
    }
    for (; r < length; ++r) s[r] = dot(qg, k_cache + rows[r], head_dim);
  }
}

// out[h] = sum over t of weight[h][t] * value row t, for G heads at once: attend()'s chain for each
// head and lane (a fused multiply-add per token, in token order), sixteen lanes per register.
template <typename T, int NV, int G>
inline void add_values_wide(const float* weights, const T* v_cache, const std::vector<int64_t>& rows, int64_t stride,
                            float* out, int64_t head_dim) {
  const int64_t length = static_cast<int64_t>(rows.size());
  __m512 a[G][NV / 2];
  for (int h = 0; h < G; ++h)
    for (int w = 0; w < NV / 2; ++w) a[h][w] = _mm512_setzero_ps();
  for (int64_t t = 0; t < length; ++t) {
    const T* row = v_cache + rows[t];
    __m512 value[NV / 2];
    for (int w = 0; w < NV / 2; ++w) value[w] = load16(row + 16 * w);
    for (int h = 0; h < G; ++h) {
      const __m512 weight = _mm512_set1_ps(weights[h * stride + t]);
      for (int w = 0; w < NV / 2; ++w) a[h][w] = _mm512_fmadd_ps(weight, value[w], a[h][w]);
    }
  }
  for (int h = 0; h < G; ++h)
    for (int w = 0; w < NV / 2; ++w) _mm512_storeu_ps(out + h * head_dim + 16 * w, a[h][w]);
}

// attend<T, NV>() for NV > 0, sixteen lanes wide: the same scores, softmax and outputs, bit for bit.
template <typename T, int NV>
void attend_wide(const float* q, const T* k_cache, const T* v_cache, const std::vector<int64_t>& rows, int64_t group,
                 int64_t head_dim, float scale, std::vector<float>& scores, float* acc) {
  static_assert(NV > 0 && NV % 2 == 0, "whole 512-bit registers of output");
  const int64_t length = static_cast<int64_t>(rows.size());
  const int64_t stride = (length + 7) / 8 * 8;
  scores.assign(group * stride, 0.0f);
  for (int64_t g = 0; g < group;) {  // scores: up to three heads share each key row's loads
    const int64_t left = group - g;
    if (left >= 3 && NV <= 8) {
      scores_wide<T, NV, (NV <= 8 ? 3 : 1)>(q, k_cache, v_cache, rows, g, head_dim, scores.data(), stride);
      g += 3;
    } else if (left >= 2) {
      scores_wide<T, NV, 2>(q, k_cache, v_cache, rows, g, head_dim, scores.data(), stride);
      g += 2;
    } else {
      scores_wide<T, NV, 1>(q, k_cache, v_cache, rows, g, head_dim, scores.data(), stride);
      g += 1;
    }
  }
  for (int64_t g = 0; g < group; ++g) {  // softmax, head by head, as attend() computes it
    float* s = scores.data() + g * stride;
    const float inv_sum = softmax_numerators(s, length, stride, scale);
    for (int64_t t = 0; t < length; ++t) s[t] *= inv_sum;  // the weight attend() computes for each value row
  }
  // Values: each row read and widened once for the whole group, G heads' chains side by side
  // (one head's chain of FMAs waits on itself at every token; several do not wait on each other).
  const float* weights = scores.data();
  for (int64_t g = 0; g < group;) {  // up to four heads at a time, while their accumulators fit in 16 registers
    const int64_t left = group - g;
    const float* w = weights + g * stride;
    float* out = acc + g * head_dim;
    if (left >= 4 && 2 * NV <= 16) {
      add_values_wide<T, NV, (2 * NV <= 16 ? 4 : 1)>(w, v_cache, rows, stride, out, head_dim);
      g += 4;
    } else if (left == 3 && 3 * NV / 2 <= 16) {
      add_values_wide<T, NV, (3 * NV / 2 <= 16 ? 3 : 1)>(w, v_cache, rows, stride, out, head_dim);
      g += 3;
    } else if (left >= 2 && NV <= 16) {
      add_values_wide<T, NV, 2>(w, v_cache, rows, stride, out, head_dim);
      g += 2;
    } else {
      add_values_wide<T, NV, 1>(w, v_cache, rows, stride, out, head_dim);
      g += 1;
    }
  }
}

#pragma GCC pop_options

template <typename T, typename Index>
void decode_kernel(const T* query, const T* k_cache, const T* v_cache, const Index* block_tables,
                   const Index* context_lens, T* out, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,
                   int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale, bool wide) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t row_stride = num_kv_heads * head_dim;  // between consecutive tokens of a block
  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
    std::vector<int64_t> rows;  // where token t's K/V row of this head starts in the cache
    for (int64_t task = begin; task < end; ++task) {
      const int64_t seq = task / num_kv_heads, kv_head = task % num_kv_heads;
      const int64_t length = static_cast<int64_t>(context_lens[seq]);
      const Index* table = block_tables + seq * max_blocks;
      rows.resize(length);
      for (int64_t t = 0; t < length; ++t) {
        const int64_t slot = static_cast<int64_t>(table[t / block_size]) * block_size + t % block_size;
        rows[t] = slot * row_stride + kv_head * head_dim;
      }
      const T* q_in = query + (seq * num_heads + kv_head * group) * head_dim;  // the group's heads are adjacent
      for (int64_t i = 0; i < group * head_dim; ++i) q[i] = static_cast<float>(q_in[i]);
      switch (head_dim) {  // the common head sizes get register accumulators (and sixteen lanes where there are)
        case 64: (wide ? attend_wide<T, 8> : attend<T, 8>)(q.data(), k_cache, v_cache, rows, group, head_dim, scale,
                                                           scores, acc.data()); break;
        case 128: (wide ? attend_wide<T, 16> : attend<T, 16>)(q.data(), k_cache, v_cache, rows, group, head_dim, scale,
                                                              scores, acc.data()); break;
        case 32: (wide ? attend_wide<T, 4> : attend<T, 4>)(q.data(), k_cache, v_cache, rows, group, head_dim, scale,
                                                           scores, acc.data()); break;
        default: attend<T, 0>(q.data(), k_cache, v_cache, rows, group, head_dim, scale, scores, acc.data()); break;
      }
      T* o = out + (seq * num_heads + kv_head * group) * head_dim;
      for (int64_t i = 0; i < group * head_dim; ++i) o[i] = static_cast<T>(acc[i]);
    }
  });
}

template <typename Index>
void check_tables(const Index* block_tables, const Index* context_lens, int64_t num_seqs, int64_t max_blocks,
                  int64_t block_size, int64_t num_blocks) {
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t length = static_cast<int64_t>(context_lens[seq]);
    TORCH_CHECK(length >= 1 && length <= max_blocks * block_size, "paged_decode_attention: sequence ", seq,
                " has context length ", length, "; allowed 1..", max_blocks * block_size, " (its block table's capacity)");
    for (int64_t b = 0; b < (length + block_size - 1) / block_size; ++b) {
      const int64_t block = static_cast<int64_t>(block_tables[seq * max_blocks + b]);
      TORCH_CHECK(block >= 0 && block < num_blocks, "paged_decode_attention: sequence ", seq, " block ", b, " is ",
                  block, "; the cache has blocks 0..", num_blocks - 1);
    }
  }
}

template <typename T, typename Index>
void dispatch_cache(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& block_tables, const at::Tensor& context_lens, at::Tensor& out, double scale,
                    bool wide) {
  const int64_t num_blocks = k_cache.size(0), block_size = k_cache.size(1);
  const int64_t num_seqs = query.size(0), max_blocks = block_tables.size(1);
  check_tables(block_tables.data_ptr<Index>(), context_lens.data_ptr<Index>(), num_seqs, max_blocks, block_size,
               num_blocks);
  decode_kernel<T, Index>(query.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                          block_tables.data_ptr<Index>(), context_lens.data_ptr<Index>(), out.data_ptr<T>(), num_seqs,
                          query.size(1), k_cache.size(2), query.size(2), block_size, max_blocks,
                          static_cast<float>(scale), wide);
}

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens, double scale,
                                  bool avx512) {
  for (const at::Tensor* t : {&query, &k_cache, &v_cache, &block_tables, &context_lens}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "paged_decode_attention: contiguous CPU tensors only");
  }
  TORCH_CHECK(query.dim() == 3 && k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "paged_decode_attention: query (seqs, heads, head_dim) and caches (blocks, block_size, kv_heads, "
              "head_dim) expected, got ", query.sizes(), ", ", k_cache.sizes(), " and ", v_cache.sizes());
  TORCH_CHECK(query.size(1) > 0 && query.size(2) > 0 && k_cache.size(1) > 0 && k_cache.size(2) > 0,
              "paged_decode_attention: heads, head_dim, block_size and kv_heads must be >= 1, got query ",
              query.sizes(), " and cache ", k_cache.sizes());
  TORCH_CHECK(query.size(2) == k_cache.size(3) && query.size(1) % k_cache.size(2) == 0,
              "paged_decode_attention: head_dim must match and heads must be a multiple of kv_heads, got query ",
              query.sizes(), " and cache ", k_cache.sizes());
  TORCH_CHECK(query.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode_attention: query and caches must share a dtype");
  TORCH_CHECK(block_tables.dim() == 2 && context_lens.dim() == 1 && block_tables.size(0) == query.size(0) &&
                  context_lens.size(0) == query.size(0) && block_tables.scalar_type() == context_lens.scalar_type(),
              "paged_decode_attention: block_tables (seqs, max_blocks) and context_lens (seqs,) of one integer dtype");
  at::Tensor out = at::empty_like(query);
  if (query.size(0) == 0) return out;
  const bool wide = avx512 && cpu_has_avx512();  // the same bits either way
  const bool long_tables = block_tables.scalar_type() == at::kLong;
  TORCH_CHECK(long_tables || block_tables.scalar_type() == at::kInt, "paged_decode_attention: int32 or int64 tables");
  if (query.scalar_type() == at::kFloat) {
    if (long_tables) dispatch_cache<float, int64_t>(query, k_cache, v_cache, block_tables, context_lens, out, scale, wide);
    else dispatch_cache<float, int32_t>(query, k_cache, v_cache, block_tables, context_lens, out, scale, wide);
  } else if (query.scalar_type() == at::kBFloat16) {
    if (long_tables) {
      dispatch_cache<c10::BFloat16, int64_t>(query, k_cache, v_cache, block_tables, context_lens, out, scale, wide);
    } else {
      dispatch_cache<c10::BFloat16, int32_t>(query, k_cache, v_cache, block_tables, context_lens, out, scale, wide);
    }
  } else {
    TORCH_CHECK(false, "paged_decode_attention: float32 or bfloat16 only, got ", query.scalar_type());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("paged_decode_attention(Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, bool avx512=True) -> Tensor");
}

TORCH_LIBRARY_IMPL(nanoengine, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
