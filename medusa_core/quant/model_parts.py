"""The pieces of a transformers model that the quantization routes replace, found without Triton: every
(parent, name, child) of a model, and which children are RMSNorms of the plain kind. The NF4 routing
(nf4_fused.py: exact mode's norms) and the norm routing (norm_routing.py) both look for them."""

from __future__ import annotations

import torch
from torch import nn


def children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, child) for every module of the model, listed before any is replaced."""
    return [(parent, name, child) for parent in list(model.modules()) for name, child in list(parent.named_children())]


def is_rms_norm(module: nn.Module) -> bool:
    """A transformers RMSNorm of the plain kind (weight times x / rms(x)): what RowsAloneRMSNorm replaces.
    Gemma's (1 + weight) norms are of another kind and are left alone (and so not verified exact)."""
    return type(module).__name__ in ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm") and \
        isinstance(getattr(module, "weight", None), torch.Tensor)
