"""Routing the decoder's RMSNorms (quant/norm_routing.py) on CPU, the Triton norm under Triton's
interpreter in fp32: the one-kernel norm stands in for every RMSNorm with the same weights and gives
transformers' output to rounding; greedy Medusa through it still gives plain decoding's tokens; auto keeps
whichever the GPU times faster and says both; exact mode keeps its own norms; each wrong choice is one line."""

from __future__ import annotations

import sys

import pytest
import torch

pytest.importorskip("triton", reason="the Triton norm needs Triton: pip install triton")
from tiny import copied_heads, tiny_model  # noqa: E402

from medusa_core.decoding.config import DecodeConfig  # noqa: E402
from medusa_core.decoding.generate import generate  # noqa: E402
from medusa_core.decoding.tree import build_tree_buffers, resolve_tree  # noqa: E402
from medusa_core.errors import LoadError  # noqa: E402
from medusa_core.loading.load import load  # noqa: E402
from medusa_core.loading.policy import tuning_mode  # noqa: E402
from medusa_core.loading.spec import LoadSpec  # noqa: E402
from medusa_core.quant import norm_routing as nr  # noqa: E402
from medusa_core.quant.bnb import quantize_linear_nf4_, use_nf4_kernel  # noqa: E402
from medusa_core.quant.triton_runtime import INTERPRET_ENV  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv(INTERPRET_ENV, "1")


def norm_modules(model) -> list[str]:
    return [type(m).__name__ for m in model.get_decoder().modules() if "Norm" in type(m).__name__]


def answer(model, **kw) -> list[int]:
    return [t for s in generate(model, [5, 9, 13, 7, 21], config=DecodeConfig(max_new_tokens=12), **kw) for t in s.tokens]


def test_the_triton_norms_stand_in_for_every_rmsnorm_and_give_transformers_output_to_rounding():
    model = tiny_model(hidden=64, layers=3)
    ids = torch.tensor([[5, 9, 13, 7, 21, 30]])
    with torch.no_grad():
        stock = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    originals = [m for m in model.get_decoder().modules() if type(m).__name__ == "LlamaRMSNorm"]

    assert nr.use_norm_kernel(model, "triton") == "norms: one Triton kernel for each of 7 RMSNorms"
    assert norm_modules(model) == ["RowsAloneRMSNorm"] * 7 and nr.norms_routed(model) == "triton"
    assert model.state_dict().keys() == state.keys()     # the same parameters under the same keys
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, stock, rtol=1e-5, atol=1e-5)

    assert nr.use_norm_kernel(model, "torch") == "norms: transformers' own"
    assert [m for m in model.get_decoder().modules() if "Norm" in type(m).__name__] == originals
    with torch.no_grad():
        assert torch.equal(model(ids).logits, stock)


def test_greedy_medusa_through_the_triton_norms_gives_plain_decodings_tokens():
    model = tiny_model(hidden=64)
    heads = copied_heads(model, num_heads=3)
    tree = build_tree_buffers(resolve_tree("cartesian-2x2x2"), 3)
    nr.use_norm_kernel(model, "triton")
    calls = []
    for module in model.get_decoder().modules():
        if type(module).__name__ == "RowsAloneRMSNorm":
            module.register_forward_hook(lambda *args: calls.append(1))
    plain = answer(model)
    assert len(calls) >= 5 * 12, "every step ran the Triton norms"
    assert answer(model, heads=heads, tree=tree) == plain and len(plain) == 12


def test_auto_off_cuda_keeps_transformers_norms_and_says_nothing():
    model = tiny_model()
    assert nr.use_norm_kernel(model, "auto") == ""
    assert norm_modules(model) == ["LlamaRMSNorm"] * 5 and nr.norms_routed(model) == "torch"


class GpuTimings:
    """auto's CUDA path run here: the norms' device reads "cuda", and the GPU's timings stood in."""

    def __init__(self, monkeypatch, torch_us: float, triton_us: float, fails: Exception | None = None):
        monkeypatch.setattr(nr, "_device_of", lambda norms: torch.device("cuda"))

        def timed(norms, dtype, device):
            if fails is not None:
                raise fails
            return torch_us * len(norms), triton_us * len(norms)

        monkeypatch.setattr(nr, "_timed_sums", timed)


def test_auto_on_a_gpu_keeps_the_norm_it_times_faster_and_says_both(monkeypatch):
    model = tiny_model()
    GpuTimings(monkeypatch, torch_us=13.0, triton_us=3.0)
    assert nr.use_norm_kernel(model, "auto") == ("norms: one Triton kernel for each of 5 RMSNorms (auto measured "
                                                 "15 µs against 65 µs for transformers' over a 1-row and a 16-row step)")
    assert nr.norms_routed(model) == "triton"
    GpuTimings(monkeypatch, torch_us=3.0, triton_us=13.0)
    assert nr.use_norm_kernel(model, "auto") == ("norms: transformers' own (auto measured 15 µs against 65 µs "
                                                 "for the Triton norm over a 1-row and a 16-row step)")
    assert norm_modules(model) == ["LlamaRMSNorm"] * 5


def test_a_triton_norm_that_fails_on_the_gpu_leaves_transformers_and_says_why(monkeypatch):
    model = tiny_model()
    GpuTimings(monkeypatch, 13.0, 3.0, fails=RuntimeError("PTX .version 9.9 does not support .target sm_200\nmore"))
    assert nr.use_norm_kernel(model, "auto") == ("norms: transformers' own (auto: timing the norms failed on this "
                                                 "GPU: RuntimeError: PTX .version 9.9 does not support .target sm_200)")
    assert norm_modules(model) == ["LlamaRMSNorm"] * 5


