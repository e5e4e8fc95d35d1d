"""The Triton NF4 kernel, run on CPU by Triton's interpreter: it reads bitsandbytes' packed
weights as stored, dequantizes exactly as bitsandbytes does, multiplies within rounding, never
reads past its buffers, and decodes the same greedy text as bitsandbytes' own path.

Interpreter facts (docs/design.md, "Exactness rules"): fp32 math is exact there and bf16 is broken, so everything
here computes in fp32 (fp16 once). TRITON_INTERPRET is set only while this module's tests run;
the kernel picks the interpreter at launch time, so other test modules never see it."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("triton", reason="the NF4 kernel needs Triton: pip install triton")
import bitsandbytes.functional as bnbf  # noqa: E402
from tiny import copied_heads, tiny_model  # noqa: E402

from medusa_core.quant import nf4_matmul as nm  # noqa: E402
from medusa_core.quant.kernel_timing import pick_fastest  # noqa: E402
from medusa_core.quant.triton_runtime import INTERPRET_ENV  # noqa: E402
from medusa_core.errors import LoadError  # noqa: E402
from medusa_core.decoding.config import DecodeConfig  # noqa: E402
from medusa_core.decoding.generate import generate  # noqa: E402
from medusa_core.loading.load import load  # noqa: E402
from medusa_core.loading.spec import LoadSpec  # noqa: E402
from medusa_core.quant.bnb import quantize_linear_nf4_, use_nf4_kernel  # noqa: E402
from medusa_core.decoding.tree import build_tree_buffers, resolve_tree  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv(INTERPRET_ENV, "1")


def quantized(n: int, k: int, nested: bool, seed: int = 0, flat: bool = False):
    """(packed, state, w) for a random W[n, k]. ``flat`` quantizes W as rows of 64 (same flat layout,
    so the state is relabelled (n, k)): bitsandbytes 0.50's CPU quantizer is wrong at widths like 96,
    and this is how a K that is no multiple of the 64-value block gets a correct state."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    src = w.reshape(-1, 64) if flat else w
    packed, state = bnbf.quantize_4bit(src, blocksize=64, compress_statistics=nested, quant_type="nf4")
    if flat:
        state.shape = torch.Size([n, k])
    return packed, state, w


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("n,k,flat", [(200, 192, False), (72, 96, True)])
def test_kernel_dequant_equals_bitsandbytes_bit_for_bit(nested, n, k, flat):
    packed, state, w = quantized(n, k, nested, flat=flat)
    as_quantized = copy.copy(state)
    as_quantized.shape = torch.Size([n * k // 64, 64]) if flat else state.shape   # bnb's CPU path is per shape
    theirs = bnbf.dequantize_4bit(packed, as_quantized).reshape(n, k)
    assert theirs.dtype == torch.float32
    assert torch.equal(nm.dequantize_nf4(packed, state), theirs)          # the layout as documented
    assert torch.equal(nm.dequantize_with_kernel(packed, state), theirs)  # the kernel's own tile path
    assert (theirs - w).abs().max() < 0.5 * w.abs().max()                 # and it is a quantization of w


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64])
def test_matmul_within_rounding_of_dequantized_reference(nested, m):
    n, k = 200, 192          # neither a multiple of the 64-row tile nor of a 128-column step
    packed, state, _ = quantized(n, k, nested)
    ref_w = nm.dequantize_nf4(packed, state).double()
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    for b in (None, bias):
        y = nm.nf4_matmul(x, packed, state, b)
        ref = x.double() @ ref_w.T + (0 if b is None else b.double())
        assert y.shape == (m, n) and y.dtype == torch.float32
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4)


def test_split_k_and_unaligned_k_and_3d_input():
    packed, state, _ = quantized(72, 96, nested=True, flat=True)   # 64-value blocks straddle rows
    ref_w = nm.dequantize_nf4(packed, state).double()
    x = torch.randn(2, 5, 96)
    bias = torch.randn(72)
    for cfg in (None, nm.KernelConfig(16, 32, split_k=2)):
        y = nm.nf4_matmul(x, packed, state, bias, config=cfg)
        assert y.shape == (2, 5, 72)
        torch.testing.assert_close(y.double(), x.double() @ ref_w.T + bias.double(), rtol=1e-5, atol=1e-4)


# the stream kernel: one row, several slots and blocks per step, split-K whose last group is prefetched
# past its end, MMA row tiles (33 rows: two tiles, the second nearly empty), 64 rows in one tile
STREAM_CONFIGS = [(1, nm.KernelConfig(1, 32, 2, sub=1, slots=4)), (1, nm.KernelConfig(1, 64, 1, sub=2, slots=1)),
                  (3, nm.KernelConfig(16, 32, 2, sub=1, slots=2)), (33, nm.KernelConfig(32, 64, 1, sub=1, slots=4)),
                  (64, nm.KernelConfig(64, 64, 2, sub=2, slots=2))]


