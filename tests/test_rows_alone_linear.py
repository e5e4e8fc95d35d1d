"""Exact mode's lm_head kernel (quant/rows_alone_linear.py) under Triton's interpreter, fp32: it is the
product to rounding, and a row gets the same bits alone as among any number of other rows."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="the row-exact linear kernel needs Triton: pip install triton")
from medusa_core.quant.triton_runtime import INTERPRET_ENV  # noqa: E402
from medusa_core.quant.rows_alone_linear import RowsAloneHead, rows_alone_linear  # noqa: E402


@pytest.fixture(autouse=True)
def interpret(monkeypatch):
    monkeypatch.setenv(INTERPRET_ENV, "1")


def test_a_row_gets_its_bits_alone_and_the_product_to_rounding():
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(72, 100, bias=True)                  # K and N off the kernel's blocks
    x = torch.randn(20, 72, generator=gen)
    together = rows_alone_linear(x, head.weight, head.bias)
    with torch.no_grad():
        torch.testing.assert_close(together, head(x), rtol=1e-5, atol=1e-5)
    for rows in (1, 3, 9, 20):                                  # other row tiles, other counts
        assert torch.equal(rows_alone_linear(x[:rows], head.weight, head.bias), together[:rows]), rows
    assert torch.equal(torch.cat([rows_alone_linear(x[i:i + 1], head.weight, head.bias) for i in range(20)]),
                       together)


def test_the_head_wrapper_keeps_the_weight_and_takes_any_leading_shape():
    head = torch.nn.Linear(64, 50, bias=False)
    exact = RowsAloneHead(head)
    assert exact.weight is head.weight and exact.bias is None and exact.out_features == 50
    x = torch.randn(2, 3, 64)
    assert exact(x).shape == (2, 3, 50) and exact(x[0, 0]).shape == (50,)      # the prefill's one (H,) row
    assert torch.equal(exact(x[0, 0]), exact(x)[0, 0])


def test_a_weight_it_cannot_take_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"^rows_alone_linear takes a dense \(N, K\) weight matching x's 64 features"):
        rows_alone_linear(torch.randn(2, 64), torch.randn(10, 32))