def test_exact_mode_keeps_its_own_norms_and_leaving_it_gives_transformers_back_to_route_again():
    model = tiny_model(hidden=64)
    quantize_linear_nf4_(model, torch.float32)
    nr.use_norm_kernel(model, "triton")
    use_nf4_kernel(model, "repacked-exact")          # as the loader: the NF4 kernel first, then the norms
    assert nr.use_norm_kernel(model, "auto") == "" and nr.norms_routed(model) == "exact"
    assert all(m.exact for m in model.get_decoder().modules() if type(m).__name__ == "RowsAloneRMSNorm")
    with pytest.raises(ValueError, match=r"^--norm-kernel torch: --nf4-kernel repacked-exact brings its own "
                                         r"row-exact norms: drop --norm-kernel$"):
        nr.use_norm_kernel(model, "torch")
    use_nf4_kernel(model, "bnb")
    assert nr.norms_routed(model) == "torch" and norm_modules(model) == ["LlamaRMSNorm"] * 5
    assert nr.use_norm_kernel(model, "triton").startswith("norms: one Triton kernel for each of 5")


def test_wrong_norm_choices_are_one_line(monkeypatch):
    model = tiny_model()
    with pytest.raises(ValueError, match=r"^norm kernel 'fused' is unknown: use one of auto, torch, triton$"):
        nr.use_norm_kernel(model, "fused")
    monkeypatch.setenv(INTERPRET_ENV, "0")
    with pytest.raises(ValueError, match=r"^--norm-kernel triton: the Triton norm needs a CUDA device .*: use "
                                         r"--norm-kernel auto$"):
        nr.use_norm_kernel(model, "triton")
    assert norm_modules(model) == ["LlamaRMSNorm"] * 5


def test_trees_tuned_on_transformers_norms_keep_their_cache_key_and_the_triton_norms_get_their_own():
    model = tiny_model()
    key = tuning_mode(LoadSpec(), model, "cpu", "none", torch.float32)
    assert "norms" not in key                         # entries tuned before the Triton norm still match
    nr.use_norm_kernel(model, "triton")
    assert tuning_mode(LoadSpec(), model, "cpu", "none", torch.float32) != key


def test_the_loader_routes_the_norms_after_the_nf4_kernel_and_says_so(tiny_dirs):
    backbone = str(tiny_dirs[0])
    loaded = load(LoadSpec(model=backbone, device="cpu", norm_kernel="triton"))
    assert "cpu; norms: one Triton kernel for each of 9 RMSNorms)" in loaded.description, loaded.description
    assert nr.norms_routed(loaded.model) == "triton"
    assert "norms" not in load(LoadSpec(model=backbone, device="cpu")).description      # auto off CUDA: nothing to say
    with pytest.raises(LoadError, match=r"^--norm-kernel triton: --nf4-kernel repacked-exact brings its own"):
        load(LoadSpec(model=backbone, device="cpu", quant="nf4", nf4_kernel="repacked-exact", norm_kernel="triton"))


def test_without_triton_the_model_loads_with_transformers_norms_and_forcing_triton_is_one_line(monkeypatch, tiny_dirs):
    monkeypatch.setitem(sys.modules, "triton", None)                     # `import triton` fails, as on macOS
    monkeypatch.delitem(sys.modules, "medusa_core.quant.rows_alone_norm", raising=False)
    model = tiny_model()
    assert nr.use_norm_kernel(model, "auto") == "" and nr.use_norm_kernel(model, "torch") == "norms: transformers' own"
    with pytest.raises(ValueError, match=r"^--norm-kernel triton: medusa_core.quant.rows_alone_norm needs Triton"):
        nr.use_norm_kernel(model, "triton")
    assert norm_modules(model) == ["LlamaRMSNorm"] * 5
    assert load(LoadSpec(model=str(tiny_dirs[0]), device="cpu")).model is not None


def test_the_timing_compares_both_norms_on_each_width_at_a_step_and_a_trees_rows(monkeypatch):
    """_timed_sums with the CUDA graph timing stood in: each (width, dtype) once per row count, per-head norms on a
    row per head, inputs in the activations' dtype, and a Triton result that is not transformers' refused."""
    from medusa_core.quant import kernel_timing

    timed = []

    def stand_in(calls):
        fn = calls[0]
        x = fn.args[0] if fn.args else None
        kind = "triton" if getattr(fn.func, "__name__", "") == "rows_alone_rms_norm" else "torch"
        timed.append((kind, tuple(x.shape), x.dtype))
        return 2.0 if timed[-1][0] == "triton" else 5.0

    monkeypatch.setattr(kernel_timing, "graph_time_us", stand_in)
    model = tiny_model(arch="qwen2", hidden=64, layers=2)
    per_head = LlamaRMSNorm16()
    norms = [m for m in model.get_decoder().modules() if nr.is_rms_norm(m)] + [per_head, per_head]
    torch_us, triton_us = nr._timed_sums(norms, torch.float32, torch.device("cpu"))
    assert (torch_us, triton_us) == (5 * 2 * 5.0 + 2 * 2 * 5.0, 5 * 2 * 2.0 + 2 * 2 * 2.0)   # 5 + 2 norms, 2 row counts
    assert sorted(timed) == sorted([(k, (rows, 64), torch.float32) for k in ("torch", "triton") for rows in (1, 16)] +
                                   [(k, (rows * 4, 16), torch.float32) for k in ("torch", "triton") for rows in (1, 16)])
    # a kernel whose result is not transformers'
    monkeypatch.setattr("medusa_core.quant.rows_alone_norm.rows_alone_rms_norm", lambda x, w, eps: -x)
    with pytest.raises(RuntimeError, match="^wrong result: relative error"):
        nr._timed_sums(norms, torch.float32, torch.device("cpu"))


def LlamaRMSNorm16():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(16, eps=1e-6)
