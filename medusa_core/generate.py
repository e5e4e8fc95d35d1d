"""The one generation loop. Medusa and the plain baseline are the same loop;
the baseline uses the one-node tree (``build_tree_buffers([], 0)``), so the
two are timed with identical code around the model.

Per step: one forward of the tree's T tokens through the stock transformers
decoder with the tree mask, the lm_head on the T rows, acceptance, the heads
on the single last accepted row (which proposes the next tree), and one
deliberate host-device sync that reads the accepted tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .acceptance import accept_match, accept_typical, target_tokens
from .heads import MedusaHeads
from .kv_cache import ContextOverflowError, StepMask, TreeKVCache, causal_mask
from .tree import TreeBuffers, build_tree_buffers

Mode = Literal["greedy", "sample", "typical"]
MODES: tuple[str, ...] = ("greedy", "sample", "typical")


@dataclass(frozen=True)
class DecodeConfig:
    mode: Mode = "greedy"
    temperature: float = 0.7      # sample/typical; greedy ignores it
    top_p: float = 1.0            # sample only
    top_k: int = 0                # sample only; 0 = off
    epsilon: float = 0.09         # typical: posterior threshold
    delta: float = 0.3            # typical: posterior alpha
    max_new_tokens: int = 256
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r} is unknown: use one of {', '.join(MODES)}")
        checks = [
            (self.temperature >= 0, f"temperature {self.temperature} is negative: use 0 (greedy) or more"),
            (0 < self.top_p <= 1, f"top_p {self.top_p} is out of range: use a value in (0, 1]"),
            (self.top_k >= 0, f"top_k {self.top_k} is negative: use 0 (off) or a positive count"),
            (0 <= self.epsilon <= 1, f"epsilon {self.epsilon} is out of range: use a value in [0, 1]"),
            (0 <= self.delta <= 1, f"delta {self.delta} is out of range: use a value in [0, 1]"),
            (self.max_new_tokens >= 1, f"max_new_tokens {self.max_new_tokens} must be at least 1"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


@dataclass(frozen=True)
class Step:
    tokens: list[int]             # new token ids, in order
    from_heads: int               # how many of them were Medusa guesses that the backbone accepted
    seconds: float                # wall time of this step (prefill included for the first)
    prefill: bool = False
    finish_reason: str | None = None  # "eos", "length", "context" or "cancelled" on the last step


def new_cache(model: nn.Module, capacity: int) -> TreeKVCache:
    config = model.config.get_text_config()
    return TreeKVCache(config.num_hidden_layers, capacity, max_context=max_context(model))


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype activations (and so attention masks) have: that of the first float weight,
    since quantized weights are stored as integers."""
    return next(p for p in model.get_decoder().parameters() if p.is_floating_point()).dtype


