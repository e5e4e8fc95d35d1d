"""Row-exact attention (exact_attention.py): a tree row's output is, bit for bit, what a plain
1-row step computes for the same token over the same prefix, whatever the tree around it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from medusa_core.quant import exact_attention
from medusa_core.quant.exact_attention import exact_rows_attention

HEADS, KV_HEADS, DIM = 6, 2, 32
NEG = torch.finfo(torch.float32).min


def attend(query, key, value, mask, shared=None):
    """One layer's attention; ``shared``: the forward's scratch (decoding.step.decoder_kwargs), fresh if None."""
    return exact_rows_attention(nn.Module().eval(), query, key, value, mask, scaling=DIM ** -0.5,
                                rows_alone={} if shared is None else shared)[0]          # (1, T, h, D)


@pytest.mark.parametrize("prefix", [1, 17, 63, 200, 513])
def test_a_tree_row_equals_the_plain_step_for_its_token(prefix):
    g = torch.Generator().manual_seed(prefix)
    # tree [[0], [1]]: slot prefix = root, prefix + 1 = child a, prefix + 2 = child b (both see the root)
    key = torch.randn(1, KV_HEADS, prefix + 3, DIM, generator=g)
    value = torch.randn(1, KV_HEADS, prefix + 3, DIM, generator=g)
    query = torch.randn(1, HEADS, 3, DIM, generator=g)
    mask = torch.zeros(1, 1, 3, prefix + 3)
    mask[..., 0, prefix + 1:] = NEG
    mask[..., 1, prefix + 2] = NEG
    mask[..., 2, prefix + 1] = NEG
    tree = attend(query, key, value, mask)

    def plain(row, slots):     # a 1-row step: its token's keys right after the prefix, nothing masked
        k, v = key[:, :, slots], value[:, :, slots]
        return attend(query[:, :, row:row + 1], k, v, torch.zeros(1, 1, 1, len(slots)))

    upto = list(range(prefix + 1))
    assert torch.equal(tree[:, 0:1], plain(0, upto))
    assert torch.equal(tree[:, 1:2], plain(1, upto + [prefix + 1]))
    assert torch.equal(tree[:, 2:3], plain(2, upto + [prefix + 2]))


def test_rows_off_the_first_chain_equal_their_plain_steps_in_every_layer_of_a_forward():
    """A deeper tree, several layers of one forward: rows whose ancestors are not contiguous after the
    prefix read the shared leading slots from buffers the forward keeps and refills per layer, then
    their own; each row still gets what a plain step over its own keys gets, in every layer."""
    prefix = 40
    paths = [(0,), (1,), (0, 0), (1, 0), (1, 1), (1, 0, 0)]             # node i + 1 is paths[i]; 0 is the root
    nodes = [()] + paths
    width = prefix + len(nodes)
    mask = torch.full((1, 1, len(nodes), width), NEG)
    mask[..., :prefix + 1] = 0                                        # the prefix and the root
    for row, path in enumerate(nodes):
        for depth in range(1, len(path) + 1):
            mask[..., row, prefix + nodes.index(path[:depth])] = 0    # its ancestors and itself
    g = torch.Generator().manual_seed(5)
    shared = {}
    for _ in range(3):                                                # three layers, one scratch
        key = torch.randn(1, KV_HEADS, width, DIM, generator=g)
        value = torch.randn(1, KV_HEADS, width, DIM, generator=g)
        query = torch.randn(1, HEADS, len(nodes), DIM, generator=g)
        tree = attend(query, key, value, mask, shared)
        for row in range(len(nodes)):
            slots = (mask[0, 0, row] == 0).nonzero().squeeze(1)
            alone = attend(query[:, :, row:row + 1], key[:, :, slots], value[:, :, slots],
                           torch.zeros(1, 1, 1, len(slots)))
            assert torch.equal(tree[:, row:row + 1], alone), (row, nodes[row])
    assert "gathered" in shared                                       # the buffers were used, and kept


def test_it_is_attention():
    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(1, KV_HEADS, 9, DIM, generator=g), torch.randn(1, KV_HEADS, 9, DIM, generator=g)
    query = torch.randn(1, HEADS, 4, DIM, generator=g)
    mask = torch.triu(torch.full((4, 9), NEG), diagonal=6)[None, None]      # rows see 6..9 keys
    ref = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(attend(query, key, value, mask), ref.transpose(1, 2))
    bool_mask = mask == 0                                                    # the masks transformers builds
    assert torch.equal(attend(query, key, value, bool_mask), attend(query, key, value, mask))


def tree_mask(prefix: int) -> torch.Tensor:
    """(1, 1, 3, prefix + 3) additive: root, then two children that each see the root only."""
    mask = torch.zeros(1, 1, 3, prefix + 3)
    mask[..., 0, prefix + 1:] = NEG
    mask[..., 1, prefix + 2] = NEG
    mask[..., 2, prefix + 1] = NEG
    return mask


@pytest.mark.parametrize("kernel", [False, True])
def test_the_layers_of_a_forward_share_one_listing_of_each_rows_keys(kernel, monkeypatch):
    """The forward's first layer works out which keys each row reads, the others reuse it: once per
    step instead of once per layer (on CUDA, small kernels inside the graph). Another mask is worked
    out again, never served a stale listing. ``kernel``: the CUDA path (the Triton kernel, run here by
    its interpreter)."""
    if kernel:
        pytest.importorskip("triton", reason="the row-exact attention kernel needs Triton: pip install triton")
        from medusa_core.quant.triton_runtime import INTERPRET_ENV

        monkeypatch.setenv(INTERPRET_ENV, "1")              # the kernel on CPU tensors
    monkeypatch.setattr(exact_attention, "kernel_path", lambda query: kernel)
    listed = []
    real = exact_attention.visible
    monkeypatch.setattr(exact_attention, "visible", lambda mask: (listed.append(1), real(mask))[1])
    g = torch.Generator().manual_seed(3)
    key, value = torch.randn(1, KV_HEADS, 13, DIM, generator=g), torch.randn(1, KV_HEADS, 13, DIM, generator=g)
    layers = [torch.randn(1, HEADS, 3, DIM, generator=g) for _ in range(4)]
    mask, shared = tree_mask(10), {}
    outs = [attend(q, key, value, mask, shared) for q in layers]
    assert len(listed) == 1
    assert all(torch.equal(out, attend(q, key, value, mask)) for q, out in zip(layers, outs))
    other = torch.triu(torch.full((3, 13), NEG), diagonal=11)[None, None]           # a causal mask, new object
    assert torch.equal(attend(layers[0], key, value, other, shared), attend(layers[0], key, value, other))
    ref = torch.nn.functional.scaled_dot_product_attention(layers[0], key, value, attn_mask=other, enable_gqa=True)
    torch.testing.assert_close(attend(layers[0], key, value, other, shared), ref.transpose(1, 2))


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_a_model_forward_lists_the_keys_once_for_all_its_layers(arch, monkeypatch):
    """Through a real decoder (prefill and tree steps): transformers hands every layer the step's one
    mask and the one scratch, so the listing is worked out once per forward, not once per layer."""
    from tiny import copied_heads, tiny_model

    from medusa_core.decoding.config import DecodeConfig
    from medusa_core.decoding.generate import generate
    from medusa_core.decoding.tree import build_tree_buffers

    model = tiny_model(arch, layers=3)
    exact_attention.use_exact_rows(model)
    listed, forwards = [], []
    real = exact_attention.visible
    monkeypatch.setattr(exact_attention, "visible", lambda mask: (listed.append(1), real(mask))[1])
    model.get_decoder().register_forward_hook(lambda *args: forwards.append(1))
    tree = build_tree_buffers([[0], [1], [0, 0]], 2)
    steps = list(generate(model, [5, 6, 7], heads=copied_heads(model), tree=tree, config=DecodeConfig(max_new_tokens=8)))
    assert len(steps) > 2 and len(forwards) == len(steps) and len(listed) == len(forwards)
