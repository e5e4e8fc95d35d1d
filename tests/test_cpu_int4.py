"""The CPU's 4-bit path (cpu_int4.py): group codes that reproduce a Q4_1 weight, a kernel that
multiplies by exactly that weight, rows that do not depend on how many are verified together, and a
loaded model whose greedy Medusa still equals its greedy plain decoding."""

from __future__ import annotations

import json
import math

import pytest
import torch
from machine import skip_unless_row_exact
from tiny import char_tokenizer, copied_heads, tiny_model
from torch import nn

from medusa_core.quant import cpu_int4, exact_attention
from medusa_core.errors import LoadError
from medusa_core.decoding.config import DecodeConfig
from medusa_core.decoding.generate import generate
from medusa_core.quant.cpu_int4 import exact_mode
from medusa_core.loading.load import load
from medusa_core.loading.spec import LoadSpec
from medusa_core.loading.policy import resolve_quant
from medusa_core.decoding.tree import build_tree_buffers, resolve_tree

pytestmark = pytest.mark.skipif(not cpu_int4.kernel_available(), reason="this torch has no int4 CPU kernel")


def q4_1_weight(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight as GGUF's Q4_1 stores one: per group of 32, (code 0..15) * d + m, every code used."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.stack([torch.randperm(32, generator=g) % 16 for _ in range(n * k // 32)]).reshape(n, k)
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()      # fp16 scales, as stored
    m = (-8 * d + torch.randn(n, k // 32, generator=g) * 1e-3).half().float()
    weight = codes.float() * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)
    return weight, codes


def test_requantizing_a_q4_1_weight_finds_its_codes_again():
    weight, codes = q4_1_weight(64, 128)
    found, scales_zeros = cpu_int4.quantize_groups(weight)
    assert torch.equal(found, codes.to(torch.int32))
    step = scales_zeros[..., 0].float().repeat_interleave(32, 0).T                # (N, K)
    # only the scale's rounding to bf16 (8 bits) moves a weight: far less than a quantization step
    assert ((cpu_int4.dequantize(found, scales_zeros) - weight).abs() <= step / 16).all()


def test_any_weight_is_within_half_a_step():
    weight = torch.randn(48, 96)
    codes, scales_zeros = cpu_int4.quantize_groups(weight)
    step = scales_zeros[..., 0].float().repeat_interleave(32, 0).T
    assert codes.min() >= 0 and codes.max() <= 15
    assert ((cpu_int4.dequantize(codes, scales_zeros) - weight).abs() <= 0.55 * step).all()


def test_a_group_far_from_zero_with_a_small_range_is_still_covered():
    weight = 1.0 + 0.01 * torch.randn(16, 64)        # bf16 rounds a zero near 1 by up to 0.004: 3 steps of 0.0013
    codes, scales_zeros = cpu_int4.quantize_groups(weight)
    step = scales_zeros[..., 0].float().repeat_interleave(32, 0).T
    assert ((cpu_int4.dequantize(codes, scales_zeros) - weight).abs() <= 0.55 * step).all()


def test_int4_linear_multiplies_by_the_dequantized_weight():
    dense = nn.Linear(128, 64, bias=True)
    layer = cpu_int4.Int4Linear.from_linear(dense)
    x = torch.randn(3, 7, 128)
    reference = x.bfloat16().float() @ cpu_int4.dequantize(*cpu_int4.quantize_groups(dense.weight)).T + dense.bias
    out = layer(x)
    assert out.shape == (3, 7, 64) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference, rtol=1e-2, atol=1e-2)   # the kernel rounds its output to bf16


def test_the_probe_tells_a_layer_that_gives_a_row_its_bits_alone_from_one_that_does_not(monkeypatch):
    # whether this CPU's kernels do is this CPU's to say (the load probes it): the probe is what is tested, on a
    # GEMM that rounds otherwise from a given row count (test audit: asserted of this CPU's kernels)
    head = nn.Linear(64, 500, bias=False)
    for otherwise_from, invariant in ((33, True), (2, False)):
        monkeypatch.setattr(cpu_int4, "F", GemmRoundingOtherwiseFrom(otherwise_from))
        assert cpu_int4.row_invariant(cpu_int4.Bf16Head(head, rows_per_call=64), 64, rows=9) is invariant
        assert cpu_int4.row_invariant(cpu_int4.Bf16Head(head, rows_per_call=1), 64, rows=9)   # a row a call


def test_the_bf16_head_ranks_a_near_tie_as_fp32_does():
    """bf16 output steps are 0.125 at a logit of 25: two tokens 0.03 apart came out tied, and greedy
    took the wrong one (SmolLM2 on an AVX2 CPU: "L'Étoile..." for the capital of France). The top
    logits are fp32 again; the rest keep the GEMM's bf16 values."""
    head = nn.Linear(64, 300, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
        head.weight[7] = 25.0 / 64          # x . w = 25.0 for x = ones
        head.weight[9] = 25.03 / 64         # 0.03 above: the same bf16 value
    x = torch.ones(2, 64)
    fp32 = head(x)
    assert torch.nn.functional.linear(x.bfloat16(), head.weight.bfloat16())[0, [7, 9]].unique().numel() == 1
    out = cpu_int4.Bf16Head(head)(x)
    assert out.argmax(-1).tolist() == [9, 9]
    # the logits recomputed are the GEMM's largest (fp32's 16th and 17th may swap in bf16)
    top = torch.nn.functional.linear(x.bfloat16(), head.weight.bfloat16()).float().topk(cpu_int4.REFINED).indices
    torch.testing.assert_close(out.gather(-1, top), fp32.gather(-1, top), rtol=0, atol=1e-5)
    # with a bias the largest are picked after it, and it is added to the recomputed ones too
    with torch.no_grad():
        head.bias = nn.Parameter(torch.zeros(300))
        head.bias[3] = 30.0                 # token 3 now leads by far
    out = cpu_int4.Bf16Head(head)(x)
    assert out.argmax(-1).tolist() == [3, 3]
    torch.testing.assert_close(out[:, [3, 7, 9]], head(x)[:, [3, 7, 9]], rtol=0, atol=1e-5)


def test_the_int4_head_ranks_a_near_tie_as_fp32_does():
    # its approximation is coarser than bf16's: the largest logits are recomputed in fp32 as the bf16 head's are
    head = nn.Linear(64, 304, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 0.05, generator=torch.Generator().manual_seed(0))
        head.weight[7] = 25.0 / 64
        head.weight[9] = 25.03 / 64
    x = torch.ones(2, 64)
    int4 = cpu_int4.Int4Head(head)
    out = int4(x)
    assert out.argmax(-1).tolist() == [9, 9] and out.dtype == x.dtype and int4.weight is head.weight
    torch.testing.assert_close(out[:, [7, 9]], head(x)[:, [7, 9]], rtol=0, atol=1e-5)


@pytest.mark.parametrize("faster", ["int4", "bf16"])
def test_the_head_is_approximated_by_whichever_is_faster_on_this_cpu_and_the_line_says_both(monkeypatch, faster):
    times = {"head_bf16_ms": 3.0, "head_int4_ms": 1.0} if faster == "int4" else {"head_bf16_ms": 1.0, "head_int4_ms": 3.0}
    monkeypatch.setattr(cpu_int4, "measure_heads", lambda bf16, int4: times)
    # the bf16 GEMM's row invariance at this tiny head's shape is this CPU's to say (oneDNN picks by shape): not
    # what this test is about
    monkeypatch.setattr(cpu_int4, "exact_probe", lambda model: (None, cpu_int4.HEAD_ROWS_PER_CALL[0]))
    model = tiny_model(hidden=64)
    model.lm_head.weight = model.model.embed_tokens.weight           # tied, as SmolLM2's are
    applied, line = cpu_int4.use_int4(model, measured=False)
    other = "bf16" if faster == "int4" else "int4"
    assert applied and (f"with bf16 matmuls, {faster} lm_head (1.00 ms against 3.00 for {other} at 1 and 4 rows) "
                        "and row-exact attention: asked for") in line
    head = model.get_output_embeddings()
    assert head.kind == faster and head.weight is model.get_input_embeddings().weight and exact_mode(model)
    # a tree tuned with one head does not fit the other: the int4 head keys its own (the bf16 one, as before)
    from medusa_core.loading.policy import tuning_mode

    mode = json.loads(tuning_mode(LoadSpec(), model, "cpu", "int4", torch.float32))
    assert mode.get("lm_head") == ("int4" if faster == "int4" else None)
    assert mode["fused"] == "q/k/v,gate/up"          # and a tree tuned on projections apart does not fit fused ones


def test_remembered_head_timings_decide_without_measuring_and_a_head_not_row_invariant_stays_bf16(monkeypatch):
    head = nn.Linear(64, 64, bias=False)
    monkeypatch.setattr(cpu_int4, "measure_heads", lambda bf16, int4: pytest.fail("measured again"))
    kept = cpu_int4.Speed(10.0, 2.0, "read", head_bf16_ms=3.0, head_int4_ms=1.0)
    chosen, said = cpu_int4.choose_head(head, 64, kept, trees=True)
    assert chosen.kind == "int4" and said == "int4 lm_head (1.00 ms against 3.00 for bf16 at 1 and 4 rows)"
    real = cpu_int4.row_invariant
    monkeypatch.setattr(cpu_int4, "row_invariant", lambda layer, *a, **k: not isinstance(layer, cpu_int4.Int4Head)
                        and real(layer, *a, **k))
    chosen, said = cpu_int4.choose_head(head, 64, kept, trees=True)
    assert chosen.kind == "bf16" and said == "bf16 lm_head (the int4 one is not row-invariant on this CPU)"
    chosen, _ = cpu_int4.choose_head(head, 64, kept, trees=False)     # no tree runs: row invariance not needed
    assert chosen.kind == "int4"


def test_the_heads_proposals_in_int4_guess_what_fp32_guesses_and_stay_out_of_the_heads_weights():
    from medusa_core.heads.medusa_heads import HeadsConfig, MedusaHeads

    torch.manual_seed(0)
    lm_head = nn.Linear(64, 500, bias=False)
    heads = MedusaHeads(HeadsConfig(2, 1, 64, 500, own_projection=False)).eval()
    heads.restrict_proposals(torch.arange(0, 500, 5), lm_head)          # 100 tokens: no multiple of 16 (padded)
    hidden = torch.randn(3, 64)
    dense = heads.guesses(hidden, lm_head, top_k=3)
    keys = set(heads.state_dict())
    assert cpu_int4.proposals_in_int4(heads) and isinstance(heads.proposals, cpu_int4.Int4Head)
    assert heads.logits(hidden, lm_head).shape == (2, 3, 100)
    assert torch.equal(heads.guesses(hidden, lm_head, top_k=3), dense)   # the largest are recomputed in fp32
    assert set(heads.state_dict()) == keys, "the approximation is this process's, not part of the heads"
    heads.restrict_proposals(torch.arange(0, 500, 7), lm_head)           # another vocabulary: dense again
    assert heads.proposals is None
    assert not cpu_int4.proposals_in_int4(MedusaHeads(HeadsConfig(2, 1, 64, 500, own_projection=False)))


def test_a_quantized_model_keeps_its_tied_lm_head_weight_and_drops_fp32_layers():
    model = tiny_model(hidden=64)
    model.lm_head.weight = model.model.embed_tokens.weight           # tied, as SmolLM2's are
    kept = cpu_int4.quantize_model_int4_(model)
    assert kept == 0
    assert not any(type(m) is nn.Linear for m in model.get_decoder().modules())
    assert isinstance(model.get_output_embeddings(), cpu_int4.Bf16Head)
    # still one tensor: the heads read the root token's and their proposals' rows from it
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("arch", ["llama", "qwen2"])           # qwen2: q/k/v with biases
def test_qkv_and_gate_up_are_one_int4_matmul_each_and_every_projection_keeps_its_own_weights(arch):
    from medusa_core.quant.fused_projections import FusedSlice

    model = tiny_model(arch, hidden=64)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    groups = [(attn, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj"))]
    dense = {name: getattr(parent, name) for parent, names in groups for name in names}
    apart = {name: cpu_int4.Int4Linear.from_linear(d) for name, d in dense.items()}
    replaced = []
    assert cpu_int4.quantize_model_int4_(model, replaced) == 0
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1))
    for parent, names in groups:
        slices = [getattr(parent, name) for name in names]
        fused = slices[0].fused
        assert all(isinstance(s, FusedSlice) and s.fused is fused for s in slices)
        assert fused.splits == tuple(dense[name].out_features for name in names)
        # groups run along a row: the stacked weight quantizes to each projection's own codes and scales
        assert torch.equal(fused.scales_zeros, torch.cat([apart[name].scales_zeros for name in names], 1))
        for name in reversed(names):             # any call order gives each its own columns
            want = apart[name](x)
            torch.testing.assert_close(getattr(parent, name)(x), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        assert fused._pending is None            # nothing kept once every slice is taken
    if arch == "qwen2":
        assert attn.q_proj.fused.bias is not None and mlp.gate_proj.fused.bias is None
    assert "fused 64+32+32" in repr(attn)
    cpu_int4.restore_(replaced)
    assert all(getattr(parent, name) is dense[name] for parent, names in groups for name in names)


def test_the_row_invariance_probe_checks_the_matmuls_as_fused(monkeypatch):
    probed = set()

    def record(layer, in_features, rows=5, dtype=torch.float32):
        probed.add((layer.out_features, in_features))
        return True
    monkeypatch.setattr(cpu_int4, "row_invariant", record)
    monkeypatch.setattr(cpu_int4, "head_rows_per_call", lambda head: 64)
    assert cpu_int4.exact_probe(tiny_model(hidden=64)) == (None, 64)
    assert probed == {(64 + 32 + 32, 64), (64, 64), (128 + 128, 64), (64, 128)}    # q/k/v, o, gate/up, down


def test_sizes_the_kernel_cannot_take_stay_unquantized_and_are_named():
    model = tiny_model(hidden=64)
    model.model.layers[0].mlp.gate_proj = nn.Linear(64, 120, bias=False)    # 120 outputs: not a multiple of 16
    model.model.layers[0].mlp.up_proj = nn.Linear(64, 120, bias=False)
    model.model.layers[0].mlp.down_proj = nn.Linear(120, 64, bias=False)    # 120 inputs: not a multiple of 32
    applied, line = cpu_int4.use_int4(model, measured=False)
    assert applied and "3 layer(s) kept unquantized" in line and "trees may differ" in line
    assert not cpu_int4.exact_mode(model)


def test_without_heads_row_invariance_is_neither_required_nor_mentioned(monkeypatch):
    # a model loaded without heads runs plain decoding only: "trees would not equal plain decoding" was
    # said (and kept it in fp32) where no tree could run
    monkeypatch.setattr(cpu_int4, "exact_probe", lambda model: ("the int4 kernel is not row-invariant on this CPU", 64))
    applied, line = cpu_int4.use_int4(tiny_model(hidden=64), measured=True)
    assert not applied and "not row-invariant on this CPU: trees would not equal plain decoding" in line
    applied, line = cpu_int4.use_int4(tiny_model(hidden=64), measured=True, trees=False)
    assert "row-invariant" not in line and "tree" not in line
    assert "measured" in line, "chosen by its speed alone"
    model = tiny_model(hidden=64)
    model.model.layers[0].mlp.down_proj = nn.Linear(120, 64, bias=False)    # 120 inputs: not a multiple of 32
    model.model.layers[0].mlp.up_proj = nn.Linear(64, 120, bias=False)
    model.model.layers[0].mlp.gate_proj = nn.Linear(64, 120, bias=False)
    applied, line = cpu_int4.use_int4(model, measured=False, trees=False)
    assert applied and "3 layer(s) kept unquantized" in line and "tree" not in line


def test_auto_times_every_layers_matmuls_as_a_step_reads_them():
    """One layer timed again and again kept its fp32 weights in the CPU's cache and hid int4's gain (fewer bytes
    read): on an AVX2 CPU it measured 0.80x where whole-model forwards ran 1.3x faster in int4, and auto kept fp32.
    Every quantizable Linear of every layer is timed, and the lm_head."""
    model = tiny_model(hidden=64, layers=3)
    called: dict[str, int] = {}
    for name, module in model.named_modules():
        if type(module) is nn.Linear:
            module.register_forward_hook(lambda m, args, out, name=name: called.__setitem__(name, called.get(name, 0) + 1))
    times = cpu_int4.measure(model, rows=(1,), repeats=2)
    decoder = {name for name, m in model.model.layers.named_modules() if type(m) is nn.Linear}
    assert {f"model.layers.{name}" for name in decoder} | {"lm_head"} == set(called), sorted(called)
    assert len(decoder) == 3 * 7 and times["fp32_ms"] > 0 and times["int4_ms"] > 0
    assert times["head_bf16_ms"] > 0 and times["head_int4_ms"] > 0        # the head's two approximations, apart


def test_auto_measures_a_bf16_model_without_failing():
    model = tiny_model(hidden=64).to(torch.bfloat16)
    applied, line = cpu_int4.use_int4(model, measured=True)
    assert "\n" not in line and ("measured" in line or "fp32 matmuls (" in line)


def test_int4_is_refused_off_the_cpu_in_one_line():
    for device in ("cuda", "mps"):
        with pytest.raises(LoadError, match=f"quant 'int4' is torch's CPU kernel and the device is {device}: "
                                            "use --device cpu"):
            resolve_quant("int4", device)
    assert resolve_quant("auto", "cpu") == "none"                  # another model is never quantized unasked
    assert resolve_quant("auto", "cpu", cpu_default=True) == "int4"
    assert resolve_quant("auto", "cpu", cpu_default=True, dtype=torch.bfloat16) == "none"
    assert resolve_quant("auto", "mps", cpu_default=True) == "none"


@pytest.fixture(scope="module")
def int4_loaded(tmp_path_factory):
    backbone = tmp_path_factory.mktemp("int4") / "backbone"
    tokenizer = char_tokenizer()
    tiny_model(vocab=len(tokenizer), hidden=64, layers=3).save_pretrained(backbone)
    tokenizer.save_pretrained(backbone)
    return load(LoadSpec(model=str(backbone), device="cpu", quant="int4"))


def test_quant_int4_loads_and_says_so(int4_loaded):
    # the character vocabulary is no multiple of 16, which the int4 kernel needs: the bf16 head, nothing timed
    assert int4_loaded.model.get_output_embeddings().out_features % 16
    assert ("int4 weights (group 32, q/k/v and gate/up each one matmul) with bf16 matmuls, bf16 lm_head and row-exact "
            "attention: asked for") in int4_loaded.description
    assert int4_loaded.model.config._attn_implementation == exact_attention.NAME
    assert "asked for" in int4_loaded.description


def test_steps_and_prefill_take_the_row_exact_path(int4_loaded, monkeypatch):
    model = int4_loaded.model
    fallbacks = []
    real = exact_attention.sdpa_attention_forward
    monkeypatch.setattr(exact_attention, "sdpa_attention_forward",
                        lambda *args, **kwargs: fallbacks.append(1) or real(*args, **kwargs))
    heads = copied_heads(model, num_heads=5)
    tree = build_tree_buffers(resolve_tree("small-16"), heads.config.num_heads)
    steps = list(generate(model, list(range(4, 20)), heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=12)))
    assert len(steps) > 2
    assert not fallbacks, "every step and the prefill compute each row alone"


def test_greedy_trees_equal_plain_decoding_in_int4(int4_loaded):
    skip_unless_row_exact(int4_loaded)
    model = int4_loaded.model
    heads = copied_heads(model, num_heads=5)
    config = DecodeConfig(max_new_tokens=40)
    for seed in range(3):
        prompt = torch.randint(4, 104, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        plain = [t for s in generate(model, prompt, config=config) for t in s.tokens]
        assert len(plain) == 40
        for name in ("small-16", "chain-3"):
            tree = build_tree_buffers(resolve_tree(name), heads.config.num_heads)
            medusa = [t for s in generate(model, prompt, heads=heads, tree=tree, config=config) for t in s.tokens]
            assert medusa == plain, f"{name}, prompt {seed}"


def reference_texts(seed: int = 0) -> list[tuple[list[int], int]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(4, 64, (40,), generator=g).tolist(), 10) for _ in range(3)]


def test_fidelity_is_scored_against_fp32_and_reported():
    model = tiny_model(hidden=64)
    applied, line = cpu_int4.use_int4(model, measured=False, reference=reference_texts())
    assert applied and "on a 90-token reference text" in line and "next-token argmaxes as fp32's, NLL" in line
    # the same quantization, scored by hand: fp32 logits of a fresh copy against the int4 model's
    fresh = tiny_model(hidden=64)
    fp32, int4 = cpu_int4.reference_logits(fresh, reference_texts()), cpu_int4.reference_logits(model, reference_texts())
    scored = cpu_int4.fidelity(fp32, int4, reference_texts())
    assert scored.tokens == 90 and scored.line() in line


def test_fidelity_counts_the_argmaxes_int4_keeps_and_each_sides_nll():
    # (test audit: the test above scores it with the same function as the load)
    fp32 = [torch.tensor([[0.0, 2.0, 0.0], [3.0, 0.0, 0.0]]), torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])]
    int4 = [torch.tensor([[0.0, 2.0, 0.0], [0.0, 3.0, 0.0]]), torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])]
    reference = [([9, 1, 0], 1), ([9, 2, 1], 1)]      # the text's next tokens: 1, 0, 2, 1
    scored = cpu_int4.fidelity(fp32, int4, reference)
    nll = lambda right, rest: -math.log(math.exp(right) / (math.exp(right) + sum(math.exp(r) for r in rest)))
    assert (scored.tokens, scored.agreement) == (4, 0.75)            # the second position's argmax moved
    assert scored.nll_fp32 == pytest.approx((nll(2, [0, 0]) + nll(3, [0, 0]) + 2 * nll(1, [0, 0])) / 4)
    assert scored.nll_int4 == pytest.approx((nll(2, [0, 0]) + nll(0, [3, 0]) + 2 * nll(1, [0, 0])) / 4)


