"""Medusa heads: K small decoders on the backbone's last hidden state.

Head k guesses the token k + 1 places after the backbone's next token:
``h' = h + SiLU(W h + b)`` for each residual block, then a vocabulary
projection. The module layout makes ``state_dict()`` keys match the published
Medusa-1 files: ``{head}.{block}.linear.weight/bias`` and ``{head}.{blocks}.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class HeadsConfig:
    num_heads: int
    num_layers: int          # residual blocks per head
    hidden_size: int
    vocab_size: int
    own_projection: bool = True  # False: "version 2" heads that reuse the backbone's lm_head


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    def __init__(self, config: HeadsConfig):
        super().__init__()
        self.config = config
        layers = []
        for _ in range(config.num_heads):
            blocks: list[nn.Module] = [ResBlock(config.hidden_size) for _ in range(config.num_layers)]
            if config.own_projection:
                blocks.append(nn.Linear(config.hidden_size, config.vocab_size, bias=False))
            layers.append(nn.Sequential(*blocks))
        self.heads = nn.ModuleList(layers)

    @torch.no_grad()
    def init_from_lm_head(self, lm_head: nn.Module) -> None:
        """DESIGN §1: residual weights zero and projection = lm_head, so an untrained head
        predicts what the backbone predicts."""
        for head in self.heads:
            for block in head:
                if isinstance(block, ResBlock):
                    block.linear.weight.zero_()
                    block.linear.bias.zero_()
                elif self.config.own_projection:
                    block.weight.copy_(lm_head.weight.to(block.weight.dtype))

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module, count: int | None = None) -> torch.Tensor:
        """hidden (..., H) -> logits (count, ..., V) of the first ``count`` heads (all by default):
        a shallow tree reads only the heads it uses. ``lm_head`` serves heads without a projection."""
        outs = torch.stack([head(hidden) for head in self.heads[:count]])   # (count, ..., H or V)
        if self.config.own_projection:
            return outs
        # shared projection: one count-row matmul, not count one-row ones (a 49152-wide projection
        # reads its whole weight per call; on a CPU one call per head cost ~10 ms each)
        return lm_head(outs)

    # The published files' keys are our keys with the "heads." prefix removed.
    def published_state_dict(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("heads."): v for k, v in self.state_dict().items()}

    def load_published_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Strict load: a missing or unexpected key is an error listing the keys."""
        self.load_state_dict({f"heads.{k}": v for k, v in state.items()}, strict=True)
