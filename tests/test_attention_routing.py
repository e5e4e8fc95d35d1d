"""Routing the rotary embedding and the attention (quant/attention_routing.py) on CPU, the kernels under Triton's
interpreter: auto keeps transformers' off CUDA and says nothing; on a GPU (its device and clock stood in) it keeps
whichever times faster and says both; a timing that fails leaves transformers' and says why; exact mode's
attention stays its own; the timings' own checks of each kernel's result hold; each wrong choice is one line."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("triton", reason="the rotary and attention kernels need Triton: pip install triton")
from tiny import tiny_model  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from medusa_core.errors import LoadError  # noqa: E402
from medusa_core.loading.load import load  # noqa: E402
from medusa_core.loading.policy import tuning_mode  # noqa: E402
from medusa_core.loading.spec import LoadSpec  # noqa: E402
from medusa_core.quant import attention_routing as ar  # noqa: E402
from medusa_core.quant import kernel_timing  # noqa: E402
from medusa_core.quant.bnb import quantize_linear_nf4_, use_nf4_kernel  # noqa: E402
from medusa_core.quant.triton_runtime import INTERPRET_ENV  # noqa: E402

ORIGINAL_ROTARY = modeling_llama.apply_rotary_pos_emb


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv(INTERPRET_ENV, "1")
    yield
    modeling_llama.apply_rotary_pos_emb = ORIGINAL_ROTARY      # the routing is per family: leave it as found


def routes(model) -> tuple[str, str]:
    return ar.rotary_routed(model), ar.attention_routed(model)


class StandInGpu:
    """auto's CUDA path run here: the model's device reads "cuda" and its dtype bf16 (the split kernel computes
    16-bit calls only), and the GPU's timings stood in as (transformers' µs, the kernel's µs)."""

    def __init__(self, monkeypatch, rotary=(60.0, 10.0), attention=(300.0, 200.0), fails: Exception | None = None):
        monkeypatch.setattr(ar, "_device", lambda model: torch.device("cuda"))
        monkeypatch.setattr(ar, "_dtype", lambda model: torch.bfloat16)

        def timed(pair):
            def measure(model):
                if fails is not None:
                    raise fails
                return pair
            return measure

        monkeypatch.setattr(ar, "_timed_rotary", timed(rotary))
        monkeypatch.setattr(ar, "_timed_attention", timed(attention))


def test_auto_off_cuda_keeps_transformers_rotary_and_sdpa_and_says_nothing():
    model = tiny_model()
    assert ar.use_rotary(model, "auto") == "" and ar.use_attention(model, "auto") == ""
    assert routes(model) == ("torch", "sdpa") and modeling_llama.apply_rotary_pos_emb is ORIGINAL_ROTARY


def test_auto_on_a_gpu_keeps_the_kernels_it_times_faster_and_says_both(monkeypatch):
    model = tiny_model()
    StandInGpu(monkeypatch, rotary=(60.0, 10.0), attention=(300.0, 200.0))
    assert ar.use_rotary(model, "auto") == ("rotary: one Triton kernel for the queries and keys of each layer, one "
                                            "for its cache write (auto measured 10 µs against 60 µs for transformers' "
                                            "and index_copy_ over a 1-row and a 16-row step)")
    assert ar.use_attention(model, "auto") == ("attention: split over the keys in Triton, hidden key blocks skipped "
                                               "(auto measured 200 µs against 300 µs for SDPA over a 1-row and a "
                                               "16-row step)")
    assert routes(model) == ("triton", "split")
    StandInGpu(monkeypatch, rotary=(10.0, 60.0), attention=(200.0, 300.0))     # a GPU where they lose: routed back
    assert ar.use_rotary(model, "auto") == ("rotary: transformers' own (auto measured 10 µs against 60 µs for the "
                                            "Triton rotary and cache write over a 1-row and a 16-row step)")
    assert ar.use_attention(model, "auto") == ("attention: transformers' SDPA (auto measured 200 µs against 300 µs "
                                               "for the split attention over a 1-row and a 16-row step)")
    assert routes(model) == ("torch", "sdpa") and modeling_llama.apply_rotary_pos_emb is ORIGINAL_ROTARY


def test_kernels_that_fail_on_the_gpu_leave_transformers_and_say_why(monkeypatch):
    model = tiny_model()
    StandInGpu(monkeypatch, fails=RuntimeError("PTX .version 9.9 does not support .target sm_200\nmore"))
    assert ar.use_rotary(model, "auto") == ("rotary: transformers' own (auto: timing the rotary failed on this GPU: "
                                            "RuntimeError: PTX .version 9.9 does not support .target sm_200)")
    assert ar.use_attention(model, "auto") == ("attention: transformers' SDPA (auto: timing the attention failed on "
                                               "this GPU: RuntimeError: PTX .version 9.9 does not support .target "
                                               "sm_200)")
    assert routes(model) == ("torch", "sdpa")


