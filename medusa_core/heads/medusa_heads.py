"""Medusa heads: K small decoders on the backbone's last hidden state.

Head k guesses the token k + 1 places after the backbone's next token:
``h' = h + SiLU(W h + b)`` for each residual block, then a vocabulary
projection. The module layout makes ``state_dict()`` keys match the published
Medusa-1 files: ``{head}.{block}.linear.weight/bias`` and ``{head}.{blocks}.weight``.

Root-conditioned heads (this project's own layout, ``root.{head}.linear.weight/bias`` beside the
published keys) also read the token the backbone itself chose next, the root of the tree, which
the step knows before the heads run: ``h' = h + SiLU(W [h; e] + b)`` first, with e the lm_head's
row of that token (SmolLM2 ties it to the embedding), so no new vocabulary-sized weight is added.
A head that knows x_{t+1} guesses x_{t+2} far better than one that must infer it from h_t
(docs/cpu_default.md). With W and b zero it is the unconditioned head.
"""

from __future__ import annotations

from collections.abc import Callable
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
    root_conditioned: bool = False  # True: each head first reads the root token (RootBlock)


class ResBlock(nn.Module):
    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class RootBlock(nn.Module):
    """h' = h + SiLU(W [h; e] + b): a residual block that also reads e, the lm_head row of the root token."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(2 * hidden_size, hidden_size)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor, root_row: torch.Tensor) -> torch.Tensor:
        """x (..., H), root_row (..., H) -> (..., H)."""
        return x + self.act(self.linear(torch.cat([x, root_row], dim=-1)))


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
        # named "root" so that state_dict keys read root.{head}.linear.* (heads/files.py's own-layout keys)
        self.root = nn.ModuleList([RootBlock(config.hidden_size) for _ in range(config.num_heads)]) \
            if config.root_conditioned else None
        # The proposal vocabulary (restrict_proposals): None until set; never saved with the weights.
        for name in ("proposal_ids", "proposal_weight", "proposal_bias", "proposal_columns"):
            self.register_buffer(name, None, persistent=False)
        self.approximate_proposals(None)

    @torch.no_grad()
    def init_from_lm_head(self, lm_head: nn.Module) -> None:
        """Residual weights zero and projection = lm_head, so an untrained head predicts what the
        backbone predicts and training only learns the shift (docs/design.md, "The method")."""
        for head in self.heads:
            for block in head:
                if isinstance(block, ResBlock):
                    block.linear.weight.zero_()
                    block.linear.bias.zero_()
                elif self.config.own_projection:
                    block.weight.copy_(lm_head.weight.to(block.weight.dtype))
        self.zero_root_blocks()

    @torch.no_grad()
    def zero_root_blocks(self) -> None:
        """Root blocks that pass h through unchanged: heads warm-started from unconditioned ones
        begin exactly where those were."""
        for block in self.root or ():
            block.linear.weight.zero_()
            block.linear.bias.zero_()

    def _blocks(self, hidden: torch.Tensor, lm_head: nn.Module, which, root: torch.Tensor | None) -> torch.Tensor:
        """hidden (..., H), root (...,) token ids -> (k, ..., H or V): the blocks of heads ``which``
        (and their own projections, if they have them)."""
        if self.root is None:
            return torch.stack([self.heads[k](hidden) for k in which])
        if root is None:
            raise ValueError("these heads are root-conditioned: pass root, the backbone's own next token ids")
        weight = lm_head.weight
        if not weight.is_floating_point():
            raise ValueError("root-conditioned heads read the lm_head's rows, and this lm_head is quantized: "
                             "keep the lm_head unquantized")
        rows = weight.index_select(0, root.reshape(-1)).reshape(*root.shape, -1).to(hidden.dtype)   # (..., H)
        return torch.stack([self.heads[k](self.root[k](hidden, rows)) for k in which])

    def forward(self, hidden: torch.Tensor, lm_head: nn.Module, count: int | None = None,
                root: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (..., H) -> logits (count, ..., V) over the whole vocabulary, of the first ``count``
        heads (all by default). ``lm_head`` serves heads without a projection; ``root`` (...,) is the
        backbone's next token at each row, needed by root-conditioned heads."""
        which = range(self.config.num_heads)[:count]
        return self._project(self._blocks(hidden, lm_head, which, root), lm_head)

    def _project(self, outs: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """outs (k, ..., H or V) from the heads' blocks -> logits (k, ..., V)."""
        if self.config.own_projection:
            return outs
        # shared projection: one k-row matmul, not k one-row ones (a vocabulary-wide projection
        # reads its whole weight per call, so k calls would read it k times; on a CPU a second head
        # then costs little: docs/cpu_default.md, "The proposal vocabulary")
        weight = lm_head.weight
        return lm_head(outs.to(weight.dtype) if weight.is_floating_point() else outs)

    # ---- proposals
    @torch.no_grad()
    def restrict_proposals(self, token_ids: torch.Tensor, lm_head: nn.Module) -> None:
        """Let the heads guess only among ``token_ids`` (S,): their projection becomes those S rows of
        the lm_head (a copy: S x H). Guesses are only proposals, which the backbone verifies, so greedy
        text and the exact sampler's distribution stay as they were and only what the heads get right moves
        (typical acceptance keeps what is plausible among the proposals: there the text can change). It pays
        where the vocabulary projection is a large part of a step, as for a small model on a CPU: restricted
        to the tokens SmolLM2 uses in its own answers, the projection costs a fraction of the whole
        vocabulary's, with no loss of head accuracy (docs/cpu_default.md, "The proposal vocabulary")."""
        if self.config.own_projection:
            raise ValueError("a proposal vocabulary needs heads that share the backbone's lm_head (version 2 heads)")
        weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
        if not weight.is_floating_point():
            raise ValueError("a proposal vocabulary needs a floating-point lm_head, and this one is quantized")
        ids = token_ids.to(device=weight.device, dtype=torch.long)
        self.proposal_ids = ids                                                                  # (S,)
        self.proposal_weight = weight.index_select(0, ids).clone()                               # (S, H)
        self.proposal_bias = None if bias is None else bias.index_select(0, ids).clone()         # (S,)
        columns = torch.full((weight.shape[0],), -1, dtype=torch.long, device=weight.device)     # (V,) -1: none
        columns[ids] = torch.arange(ids.numel(), device=weight.device)
        self.proposal_columns = columns
        self.approximate_proposals(None)              # an approximation of the former vocabulary's rows

    def approximate_proposals(self, projection: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Compute the proposal vocabulary's logits with ``projection`` ((..., H) -> (..., S), e.g. the CPU
        int4 mode's approximation with exact largest logits: quant/cpu_int4.py) instead of the dense product;
        None: the dense product again. Kept outside the module's tree (no state_dict entry, no .to() move): a
        way this process computes, not part of the heads."""
        self.__dict__["proposals"] = projection

    @property
    def proposal_vocab_size(self) -> int | None:
        return None if self.proposal_ids is None else int(self.proposal_ids.numel())

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module, which: range | list[int] | None = None,
               root: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (..., H) -> logits (len(which), ..., S) over the proposal vocabulary if one is set
        (column j is token proposal_ids[j]), else (len(which), ..., V) over the whole vocabulary."""
        which = range(self.config.num_heads) if which is None else which
        outs = self._blocks(hidden, lm_head, which, root)                   # (k, ..., H or V)
        if self.proposal_ids is None:
            return self._project(outs, lm_head)
        if self.proposals is not None:
            return self.proposals(outs.to(self.proposal_weight.dtype))          # (k, ..., S)
        return nn.functional.linear(outs.to(self.proposal_weight.dtype), self.proposal_weight,
                                    self.proposal_bias)                       # (k, ..., S)

    def logit_columns(self, token_ids: torch.Tensor, ignore: int) -> torch.Tensor:
        """Token ids (any shape) -> their column in ``logits`` (``ignore`` for ids the heads cannot guess
        and for ``ignore`` itself): the targets of a loss over the proposal vocabulary."""
        if self.proposal_ids is None:
            return token_ids
        table = self.proposal_columns                                                    # (V,)
        column = table[token_ids.clamp(0, table.numel() - 1)]
        inside = (token_ids >= 0) & (token_ids < table.numel()) & (column >= 0)
        return torch.where(inside, column, ignore)

    def guesses(self, hidden: torch.Tensor, lm_head: nn.Module, top_k: int,
                which: range | list[int] | None = None, root: torch.Tensor | None = None) -> torch.Tensor:
        """hidden (..., H) -> token ids (len(which), ..., top_k): each head's top_k guesses, best
        first, over the proposal vocabulary if one is set (else the whole vocabulary). ``which``:
        the heads to run (all by default); a shallow tree reads only the heads it uses. ``root``
        (...,): the backbone's next token at each row (root-conditioned heads only)."""
        ids = self.proposal_ids
        if ids is not None and top_k > ids.numel():
            raise ValueError(f"the tree asks each head for its top {top_k} guesses but the proposal vocabulary holds "
                             f"{ids.numel()} tokens: use a tree with at most {ids.numel()} children per node, "
                             "or a larger proposal_vocab.json")
        best = torch.topk(self.logits(hidden, lm_head, which, root), top_k, dim=-1).indices
        return best if ids is None else ids[best]

    # The published files' keys are our keys with the "heads." prefix removed.
    def published_state_dict(self) -> dict[str, torch.Tensor]:
        return {k.removeprefix("heads."): v for k, v in self.state_dict().items()}

    def load_published_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Strict load: a missing or unexpected key is an error listing the keys."""
        self.load_state_dict({k if k.startswith("root.") else f"heads.{k}": v for k, v in state.items()}, strict=True)