def test_auto_refuses_an_unfaithful_int4_and_puts_fp32_back(monkeypatch):
    """A kernel that computes something else (here: the codes scrambled) must not serve, however fast:
    auto measures fidelity on this CPU's own kernels and keeps the fp32 layers."""
    model = tiny_model(hidden=64)
    x = torch.randint(4, 64, (1, 20))
    with torch.no_grad():
        before = model(x).logits
    real = cpu_int4.quantize_groups

    def scrambled(weight):
        codes, scales_zeros = real(weight)
        return codes.flip(-1).contiguous(), scales_zeros

    monkeypatch.setattr(cpu_int4, "quantize_groups", scrambled)
    monkeypatch.setattr(cpu_int4, "measure", lambda model: {"fp32_ms": 10.0, "int4_ms": 1.0})   # "10x faster"
    applied, line = cpu_int4.use_int4(model, measured=True, reference=reference_texts())
    assert not applied and "not faithful enough" in line and "\n" not in line
    assert not any(isinstance(m, (cpu_int4.Int4Linear, cpu_int4.Bf16Head)) for m in model.modules())
    assert model.config._attn_implementation != exact_attention.NAME
    with torch.no_grad():
        assert torch.equal(model(x).logits, before), "the fp32 model is back as it was"


class GemmRoundingOtherwiseFrom:
    """torch.nn.functional as a CPU whose bf16 GEMM takes another path from ``rows`` rows up and rounds
    otherwise there (on a Xeon with AMX oneDNN did so from 33 rows: 2026-11-27). Below, each row is
    computed alone, so the test holds on any CPU, whatever its own GEMM does."""

    def __init__(self, rows: int):
        self.rows = rows

    def linear(self, x, w, bias=None):
        flat = x.reshape(-1, x.shape[-1])
        y = torch.cat([torch.nn.functional.linear(row, w, bias) for row in flat.split(1)])
        return (y * (1 + 2 ** -7) if flat.shape[0] >= self.rows else y).reshape(*x.shape[:-1], -1)