def test_exact_modes_attention_stays_its_own_and_the_rotary_serves_it(monkeypatch):
    model = tiny_model(hidden=64)
    quantize_linear_nf4_(model, torch.float32)
    use_nf4_kernel(model, "repacked-exact")              # as the loader: the NF4 kernel first, then the rest
    exact = model.config._attn_implementation
    StandInGpu(monkeypatch)
    assert ar.use_attention(model, "auto") == "" and model.config._attn_implementation == exact
    assert ar.use_rotary(model, "auto").startswith("rotary: one Triton kernel")   # bit for bit: exactness kept
    assert ar.flag_error("auto", "split", "repacked-exact", "cuda:0") == (
        "--attention-kernel split: --nf4-kernel repacked-exact brings its own row-exact attention: drop "
        "--attention-kernel")


def test_an_fp32_model_keeps_sdpa_which_the_kernel_would_hand_every_call_back_to(monkeypatch):
    model = tiny_model()
    StandInGpu(monkeypatch)
    monkeypatch.setattr(ar, "_dtype", lambda model: torch.float32)
    assert ar.use_attention(model, "auto") == "" and ar.attention_routed(model) == "sdpa"


def stand_in_clock(monkeypatch) -> list[int]:
    """kernel_timing.graph_time_us without CUDA: each timed call runs once, and 1 µs is returned per call."""
    ran = []

    def clock(calls, replays=5, repeat=4):
        for fn in calls[:1]:
            fn()
        ran.append(len(calls))
        return 1.0

    monkeypatch.setattr(kernel_timing, "graph_time_us", clock)
    return ran


def test_the_timings_check_each_kernels_result_before_they_time_it(monkeypatch):
    """The real timing functions run here on the interpreter, the clock stood in: the rotary kernel's result is
    transformers' bit for bit and the split attention's SDPA's to rounding, at a plain step's row and a tree's,
    over every layer; a kernel one ulp off transformers' rotary is refused, not timed."""
    model = tiny_model(layers=3)
    ran = stand_in_clock(monkeypatch)
    assert ar._timed_rotary(model) == (3.0 * 2, 3.0 * 2)            # 3 layers, 1 µs a call, 1 and 16 rows
    assert ar._timed_attention(model) == (3.0 * 2, 3.0 * 2)
    assert len(ran) == 8
    from medusa_core.quant import rotary_kernel

    real = rotary_kernel.fused_rotary

    def off_by_an_ulp(q, k, cos, sin):
        q_out, k_out = real(q, k, cos, sin)
        return torch.nextafter(q_out, torch.full_like(q_out, float("inf"))), k_out

    monkeypatch.setattr(rotary_kernel, "fused_rotary", off_by_an_ulp)
    with pytest.raises(RuntimeError, match=r"^wrong result: the Triton rotary is not transformers' bit for bit$"):
        ar._timed_rotary(model)


def test_the_loader_routes_them_names_them_and_keys_tuned_trees_by_them(monkeypatch):
    model = tiny_model()
    mode = json.loads(tuning_mode(LoadSpec(), model, "cuda", "nf4", torch.bfloat16))
    assert "rotary" not in mode and "attention" not in mode       # transformers' own add no key: old entries match
    StandInGpu(monkeypatch)
    ar.use_rotary(model, "auto")
    ar.use_attention(model, "auto")
    mode = json.loads(tuning_mode(LoadSpec(), model, "cuda", "nf4", torch.bfloat16))
    assert mode["rotary"] == "triton" and mode["attention"] == "split"   # a tree tuned on another step is not reused
    with pytest.raises(LoadError, match=r"^rotary_kernel 'fused' is unknown: use one of auto, torch, triton$"):
        load(LoadSpec(model="unused", device="cpu", rotary_kernel="fused"))
    with pytest.raises(LoadError, match=r"^attention_kernel 'flash' is unknown: use one of auto, sdpa, split$"):
        load(LoadSpec(model="unused", device="cpu", attention_kernel="flash"))


