// Small vector helpers shared by the native CPU kernels (cpu_native.py builds them): eight-lane
// AVX2 functions, and Vec, as wide as the build's instruction set allows.
#pragma once

#include <c10/util/BFloat16.h>

#include <immintrin.h>

namespace nanoengine_cpu {

// Eight values as float32 lanes: float loads directly, bfloat16 is the top half of a float.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const c10::BFloat16* p) {
  __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

// Eight float32 lanes rounded to bfloat16 as c10::BFloat16(float) rounds one value: to nearest,
// ties to even (add 0x7FFF plus the kept part's lowest bit, drop the low 16 bits), NaN to 0x7FC0.
// Each lane's 16 bits come back in the low half of its 32-bit lane.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lowest_kept = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lowest_kept, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), is_nan));
}

// A value rounded to T and widened back: what static_cast<float>(static_cast<T>(v)) gives.
inline __m256 round_to(__m256 v, const float*) { return v; }
inline __m256 round_to(__m256 v, const c10::BFloat16*) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }

// Eight float32 lanes stored as T (bfloat16: rounded as c10::BFloat16(float) rounds).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }

inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = bf16_bits8(v);  // each fits 16 bits, so the unsigned saturating pack is exact
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// The eight lanes added in a fixed order: ((0+4)+(2+6)) + ((1+5)+(3+7)).
inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// e^x for eight lanes, accurate to about one float32 ulp: x = n ln2 + r with |r| <= ln2 / 2,
// e^r by a degree-7 polynomial (the coefficients of the Cephes library's expf), 2^n by
// writing n into the exponent bits. Inputs are clamped to [-87, 88] (where float32 ends).
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in two so that n * (high part) is exact
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));  // p r^2 + r + 1
  const __m256i exponent = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

// Vec: the widest float32 vector of the instruction set this library is built for (AVX-512 or
// AVX2: cpu_native.py), in the spirit of vLLM's cpu_types.hpp. A kernel written over Vec is one
// source for both; this file alone knows the intrinsics. A Vec also holds "eights": kEights groups
// of eight lanes, one per row, so that chains of eight-lane sums can run several rows to a register
// and still add in exactly an eight-lane build's order (the same bits on either build).
#if defined(__AVX512F__)

struct Vec {
  static constexpr int kLanes = 16;
  static constexpr int kEights = 2;
  static constexpr int kRegisters = 32;
  __m512 v;

  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec splat(float x) { return {_mm512_set1_ps(x)}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const c10::BFloat16* p) {
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16))};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a * b + c, one rounding
  // Eight float32 values repeated in both groups.
  static Vec repeat_eight(const float* p) { return {_mm512_broadcast_f32x8(_mm256_loadu_ps(p))}; }
  // Eight values of rows[0] + offset in lanes 0-7, of rows[1] + offset in lanes 8-15.
  static Vec load_eights(const float* const* rows, int64_t offset) {
    return {_mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(rows[0] + offset)),
                               _mm256_loadu_ps(rows[1] + offset), 1)};
  }
  static Vec load_eights(const c10::BFloat16* const* rows, int64_t offset) {
    const __m256i halves = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[0] + offset))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[1] + offset)), 1);
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16))};
  }
  // The sum of each group of eight lanes of a[0..3], added as horizontal_sum adds eight lanes,
  // into out[0..7] (a[0]'s two groups first). The steps: each group's halves (lanes i + i+4),
  // then lanes 0+2 and 1+3, then those two; the eight sums gathered from lanes 0, 4, 8, ...
  static void eight_sums4(const Vec* a, float* out) {
    const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512 sums = _mm512_permutex2var_ps(sums_of_two(a[0].v, a[1].v), firsts, sums_of_two(a[2].v, a[3].v));
    _mm256_storeu_ps(out, _mm512_castps512_ps256(sums));
  }

 private:
  // The four groups' sums of ab and cd, in lanes 0, 4, 8 and 12.
  static __m512 sums_of_two(__m512 ab, __m512 cd) {
    const __m512 lows = _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0));   // each group's lanes 0-3
    const __m512 highs = _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1));  // each group's lanes 4-7
    __m512 s = _mm512_add_ps(lows, highs);
    s = _mm512_add_ps(s, _mm512_permute_ps(s, _MM_SHUFFLE(3, 2, 3, 2)));  // movehl: lanes 0+2, 1+3
    return _mm512_add_ps(s, _mm512_movehdup_ps(s));                       // movehdup: (0+2) + (1+3)
  }
};

#else

struct Vec {
  static constexpr int kLanes = 8;
  static constexpr int kEights = 1;
  static constexpr int kRegisters = 16;
  __m256 v;

  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec splat(float x) { return {_mm256_set1_ps(x)}; }
  template <typename T>
  static Vec load(const T* p) { return {load8(p)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec repeat_eight(const float* p) { return {_mm256_loadu_ps(p)}; }
  template <typename T>
  static Vec load_eights(const T* const* rows, int64_t offset) { return {load8(rows[0] + offset)}; }
  static void eight_sums4(const Vec* a, float* out) {
    for (int j = 0; j < 4; ++j) out[j] = horizontal_sum(a[j].v);
  }
};

#endif

}  // namespace nanoengine_cpu