def test_the_bf16_head_calls_its_gemm_with_as_many_rows_as_this_cpu_keeps_row_invariant(monkeypatch):
    head = nn.Linear(64, 500, bias=False)
    monkeypatch.setattr(cpu_int4, "F", GemmRoundingOtherwiseFrom(33))
    assert cpu_int4.head_rows_per_call(head) == 32
    for rows in (64, 32):
        bf16 = cpu_int4.Bf16Head(head, rows)
        x = torch.randn(64, 64, generator=torch.Generator().manual_seed(rows))
        alone = torch.cat([bf16(x[i:i + 1]) for i in range(64)])
        assert torch.equal(bf16(x), alone) == (rows == 32), rows       # 64 rows at once round otherwise there
        assert bf16(x.reshape(2, 32, 64)).shape == (2, 32, 500)
    model = tiny_model(hidden=64)
    monkeypatch.setattr(cpu_int4, "measure_heads", lambda bf16, int4: {"head_bf16_ms": 1.0, "head_int4_ms": 2.0})
    applied, line = cpu_int4.use_int4(model, measured=False)
    assert applied and ("bf16 lm_head (32 rows per call: row-invariant up to there on this CPU; 1.00 ms against "
                        "2.00 for int4 at 1 and 4 rows)") in line
    assert model.get_output_embeddings().rows_per_call == 32 and "trees may differ" not in line


