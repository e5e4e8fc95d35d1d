"""Prepacked fp32 Linear layers on the CPU: same results as F.linear, same greedy decoding, same weights."""

import pytest
import torch
from torch.nn import functional as F

from medusa_core import cpu_linear
from medusa_core.generate import DecodeConfig, generate
from medusa_core.tree import build_tree_buffers, resolve_tree
from tests.tiny import tiny_model, trained_heads

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no MKL packed sgemm")


@pytest.mark.parametrize("rows", [1, 2, 5, 16, 64, 100])
def test_packed_equals_plain_linear_within_fp32_rounding(rows):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200)
    packed = cpu_linear.PackedLinear(linear)
    x = torch.randn(1, rows, 96)
    with torch.no_grad():
        y = packed(x)
        again = packed(x)                       # the second call reuses the pack
    assert y.shape == (1, rows, 200)
    torch.testing.assert_close(y, F.linear(x, linear.weight, linear.bias), rtol=1e-5, atol=1e-5)
    assert torch.equal(y, again)


def test_packs_are_bounded_and_weights_stay_shared():
    linear = torch.nn.Linear(32, 48)
    packed = cpu_linear.PackedLinear(linear)
    with torch.no_grad():
        for rows in (2, 3, 4, 5, 6):
            packed(torch.randn(rows, 32))
    assert len(packed._packs) == cpu_linear.MAX_PACKS
    assert packed.weight is linear.weight and packed.bias is linear.bias


def test_greedy_medusa_still_equals_greedy_baseline_after_prepacking():
    model = tiny_model(vocab=96, hidden=64, seed=5)
    heads = trained_heads(model, steps=60)
    prompt = [5, 17, 33, 8]
    config = DecodeConfig(max_new_tokens=40)
    before = [t for s in generate(model, prompt, config=config) for t in s.tokens]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    swapped = cpu_linear.prepack_(model)
    assert swapped == 2 * 7 + 1                  # 7 projections per layer, 2 layers, lm_head
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    baseline = [t for s in generate(model, prompt, config=config) for t in s.tokens]
    medusa = [t for s in generate(model, prompt, heads=heads, tree=build_tree_buffers(resolve_tree("small-16"), 5), config=config) for t in s.tokens]
    assert baseline == before == medusa
