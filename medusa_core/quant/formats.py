"""What format a loaded backbone's weights are in, in one word the page can explain a greedy
divergence with: 4-bit weights computed in a compute dtype differ with the number of rows in a
matmul unless the mode is row-exact."""

from __future__ import annotations

import torch
from torch import nn

from . import nf4_fused
from .cpu_int4 import Int4Linear, exact_mode


def weights_format(model: nn.Module) -> str | None:
    """"NF4" (bitsandbytes' storage, or the repacked kernel where trees may differ), "NF4-exact" (the
    repacked kernel's exact mode, the whole step row-exact here), "int8" (bitsandbytes' 8-bit), "int4" (the
    CPU's row-exact int4 mode), "int4/bf16" (int4 where trees may differ), or None when the weights are in the
    compute dtype."""
    if any(isinstance(m, nf4_fused.RepackedNF4Linear) for m in model.modules()):
        return "NF4-exact" if nf4_fused.exact_mode(model) else "NF4"
    stored = {p.dtype for p in model.parameters() if not p.is_floating_point()}
    if torch.int8 in stored:     # bitsandbytes' 8-bit (--quant int8): its 4-bit codes are uint8
        return "int8"
    if stored:
        return "NF4"
    if any(isinstance(m, Int4Linear) for m in model.modules()):
        return "int4" if exact_mode(model) else "int4/bf16"
    return None