@pytest.mark.parametrize("nested", [False, True])
def test_stream_kernel_within_rounding_of_dequantized_reference(nested):
    n, k = 72, 256           # rows: no multiple of the row tile; K: 4 scale blocks
    packed, state, _ = quantized(n, k, nested)
    ref_w = nm.dequantize_nf4(packed, state).double()
    gen = torch.Generator().manual_seed(1)
    for m, cfg in STREAM_CONFIGS:
        x = torch.randn(2, m, k, generator=gen)[1]            # a view at an offset: strides, not a copy
        bias = torch.randn(n, generator=gen) if m % 2 else None
        y = nm.nf4_matmul(x, packed, state, bias, config=cfg)
        ref = x.double() @ ref_w.T + (0 if bias is None else bias.double())
        assert y.shape == (m, n)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4, msg=cfg.describe)


@pytest.mark.parametrize("k,offset", [(192, 0), (256, 1)])
def test_stream_kernel_falls_back_to_the_tile_kernel(k, offset):
    """K=192: 3 blocks, no multiple of 2 slots; offset 1: packed bytes not 4-byte aligned (no words)."""
    packed, state, _ = quantized(72, k, nested=True)
    buf = torch.zeros(packed.numel() + offset, 1, dtype=torch.uint8)
    buf[offset:] = packed
    packed = buf[offset:]
    x = torch.randn(3, k)
    cfg = nm.KernelConfig(16, 32, 2, sub=1, slots=2)
    torch.testing.assert_close(nm.nf4_matmul(x, packed, state, config=cfg),
                               nm.nf4_matmul(x, packed, state, config=nm.KernelConfig(16, 32, 2)), rtol=0, atol=0)


@pytest.mark.parametrize("cfg", [None, nm.KernelConfig(16, 32, 1, sub=1, slots=2), nm.KernelConfig(1, 32, 1, sub=1, slots=2)])
def test_fp16_activations_give_fp16_within_rounding(cfg):
    """fp16 x. The tile kernel casts W to fp16 as bitsandbytes does and matches that elementwise; the
    stream kernel (reading x as 32-bit (even, odd) column pairs) rounds the codes, not code*scale, to
    fp16, so it is held to the exact product within fp16 rounding instead."""
    packed, state, _ = quantized(128, 128, nested=True)
    w = nm.dequantize_nf4(packed, state)
    x = torch.randn(4 if cfg is None or cfg.block_m > 1 else 1, 128).half()
    y = nm.nf4_matmul(x, packed, state, config=cfg)
    assert y.dtype == torch.float16
    exact = x.double() @ w.double().T
    assert float((y.double() - exact).norm() / exact.norm()) < 1e-3
    if cfg is None:
        torch.testing.assert_close(y.float(), x.float() @ w.half().float().T, rtol=2e-3, atol=2e-3)


def test_tuner_skips_configs_that_fail_or_disagree_with_one_line_each(capsys):
    tile, stream, broken, wrong = (nm.KernelConfig(16, 64, 1), nm.KernelConfig(16, 64, 1, sub=1, slots=2),
                                   nm.KernelConfig(16, 128, 1, sub=1, slots=4), nm.KernelConfig(16, 32, 2, sub=1, slots=2))
    packed, state, _ = quantized(72, 256, nested=True)
    x = torch.randn(3, 256)

    def run(cfg):
        if cfg == broken:
            raise RuntimeError("Illegal shared layout\n(the rest of a compiler error)")
        y = nm.nf4_matmul(x, packed, state, config=cfg)
        return y * 1.1 if cfg == wrong else y

    best, log = pick_fastest([tile, broken, stream, wrong], run, time_us=lambda cfg: 10.0 if cfg == tile else 5.0,
                                where="72x256")
    assert best == stream                     # the stream kernel agrees with the tile kernel and is "faster"
    assert log == [(tile.describe(), 10.0), (broken.describe(), None), (stream.describe(), 5.0), (wrong.describe(), None)]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "Illegal shared layout" in lines[0] and "wrong result" in lines[1]
    assert all(line.startswith("kernel tuning: ") and "skipped for 72x256" in line for line in lines)
    none, log = pick_fastest([broken], run, time_us=lambda cfg: 1.0, where="72x256")
    assert none is None and log == [(broken.describe(), None)]


