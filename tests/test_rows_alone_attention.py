"""The row-exact attention kernel (quant/rows_alone_attention.py) under Triton's interpreter, fp32:
each tree row gets the bits it gets alone over its keys laid out as plain decoding lays them out,
whatever the row count; and the result is attention (SDPA's within rounding). Both forms of its
reductions run: the interpreter's written-out trees and the compiled kernel's tl.reduce."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton", reason="the row-exact attention kernel needs Triton: pip install triton")
from tiny import tree_seen, with_compiled_reductions  # noqa: E402

from medusa_core.quant.triton_runtime import INTERPRET_ENV  # noqa: E402
from medusa_core.quant import rows_alone_attention as ra  # noqa: E402
from medusa_core.quant.rows_alone_attention import rows_alone_attention, visible_slots  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv(INTERPRET_ENV, "1")


@pytest.fixture
def reduction(request, monkeypatch):
    """The interpreter's reductions (written-out trees), or the compiled kernel's (tl.reduce) run here."""
    if request.param == "reduce":
        with_compiled_reductions(ra, monkeypatch)
    return request.param


PARENTS = [-1, 0, 0, 1, 1, 2, 3]      # a 7-node tree: node i's parent


def qkv(heads: int, kv_heads: int, rows: int, width: int, dim: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, heads, rows, dim, generator=gen), torch.randn(1, kv_heads, width, dim, generator=gen),
            torch.randn(1, kv_heads, width, dim, generator=gen))


# MHA; GQA with a head size no power of 2, also through tl.reduce (40 s under the interpreter)
@pytest.mark.parametrize("heads,kv_heads,dim,reduction", [(4, 4, 32, "tree"), (6, 2, 48, "tree"), (6, 2, 48, "reduce")],
                         indirect=["reduction"])
def test_a_tree_row_gets_the_bits_it_gets_alone_over_its_keys_in_plain_order(heads, kv_heads, dim, reduction):
    prefix = 70                     # over two blocks of the list, and not a multiple of one
    width = prefix + len(PARENTS) + 9
    q, k, v = qkv(heads, kv_heads, len(PARENTS), width, dim, seed=dim)
    seen = tree_seen(PARENTS, prefix, width)
    tree = rows_alone_attention(q, k, v, seen)                                   # (1, T, heads, D)
    mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))[None, None]
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(tree, ref, rtol=1e-5, atol=1e-5)
    for i in range(len(PARENTS)):
        # plain decoding of the same token: its keys (prefix, then the accepted path) at consecutive
        # slots of a cache of another width, with other values after them, and the row alone in the call
        slots = seen[i].nonzero().squeeze(1)
        gen = torch.Generator().manual_seed(i)
        k_plain = torch.randn(1, kv_heads, width + 5, dim, generator=gen)
        v_plain = torch.randn(1, kv_heads, width + 5, dim, generator=gen)
        k_plain[:, :, :len(slots)], v_plain[:, :, :len(slots)] = k[:, :, slots], v[:, :, slots]
        alone_seen = torch.zeros(1, width + 5, dtype=torch.bool)
        alone_seen[0, :len(slots)] = True
        alone = rows_alone_attention(q[:, :, i:i + 1].clone(), k_plain, v_plain, alone_seen)
        assert torch.equal(alone[0, 0], tree[0, i]), f"row {i}"


def test_a_prefill_row_does_not_depend_on_how_the_prompt_was_split():
    # the two decoders of a comparison can prefill the same conversation in different pieces
    width, dim = 80, 32
    q, k, v = qkv(2, 1, 40, width, dim, seed=3)
    causal = torch.arange(width)[None, :] <= torch.arange(40)[:, None]          # rows 0..39 of a prompt
    whole = rows_alone_attention(q, k, v, causal)
    tail = rows_alone_attention(q[:, :, 25:].clone(), k, v, causal[25:])         # the last 15 rows alone
    assert torch.equal(whole[:, 25:], tail)


def test_visible_slots_lists_each_rows_slots_in_order():
    seen = torch.tensor([[True, False, True, True], [False, False, False, True]])
    slots, counts = visible_slots(seen)
    assert counts.tolist() == [3, 1]
    assert slots[0, :3].tolist() == [0, 2, 3] and slots[1, :1].tolist() == [3]


def test_shapes_it_cannot_take_are_one_line_errors():
    q, k, v = qkv(3, 2, 2, 8, 16, seed=0)
    with pytest.raises(ValueError, match=r"^rows_alone_attention takes batch 1, query heads a multiple of kv heads"):
        rows_alone_attention(q, k, v, torch.ones(2, 8, dtype=torch.bool))