def max_context(model: nn.Module) -> int:
    return int(getattr(model.config.get_text_config(), "max_position_embeddings", 4096))


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompt_ids: Sequence[int],
    *,
    heads: MedusaHeads | None = None,
    tree: TreeBuffers | None = None,
    config: DecodeConfig = DecodeConfig(),
    cache: TreeKVCache | None = None,
    stop_ids: Sequence[int] = (),
    should_stop: Callable[[], bool] | None = None,
) -> Iterator[Step]:
    """Decode after ``prompt_ids``; yields one Step per forward pass.

    ``tree=None`` (or a one-node tree) is the plain baseline. Pass the same ``cache``
    across the turns of a conversation: the cached prefix is reused, and a prompt
    that diverges from it rewinds to the common part.
    """
    decoder, lm_head = model.get_decoder(), model.get_output_embeddings()
    device = lm_head.weight.device
    mask_dtype = compute_dtype(model)
    if tree is None:
        tree = build_tree_buffers([], num_heads=0, dtype=mask_dtype, device=device)
    if tree.num_heads and heads is None:
        raise ValueError(f"a tree of depth {tree.num_heads} needs Medusa heads: pass heads, or use the baseline tree")
    use_heads = tree.num_heads > 0
    greedy = config.mode == "greedy" or (config.mode == "sample" and config.temperature == 0)
    generator = None
    if config.seed is not None:
        generator = torch.Generator(device=device).manual_seed(config.seed)

    prompt_ids = list(prompt_ids)
    context = max_context(model)
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt_ids) >= context:
        raise ContextOverflowError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context is {context}: "
            "shorten the conversation or clear it"
        )
    if cache is None:
        cache = new_cache(model, 0)
    cache.ensure_capacity(len(prompt_ids) + config.max_new_tokens + tree.size)
    step_mask = StepMask(tree.attn_mask.to(mask_dtype), cache.capacity)
    stops = set(stop_ids)
    if getattr(model.generation_config, "eos_token_id", None) is not None:
        eos = model.generation_config.eos_token_id
        stops.update(eos if isinstance(eos, list) else [eos])

    def pick(logits: torch.Tensor) -> torch.Tensor:
        """(T, V) -> (T,) target token per node: what the plain sampler would emit there."""
        if config.mode == "typical" or greedy:
            return logits.argmax(-1)   # typical takes its root/bonus token greedily (paper §2.3.1)
        return target_tokens(logits, config.temperature, config.top_p, config.top_k, generator)

    def propose(root: torch.Tensor, hidden_row: torch.Tensor) -> torch.Tensor:
        """Next tree's tokens (T,) from its root token (1,) and the heads at one hidden row (H,)."""
        if not use_heads:
            return root
        head_logits = heads(hidden_row, lm_head, count=tree.num_heads)        # (K, V)
        guesses = torch.topk(head_logits, tree.top_k, dim=-1).indices          # (K, top_k)
        return torch.cat([root, guesses.flatten()])[tree.candidate_index]     # (T,)

    # ---- prefill: run the uncached part of the prompt, emit the first token
    t0 = time.perf_counter()
    start = cache.reuse_prefix(prompt_ids)
    new = torch.tensor(prompt_ids[start:], device=device)[None]               # (1, n)
    hidden = decoder(
        input_ids=new,
        attention_mask=causal_mask(start, new.shape[1], mask_dtype, device),
        position_ids=torch.arange(start, len(prompt_ids), device=device)[None],
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state[0, -1]                                                 # (H,)
    cache.commit(prompt_ids[start:])
    root = pick(lm_head(hidden)[None])                                         # (1,)
    tree_tokens = propose(root, hidden)
    first = root.item()  # sync: the first token is the time-to-first-token moment
    produced = 1
    reason = _finish(first, stops, produced, config.max_new_tokens, should_stop)
    yield Step([first], 0, time.perf_counter() - t0, prefill=True, finish_reason=reason)
    if reason:
        return

    depth = tree.leaf_paths.shape[1]
    while True:
        if cache.length + tree.size > context:
            yield Step([], 0, 0.0, finish_reason="context")
            return
        t0 = time.perf_counter()
        hidden = decoder(
            input_ids=tree_tokens[None],
            attention_mask=step_mask.at(cache.length),
            position_ids=(tree.depths + cache.length)[None],
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state[0]                                                 # (T, H)
        logits = lm_head(hidden)                                               # (T, V)
        targets = pick(logits)                                                 # (T,)
        if config.mode == "typical":
            best, length = accept_typical(
                tree_tokens, logits, tree.leaf_paths, config.temperature, config.epsilon, config.delta
            )
        else:
            best, length = accept_match(tree_tokens, targets, tree.leaf_paths)
        # index_select/gather with (1,) tensors throughout: a 0-dim tensor index would sync
        path = tree.leaf_paths.index_select(0, best)[0]                        # (D+1,) node ids, -1 padded
        last = path.gather(0, length - 1)                                      # (1,) last accepted node
        bonus = targets.index_select(0, last)                                  # (1,) next root
        tree_tokens_next = propose(bonus, hidden.index_select(0, last)[0])
        # One deliberate sync: [length, path tokens (D+1), bonus, path nodes (D+1)] in one read.
        packed = torch.cat([length, tree_tokens[path.clamp(min=0)], bonus, path]).tolist()
        n = packed[0]
        accepted = packed[1:1 + n]               # root + accepted guesses: now in the cache
        nodes = packed[2 + depth:2 + depth + n]
        emitted = accepted[1:] + [packed[1 + depth]]
        if nodes == list(range(n)):
            cache.commit(accepted)               # already in place (always so for chains and the baseline)
        else:
            cache.commit_path(path[:n], accepted)
        tree_tokens = tree_tokens_next

        kept, reason = [], None
        for token in emitted:
            kept.append(token)
            produced += 1
            reason = _finish(token, stops, produced, config.max_new_tokens, should_stop)
            if reason:
                break
        if reason:
            # Tokens accepted past the cut were never emitted: keep the cache equal to
            # prompt + reply[:-1] so the next turn's prefix match is exact.
            cache.rewind(len(prompt_ids) + produced - 1)
        yield Step(kept, len(kept) - 1 if len(kept) == len(emitted) else len(kept),
                   time.perf_counter() - t0, finish_reason=reason)
        if reason:
            return


def _finish(token: int, stops: set[int], produced: int, limit: int, should_stop) -> str | None:
    if token in stops:
        return "eos"
    if produced >= limit:
        return "length"
    if should_stop is not None and should_stop():
        return "cancelled"
    return None
