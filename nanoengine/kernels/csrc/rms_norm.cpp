// RMSNorm, alone or fused with the residual add, in one pass per row (chapter 10: fusion). The
// definition it must agree with is layers/layernorm.py.
//
// Eager PyTorch runs RMSNorm as several operators (the float32 copy, the norm, the cast, the
// weight multiply, the residual add before it), each a pass over the activations and a call from
// Python: for a decoding token, the calls are almost all of the norms' time (results/README.md).
// Here a step's norm is one call, reading each row once for its sum of squares and once to write.
//
// Numerics: sums of squares in float32, in an order fixed by this source; the normalised value is
// rounded to x's dtype before the weight multiplies it, as Hugging Face's Llama does. Eight values
// at a time, rounded as PyTorch rounds one (cpu_vec.h): the bits of the scalar tail loop.

#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "ops.h"

#include <cmath>
#include <vector>

namespace nanoengine_cpu {
namespace {

// One row: out = weight * dtype(x / sqrt(mean(x^2) + eps)). x is float32 here (a sum already
// rounded to the activation dtype, or the input converted).
template <typename T>
inline void normalise_row(const float* x, const T* weight, T* out, int64_t H, float eps) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t h = 0;
  for (; h + 16 <= H; h += 16) {
    const __m256 a = _mm256_loadu_ps(x + h), b = _mm256_loadu_ps(x + h + 8);
    acc0 = _mm256_fmadd_ps(a, a, acc0);
    acc1 = _mm256_fmadd_ps(b, b, acc1);
  }
  float sum = horizontal_sum(_mm256_add_ps(acc0, acc1));
  for (; h < H; ++h) sum += x[h] * x[h];
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
  const __m256 inv8 = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) {  // the scalar loop's roundings, eight lanes at a time
    const __m256 normed = round_to(_mm256_mul_ps(_mm256_loadu_ps(x + i), inv8), weight);
    store8(out + i, _mm256_mul_ps(load8(weight + i), normed));
  }
  for (; i < H; ++i) {
    const T normed = static_cast<T>(x[i] * inv);
    out[i] = static_cast<T>(static_cast<float>(weight[i]) * static_cast<float>(normed));
  }
}

template <typename T>
void norm_rows(const T* x, const T* residual, const T* weight, T* out, T* new_residual, int64_t rows, int64_t H,
               float eps) {
  // At least 16 rows to a thread (a round figure, not tuned): a few decoding rows stay on the caller.
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * H;
      if (residual != nullptr) {  // the sum, rounded to the dtype, is the next residual stream
        const T* rr = residual + r * H;
        T* nr = new_residual + r * H;
        int64_t i = 0;
        for (; i + 8 <= H; i += 8) {
          const __m256 sum = _mm256_add_ps(load8(xr + i), load8(rr + i));
          store8(nr + i, sum);
          _mm256_storeu_ps(row.data() + i, round_to(sum, nr));
        }
        for (; i < H; ++i) {
          nr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(rr[i]));
          row[i] = static_cast<float>(nr[i]);
        }
      } else {
        int64_t i = 0;
        for (; i + 8 <= H; i += 8) _mm256_storeu_ps(row.data() + i, load8(xr + i));
        for (; i < H; ++i) row[i] = static_cast<float>(xr[i]);
      }
      normalise_row(row.data(), weight, out + r * H, H, eps);
    }
  });
}

void check(const at::Tensor& x, const at::Tensor& weight, const char* op) {
  check_cpu_contiguous(op, {&x, &weight});
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), op,
              ": x (..., H) and weight (H,) expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), op, ": x and weight must share a dtype, got ",
              x.scalar_type(), " and ", weight.scalar_type());
}

// out = norm(x) or, with a residual, out = norm(x + residual) and new_residual = x + residual.
void run(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, at::Tensor& out,
         at::Tensor* new_residual, double eps, const char* op) {
  const int64_t H = x.size(-1), rows = H == 0 ? 0 : x.numel() / H;
  dispatch_float_or_bfloat16(x.scalar_type(), op, [&](auto zero) {
    using T = decltype(zero);
    norm_rows<T>(x.data_ptr<T>(), residual ? residual->data_ptr<T>() : nullptr, weight.data_ptr<T>(),
                 out.data_ptr<T>(), new_residual ? new_residual->data_ptr<T>() : nullptr, rows, H,
                 static_cast<float>(eps));
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight, "rms_norm");
  at::Tensor out = at::empty_like(x);
  run(x, nullptr, weight, out, nullptr, eps, "rms_norm");
  return out;
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  check(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "add_rms_norm: residual must be a contiguous tensor of x's shape and dtype, got ", residual.sizes());
  at::Tensor out = at::empty_like(x), new_residual = at::empty_like(x);
  run(x, &residual, weight, out, &new_residual, eps, "add_rms_norm");
  return {out, new_residual};
}

}  // namespace nanoengine_cpu

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor",
        torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(nanoengine_cpu::rms_norm)));
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(nanoengine_cpu::add_rms_norm)));
}
