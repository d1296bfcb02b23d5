// The rotary embedding in one pass over a step's queries and keys (chapter 10). The definition it
// must agree with, bit for bit, is layers/rotary.py's rotate_half: eager PyTorch makes six passes
// (a cast, two products, the halves swapped, a sum, a cast back); this loop computes the same
// products and sum in the same order, in float32, once per element.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "ops.h"

namespace nanoengine_cpu {
namespace {

template <typename T>
inline void rotate_head(const T* x, const float* cos, const float* sin, T* out, int64_t d) {
  const int64_t half = d / 2;
  if (half % 8 == 0) {
    for (int64_t i = 0; i < half; i += 8) {
      const __m256 lo = load8(x + i), hi = load8(x + half + i);
      store8(out + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                    _mm256_mul_ps(hi, _mm256_loadu_ps(sin + i))));
      store8(out + half + i, _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + i)),
                                           _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + i))));
    }
    return;
  }
  for (int64_t i = 0; i < d; ++i) {
    const float a = static_cast<float>(x[i]) * cos[i];
    const float b = static_cast<float>(x[i < half ? i + half : i - half]) * sin[i];
    out[i] = static_cast<T>(a + b);
  }
}

// x (T, heads, d) with each token's heads contiguous; cos, sin (T, 1, d) float32 -> a rotated copy.
template <typename T>
void rotate_into(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), token_stride = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  // A (token, head) pair is a task, at least 64 to a thread (a round figure, not tuned): one
  // decoding sequence's 20 heads are too few to split.
  at::parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const int64_t t = w / heads, h = w % heads;
      rotate_head(xp + t * token_stride + h * d, cp + t * d, sp + t * d, op + w * d, d);
    }
  });
}

}  // namespace

// One head: out_i = x_i cos_i + x_(i +- d/2) sin_i (sin is signed, [-sin | sin]), each product
// rounded and then the sum, in float32.
at::Tensor rotate_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotate_half: x (tokens, heads, head_dim) on the CPU with each token's heads contiguous expected, got "
              "sizes ", x.sizes(), " strides ", x.strides());
  TORCH_CHECK(x.size(2) % 2 == 0, "rotate_half: head_dim must be even, got ", x.size(2));
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 && t->size(0) == x.size(0) &&
                    t->size(1) == 1 && t->size(2) == x.size(2),
                "rotate_half: cos and sin (tokens, 1, head_dim) contiguous float32 expected, got ", t->sizes());
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  dispatch_float_or_bfloat16(x.scalar_type(), "rotate_half",
                             [&](auto zero) { rotate_into<decltype(zero)>(x, cos, sin, out); });
  return out;
}

}  // namespace nanoengine_cpu

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("rotate_half(Tensor x, Tensor cos, Tensor sin) -> Tensor",
        torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(nanoengine_cpu::rotate_half)));
}
