"""fp32 Linear layers on a CPU with MKL's prepacked weights, so verifying a tree costs little more
than one token.

On a CPU, fp32 ``F.linear`` with 2..64 input rows goes through MKL's sgemm, which repacks the whole
weight on every call: for SmolLM2's 576->49152 lm_head (2 cores) 1 row takes 6.8 ms but 8 rows 20 ms
and 16 rows 23 ms, so a 16-node tree step cost several one-token steps. MKL can pack a weight once
for a given row count (``cblas_sgemm_pack``, exposed as ``torch.ops.mkl._mkl_reorder_linear_weight``
and ``_mkl_linear``, what inductor's freezing uses): the same projection then takes 8.5 ms at 8 rows
and 9.7 ms at 16, with results equal to the unpacked sgemm's for those rows (measured: bit for bit),
so exact greedy decoding stays exact. One row keeps the plain path (a gemv, no repacking).

A pack is made per row count on first use and holds ~2x the weight's bytes, so each layer keeps at
most MAX_PACKS of them (a decoding step uses two row counts: the tree's T and the heads' K).
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn
from torch.nn import functional as F

MAX_PACKS = 3            # row counts kept packed per layer (LRU)
PACKED_ROWS = range(2, 65)   # tree verification and head rows; prefill (longer) and 1 row stay plain


def available() -> bool:
    """MKL's packed sgemm is compiled into this torch (x86 builds)."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


class PackedLinear(nn.Module):
    """Drop-in for an fp32 ``nn.Linear`` on the CPU; shares (does not copy) the weight and bias, so
    tied embeddings stay tied and state dicts are unchanged."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        self._packs: OrderedDict[int, torch.Tensor] = OrderedDict()

    def _pack(self, rows: int) -> torch.Tensor:
        pack = self._packs.pop(rows, None)
        if pack is None:
            pack = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach(), rows)
            while len(self._packs) >= MAX_PACKS:
                self._packs.popitem(last=False)
        self._packs[rows] = pack
        return pack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if rows not in PACKED_ROWS or torch.is_grad_enabled() or x.dtype != torch.float32:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.mkl._mkl_linear(x.reshape(rows, self.in_features), self._pack(rows), self.weight,
                                      self.bias, rows)                      # (rows, out)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, mkl packs={list(self._packs)}"


def prepack_(model: nn.Module) -> int:
    """Swap every fp32 ``nn.Linear`` of a CPU model (lm_head included) for a PackedLinear, in place;
    returns how many. A no-op (0) where MKL's packed sgemm is missing or the model is not fp32 on CPU."""
    if not available():
        return 0
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is nn.Linear and child.weight.device.type == "cpu" and child.weight.dtype == torch.float32]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)


def is_prepacked(model: nn.Module) -> bool:
    return any(isinstance(m, PackedLinear) for m in model.modules())
