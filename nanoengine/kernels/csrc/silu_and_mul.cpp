// The gated MLP's activation, silu(gate) * up, in one call from Python (chapter 10).
// It adds no arithmetic of its own: it makes layers/activation.py's silu_and_mul calls (ATen's
// silu, then its product) from C++, so the bits are eager's, and Python makes one operator call
// a layer instead of three (chunk, silu, mul).

#include <ATen/ATen.h>
#include <torch/library.h>

#include "ops.h"

at::Tensor nanoengine_cpu::silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) % 2 == 0, "silu_and_mul: x (..., 2 * intermediate) expected, got ",
              x.sizes());
  const int64_t half = x.size(-1) / 2;
  return at::mul(at::silu(x.narrow(-1, 0, half)), x.narrow(-1, half, half));
}

TORCH_LIBRARY_FRAGMENT(nanoengine, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor",
        torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(nanoengine_cpu::silu_and_mul)));
}
