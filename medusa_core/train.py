"""Medusa-1 head training: the backbone frozen, the heads fitted to its own text.

Head k at position t is trained on the token k + 2 places ahead (the backbone
itself predicts t + 1), with loss sum_k 0.8^k * CE_k (DESIGN §1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .heads import MedusaHeads


@dataclass(frozen=True)
class HeadLoss:
    total: torch.Tensor          # scalar, differentiable
    per_head: list[float]        # CE of each head
    top1: list[float]            # accuracy of each head's argmax


def head_loss(heads: MedusaHeads, hidden: torch.Tensor, ids: torch.Tensor, lm_head: nn.Module, decay: float = 0.8) -> HeadLoss:
    """hidden (B, S, H) last hidden states of ``ids`` (B, S) -> weighted head loss."""
    total = hidden.new_zeros((), dtype=torch.float32)
    per_head, top1 = [], []
    for k, head in enumerate(heads.heads):
        shift = k + 2
        if ids.shape[1] <= shift:
            break
        x = head(hidden[:, :-shift])
        logits = (x if heads.config.own_projection else lm_head(x)).float()   # (B, S-shift, V)
        target = ids[:, shift:]                                                # (B, S-shift)
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
        total = total + decay**k * ce
        per_head.append(ce.item())
        top1.append((logits.argmax(-1) == target).float().mean().item())
    return HeadLoss(total, per_head, top1)


@torch.no_grad()
def backbone_hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(B, S) -> (B, S, H) final (post-norm) hidden states of the frozen backbone."""
    return model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state


def fit_heads(
    model: nn.Module,
    heads: MedusaHeads,
    sequences: Sequence[Sequence[int]],
    steps: int = 200,
    lr: float = 1e-3,
    batch_size: int = 8,
    seed: int = 0,
) -> list[float]:
    """Train ``heads`` on equal-length token sequences of the backbone's own text; returns the loss curve."""
    data = torch.tensor([list(s) for s in sequences], device=model.get_output_embeddings().weight.device)
    hidden_all = torch.cat([backbone_hidden(model, data[i:i + batch_size]) for i in range(0, len(data), batch_size)])
    lm_head = model.get_output_embeddings()
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    heads.train()
    for _ in range(steps):
        pick = torch.randint(len(data), (min(batch_size, len(data)),), generator=gen)
        loss = head_loss(heads, hidden_all[pick], data[pick], lm_head)
        opt.zero_grad()
        loss.total.backward()
        opt.step()
        losses.append(loss.total.item())
    heads.eval()
    return losses
