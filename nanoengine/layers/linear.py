"""Linear layers that can be split over tensor-parallel ranks (chapter 9).

A column-parallel layer splits the *output* features (each rank computes a slice, no communication);
a row-parallel one splits the *input* features (each rank computes a partial sum of the whole output,
an all-reduce adds them). A column-parallel layer followed by a row-parallel one (attention's qkv ->
o, the MLP's gate_up -> down) needs a single all-reduce per pair: the Megatron-LM layout. The merged
layers pack several column-parallel projections into one matrix, so one GEMM does the work of two or
three; their ``weight_loader`` copies each Hugging Face checkpoint tensor (``q_proj``, ``gate_proj``)
into its slice.

The product itself is the layer's ``linear_method`` (vLLM's name), made in its constructor from the
backend's kernels (``layers.kernels``): ``F.linear`` by default. Once the weights are loaded, each
method's ``process_weights_after_loading(layer)`` (vLLM's hook) may prepare a copy (the CPU's
prepacks it: ``backends/cpu.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.distributed.parallel_state import TPGroup
from nanoengine.layers.kernels import current_kernels


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what} ({numerator}) is not divisible by tensor_parallel_size ({denominator})")
    return numerator // denominator


class LinearMethod:
    """How a GEMM layer computes ``y = x W^T + b``: one object per layer, made by its constructor."""

    name = "abstract"
    copy_bytes = 0  # bytes of weight copies ``process_weights_after_loading`` made (the memory report)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once the layer's weight is loaded (and before any step): prepare what ``apply`` reads."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class UnquantizedLinearMethod(LinearMethod):
    """``y = x W^T + b`` with ``F.linear`` on the layer's weight as loaded: every device's default."""

    name = "F.linear"

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


class GemmLayer:
    """Mixin for a module whose ``weight`` (out_features, in_features) feeds a GEMM through its ``linear_method``."""

    def make_linear_method(self) -> None:
        make = current_kernels().linear_method
        self.linear_method: LinearMethod = make() if make is not None else UnquantizedLinearMethod()


class LinearBase(GemmLayer, nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.make_linear_method()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        _copy_checked(param.data, loaded)


class ColumnParallelLinear(LinearBase):
    """y = x W^T with W's rows (output features) split over ranks: (out/tp, in)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = TPGroup.single()):
        super().__init__(input_size, _divide(output_size, tp.size, "output size"), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        shard = param.data.shape[0]
        _copy_checked(param.data, loaded.narrow(0, self.tp.rank * shard, shard))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs packed in one matrix (the MLP's gate and up)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 tp: TPGroup = TPGroup.single()):
        self.output_sizes = output_sizes
        super().__init__(input_size, sum(output_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        offset = sum(self.output_sizes[:shard_id]) // self.tp.size
        size = self.output_sizes[shard_id] // self.tp.size
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matrix, split over ranks by whole heads.

    Each rank gets ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV heads, so
    attention needs no communication at all: a head never spans two ranks.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup = TPGroup.single()):
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp.size, "number of attention heads")
        self.num_kv_heads = _divide(num_kv_heads, tp.size, "number of KV heads")
        super().__init__(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        offset, size = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}[shard_id]
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp.rank * size, size))


class RowParallelLinear(LinearBase):
    """y = x W^T with W's columns (input features) split: partial sums, then all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp: TPGroup = TPGroup.single()):
        super().__init__(_divide(input_size, tp.size, "input size"), output_size, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is added once, after the reduction
            _copy_checked(param.data, loaded)
            return
        shard = param.data.shape[1]
        _copy_checked(param.data, loaded.narrow(1, self.tp.rank * shard, shard))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_method.apply(self, x, None)
        self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"checkpoint tensor of shape {tuple(src.shape)} does not fit parameter "
                         f"slice of shape {tuple(dst.shape)}")
    dst.copy_(src)
