"""The one generation loop: the host side around step.DecodeStep. Medusa and
the plain baseline are the same loop and the same step object; the baseline
uses the one-node tree (``build_tree_buffers([], 0)``), so the two are timed
with identical code around the model.

The step runs on the device (a CUDA graph replay on CUDA); the loop does what
needs the host: the prefill, one deliberate read of the step's small result per
step, stop tokens, cancel, max tokens, streaming, prefix reuse across turns and
the rewind on a cut.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..heads.medusa_heads import MedusaHeads
from .config import DecodeConfig
from .kv_cache import WRITER_NAME, WRITERS, ContextOverflowError, KVCache
from .step import DecodeStep
from .step_store import step_for
from .tree import TreeBuffers, build_tree_buffers


# Prompt tokens per prefill forward on the CPU. A long prompt is read in pieces so that Stop is heard
# between them: SmolLM2 on 2 CPU cores reads a 5,000-token paste for most of a minute, and a late piece
# of 256 tokens takes about 1.5 s of it (512: about 3 s). A 1,217-token prompt read in pieces of 256
# took as long as in one forward (4.1-4.4 s against 4.1-4.2). Where attention and matmuls are
# row-exact (the CPU's int4 mode) the pieces give the keys one forward gives; in fp32 the two decoders
# of a comparison read the same pieces from the same start.
PREFILL_PIECE = 256


def prefill_piece(device: torch.device) -> int:
    """Prompt tokens per prefill forward on ``device``: PREFILL_PIECE on the CPU; the whole prompt on
    CUDA, which reads it in well under a second, and where each piece would dequantize the 4-bit
    weights again (a cost no GPU has measured)."""
    return PREFILL_PIECE if device.type == "cpu" else sys.maxsize


@dataclass(frozen=True)
class StepResult:
    tokens: list[int]             # new token ids, in order
    from_heads: int               # how many of them were Medusa guesses that the backbone accepted
    seconds: float                # wall time of this step (prefill included for the first)
    prefill: bool = False
    finish_reason: str | None = None  # "eos", "length", "context" or "cancelled" on the last step


def new_cache(model: nn.Module, capacity: int = 0) -> KVCache:
    """An empty cache for one conversation (buffers are allocated by its first forward), written by the
    writer the model's routing names (kv_cache.WRITER_NAME), if any."""
    config = model.config.get_text_config()
    name = getattr(model, WRITER_NAME, None)
    if name is not None and name not in WRITERS:
        raise ValueError(f"the model names the cache writer {name!r}, which no module registered (known: "
                         f"{sorted(WRITERS)}): route the rotary again (quant/attention_routing.use_rotary)")
    return KVCache(config.num_hidden_layers, max_context(model), capacity, WRITERS.get(name))


def max_context(model: nn.Module) -> int:
    """The longest sequence the step runs as the model was made to: its positions, or its sliding window (as
    Mistral-7B-v0.1's 4096 of 32768) where its layers use one, since this cache's masks attend over every slot;
    inside the window the two are the same attention."""
    config = model.config.get_text_config()
    context = int(getattr(config, "max_position_embeddings", 4096))
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)      # where given, which layers slide (Qwen2: none by default)
    if isinstance(window, int) and window > 0 and (layer_types is None or "sliding_attention" in layer_types):
        context = min(context, window)
    return context


