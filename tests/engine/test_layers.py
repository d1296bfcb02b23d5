"""The layers' one-call forms compute exactly the textbook formulas (same bits in float32)."""

from __future__ import annotations

import pytest
import torch

from nanoengine.layers.layernorm import add_rms_norm, rms_norm
from nanoengine.layers.rotary import RotaryEmbedding


@pytest.mark.parametrize("rows", [1, 3, 67])
def test_rms_norm_is_the_formula_bit_for_bit(rows):
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, 576) * 3, torch.randn(576)
    formula = weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    assert torch.equal(rms_norm(x, weight, 1e-5), formula)
    residual = torch.randn(rows, 576)
    normed, summed = add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, x + residual) and torch.equal(normed, rms_norm(x + residual, weight, 1e-5))


def test_rms_norm_rounds_to_the_input_dtype_before_the_weight():
    x = torch.randn(4, 64).bfloat16()
    weight = torch.randn(64).bfloat16()
    formula = weight * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    assert torch.equal(rms_norm(x, weight, 1e-6), formula)


def test_rotation_in_one_call_is_the_textbook_rotate_half():
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim=64, max_position=128, base=1e5)
    positions = torch.tensor([0, 5, 127, 3])
    q, k = torch.randn(4, 9, 64), torch.randn(4, 3, 64)
    half = torch.arange(0, 64, 2, dtype=torch.float64) / 64
    angles = torch.outer(positions.double(), 1.0 / (1e5 ** half))
    cos, sin = angles.cos().float()[:, None, :], angles.sin().float()[:, None, :]

    def textbook(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    rq, rk = rope(positions, q, k)
    assert torch.equal(rq, textbook(q)) and torch.equal(rk, textbook(k))
    both = rope.rotate(torch.cat((q, k), dim=1), rope.rows(positions))  # query and key heads together
    assert torch.equal(both, torch.cat((rq, rk), dim=1))


def test_the_model_gathers_the_rotary_rows_once_for_all_layers():
    from nanoengine.loader.weights import random_model

    net = random_model("tiny-llama")
    rotaries = {id(layer.self_attn.rotary_emb) for layer in net.model.layers}
    assert rotaries == {id(net.model.rotary_emb)}