def int4_kernels_row_invariant(monkeypatch, head: bool) -> None:
    """The int4 kernel's row invariance as a CPU would have it (the decoder's layers: yes; the head's: ``head``),
    whatever this CPU's kernel does; the bf16 head's is measured (through the patched F)."""
    real = cpu_int4.row_invariant
    monkeypatch.setattr(cpu_int4, "row_invariant", lambda layer, *a, **k: head if isinstance(layer, cpu_int4.Int4Head)
                        else isinstance(layer, cpu_int4.Int4Linear) or real(layer, *a, **k))


def test_where_only_the_int4_head_is_row_invariant_auto_runs_the_int4_mode_with_it_even_if_slower(monkeypatch):
    # a CPU whose bf16 GEMM rounds a row otherwise from 2 rows on: the int4 head keeps trees exact there, so auto
    # no longer falls back to fp32 for the head's sake
    monkeypatch.setattr(cpu_int4, "F", GemmRoundingOtherwiseFrom(2))
    int4_kernels_row_invariant(monkeypatch, head=True)
    monkeypatch.setattr(cpu_int4, "measure", lambda model: {"fp32_ms": 10.0, "int4_ms": 2.0, "head_bf16_ms": 1.0,
                                                            "head_int4_ms": 3.0})
    assert cpu_int4.head_rows_per_call(nn.Linear(64, 500, bias=False)) is None
    model = tiny_model(hidden=64)
    applied, line = cpu_int4.use_int4(model, measured=True)
    assert applied and ("int4 lm_head (the bf16 one is not row-invariant on this CPU even 8 rows per call) and "
                        "row-exact attention: 5.00x fp32's matmul speed") in line, line
    assert model.get_output_embeddings().kind == "int4" and "trees may differ" not in line and exact_mode(model)


