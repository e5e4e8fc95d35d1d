"""Projections that read the same input, computed as one matmul over their weights stacked by rows:
q/k/v into one, gate/up into one.

Why: at the few rows a decoding step has, a projection costs its launch (GPU) or its call (CPU) as much
as its bytes. One matmul is one call instead of two or three, one pass over x, and a wider N.

How the stock transformers forward stays unchanged: q_proj, k_proj and v_proj become FusedSlice
modules sharing one SplitLinear (the quantization's own matmul module over the stacked weights).
Whichever slice is called first computes the whole product for its input and keeps its siblings'
columns; a sibling called with that same input tensor (the same object, and not modified since, where
autograd's version counter can tell: inference tensors have none) takes its kept columns, and they
are dropped once all are taken. With any other input a slice recomputes. So every slice returns
fused(x)[its columns] whatever order the forward calls them in; the cost of an odd order is only a
second matmul. A wrapper around the attention or MLP forward would need a fork of transformers' code
per architecture; this needs none. The cache holds tensors only between siblings' calls (inside a CUDA
graph capture it is Python-side bookkeeping, as the rest of the forward).

Used by the repacked NF4 kernel on CUDA (nf4_fused.py) and the int4 kernel on the CPU (cpu_int4.py).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch
from torch import nn

FUSE = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class SplitLinear(nn.Module):
    """A matmul module over one projection or several stacked by rows: ``splits`` is each one's out_features.
    Subclasses compute the whole product in ``forward``; ``take`` hands it out per projection."""

    def __init__(self, splits: tuple[int, ...]):
        super().__init__()
        self.splits = splits
        self._pending = None            # (x, version, {slice index: columns}) between siblings' calls

    def take(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Columns of projection ``index`` for input x: kept from a sibling's call on this x, or computed."""
        version = None if x.is_inference() else x._version
        pending = self._pending
        if pending is None or pending[0] is not x or pending[1] != version or index not in pending[2]:
            pending = self._pending = (x, version, dict(enumerate(self(x).split(self.splits, dim=-1))))
        out = pending[2].pop(index)
        if not pending[2]:
            self._pending = None
        return out


class FusedSlice(nn.Module):
    """Stands where q_proj (k_proj, ...) stood: its columns of the shared fused product."""

    def __init__(self, fused: SplitLinear, index: int):
        super().__init__()
        self.fused = fused               # one module shared by the siblings (named_modules lists it once)
        self.index = index
        self.in_features, self.out_features = fused.in_features, fused.splits[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused.take(x, self.index)


Layer = tuple[nn.Module, str, nn.Module]        # (parent, name, projection)


def fusable(layers: list[Layer], kind: Callable[[nn.Module], Hashable],
            fuse=FUSE) -> list[tuple[tuple[str, ...], list[Layer]]]:
    """(names, their layers) for every ``fuse`` group found whole under one parent, its projections all of one
    ``kind`` (what must agree to stack them: the input size and the dtype)."""
    by_parent: dict[int, dict[str, Layer]] = {}
    for entry in layers:
        by_parent.setdefault(id(entry[0]), {})[entry[1]] = entry
    found = []
    for named in by_parent.values():
        for names in fuse:
            group = [named.get(n) for n in names]
            if all(group) and len({kind(e[2]) for e in group}) == 1:
                found.append((names, group))
    return found


def place(fused: SplitLinear, layers: list[Layer]) -> None:
    """Put ``fused`` where ``layers`` stood: itself for one layer, a FusedSlice per layer for several."""
    if len(layers) == 1:
        parent, name, _ = layers[0]
        setattr(parent, name, fused)
        return
    for index, (parent, name, _) in enumerate(layers):
        setattr(parent, name, FusedSlice(fused, index))


def fused_groups(model: nn.Module) -> list[str]:
    """The names of the FUSE groups fused somewhere in ``model`` ("q/k/v", "gate/up"), in FUSE's order."""
    parents = list(model.modules())
    return ["/".join(n.removesuffix("_proj") for n in names) for names in FUSE
            if any(all(isinstance(getattr(parent, n, None), FusedSlice) for n in names) for parent in parents)]
