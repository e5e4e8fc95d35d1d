"""Where one CPU decoding step's time goes, by category: the gap to close next.

Forward hooks time every module of a kind exclusively (a module's own time, its hooked children's
removed): the 4-bit (or fp32) projections, attention (rotary, the row-exact SDPA loop, reshapes),
the MLP's activation, the norms, the lm_head, the Medusa heads, what else runs in the decoder
(residual adds, rotary tables, mask handling, the layers' Python), and whatever the step does
outside the model (candidates, acceptance, the KV-cache copy, the one sync, the loop). Each step
is timed by the generation loop itself, so the categories add up to its wall time.

    python -m medusa_core.benchmarks.profile_cpu_step                          # the app's CPU default, its tuned tree
    python -m medusa_core.benchmarks.profile_cpu_step --tree baseline chain-1 small-16 --quant none

CPU only: on a GPU kernels run asynchronously and host-side hooks see launch times, not work.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from ..loading.chat_format import render_chat
from ..errors import LoadError, OneLineParser, exit_status
from ..decoding.config import DecodeConfig
from ..decoding.generate import generate
from ..loading.assets import CPU_DEFAULT_PROMPTS
from ..loading.load import load
from ..loading.spec import LoadSpec
from ..training.data import read_prompts
from ..decoding.tree import TreeError, build_tree_buffers, resolve_tree, tree_name

ORDER = ("projections (4-bit or fp32 matmuls)", "attention", "MLP activation", "norms", "lm_head", "Medusa heads",
         "decoder: residuals, rotary tables, layer Python", "outside the model: candidates, acceptance, KV copy, loop")


@dataclass(frozen=True)
class ProfileConfig:
    trees: tuple[str, ...] = ()          # () = the loaded default tree; "baseline" is always profiled
    quant: str = "auto"
    prompts: int = 4                     # the first held-out prompts
    steps: int = 32                      # decoding steps profiled per prompt (after a warm-up prompt)


def category(module: nn.Module, model: nn.Module) -> str | None:
    name = type(module).__name__
    head = model.get_output_embeddings()
    if module is head:
        return "lm_head"
    if any(module is part for part in head.modules()):
        return None     # the int4 head's kernel layer (cpu_int4.Int4Head): the head's time, not a projection's
    if name in ("Int4Linear", "FusedSlice", "Linear", "Linear4bit", "Linear8bitLt"):
        return ORDER[0]
    if name.endswith("Attention"):
        return "attention"
    if name.endswith("MLP"):
        return "MLP activation"
    if name.endswith("RMSNorm") or name.endswith("LayerNorm"):
        return "norms"
    if module is model.get_decoder():
        return ORDER[6]
    return None


class ExclusiveTimer:
    """Seconds per category, each module's time less its hooked children's (a stack of starts)."""

    def __init__(self, modules: list[tuple[nn.Module, str]]):
        self.seconds: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []           # [category, start, children's seconds]
        self._handles = []
        for module, kind in modules:
            self._handles.append(module.register_forward_pre_hook(lambda *_, kind=kind: self._enter(kind)))
            self._handles.append(module.register_forward_hook(lambda *_: self._leave()))

    def _enter(self, kind: str) -> None:
        self._stack.append([kind, time.perf_counter(), 0.0])

    def _leave(self) -> None:
        kind, start, children = self._stack.pop()
        took = time.perf_counter() - start
        self.seconds[kind] += took - children
        if self._stack:
            self._stack[-1][2] += took

    def wrap(self, obj, method: str, kind: str) -> None:
        """Time a method that is not a module's forward (the heads' ``guesses``, which the step calls)."""
        real = getattr(obj, method)

        def timed(*args, **kwargs):
            self._enter(kind)
            try:
                return real(*args, **kwargs)
            finally:
                self._leave()

        setattr(obj, method, timed)
        self._handles.append(_Unwrap(obj, method))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _Unwrap:
    def __init__(self, obj, method: str):
        self.obj, self.method = obj, method

    def remove(self) -> None:
        delattr(self.obj, self.method)     # the class's method shows through again


def profile(loaded, tree_name: str, prompt_ids: list[list[int]], steps: int) -> tuple[dict[str, float], float, int]:
    """(ms per step by category, ms per step in all, steps) over ``steps`` decoding steps per prompt."""
    model, heads = loaded.model, loaded.heads
    tree = build_tree_buffers(resolve_tree(tree_name), heads.config.num_heads if heads is not None else 0)
    hooked = [(m, category(m, model)) for m in model.modules()]
    config = DecodeConfig(max_new_tokens=steps * tree.size + 1)
    use_heads = heads if tree.num_heads else None
    for step in generate(model, prompt_ids[0], heads=use_heads, tree=tree, config=config):   # warm-up
        pass
    timer = ExclusiveTimer([(m, kind) for m, kind in hooked if kind is not None])
    if use_heads is not None:
        timer.wrap(heads, "guesses", "Medusa heads")    # their blocks and projection, all in one call
    total, count = 0.0, 0
    try:
        for ids in prompt_ids:
            timer_before = dict(timer.seconds)
            done = 0
            for step in generate(model, ids, heads=use_heads, tree=tree, config=config):
                if step.prefill:
                    timer.seconds = defaultdict(float, timer_before)   # the prefill is not a step
                    continue
                total, count, done = total + step.seconds, count + 1, done + 1
                if done == steps:
                    break
    finally:
        timer.remove()
    per_step = {kind: 1e3 * timer.seconds.get(kind, 0.0) / max(count, 1) for kind in ORDER[:-1]}
    per_step[ORDER[-1]] = 1e3 * total / max(count, 1) - sum(per_step.values())
    return per_step, 1e3 * total / max(count, 1), count


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_core.benchmarks.profile_cpu_step", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", nargs="+", default=[], help="trees to profile beside the baseline; 'default' (or none given): the "
                                                                 "model's default tree, tuned for this machine")
    p.add_argument("--quant", default="auto", choices=("auto", "int4", "none"))
    p.add_argument("--count", dest="prompts", type=int, default=4, help="how many held-out prompts (the first ones)")
    p.add_argument("--steps", type=int, default=32, help="decoding steps per prompt")
    a = p.parse_args(argv)
    config = ProfileConfig(trees=tuple(a.tree), quant=a.quant, prompts=a.prompts, steps=a.steps)
    held_out = len(read_prompts(CPU_DEFAULT_PROMPTS))
    # before the load and the tuning (minutes): a count of 0 failed after them, -1 profiled 23 prompts
    if not 1 <= config.prompts <= held_out:
        p.error(f"--count {config.prompts} must be from 1 to {held_out} (the held-out prompts)")
    if config.steps < 1:
        p.error(f"--steps {config.steps} must be at least 1")
    try:
        for name in config.trees:   # before the load (QA: after it, and the list named every tree but "default")
            if name != "default":
                resolve_tree(name)
    except TreeError as err:
        print(f"error: {err} (or 'default', the model's own tree)", file=sys.stderr)
        return 1
    try:
        loaded = load(LoadSpec(device="cpu", quant=config.quant))
        asked = [loaded.default_tree if t == "default" else t for t in config.trees or ("default",)]
        trees = list(dict.fromkeys(["baseline", *asked]))
        for name in trees:
            build_tree_buffers(resolve_tree(name), loaded.heads.config.num_heads)
    except (LoadError, TreeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    prompts = [render_chat(loaded.tokenizer, text) for text in read_prompts(CPU_DEFAULT_PROMPTS)[:config.prompts]]
    print(loaded.description)
    print(f"{torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()} kernels; "
          f"ms per decoding step, {config.prompts} prompts x {config.steps} steps")
    results = {name: profile(loaded, name, prompts, config.steps) for name in trees}
    sizes = [build_tree_buffers(resolve_tree(name), loaded.heads.config.num_heads).size for name in trees]
    labels = [f"{tree_name(name)} ({size} node{'s' if size > 1 else ''})" for name, size in zip(trees, sizes)]
    print(f"{'category':<58}" + "".join(f"{label:>24}" for label in labels))
    for kind in ORDER:
        row = "".join(f"{results[n][0][kind]:>15.2f} ({100 * results[n][0][kind] / results[n][1]:>4.1f}%)"
                      for n in trees)
        print(f"{kind:<58}{row}")
    print(f"{'step':<58}" + "".join(f"{results[n][1]:>15.2f} {'':>7}" for n in trees))
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