def test_a_head_row_invariant_in_neither_format_keeps_auto_in_fp32_and_says_it_is_the_head(monkeypatch):
    monkeypatch.setattr(cpu_int4, "F", GemmRoundingOtherwiseFrom(2))
    int4_kernels_row_invariant(monkeypatch, head=False)
    applied, line = cpu_int4.use_int4(tiny_model(hidden=64), measured=True)
    assert not applied and line == ("fp32 matmuls (the lm_head is not row-invariant on this CPU, in bf16 even 8 rows "
                                    "per call nor in int4: trees would not equal plain decoding)")


def test_the_head_benchmark_decodes_each_head_and_tree_and_gives_the_models_head_back(default_loaded):
    # benchmarks/cpu_variants.py on the CPU default, shortened: its speed figures are the benchmark's to report
    from medusa_core.benchmarks import cpu_variants

    model = default_loaded.model
    chosen = model.get_output_embeddings()
    if not isinstance(chosen, cpu_int4.RefinedHead):
        pytest.skip("this CPU runs the default in fp32 (the int4 mode measured slower or not row-invariant)")
    result = cpu_variants.compare(model, default_loaded.tokenizer, default_loaded.heads, ["Name three colours."],
                                  max_new_tokens=6, rounds=1,
                                  variants=cpu_variants.head_variants(model, default_loaded.heads))
    assert set(result.tokens_per_s) == {(h, t) for h in ("bf16", "int4") for t in cpu_variants.TREES}
    assert all(rate > 0 for rate in result.tokens_per_s.values())
    assert result.medusa_is_plain == 2 * result.cases == 8, "greedy Medusa left plain decoding under a head"
    assert model.get_output_embeddings() is chosen
    # the load put the proposals through the int4 kernel exactly where it kept the int4 head, and says so
    int4 = chosen.kind == "int4"
    assert (default_loaded.heads.proposals is not None) == int4
    assert ("(their logits in int4, as the lm_head's)" in default_loaded.description) == int4