@torch.inference_mode()
def generate(
    model: nn.Module,
    prompt_ids: Sequence[int],
    *,
    heads: MedusaHeads | None = None,
    tree: TreeBuffers | None = None,
    config: DecodeConfig = DecodeConfig(),
    cache: KVCache | None = None,
    stop_ids: Sequence[int] = (),
    should_stop: Callable[[], bool] | None = None,
    graphs: bool | None = None,
) -> Iterator[StepResult]:
    """Decode after ``prompt_ids``; yields one StepResult per forward pass.

    ``tree=None`` (or a one-node tree) is the plain baseline. Pass the same ``cache``
    across the turns of a conversation: the cached prefix is reused, a prompt that
    diverges from it rewinds to the common part, and the steps (CUDA graphs) captured
    for it are reused. ``graphs``: None = CUDA graphs on CUDA, eager elsewhere.
    """
    device = model.get_output_embeddings().weight.device
    if tree is None:
        tree = plain_tree(model)
    if tree.num_heads and heads is None:
        raise ValueError(f"a tree of depth {tree.num_heads} needs Medusa heads: pass heads, or use the baseline tree")
    if heads is not None and tree.num_heads > heads.config.num_heads:    # else an IndexError deep in the step
        raise ValueError(f"a tree of depth {tree.num_heads} is more than these {heads.config.num_heads} Medusa heads: "
                         f"build it for them (build_tree_buffers(paths, {heads.config.num_heads}))")
    prompt_ids = checked_prompt(model, prompt_ids)
    if cache is None:
        cache = new_cache(model)
    # Room for the whole reply up front, so a reply never changes bucket (and recaptures) midway.
    cache.ensure_capacity(len(prompt_ids) + config.max_new_tokens + tree.size)
    step = step_for(model, heads if tree.num_heads else None, tree, config, cache, graphs)
    step.set_params(config)
    sampling = not step.rule.argmax
    generator = sampling_generator(device, config.seed) if sampling else None
    stops = stop_set(model, stop_ids)

    # ---- prefill: run the uncached part of the prompt, emit the first token
    t0 = time.perf_counter()
    start = cache.reuse_prefix(prompt_ids)
    uniform = torch.rand(1, generator=generator, device=device) if sampling else step.uniforms[:1]
    size = prefill_piece(device)
    while len(prompt_ids) - start > size:
        if should_stop is not None and should_stop():   # what was read stays cached, a prefix of the prompt
            yield StepResult([], 0, time.perf_counter() - t0, finish_reason="cancelled")
            return
        piece = prompt_ids[start:start + size]
        step.read(piece)
        cache.commit(piece)
        start += len(piece)
    root = step.prefill(prompt_ids[start:], uniform)
    cache.commit(prompt_ids[start:])
    first = root.item()  # sync: the first token is the time-to-first-token moment
    produced = 1
    reason = _finish(first, stops, produced, config.max_new_tokens, should_stop)
    yield StepResult([first], 0, time.perf_counter() - t0, prefill=True, finish_reason=reason)
    if reason:
        return

    while True:
        if cache.length + tree.size > cache.capacity:
            # capacity >= prompt + max_new_tokens + T unless the context capped it
            if tree.size == 1:
                yield StepResult([], 0, 0.0, finish_reason="context")
                return
            # The context's last slots hold no whole tree: the one-node step ends the reply where
            # plain decoding would (a 64-node tree stopped 63 tokens short of it).
            step = plain_tail(model, step, config, cache, graphs)
            tree = step.tree
            continue
        step.prepare()      # a first step's graph capture, outside its time
        t0 = time.perf_counter()
        if sampling:
            step.uniforms.uniform_(generator=generator)
        # The one deliberate sync: [n, path tokens (D+1), bonus] in one read.
        packed = step.run().tolist()
        n = packed[0]
        accepted = packed[1:1 + n]               # root + accepted guesses: the step put them in the cache
        cache.commit(accepted, on_device=True)
        emitted = accepted[1:] + [packed[-1]]

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
        # from the heads: the kept tokens but the bonus (the backbone's own), which a cut may have left out
        yield StepResult(kept, min(len(kept), len(emitted) - 1),
                         time.perf_counter() - t0, finish_reason=reason)
        if reason:
            return


def plain_tree(model: nn.Module) -> TreeBuffers:
    """The one-node tree: plain decoding, on the model's device."""
    device = model.get_output_embeddings().weight.device
    return build_tree_buffers([], num_heads=0, device=device)


def plain_tail(model: nn.Module, step: DecodeStep, config: DecodeConfig, cache: KVCache,
               graphs: bool | None) -> DecodeStep:
    """The one-node step, taking over from ``step`` at the token it was about to verify as its root."""
    tail = step_for(model, None, plain_tree(model), config, cache, graphs)
    tail.set_params(config)
    tail.tokens.copy_(step.tokens[:1])
    return tail


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (one ending first counts); None if equal:
    how the page's comparison and the benchmarks check greedy Medusa against plain decoding."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def checked_prompt(model: nn.Module, prompt_ids: Sequence[int]) -> list[int]:
    """The prompt as a list; ValueError if empty, ContextOverflowError if it leaves no room to answer."""
    prompt_ids, context = list(prompt_ids), max_context(model)
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    if len(prompt_ids) >= context:
        raise ContextOverflowError(
            f"the prompt has {len(prompt_ids)} tokens but the model's context is {context}: "
            "shorten the conversation or clear it"
        )
    return prompt_ids


def sampling_generator(device: torch.device, seed: int | None) -> torch.Generator:
    """The reply's random stream: seeded when asked (a reproducible reply), else fresh."""
    generator = torch.Generator(device=device)
    if seed is not None:
        generator.manual_seed(mixed_seed(seed))
    else:
        generator.seed()
    return generator


def mixed_seed(seed: int) -> int:
    """``seed`` (any integer; the API takes 64-bit ones) with each of its bits spread over all 64 (splitmix64's
    finalizer, a bijection of 64-bit numbers). Why: torch's CPU generator keeps only a seed's low 32 bits, so seeds 6
    and 6 + 2**32 sampled the same answer, and were reported as two (API QA). Two seeds now meet only by chance."""
    z = (seed + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def stop_set(model: nn.Module, stop_ids: Sequence[int] = ()) -> set[int]:
    """The token ids a reply ends at: ``stop_ids`` plus the model's generation_config EOS."""
    stops = set(stop_ids)
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is not None:
        stops.update(eos if isinstance(eos, list) else [eos])
    return stops


def _finish(token: int, stops: set[int], produced: int, limit: int, should_stop) -> str | None:
    if token in stops:
        return "eos"
    if produced >= limit:
        return "length"
    if should_stop is not None and should_stop():
        return "cancelled"
    return None
