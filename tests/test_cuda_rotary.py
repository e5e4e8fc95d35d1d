"""The rotary kernel (quant/rotary_kernel.py) and the cache write routed with it (quant/cache_write_kernel.py) on
CUDA: in bf16, where Triton's CPU interpreter rounds otherwise, the rotation's bits are transformers' own and the
cache holds index_copy_'s, eagerly and inside a CUDA graph, and a captured decoding step through them gives the
tokens the step gives without them. Skipped without CUDA: the runbook's cuda-tests stage runs it."""

from __future__ import annotations

import importlib

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton", reason="the rotary kernel needs Triton: pip install triton")

from tiny import tree_decoding  # noqa: E402

from medusa_core.quant import rotary_kernel as rk  # noqa: E402


@pytest.fixture(autouse=True)
def _transformers_rotary_back():
    yield
    for family in rk.FAMILIES:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        module.apply_rotary_pos_emb = getattr(module.apply_rotary_pos_emb, "original", module.apply_rotary_pos_emb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_the_kernel_gives_transformers_bits_on_this_gpu(dtype, tokens):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    q = torch.randn(1, tokens, 32, 128, device="cuda", generator=gen).to(dtype).transpose(1, 2)   # Llama-2-7B
    k = torch.randn(1, tokens, 8, 128, device="cuda", generator=gen).to(dtype).transpose(1, 2)    # GQA's 8
    angles = torch.randn(1, tokens, 64, device="cuda", generator=gen) * 50
    cos, sin = (f(torch.cat((angles, angles), -1)).to(dtype) for f in (torch.cos, torch.sin))
    want = apply_rotary_pos_emb(q, k, cos, sin)
    got = rk.fused_rotary(q, k, cos, sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    graph, out = torch.cuda.CUDAGraph(), None
    rk.fused_rotary(q, k, cos, sin)         # compiled before the capture
    with torch.cuda.graph(graph):
        out = rk.fused_rotary(q, k, cos, sin)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])


@pytest.mark.parametrize("tokens", [1, 16, 64])
def test_the_cache_write_holds_index_copys_bits_at_the_position_a_graph_replay_reads(tokens):
    from medusa_core.quant import cache_write_kernel as cw

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    keys, values = (torch.randn(1, tokens, 32, 128, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)
                    for _ in range(2))                                                  # (1, 32, T, 128), 7B's
    layer = torch.randn(2, 1, 32, 1024, 128, device="cuda", generator=gen).to(torch.bfloat16)
    position = torch.tensor([530], device="cuda")
    cw.write_cache(layer.clone(), keys, values, position)           # compiled before the capture
    written = layer.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cw.write_cache(written, keys, values, position)
    for start in (530, 7, 1024 - tokens):         # the position moves under the graph, as in the decoding step
        want = written.clone()
        slots = torch.arange(tokens, device="cuda") + start
        want[0].index_copy_(2, slots, keys)
        want[1].index_copy_(2, slots, values)
        position.fill_(start)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(written, want), start


def test_a_captured_bf16_step_through_it_decodes_the_tokens_it_decodes_without_it():
    from medusa_core.decoding.generate import new_cache

    model, decode = tree_decoding("cuda", torch.bfloat16, max_new_tokens=40, graphs=True)
    plain = decode()
    assert rk.use_rotary_kernel(model, "triton").startswith("rotary: one Triton kernel")
    assert new_cache(model).writer is not None, "the caches write through the kernel"
    assert decode() == plain
