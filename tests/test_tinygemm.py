"""torch's int4 kernel as issue 22's anchor (medusa_core/quant/tinygemm.py): gpt-fast's operands multiply
within rounding of x @ dequantized W, a decoder's Linears become int4 layers (or the whole model stays as
it was, with a one-line reason), and bench_synthetic times the step through them. The CPU kernel stands
in for the CUDA one here; their operands are the same, their speed is not compared."""

import json

import pytest
import torch
from tiny import tiny_model
from torch import nn

from medusa_core import bench_synthetic
from medusa_core.benchmarks.synthetic import SHAPES
from medusa_core.quant import tinygemm

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="this torch has no int4 CPU kernel")


@pytest.mark.parametrize("group", [64, 128])
def test_gpt_fast_operands_multiply_within_rounding_of_the_dequantized_weight(group):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q, scales_and_zeros = tinygemm.quantize(w, group)
    assert q.min() >= 0 and q.max() <= 15 and scales_and_zeros.shape == (256 // group, 64, 2)
    dense = tinygemm.dequantize(q, scales_and_zeros, group)
    assert float((dense - w).abs().max()) < 0.2 * w.abs().max()            # 16 levels per group
    layer = nn.Linear(256, 64)
    layer.weight.data, layer.bias.data = w, torch.randn(64)
    int4 = tinygemm.TinygemmLinear(layer, group)
    x = torch.randn(2, 3, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = int4(x)
        ref = x.bfloat16().double() @ dense.double().T + layer.bias.double()
    assert y.shape == (2, 3, 64) and y.dtype == x.dtype
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-2


def test_a_decoder_becomes_int4_layers_or_stays_whole_with_a_one_line_reason():
    model = tiny_model("llama", hidden=64)                    # q/k/v/o and gate/up take 64 inputs, down 128
    with pytest.raises(ValueError, match=r"^tinygemm cannot take a \d+x64 weight at group 128: .* --tinygemm-group"):
        tinygemm.quantize_linear_tinygemm_(model, 128)
    assert not any(isinstance(m, tinygemm.TinygemmLinear) for m in model.modules())    # nothing half-done
    with pytest.raises(ValueError, match=r"^tinygemm group 48 is not one of \(32, 64, 128, 256\)"):
        tinygemm.quantize_linear_tinygemm_(model, 48)
    x = torch.tensor([[1, 5, 7, 9]])
    before = model(x).logits
    assert tinygemm.quantize_linear_tinygemm_(model, 64) == 14
    assert sum(isinstance(m, tinygemm.TinygemmLinear) for m in model.modules()) == 14
    assert type(model.lm_head) is nn.Linear                   # lm_head and embeddings stay, as for NF4
    after = model(x).logits
    assert float((after - before).norm() / before.norm()) < 0.2     # the same model, in 16 levels per group


def test_bench_synthetic_times_the_step_through_tinygemm(tmp_path, capsys):
    out = tmp_path / "int4.json"
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "tinygemm", "--tinygemm-group", "64",
                                 "--tree-sizes", "1", "16", "--context", "16", "--iters", "2", "--warmup", "0",
                                 "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    (result,) = data["results"]
    assert result["quant"] == "tinygemm" and "tinygemm int4 (group 64) for 14 layers" in result["routing"]
    # what a step reads: the int4 codes (half a byte a weight) and a bf16 scale and zero per 64, the bf16
    # norms (two a layer and the final one) and lm_head
    shape = SHAPES["tiny"]
    per_layer = 4 * shape.hidden * shape.hidden + 3 * shape.hidden * shape.intermediate
    bf16 = 2 * ((2 * shape.layers + 1) * shape.hidden + shape.vocab * shape.hidden)
    assert result["weights_bytes"] == shape.layers * per_layer * (1 / 2 + 4 / 64) + bf16
    assert data["summary"]["tinygemm_baseline_ms"] == result["rows"][0]["loop_ms"] > 0
    assert data["summary"]["tinygemm_tree16_ms"] == result["rows"][1]["loop_ms"] > 0
    assert bench_synthetic.main(["--device", "cpu", "--shape", "tiny", "--quant", "tinygemm", "--tree-sizes", "1",
                                 "--context", "8", "--iters", "1"]) == 1
    assert "--tinygemm-group" in capsys.readouterr().err