def test_a_forced_kernel_where_it_cannot_run_is_one_line(monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV)
    assert ar.flag_error("triton", "auto", "auto", "cpu") == (
        "--rotary-kernel triton: the Triton rotary needs a CUDA device (on cpu it runs only under Triton's "
        "interpreter, TRITON_INTERPRET=1, slowly, for tests): use --rotary-kernel auto or torch")
    assert ar.flag_error("auto", "split", "auto", "cpu").startswith("--attention-kernel split: the split attention "
                                                                    "needs a CUDA device")
    assert ar.flag_error("triton", "split", "auto", "cuda:0") is None and ar.flag_error("auto", "auto", "bnb", "cpu") is None
    with pytest.raises(ValueError, match=r"^rotary kernel 'fused' is unknown: use one of auto, torch, triton$"):
        ar.use_rotary(tiny_model(), "fused")


def test_the_load_line_names_what_auto_kept_on_a_gpu(monkeypatch):
    from medusa_core.loading import load as load_module

    StandInGpu(monkeypatch)
    monkeypatch.setattr(load_module.kernel_memory, "recall", lambda *args: None)     # nothing kept, nothing read
    text = load_module.route_kernels(tiny_model(), LoadSpec(device="cuda"), "none", "cuda")
    assert ("; rotary: one Triton kernel for the queries and keys of each layer, one for its cache write (auto "
            "measured 10 µs") in text, text
    assert "; attention: split over the keys in Triton, hidden key blocks skipped (auto measured 200 µs" in text, text


def test_a_split_attention_off_sdpa_is_refused_before_it_is_timed(monkeypatch):
    from medusa_core.quant import split_attention

    model = tiny_model(layers=1)
    stand_in_clock(monkeypatch)
    real = split_attention.split_attention_forward
    monkeypatch.setattr(split_attention, "split_attention_forward",
                        lambda *args, **kw: (real(*args, **kw)[0] * 1.05, None))
    with pytest.raises(RuntimeError, match=r"^wrong result: relative error 5\.0e-02 against SDPA$"):
        ar._timed_attention(model)


def test_a_family_the_kernels_do_not_serve_keeps_transformers_without_timing(monkeypatch):
    model = tiny_model()
    model.config.model_type = "gemma2"        # softcapping: the split kernel would hand every call back to SDPA
    StandInGpu(monkeypatch, fails=AssertionError("timed a family the kernels do not serve"))
    assert ar.use_rotary(model, "auto") == "" and ar.use_attention(model, "auto") == ""
    assert routes(model) == ("torch", "sdpa")


def test_exact_modes_attention_is_not_called_sdpa_and_a_forced_split_says_the_flag_to_use():
    model = tiny_model(hidden=64)
    quantize_linear_nf4_(model, torch.float32)
    use_nf4_kernel(model, "repacked-exact")
    assert ar.use_attention(model, "sdpa") == ""           # exact mode's row-exact attention stays, and is not SDPA
    with pytest.raises(ValueError, match=r"\(exact mode keeps its own\): use --attention-kernel auto$"):
        ar.use_attention(model, "split")


def test_a_forced_kernel_the_machine_cannot_run_is_a_load_error_before_anything_loads(monkeypatch):
    monkeypatch.delenv(INTERPRET_ENV)
    with pytest.raises(LoadError, match=r"^--rotary-kernel triton: the Triton rotary needs a CUDA device .* use "
                                        r"--rotary-kernel auto or torch$"):
        load(LoadSpec(model="never-read", device="cpu", rotary_kernel="triton"))


def test_a_load_that_fails_leaves_the_models_family_routed_as_it_was(tmp_path, monkeypatch):
    """The app keeps answering with the model it has while another loads, and keeps it if the load fails: the
    family's rotary (which that model's Ready line names) is as it was after the failed load."""
    from medusa_core.benchmarks.synthetic import made_tokenizer
    from medusa_core.loading import load as load_module

    def tree_fails(*args, **kw):      # anything after the routing: here, the tree tuning
        raise RuntimeError("no-such-tree: the tree tuning failed")

    monkeypatch.setattr(load_module, "pick_tree", tree_fails)

    running = tiny_model()
    ar.use_rotary(running, "triton")
    routed = modeling_llama.apply_rotary_pos_emb
    assert ar.rotary_routed(running) == "triton"
    other = tiny_model(vocab=256, seed=1)
    other.save_pretrained(tmp_path)
    made_tokenizer(256).save_pretrained(tmp_path)
    with pytest.raises(RuntimeError, match="no-such-tree"):
        load(LoadSpec(model=str(tmp_path), device="cpu", quant="none", rotary_kernel="torch"))
    assert modeling_llama.apply_rotary_pos_emb is routed and ar.rotary_routed(running) == "triton"
