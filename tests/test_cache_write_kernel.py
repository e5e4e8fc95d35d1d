"""A forward's keys and values written into the KV cache in one Triton launch (quant/cache_write_kernel.py), under
Triton's interpreter: the bits ``index_copy_`` writes, nothing past the buffer, and the caches of a model whose
rotary runs the Triton kernel write through it and decode the same tokens. On a GPU: tests/test_cuda_rotary.py."""

import importlib

import pytest
import torch

pytest.importorskip("triton", reason="the cache write kernel needs Triton")

from tiny import tiny_model, tree_decoding  # noqa: E402

from medusa_core.decoding.generate import new_cache  # noqa: E402
from medusa_core.decoding.kv_cache import WRITER_NAME, WRITERS  # noqa: E402


@pytest.fixture
def cw(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from medusa_core.quant import cache_write_kernel, rotary_kernel

    yield cache_write_kernel
    for family in rotary_kernel.FAMILIES:       # the rotary routing holds for the process: put transformers' back
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        module.apply_rotary_pos_emb = getattr(module.apply_rotary_pos_emb, "original", module.apply_rotary_pos_emb)


def rows(kv_heads: int, tokens: int, dim: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """(1, kv_heads, tokens, D) as the attention module makes them: a transposed view of a projection's output."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(1, tokens, kv_heads, dim, generator=gen).to(dtype).transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_heads,tokens,dim,position", [(2, 1, 64, 7), (3, 5, 48, 0), (1, 16, 32, 40)])
def test_it_writes_the_bits_index_copy_writes_and_nothing_else(cw, dtype, kv_heads, tokens, dim, position):
    keys, values = rows(kv_heads, tokens, dim, dtype, 1), rows(kv_heads, tokens, dim, dtype, 2)
    layer = torch.randn(2, 1, kv_heads, 64, dim).to(dtype)          # earlier entries everywhere
    want = layer.clone()
    slots = torch.arange(tokens) + position
    want[0].index_copy_(2, slots, keys)
    want[1].index_copy_(2, slots, values)
    assert cw.fits(keys, values)
    cw.write_cache(layer, keys, values, torch.tensor([position]))
    assert torch.equal(layer, want)


def test_a_slot_past_the_buffer_is_never_written(cw):
    keys, values = rows(2, 4, 16, torch.float32, 1), rows(2, 4, 16, torch.float32, 2)
    wider = torch.zeros(2, 1, 2, 12, 16)
    layer = wider[:, :, :, :10]                 # capacity 10 inside a buffer of 12: a write past it would show
    cw.write_cache(layer, keys, values, torch.tensor([8]))
    assert torch.equal(wider[0, :, :, 8:10], keys[:, :, :2]) and torch.equal(wider[1, :, :, 8:10], values[:, :, :2])
    assert not wider[:, :, :, 10:].any()


def test_a_model_routed_to_the_triton_rotary_writes_its_caches_through_the_kernel_to_the_same_tokens(cw):
    from medusa_core.quant import rotary_kernel

    model, decode = tree_decoding()
    before = decode()
    assert new_cache(model).writer is None
    assert rotary_kernel.use_rotary_kernel(model, "triton").endswith(", one for its cache write")
    assert new_cache(model).writer is WRITERS[cw.NAME]
    writes = []
    kernel = WRITERS[cw.NAME]
    WRITERS[cw.NAME] = type(kernel)(kernel.fits, lambda *a: writes.append(a[1].shape[2]) or kernel.write(*a))
    try:
        assert decode() == before
    finally:
        WRITERS[cw.NAME] = kernel
    assert 5 in writes and 15 in writes, "the prefill's and the 15-node tree's rows went through the kernel"
    rotary_kernel.use_rotary_kernel(model, "torch")
    assert new_cache(model).writer is None and not hasattr(model, WRITER_NAME)
    assert WRITER_NAME not in model.config.to_json_string(), "a routing is the process's, not the checkpoint's"


def test_what_it_cannot_write_is_refused_in_one_line_and_a_cache_writer_no_module_registered_too(cw):
    keys = rows(2, 3, 16, torch.float32, 1)
    with pytest.raises(ValueError) as err:
        cw.write_cache(torch.zeros(2, 1, 4, 32, 16), keys, keys, torch.tensor([0]))
    assert str(err.value) == ("write_cache takes (1, kv_heads, T, D) keys and values with rows along D into a (2, 1, "
                              "kv_heads, capacity, D) layer; got keys (1, 2, 3, 16), layer (2, 1, 4, 32, 16)")
    assert not cw.fits(keys, keys.to(torch.float16)) and not cw.fits(keys, keys.mT.contiguous().mT)   # D not rows
    model = tiny_model("llama", hidden=64, vocab=64, seed=3)
    setattr(model, WRITER_NAME, "cuda-graph-magic")
    with pytest.raises(ValueError) as err:
        new_cache(model)
    assert str(err.value) == ("the model names the cache writer 'cuda-graph-magic', which no module registered "
                              "(known: ['triton']): route the rotary again (quant/attention_routing.use_rotary)")


def test_the_caches_the_routing_times_hold_the_same_rows_at_the_prefix(cw):
    # quant/attention_routing.py times the rotary with each writer on these caches (the timing itself: on a GPU)
    from medusa_core.quant.attention_routing import TIMED_PREFIX, _cache_at_prefix

    keys, values = rows(2, 3, 16, torch.float32, 1), rows(2, 3, 16, torch.float32, 2)
    copied, written = _cache_at_prefix(None, keys, values), _cache_at_prefix(cw.NAME, keys, values)
    assert copied.writer is None and written.writer is WRITERS[cw.NAME]
    assert torch.equal(written.storage, copied.storage)
    assert torch.equal(written.storage[0, 0, :, :, TIMED_PREFIX:TIMED_PREFIX + 3], keys)
