"""What a Medusa head is trained on and the loss it is trained with.

Head k at position t is trained on the token k + 2 places ahead (the backbone itself predicts
t + 1), with loss sum_k decay^k * CE_k (the Medusa-1 recipe; docs/design.md). Hidden states come
from the frozen backbone, computed per batch or once for a whole data set (``cached_positions``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..heads.medusa_heads import MedusaHeads
from .data import IGNORE


@dataclass(frozen=True)
class Positions:
    """Training positions, flattened: what the heads read at position t and what they must guess."""

    hidden: torch.Tensor     # (N, H) the backbone's last hidden state at t
    root: torch.Tensor       # (N,) the token at t + 1: the backbone's own next token, the tree's root
    targets: torch.Tensor    # (K, N) the token at t + k + 2 for head k; IGNORE where it is no target

    def __len__(self) -> int:
        return self.root.shape[0]

    def select(self, index: torch.Tensor | slice) -> "Positions":
        return Positions(self.hidden[index], self.root[index], self.targets[:, index])


def positions(hidden: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor, num_heads: int) -> Positions:
    """hidden (B, S, H) of ``ids`` (B, S), ``targets`` (B, S) (IGNORE: prompt tokens, padding) ->
    every position where at least one head has a target."""
    batch, length = ids.shape
    shifted = torch.full((num_heads, batch, length), IGNORE, dtype=torch.long, device=ids.device)   # (K, B, S)
    for k in range(num_heads):
        shift = k + 2
        if length > shift:
            shifted[k, :, :length - shift] = targets[:, shift:]
    root = torch.zeros_like(ids)                                                # (B, S); last column: no target
    root[:, :-1] = ids[:, 1:]
    keep = (shifted != IGNORE).any(0)                                           # (B, S)
    return Positions(hidden[keep], root[keep], shifted[:, keep])


@dataclass(frozen=True)
class HeadLoss:
    total: torch.Tensor          # scalar; differentiable unless backward() already ran per head
    per_head: list[float]        # CE of each head
    top1: list[float]            # accuracy of each head's argmax


def head_loss(heads: MedusaHeads, batch: Positions, lm_head: nn.Module,
              decay: float = 0.8, backward: bool = False) -> HeadLoss:
    """Weighted head loss sum_k decay^k CE_k over ``batch``, over the heads' proposal vocabulary if
    they have one (targets outside it are no targets: the heads can never propose them).

    ``backward=True`` back-propagates each head as soon as its loss is known: the hidden states
    are frozen, so the heads' graphs are independent and only one head's (N, V) logits are alive
    at a time (the 7B memory plan).
    """
    total = torch.zeros((), dtype=torch.float32, device=batch.hidden.device)
    per_head, top1 = [], []
    for k in range(min(heads.config.num_heads, batch.targets.shape[0])):
        target = heads.logit_columns(batch.targets[k], IGNORE)                 # (N,)
        valid = target != IGNORE
        if not bool(valid.any()):   # possible in a small batch; a later head may still have targets
            per_head.append(float("nan"))
            top1.append(float("nan"))
            continue
        logits = heads.logits(batch.hidden[valid], lm_head, [k], batch.root[valid])[0].float()   # (n, V or S)
        ce = nn.functional.cross_entropy(logits, target[valid])
        if backward:
            (decay**k * ce).backward()
        total = total + decay**k * (ce.detach() if backward else ce)
        per_head.append(ce.item())
        top1.append((logits.argmax(-1) == target[valid]).float().mean().item())
    return HeadLoss(total, per_head, top1)


@torch.no_grad()
def backbone_hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(B, S) -> (B, S, H) final (post-norm) hidden states of the frozen backbone."""
    return model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state


def padded(rows: Sequence[tuple[list[int], list[int]]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[(ids, targets)] of any lengths -> (ids, targets) (B, S_max), padded on the right."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (i, t) in enumerate(rows):
        ids[r, :len(i)] = torch.tensor(i)
        targets[r, :len(t)] = torch.tensor(t)
    return ids.to(device), targets.to(device)


@torch.no_grad()
def cached_positions(model: nn.Module, rows: Sequence[tuple[list[int], list[int]]], pad: int, num_heads: int,
                     batch_tokens: int = 16384, desc: str = "hidden states") -> Positions:
    """Every training position of ``rows`` with its fp32 hidden state, computed once. Rows go through
    the backbone sorted by length, about ``batch_tokens`` padded tokens per forward, so batches carry
    little padding (all of them are held in memory at once: plan for hidden size x 4 bytes per position)."""
    from tqdm import tqdm

    device = model.get_output_embeddings().weight.device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    chunks: list[list[int]] = [[]]
    for i in order:   # ascending lengths: the row being added is the chunk's widest
        if chunks[-1] and (len(chunks[-1]) + 1) * len(rows[i][0]) > batch_tokens:
            chunks.append([])
        chunks[-1].append(i)
    parts = []
    for chunk in tqdm(chunks, desc=desc, mininterval=10):
        ids, targets = padded([rows[i] for i in chunk], pad, device)
        parts.append(positions(backbone_hidden(model, ids).float(), ids, targets, num_heads))
    return Positions(torch.cat([p.hidden for p in parts]), torch.cat([p.root for p in parts]),
                     torch.cat([p.targets for p in parts], dim=1))
