"""Which decoding step a conversation's cache runs: a step (and its CUDA graph) is bound to one
cache's buffers, so each cache keeps the few it has used, keyed by model, tree, acceptance rule and
graphs, and reuses them turn after turn."""

from __future__ import annotations

from torch import nn

from ..heads.medusa_heads import MedusaHeads
from .config import DecodeConfig
from .graphs import use_graphs
from .kv_cache import KVCache, bucket
from .step import AcceptRule, DecodeStep
from .tree import TreeBuffers

# Steps (and their graphs) a cache keeps; older ones are freed. A chat uses one tree at a
# time, so this only bounds what trying several trees or sampling modes leaves behind.
MAX_STEPS_PER_CACHE = 4


def _key(model, tree: TreeBuffers, rule: AcceptRule, graphs: bool) -> tuple:
    return id(model), tuple(tree.paths), rule, graphs


def step_for(model: nn.Module, heads: MedusaHeads | None, tree: TreeBuffers, config: DecodeConfig, cache: KVCache,
             graphs: bool | None = None) -> DecodeStep:
    """The step for this tree and rule bound to ``cache``'s current buffers: reused (with its
    graph) when the cache has one, else made; the least recently used beyond
    MAX_STEPS_PER_CACHE is freed."""
    rule, graphs = AcceptRule.of(config), use_graphs(model, graphs)
    key = _key(model, tree, rule, graphs)
    step = cache.steps.pop(key, None)
    if step is None or step.heads is not heads:     # other heads: a step bound to the old ones is stale
        step = DecodeStep(model, heads, tree, cache, rule, graphs)
    cache.steps[key] = step
    while len(cache.steps) > MAX_STEPS_PER_CACHE:
        cache.steps.popitem(last=False)
    return step


def needs_capture(model: nn.Module, cache: KVCache, tree: TreeBuffers, config: DecodeConfig, prompt_len: int | None = None,
                  graphs: bool | None = None) -> bool:
    """Whether the next generate() with this cache, tree and config first captures a CUDA graph
    (a one-time cost, long enough on a 7B model to announce): always False off CUDA. With
    ``prompt_len``, a move to a bigger capacity bucket (which recaptures) counts too."""
    if not use_graphs(model, graphs):
        return False
    if prompt_len is not None:
        needed = bucket(prompt_len + config.max_new_tokens + tree.size, cache.max_context)
        if needed > cache.capacity:
            return True
    step = cache.steps.get(_key(model, tree, AcceptRule.of(config), True))
    return step is None or not step.captured
