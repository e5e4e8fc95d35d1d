"""How often each head's guess is the backbone's next token: rank histograms over held-out text,
the measure training reports and calibrate turns into a tree."""

from __future__ import annotations

import torch
from torch import nn

from ..heads.medusa_heads import MedusaHeads
from .data import IGNORE
from .loss import Positions, backbone_hidden, positions


@torch.no_grad()
def rank_counts(heads: MedusaHeads, lm_head: nn.Module, batch: Positions, top_k: int) -> torch.Tensor:
    """-> (K, top_k + 1) counts: column i < top_k counts targets that were head k's rank-i guess,
    the last column targets outside its top_k. Guesses are the decoding step's own (heads.guesses)."""
    counts = torch.zeros(heads.config.num_heads, top_k + 1, dtype=torch.long)
    dtype = next(heads.parameters()).dtype
    for k in range(min(heads.config.num_heads, batch.targets.shape[0])):
        valid = batch.targets[k] != IGNORE                                     # (N,)
        if not bool(valid.any()):
            continue
        guesses = heads.guesses(batch.hidden[valid].to(dtype), lm_head, top_k, [k], batch.root[valid])[0]  # (n, top_k)
        hit = guesses == batch.targets[k][valid][:, None]                       # (n, top_k)
        rank = torch.where(hit.any(-1), hit.long().argmax(-1), top_k)           # (n,)
        counts[k] += torch.bincount(rank.cpu(), minlength=top_k + 1)
    return counts


@torch.no_grad()
def rank_histogram(heads: MedusaHeads, model: nn.Module, batches, top_k: int = 10) -> torch.Tensor:
    """rank_counts over ``batches`` of (ids, targets) (B, S), hidden states from the backbone."""
    lm_head = model.get_output_embeddings()
    counts = torch.zeros(heads.config.num_heads, top_k + 1, dtype=torch.long)
    for ids, targets in batches:
        counts += rank_counts(heads, lm_head, positions(backbone_hidden(model, ids), ids, targets,
                                                        heads.config.num_heads), top_k)
    return counts
