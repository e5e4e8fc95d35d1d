"""Acceptance rules as pure tensor functions.

Shapes: T tree nodes (node 0 = root), V vocabulary, P root-to-leaf paths of
D + 1 nodes each (padded with -1). Each rule returns ``(best, length)``: the
row of ``leaf_paths`` to follow and how many of its nodes are accepted
(>= 1, the root is always kept), both as (1,) device tensors so the caller
decides when to synchronise.

Greedy and exact sampling share one rule: every node gets one *target* token
(its argmax, or one sample from its distribution); a child is accepted when it
equals its parent's target. Siblings are distinct tokens, so at most one child
matches and the walk is the paper's "sample, descend if it is a child, else
stop"; the emitted tokens are exactly the plain sampler's.
"""

from __future__ import annotations

import torch

from .config import DEFAULTS

Number = float | torch.Tensor   # a Python float, or a 0-dim device tensor a captured step reads


def sampling_probs(logits: torch.Tensor, temperature: Number, top_p: Number = 1.0, top_k: int = 0, *,
                   nucleus: bool) -> torch.Tensor:
    """(T, V) logits -> (T, V) probabilities of the plain sampler (temperature, top-k, top-p).
    ``nucleus`` says whether top-p applies: a step that keeps top_p on the device decides it once
    (AcceptRule), so the check never reads the tensor back."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if nucleus:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        p = sorted_logits.softmax(-1)                                          # (T, V) in descending order
        # drop a token when the tokens before it already reach top_p; the first always stays (a top_p that
        # rounds to 0 in float32 on the device, 1e-300, dropped it too: every probability NaN)
        drop_sorted = (p.cumsum(-1) - p) >= top_p
        drop_sorted[..., 0] = False
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(T, V) probabilities and (T,) draws from U[0, 1) -> (T,) one sample per row, by inverting
    the CDF. The draws come from the caller's seeded generator, so a captured step (which cannot
    own a generator's state) samples reproducibly; a token of probability 0 is never picked."""
    cdf = probs.cumsum(-1)                                   # (T, V)
    u = uniforms[:, None] * cdf[:, -1:]                      # (T, 1): scaled by the total, which rounding moves off 1
    return (cdf <= u).sum(-1).clamp(max=probs.shape[-1] - 1)  # first index whose CDF passes u


def _walk(ok: torch.Tensor, log_p: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ok (P, D): child d of path p accepted given its parent -> (best, length). Among the longest
    paths, the one whose accepted children are likeliest under ``log_p`` (P, D), else the first."""
    kept = ok.long().cumprod(dim=1)              # (P, D) 1 up to the first miss
    run = kept.sum(dim=1)                        # (P,) accepted children
    if log_p is None:
        best = run.argmax().view(1)              # (1,) first longest path
    else:
        likelihood = (log_p * kept).sum(dim=1)                                   # (P,) of the accepted part
        best = torch.where(run == run.max(), likelihood, float("-inf")).argmax().view(1)
    # gather, not run[best]: indexing with a 0-dim tensor would read it back to the host
    return best, run.gather(0, best) + 1


def accept_match(tree_tokens: torch.Tensor, targets: torch.Tensor, leaf_paths: torch.Tensor):
    """Greedy / exact sampling. tree_tokens (T,), targets (T,), leaf_paths (P, D+1)."""
    nodes = leaf_paths.clamp(min=0)                         # (P, D+1)
    child = tree_tokens[nodes[:, 1:]]                        # (P, D)
    parent_target = targets[nodes[:, :-1]]                   # (P, D)
    ok = (child == parent_target) & (leaf_paths[:, 1:] >= 0)
    return _walk(ok)


def typical_threshold(probs: torch.Tensor, epsilon: Number, delta: Number) -> torch.Tensor:
    """(T, V) -> (T,) min(epsilon, delta * exp(-H(p))), paper §2.3.1."""
    entropy = -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)
    return torch.clamp(delta * torch.exp(-entropy), max=epsilon)


def accept_typical(
    tree_tokens: torch.Tensor,
    logits: torch.Tensor,
    leaf_paths: torch.Tensor,
    temperature: Number,
    epsilon: Number = DEFAULTS.epsilon,
    delta: Number = DEFAULTS.delta,
):
    """Typical acceptance: child x accepted when p_parent(x) > min(epsilon, delta * exp(-H(p_parent))),
    p at ``temperature`` (> 0: a temperature near 0 makes the whole configuration greedy, DecodeConfig).
    Siblings can both pass, so paths tie in length; the likeliest wins (the paper's reference does
    the same), not the first in node order, which is often a lower-ranked guess."""
    probs = (logits.float() / temperature).softmax(-1)      # (T, V)
    threshold = typical_threshold(probs, epsilon, delta)     # (T,)
    nodes = leaf_paths.clamp(min=0)                          # (P, D+1)
    parent, child = nodes[:, :-1], tree_tokens[nodes[:, 1:]]  # (P, D) each
    p_child = probs[parent, child]                           # (P, D)
    ok = (p_child > threshold[parent]) & (leaf_paths[:, 1:] >= 0)
    return _walk(ok, p_child.clamp_min(1e-30).log())