def test_the_projection_benchmark_decodes_them_apart_and_gives_the_fused_ones_back(default_loaded):
    # benchmarks/cpu_variants.py --compare projections, shortened: its speed figures are the benchmark's to report
    from medusa_core.benchmarks import cpu_variants
    from medusa_core.loading.load import load_backbone_dir
    from medusa_core.quant.fused_projections import FusedSlice

    model = default_loaded.model
    if not isinstance(model.get_output_embeddings(), cpu_int4.RefinedHead):
        pytest.skip("this CPU runs the default in fp32 (the int4 mode measured slower or not row-invariant)")
    before = dict(model.named_modules())
    assert sum(isinstance(m, FusedSlice) for m in before.values()) == 5 * model.config.num_hidden_layers
    variants = cpu_variants.projection_variants(model, load_backbone_dir(model.name_or_path)[0])
    seen = []
    for name, swap in variants.items():         # what each variant decodes with
        restore = swap()
        seen.append((name, sum(isinstance(m, FusedSlice) for m in model.modules()),
                     type(model.model.layers[3].mlp.up_proj).__name__))
        restore()
    assert seen == [("apart", 0, "Int4Linear"), ("fused", 5 * model.config.num_hidden_layers, "FusedSlice")]
    result = cpu_variants.compare(model, default_loaded.tokenizer, default_loaded.heads, ["Name three colours."],
                                  max_new_tokens=4, rounds=1, variants=variants)
    assert set(result.tokens_per_s) == {(v, t) for v in ("apart", "fused") for t in cpu_variants.TREES}
    assert dict(model.named_modules()) == before, "the benchmark left the model otherwise than loaded"


def test_the_variants_benchmark_refuses_counts_before_loading(capsys, monkeypatch):
    # QA: --prompts 0, --rounds 0 and --max-new-tokens 0 failed with tracebacks after the load; -1 ran 23 prompts
    from medusa_core.benchmarks import cpu_variants

    monkeypatch.setattr(cpu_variants, "load", lambda *args, **kwargs: pytest.fail("the model loaded first"))
    for args, says in ((["--count", "0"], "error: --count 0 must be from 1 to "),
                       (["--count", "-1"], "error: --count -1 must be from 1 to "),
                       (["--count", "999"], "error: --count 999 must be from 1 to "),
                       (["--rounds", "0"], "error: --rounds 0 must be at least 1"),
                       (["--rounds", "-1"], "error: --rounds -1 must be at least 1"),
                       (["--max-new-tokens", "0"], "error: --max-new-tokens 0 must be at least 1")):
        with pytest.raises(SystemExit) as stopped:
            cpu_variants.main(args)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and says in err and err.count("error:") == 1, err
