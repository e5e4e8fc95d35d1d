"""One decoding step as a static-shape object: everything it reads and writes
lives in device buffers, so one call runs the whole step with no host read, and on
CUDA it is captured once as a CUDA graph and replayed.

A step, for one (tree, KV cache buffers, sampling rule):
  forward of the T tree tokens (mask and positions made on the device from the
  cache's device position) -> lm_head on T rows -> acceptance (greedy, exact
  sampling or typical) -> the accepted path's KV copied down (always D + 1 slots:
  slots past the accepted count are hidden by the mask and written over later)
  -> position advanced -> heads on the last accepted row -> the next tree's
  tokens written into the input buffer.
Its output is one small int tensor ``[n, path tokens (D + 1), bonus]`` that the
host loop (generate.py) reads once per step. The baseline is this same object
with the one-node tree.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from ..heads.medusa_heads import MedusaHeads
from .acceptance import accept_match, accept_typical, sample_from, sampling_probs
from .config import DEFAULTS, DecodeConfig
from .kv_cache import KVCache, cache_keyword, prefill_mask, tree_step_mask
from .graphs import captured
from .tree import TreeBuffers

# A model can compute each query row alone in attention (quant/exact_attention.py registers such an
# attention under this name where the CPU's int4 mode runs): the step then passes ROWS_ALONE to every
# decoder call it makes, prefill included. The name is how the quantization choice reaches the step:
# through the loaded model's config, not through an import of the quantization code.
ROW_EXACT_ATTENTION = "medusa_exact_rows"
ROWS_ALONE = "rows_alone"


def uses_exact_rows(model: nn.Module) -> bool:
    """Whether ``model`` uses the row-exact attention."""
    return getattr(model.config, "_attn_implementation", None) == ROW_EXACT_ATTENTION


def decoder_kwargs(exact_rows: bool) -> dict:
    """The keywords of one decoder forward: ROWS_ALONE where the row-exact attention runs, nothing
    elsewhere (a model's own attention need not accept unknown keywords). Its value is a fresh dict
    per forward, where the attention keeps what all the layers of that forward share: each row's
    visible slots, listed from the one mask once instead of once per layer (on CUDA a handful of
    small kernels per layer, all inside the step's graph)."""
    return {ROWS_ALONE: {}} if exact_rows else {}


WARMUP_RUNS = 2   # before capture: lazy inits and kernel compiles (bitsandbytes, Triton) happen outside the graph


@dataclass(frozen=True)
class AcceptRule:
    """The part of the decoding configuration that changes the step's code (so a graph is
    captured per rule); temperature, top-p, epsilon and delta are device values instead."""

    mode: str            # greedy | sample | typical
    top_k: int
    nucleus: bool        # top-p < 1 applies

    @property
    def argmax(self) -> bool:
        """Targets are the argmax: greedy, or typical acceptance (which samples nothing)."""
        return self.mode != "sample"

    @staticmethod
    def of(config: DecodeConfig) -> "AcceptRule":
        mode = "greedy" if config.greedy else config.mode
        sampling = mode == "sample"
        return AcceptRule(mode, config.top_k if sampling else 0, sampling and config.top_p < 1.0)


class DecodeStep:
    """The decoding step bound to one cache's buffers; made by ``step_for``."""

    def __init__(self, model: nn.Module, heads: MedusaHeads | None, tree: TreeBuffers, cache: KVCache,
                 rule: AcceptRule, graphs: bool):
        self.decoder, self.lm_head = model.get_decoder(), model.get_output_embeddings()
        self.cache_keyword = cache_keyword(self.decoder)
        self.heads, self.tree, self.rule = heads, tree, rule
        # The cache owns its steps (cache.steps); a weak reference back keeps that from being a
        # cycle, so a dropped conversation frees its buffers and graphs at once, never later in a
        # garbage collection that might run in the middle of another graph's capture.
        self._cache = weakref.ref(cache)
        device = self.lm_head.weight.device
        self.dtype = compute_dtype(model)
        self.rows_alone = uses_exact_rows(model)    # row-exact attention (CPU int4, NF4 exact mode), prefill too
        self.tokens = torch.zeros(tree.size, dtype=torch.long, device=device)     # (T,) next step's tree
        self.uniforms = torch.zeros(tree.size, dtype=torch.float32, device=device)  # (T,) sampling draws
        self.params = torch.tensor(DEFAULTS.sampling_params(), device=device)   # temperature, top-p, epsilon, delta
        self.use_graph = graphs
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None                                # the graph's output buffer

    @property
    def cache(self) -> KVCache:
        return self._cache()

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def set_params(self, config: DecodeConfig) -> None:
        """Device copies of the continuous settings (one small copy per reply, not per step)."""
        self.params.copy_(torch.tensor(config.sampling_params()))

    # ---- pieces shared by prefill and step
    def targets(self, logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """(T, V) -> (T,) what the plain sampler emits at each node."""
        if self.rule.argmax:
            return logits.argmax(-1)
        probs = sampling_probs(logits, self.params[0], self.params[1], self.rule.top_k, nucleus=self.rule.nucleus)
        return sample_from(probs, uniforms)

    def propose(self, root: torch.Tensor, hidden_row: torch.Tensor) -> torch.Tensor:
        """Next tree's tokens (T,) from its root token (1,) and the heads at one hidden row (H,)."""
        if self.tree.num_heads == 0:
            return root
        guesses = self.heads.guesses(hidden_row, self.lm_head, self.tree.top_k,
                                     range(self.tree.num_heads), root=root[0])          # (K, top_k)
        return torch.cat([root, guesses.flatten()])[self.tree.candidate_index]          # (T,)

    # ---- prefill (eager: its length varies)
    def prefill(self, new_ids: list[int], uniform: torch.Tensor) -> torch.Tensor:
        """Run the uncached prompt tokens after the committed prefix; write the first tree into
        ``tokens`` and return the first reply token (1,) on the device. The caller commits."""
        hidden = self.read(new_ids)                                                      # (H,)
        root = self.targets(self.lm_head(hidden)[None], uniform)                         # (1,)
        self.tokens.copy_(self.propose(root, hidden))
        return root

    def read(self, new_ids: list[int]) -> torch.Tensor:
        """Run prompt tokens after the committed prefix into the cache -> the last one's hidden
        state (H,). The caller commits."""
        device = self.tokens.device
        start = self.cache.length
        ids = torch.tensor(new_ids, device=device)[None]                               # (1, n)
        end = start + len(new_ids)
        with self.cache.narrowed(end):                 # prefill is eager everywhere: attend over used slots
            hidden = self.decoder(
                input_ids=ids,
                attention_mask=prefill_mask(start, len(new_ids), self.cache.width, self.dtype, device),
                position_ids=torch.arange(start, end, device=device)[None],
                **{self.cache_keyword: self.cache},
                use_cache=True,
                **decoder_kwargs(self.rows_alone),
            ).last_hidden_state[0, -1]                                                   # (H,)
        return hidden

    # ---- the step
    def run_eager(self) -> torch.Tensor:
        """One step, all on the device -> (D + 3,) long: [accepted count n, the path's D + 1
        tokens (root first; the first n are accepted), bonus token]."""
        tree, cache, pos = self.tree, self.cache, self.cache.position
        # A graph attends over the whole bucket (its position moves under it); an eager step
        # knows the committed length on the host and attends over the used slots only.
        width = None if self.use_graph else cache.length + tree.size
        with cache.narrowed(width):
            hidden = self.decoder(
                input_ids=self.tokens[None],
                attention_mask=tree_step_mask(tree.allowed, pos, cache.slot_ids[:cache.width], self.dtype),
                position_ids=(tree.depths + pos)[None],
                **{self.cache_keyword: cache},
                use_cache=True,
                **decoder_kwargs(self.rows_alone),
            ).last_hidden_state[0]                                                       # (T, H)
        logits = self.lm_head(hidden)                                                    # (T, V)
        targets = self.targets(logits, self.uniforms)                                    # (T,)
        if self.rule.mode == "typical":
            best, length = accept_typical(self.tokens, logits, tree.leaf_paths,
                                          self.params[0], self.params[2], self.params[3])
        else:
            best, length = accept_match(self.tokens, targets, tree.leaf_paths)
        # index_select/gather with (1,) tensors throughout: nothing here reads back to the host
        path = tree.leaf_paths.index_select(0, best)[0].clamp(min=0)                    # (D+1,) node ids
        last = path.gather(0, length - 1)                                                # (1,) last accepted node
        bonus = targets.index_select(0, last)                                            # (1,) next root
        path_tokens = self.tokens.index_select(0, path)                                  # (D+1,)
        if tree.num_heads:    # a tree deeper than its root
            # Node i was written at pos + i: move the path's entries to pos + [0, D], all layers at once.
            kv = cache.storage                                    # (L, 2, 1, kv_heads, capacity, head_dim)
            kv.index_copy_(4, cache.slots(tree.num_heads + 1), kv.index_select(4, path + pos))
        self.tokens.copy_(self.propose(bonus, hidden.index_select(0, last)[0]))
        pos.add_(length)
        return torch.cat([length, path_tokens, bonus])

    def prepare(self) -> None:
        """Capture the CUDA graph if it is due (once per step and cache buffers). A loop that times its steps calls
        this before the clock starts: a capture (two eager warm-up steps and the recording, ~0.3 s on a 7B) is not
        a decoding step's time (review: counted in the first step's, it lowered the page's tokens/s and swung the
        comparison's speedup with whichever pane captured)."""
        if self.use_graph and self.graph is None:
            self.capture()

    def run(self) -> torch.Tensor:
        """One step: a graph replay on CUDA (captured on first use), else eagerly."""
        self.prepare()
        if self.graph is not None:
            self.graph.replay()
            return self.out
        return self.run_eager()

    def capture(self) -> None:
        """Warm up on a side stream, then record run_eager. The warm-up runs really execute, so
        the position and tree tokens are restored after each; the KV slots they wrote lie at or
        past the position, which the mask hides and the next step writes over."""
        cache = self.cache
        position, tokens = cache.position.clone(), self.tokens.clone()

        def warm_up() -> None:
            self.run_eager()
            cache.position.copy_(position)
            self.tokens.copy_(tokens)

        self.graph, self.out = captured(self.run_eager, self.tokens.device, warm_up, WARMUP_RUNS)


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype activations (and so attention masks) have: that of the first float weight,
    since quantized weights are stored as integers."""
    return next(p for p in model.get_decoder().parameters() if p.is_floating_point()).dtype
