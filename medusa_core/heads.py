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
        # The proposal vocabulary (restrict_proposals): None until set; never saved with the weights.
        for name in ("proposal_ids", "proposal_weight", "proposal_bias"):
            self.register_buffer(name, None, persistent=False)

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
        """hidden (..., H) -> logits (count, ..., V) over the whole vocabulary, of the first ``count``
        heads (all by default). ``lm_head`` serves heads without a projection."""
        return self._project(torch.stack([head(hidden) for head in self.heads[:count]]), lm_head)

    def _project(self, outs: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """outs (k, ..., H or V) from the heads' blocks -> logits (k, ..., V)."""
        if self.config.own_projection:
            return outs
        # shared projection: one k-row matmul, not k one-row ones (a 49152-wide projection
        # reads its whole weight per call; on a CPU one call per head cost ~10 ms each)
        weight = lm_head.weight
        return lm_head(outs.to(weight.dtype) if weight.is_floating_point() else outs)

    # ---- proposals
    @torch.no_grad()
    def restrict_proposals(self, token_ids: torch.Tensor, lm_head: nn.Module) -> None:
        """Let the heads guess only among ``token_ids`` (S,): their projection becomes those S rows of
        the lm_head (a copy: S x H). Guesses are only proposals, which the backbone verifies, so this
        never changes the output, only what the heads can get right. It pays where the vocabulary
        projection is a large part of a step: on 2 CPU cores SmolLM2's 49152-wide one cost 5.1 ms of
        a ~55 ms step, and onto the 6,185 tokens of 598 of its own answers 0.55 ms, with no loss of
        head accuracy (docs/cpu_default.md)."""
        if self.config.own_projection:
            raise ValueError("a proposal vocabulary needs heads that share the backbone's lm_head (version 2 heads)")
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if not weight.is_floating_point():
            raise ValueError("a proposal vocabulary needs a floating-point lm_head, and this one is quantized")
        ids = token_ids.to(device=weight.device, dtype=torch.long)
        self.proposal_ids = ids                                                                  # (S,)
        self.proposal_weight = weight.index_select(0, ids).clone()                               # (S, H)
        self.proposal_bias = None if bias is None else bias.index_select(0, ids).clone()         # (S,)

    @property
    def proposal_vocab_size(self) -> int | None:
        return None if self.proposal_ids is None else int(self.proposal_ids.numel())

    def guesses(self, hidden: torch.Tensor, lm_head: nn.Module, top_k: int,
                which: range | list[int] | None = None) -> torch.Tensor:
        """hidden (..., H) -> token ids (len(which), ..., top_k): each head's top_k guesses, best
        first, over the proposal vocabulary if one is set (else the whole vocabulary). ``which``:
        the heads to run (all by default); a shallow tree reads only the heads it uses."""
        which = range(self.config.num_heads) if which is None else which
        outs = torch.stack([self.heads[k](hidden) for k in which])          # (k, ..., H or V)
        ids = self.proposal_ids
        if ids is None:
            return torch.topk(self._project(outs, lm_head), top_k, dim=-1).indices
        if top_k > ids.numel():
            raise ValueError(f"the tree asks each head for its top {top_k} guesses but the proposal vocabulary holds "
                             f"{ids.numel()} tokens: use a tree with at most {ids.numel()} children per node, "
                             "or a larger proposal_vocab.json")
        logits = nn.functional.linear(outs.to(self.proposal_weight.dtype), self.proposal_weight,
                                      self.proposal_bias)                                       # (k, ..., S)
        return ids[torch.topk(logits, top_k, dim=-1).indices]

    # The published files' keys are our keys with the "heads." prefix removed.
    def published_state_dict(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("heads."): v for k, v in self.state_dict().items()}

    def load_published_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Strict load: a missing or unexpected key is an error listing the keys."""
        self.load_state_dict({f"heads.{k}": v for k, v in state.items()}, strict=True)