def test_candidates_start_with_the_known_good_default_and_fit_k():
    for m_class in (1, 16, 32, 64):
        for n, k in ((11008, 4096), (4096, 11008), (4096, 4096), (32000, 4096)):
            cands = nm.candidates(m_class, n, k, 132, wide=True)
            assert cands[0] == nm.default_config(m_class, n, k, 132) and cands[0].sub == 0
            assert len(cands) <= 6 and len(set(cands)) == len(cands)
            short = nm.candidates(m_class, n, k, 132)      # what a model load times: 3 shapes x 4 classes
            assert short == cands[: len(short)] and len(short) <= 4
            assert all(c.block_m == m_class for c in cands)
            assert all(k % (c.slots * c.sub * 64) == 0 and k // c.split_k >= 4 * c.slots * 64
                       for c in cands if c.sub)


@pytest.mark.parametrize("k,cfg", [(96, None), (256, nm.KernelConfig(16, 32, 2, sub=1, slots=2))])
def test_never_reads_past_the_packed_buffers(k, cfg):
    """Every tensor the kernel reads is a view into a larger buffer whose tail would make NaN:
    absmax past its end is NaN, x past its end is NaN. K=96 puts a half-used 64-column step at
    each row's end, so a missing K mask would pull the tail into real outputs; the stream kernel
    (K=256, two splits of one 2-slot group) prefetches a group past each split's end, masked."""
    n, m = 72, 3
    packed, state, _ = quantized(n, k, nested=False, flat=True)
    ref = nm.dequantize_nf4(packed, state).double()
    big_w = torch.full((packed.numel() + 4096, 1), 0xFF, dtype=torch.uint8)
    big_w[: packed.numel()] = packed
    big_absmax = torch.full((state.absmax.numel() + 256,), float("nan"))
    big_absmax[: state.absmax.numel()] = state.absmax
    poisoned = copy.copy(state)
    poisoned.absmax = big_absmax[: state.absmax.numel()]
    x = torch.randn(m, k)
    big_x = torch.full((m * k + 4096,), float("nan"))
    big_x[: m * k] = x.reshape(-1)
    y = nm.nf4_matmul(big_x[: m * k].view(m, k), big_w[: packed.numel()], poisoned, config=cfg)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.double(), x.double() @ ref.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(nm.dequantize_with_kernel(big_w[: packed.numel()], poisoned), ref.float())


def nf4_tiny_model():
    model = tiny_model(hidden=64, vocab=64)        # widths 64/128: bitsandbytes' CPU NF4 is right there
    quantize_linear_nf4_(model, torch.float32)
    return model


def test_greedy_generation_through_the_kernel_equals_bitsandbytes():
    model = nf4_tiny_model()
    heads = copied_heads(model, num_heads=3)
    tree = build_tree_buffers(resolve_tree("cartesian-2x2x2"), 3)
    prompt = [5, 9, 13, 7, 21]

    def run(**kw):
        return [t for s in generate(model, prompt, config=DecodeConfig(max_new_tokens=12), **kw) for t in s.tokens]

    # the kernel first: bitsandbytes' CPU forward repacks the weight in place on its first call
    described = use_nf4_kernel(model, "triton")
    assert "Triton for 14 NF4 layers" in described
    with_kernel, medusa_kernel = run(), run(heads=heads, tree=tree)
    assert "bitsandbytes for all 14" in use_nf4_kernel(model, "bnb")
    with_bnb = run()
    assert len(with_kernel) == 12
    assert with_kernel == with_bnb
    assert medusa_kernel == with_bnb          # tree verification (multi-row) through the kernel too


def test_use_nf4_kernel_choices():
    import bitsandbytes as bnb

    model = nf4_tiny_model()
    q_proj = model.model.layers[0].self_attn.q_proj
    assert "bitsandbytes for all 14" in use_nf4_kernel(model, "bnb")
    assert model.model.layers[0].self_attn.q_proj is q_proj            # bnb: left exactly as it was
    use_nf4_kernel(model, "triton")
    swapped = model.model.layers[0].self_attn.q_proj
    assert type(swapped) is not bnb.nn.Linear4bit and isinstance(swapped, bnb.nn.Linear4bit)
    assert swapped.weight is q_proj.weight                              # the same Params4bit: no copy
    assert "auto: the Triton kernel needs CUDA" in use_nf4_kernel(model, "auto")
    assert type(model.model.layers[0].self_attn.q_proj) is bnb.nn.Linear4bit
    with pytest.raises(ValueError, match=r"^nf4 kernel 'fast' is unknown: use one of auto, triton, bnb, repacked, "
                                         r"repacked-exact$"):
        use_nf4_kernel(model, "fast")


def test_triton_on_cpu_without_the_interpreter_is_one_line(monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV)
    model = nf4_tiny_model()
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1") as err:
        use_nf4_kernel(model, "triton")
    assert "\n" not in str(err.value)


def test_load_spec_rejects_an_unknown_nf4_kernel():
    with pytest.raises(LoadError, match=r"nf4_kernel 'fast' is unknown: use one of auto, triton, bnb"):
        load(LoadSpec(model="x/y", device="cpu", nf4_kernel="fast"))
