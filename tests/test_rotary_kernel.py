"""The rotary embedding in one Triton launch (quant/rotary_kernel.py): bit for bit transformers' own, so a
step through it decodes the same tokens; run here under Triton's interpreter (fp32 and fp16: the interpreter
rounds fp32 to bf16 by truncation, so bf16's bits are checked on a GPU, tests/test_cuda_rotary.py)."""

import importlib

import pytest
import torch

pytest.importorskip("triton", reason="the rotary kernel needs Triton")

from tiny import tiny_model, tree_decoding  # noqa: E402



@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from medusa_core.quant import rotary_kernel

    yield rotary_kernel
    for family in rotary_kernel.FAMILIES:       # the routing holds for the process: put transformers' back
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        module.apply_rotary_pos_emb = getattr(module.apply_rotary_pos_emb, "original", module.apply_rotary_pos_emb)


def tables(batch: int, tokens: int, dim: int, dtype: torch.dtype, start: int = 3):
    """cos and sin (batch, tokens, dim) as Llama's rotary embedding makes them, in ``dtype``."""
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = (torch.arange(tokens).float() * 7 + start)[:, None] * inv          # (tokens, dim / 2)
    emb = torch.cat((angles, angles), -1).expand(batch, tokens, dim)
    return emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch,heads,kv_heads,tokens,dim", [(1, 4, 2, 1, 64), (1, 3, 3, 5, 48), (2, 2, 1, 3, 80)])
def test_the_kernel_gives_transformers_bits_in_its_layout(interpreter, dtype, batch, heads, kv_heads, tokens, dim):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(dim)
    # as the attention module makes them: (B, T, heads, D) projections viewed as (B, heads, T, D)
    q = torch.randn(batch, tokens, heads, dim, generator=gen).to(dtype).transpose(1, 2)
    k = torch.randn(batch, tokens, kv_heads, dim, generator=gen).to(dtype).transpose(1, 2)
    cos, sin = tables(batch, tokens, dim, dtype)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q, got_k = interpreter.fused_rotary(q, k, cos, sin)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    assert got_q.stride() == q.stride() and got_k.stride() == k.stride()
    # one table for a batch of two broadcasts, as transformers' broadcasting does
    if batch == 2:
        one_q, _ = interpreter.fused_rotary(q, k, cos[:1], sin[:1])
        assert torch.equal(one_q, apply_rotary_pos_emb(q, k, cos[:1], sin[:1])[0])


def test_in_bf16_the_kernels_roundings_are_transformers_roundings():
    # what the kernel computes in bf16, written out in torch: each product rounded to bf16, then their fp32 sum.
    # Here it must equal transformers' eager rotary on this CPU; the GPU test checks the kernel itself
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 5, 3, 48, generator=gen).to(torch.bfloat16).transpose(1, 2)
    k = q[:, :2]
    cos, sin = (torch.randn(1, 5, 48, generator=gen).to(torch.bfloat16) for _ in range(2))
    c, s = cos[:, None].float(), sin[:, None].float()
    rotated = torch.cat((-q[..., 24:], q[..., :24]), -1).float()
    kernels = ((q.float() * c).to(torch.bfloat16).float() + (rotated * s).to(torch.bfloat16).float()).to(torch.bfloat16)
    assert torch.equal(kernels, apply_rotary_pos_emb(q, k, cos, sin)[0])


def test_a_model_routed_through_it_decodes_the_same_tokens_and_goes_back(interpreter):
    model, decode = tree_decoding()
    before = decode()
    line = interpreter.use_rotary_kernel(model, "triton")
    assert line.startswith("rotary: one Triton kernel") and interpreter.routed(model) == "triton"
    calls = []
    fused = interpreter.fused_rotary
    interpreter.fused_rotary = lambda *a: calls.append(1) or fused(*a)
    try:
        assert decode() == before
    finally:
        interpreter.fused_rotary = fused
    assert calls, "the step never went through the kernel"
    assert interpreter.use_rotary_kernel(model, "torch") == "rotary: transformers' own"
    assert interpreter.routed(model) == "torch"


def test_what_the_kernel_does_not_compute_goes_to_transformers(interpreter, monkeypatch):
    from transformers.models.llama import modeling_llama

    model = tiny_model("llama", hidden=64, vocab=64, seed=3)
    interpreter.use_rotary_kernel(model, "triton")
    monkeypatch.setattr(interpreter, "fused_rotary", lambda *a: pytest.fail("the kernel ran"))
    q = torch.randn(1, 4, 2, 16, requires_grad=True)          # training: the kernel has no backward
    k = torch.randn(1, 2, 2, 16)
    cos, sin = tables(1, 2, 16, torch.float32)
    out, _ = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    assert out.requires_grad
    modeling_llama.apply_rotary_pos_emb(q.detach().to(torch.float16), k, cos, sin)       # mixed dtypes
    modeling_llama.apply_rotary_pos_emb(q.detach().transpose(1, 2), k.transpose(1, 2), cos, sin, unsqueeze_dim=2)  # (B, T, heads, D)


def test_a_family_with_another_rotary_is_one_line(interpreter):
    model = tiny_model("llama", hidden=64, vocab=64, seed=3)
    model.config.model_type = "gpt_neox"
    with pytest.raises(ValueError) as err:
        interpreter.use_rotary_kernel(model, "triton")
    message = str(err.value)
    assert "\n" not in message and "gpt_neox" in message and "--rotary-kernel torch" in message
    assert interpreter.use_rotary_kernel(model, "torch") == "rotary: transformers' own"
