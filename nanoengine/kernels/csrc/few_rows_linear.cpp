// A few rows times a weight matrix, streaming the weight once (chapter 10: decode is a
// matrix-vector product).
//
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n])   x (M, K), w (N, K) row-major, M small.
//
// Why: with one sequence decoding, a step reads each weight once for two flops, so its speed is
// the memory bandwidth, and MKL's sgemv and oneDNN's packed GEMM read the weights far slower than
// the CPU can stream them. Here PyTorch's threads (at::parallel_for) split the weight's rows, and
// each streams its rows once, whatever the number of rows x has.
//
// The order of the additions, which decides a float sum's last bits, is fixed by this source
// alone (fixed AVX2 + FMA intrinsics, not -march=native): for each (m, n), two 8-lane accumulators
// over k in steps of 16, summed in a fixed order, then a scalar tail. So a row gets the same bits
// on every x86-64 CPU with AVX2, for any number of threads, alone or beside other rows.

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_vec.h"
#include "ops.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace nanoengine_cpu {
namespace {

// Up to four rows of x (float32) against one weight row, reading the weight row once.
template <typename T, int ROWS>
inline void dot_rows(const float* x, int64_t x_stride, const T* w, int64_t K, float* out) {
  __m256 acc0[ROWS], acc1[ROWS];
  for (int r = 0; r < ROWS; ++r) {
    acc0[r] = _mm256_setzero_ps();
    acc1[r] = _mm256_setzero_ps();
  }
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 w0 = load8(w + k), w1 = load8(w + k + 8);
    for (int r = 0; r < ROWS; ++r) {
      acc0[r] = _mm256_fmadd_ps(w0, load8(x + r * x_stride + k), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(w1, load8(x + r * x_stride + k + 8), acc1[r]);
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float sum = horizontal_sum(_mm256_add_ps(acc0[r], acc1[r]));
    for (int64_t t = k; t < K; ++t) sum += static_cast<float>(w[t]) * x[r * x_stride + t];
    out[r] = sum;
  }
}

template <typename T>
void few_rows_kernel(const T* x_in, const T* w, const T* bias, T* y, int64_t M, int64_t K, int64_t N) {
  // x as float32: bfloat16 rows are widened once per call (exactly: every bfloat16 is a float32),
  // not once per weight row, which made a bfloat16 product compute-bound (results/README.md).
  std::vector<float> wide;
  const float* x = nullptr;
  if constexpr (std::is_same_v<T, float>) {
    x = x_in;
  } else {
    wide.assign(x_in, x_in + M * K);
    x = wide.data();
  }
  // Each task takes a run of weight rows: at least ~32 KiB of weights, so a thread's share of
  // a small matrix is still worth waking it for (a round figure, not tuned by measurement).
  const int64_t grain = std::max<int64_t>(1, (32 * 1024) / (K * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, N, grain, [&](int64_t begin, int64_t end) {
    float out[4];
    for (int64_t n = begin; n < end; ++n) {
      const T* w_row = w + n * K;
      const float b = bias ? static_cast<float>(bias[n]) : 0.0f;
      for (int64_t m = 0; m < M; m += 4) {
        const int64_t rows = std::min<int64_t>(4, M - m);
        const float* x_rows = x + m * K;
        switch (rows) {
          case 4: dot_rows<T, 4>(x_rows, K, w_row, K, out); break;
          case 3: dot_rows<T, 3>(x_rows, K, w_row, K, out); break;
          case 2: dot_rows<T, 2>(x_rows, K, w_row, K, out); break;
          default: dot_rows<T, 1>(x_rows, K, w_row, K, out); break;
        }
        for (int64_t r = 0; r < rows; ++r) y[(m + r) * N + n] = static_cast<T>(out[r] + b);
      }
    }
  });
}

}  // namespace

at::Tensor few_rows_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  check_cpu_contiguous("few_rows_linear", {&x, &weight});
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "few_rows_linear: x (M, K) and weight (N, K) expected, got ", x.sizes(), " and ", weight.sizes());
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "few_rows_linear: x and weight must share a dtype, got ",
              x.scalar_type(), " and ", weight.scalar_type());
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == x.scalar_type() &&
                    bias->is_contiguous(),
                "few_rows_linear: bias must be a contiguous (N,) tensor of x's dtype");
  }
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return has_bias ? y.copy_(bias->expand({M, N})) : y.zero_();  // an empty sum, plus the bias
  dispatch_float_or_bfloat16(x.scalar_type(), "few_rows_linear", [&](auto zero) {
    using T = decltype(zero);
    few_rows_kernel<T>(x.data_ptr<T>(), weight.data_ptr<T>(), has_bias ? bias->data_ptr<T>() : nullptr,
                       y.data_ptr<T>(), M, K, N);
  });
  return y;
}

}  // namespace nanoengine_cpu

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("few_rows_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
        torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(nanoengine_cpu::few_rows_linear)));
}
