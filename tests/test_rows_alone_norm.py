"""Exact mode's RMSNorm kernel (quant/rows_alone_norm.py) under Triton's interpreter, fp32: it is
transformers' RMSNorm to rounding, and a row gets the same bits alone as among other rows, with the
interpreter's sum (a written-out tree) and the compiled kernel's (tl.reduce)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm

pytest.importorskip("triton", reason="the row-exact norm kernel needs Triton: pip install triton")
from tiny import with_compiled_reductions  # noqa: E402
from medusa_core.quant.triton_runtime import INTERPRET_ENV  # noqa: E402
from medusa_core.quant.norm_routing import is_rms_norm  # noqa: E402
from medusa_core.quant import rows_alone_norm as rn  # noqa: E402
from medusa_core.quant.rows_alone_norm import RowsAloneRMSNorm, rows_alone_rms_norm  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv(INTERPRET_ENV, "1")


@pytest.fixture(params=["tree", "reduce"])
def reduction(request, monkeypatch):
    """The interpreter's sum (a written-out tree), or the compiled kernel's (tl.reduce) run here."""
    if request.param == "reduce":
        with_compiled_reductions(rn, monkeypatch)
    return request.param


@pytest.mark.parametrize("hidden", [64, 48])          # a power of two, and not
def test_it_is_transformers_rms_norm_and_a_row_alone_gets_its_bits(hidden, reduction):
    gen = torch.Generator().manual_seed(hidden)
    norm = LlamaRMSNorm(hidden, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=gen))
    x = torch.randn(2, 17, hidden, generator=gen) * 3
    exact = RowsAloneRMSNorm(norm)
    assert is_rms_norm(norm) and exact.weight is norm.weight
    together = exact(x)
    with torch.no_grad():
        torch.testing.assert_close(together, norm(x), rtol=1e-5, atol=1e-5)
    rows = x.reshape(-1, hidden)
    alone = torch.cat([exact(rows[i:i + 1]) for i in range(rows.shape[0])])
    assert torch.equal(alone, together.reshape(-1, hidden))


def test_a_weight_of_another_size_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"^RMSNorm weight \(32,\) does not match rows of 64: wrong layer$"):
        rows_alone_rms_norm(torch.randn(3, 64), torch.ones(32), 1e-5)
