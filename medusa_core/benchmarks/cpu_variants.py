"""Two variants of the CPU int4 mode side by side, on one load of the CPU default: plain decoding and a few
trees, greedy, over held-out prompts in interleaved rounds; tokens/s per (variant, tree), the second variant's
ratio over the first, and whether the tokens match (across variants, and Medusa against plain decoding).

- ``--compare heads``: the lm_head approximated in bf16 against int4 (quant/cpu_int4.py: ``Bf16Head``,
  ``Int4Head``), and with each its Medusa heads' proposal logits: dense fp32 beside the bf16 head, as before the
  int4 head; int4 beside the int4 head (``proposals_in_int4``).
- ``--compare projections``: q/k/v and gate/up as separate int4 matmuls against each group as one
  (quant/fused_projections.py). The separate ones are made from the fp32 checkpoint, as the load makes the fused
  ones: each projection keeps its codes and scales.

    python -m medusa_core.benchmarks.cpu_variants                          # heads; 6 prompts x 64 tokens, 2 rounds
    python -m medusa_core.benchmarks.cpu_variants --compare projections
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..decoding.config import DecodeConfig
from ..decoding.generate import generate
from ..decoding.tree import build_tree_buffers
from ..errors import LoadError, OneLineParser, exit_status
from ..loading.assets import CPU_DEFAULT_PROMPTS
from ..loading.chat_format import render_chat
from ..loading.load import load, load_backbone_dir
from ..loading.spec import LoadSpec
from ..quant import cpu_int4
from ..quant.fused_projections import FusedSlice
from ..training.data import read_prompts

TREES = {"plain": [], "[[0]]": [[0]], "[[0], [1]]": [[0], [1]], "[[0], [1], [0, 0]]": [[0], [1], [0, 0]]}

# Puts a variant in place on the loaded model and returns what puts the model back as it was loaded.
Swap = Callable[[], Callable[[], None]]


@dataclass(frozen=True)
class Comparison:
    """tokens/s per (variant, tree) and how many greedy answers matched."""

    tokens_per_s: dict[tuple[str, str], float]
    same_across: int              # answers (prompt, tree) the two variants decoded alike
    medusa_is_plain: int          # answers (prompt, tree, variant) equal to that variant's plain decoding
    cases: int                    # (prompt, tree) pairs


def compare(model: nn.Module, tokenizer, heads, prompts: list[str], max_new_tokens: int, rounds: int,
            variants: dict[str, Swap]) -> Comparison:
    """Each (prompt, variant, tree) decoded greedily, ``rounds`` times over, interleaved; the model as loaded
    after each variant."""
    ids = [render_chat(tokenizer, [{"role": "user", "content": text}]) for text in prompts]
    trees = {name: build_tree_buffers(paths, heads.config.num_heads) for name, paths in TREES.items()}
    config = DecodeConfig(max_new_tokens=max_new_tokens)
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])    # seconds, tokens after prefill
    tokens: dict[tuple[int, str, str], list[int]] = {}
    for _ in range(rounds):
        for i, prompt in enumerate(ids):
            for variant, swap in variants.items():
                restore = swap()
                try:
                    for tree_name, tree in trees.items():
                        steps = list(generate(model, prompt, heads=heads if TREES[tree_name] else None, tree=tree,
                                              config=config))
                        decoded = [s for s in steps if not s.prefill]
                        totals[variant, tree_name][0] += sum(s.seconds for s in decoded)
                        totals[variant, tree_name][1] += sum(len(s.tokens) for s in decoded)
                        tokens[i, variant, tree_name] = [t for s in steps for t in s.tokens]
                finally:
                    restore()
    first, second = variants
    cases = [(i, t) for i in range(len(ids)) for t in TREES]
    return Comparison({key: n / seconds for key, (seconds, n) in totals.items()},
                      sum(tokens[i, first, t] == tokens[i, second, t] for i, t in cases),
                      sum(tokens[i, v, t] == tokens[i, v, "plain"] for i, t in cases for v in variants),
                      len(cases))


def head_variants(model: nn.Module, heads) -> dict[str, Swap]:
    """"bf16" and "int4": the lm_head approximated so, with the proposals computed as beside it."""
    chosen, proposals = model.get_output_embeddings(), heads.proposals
    dense = nn.Linear(chosen.in_features, chosen.out_features, bias=chosen.bias is not None)
    dense.weight, dense.bias = chosen.weight, chosen.bias                  # the model's own (tied) weight

    def use(head: cpu_int4.RefinedHead) -> Swap:
        def swap():
            model.set_output_embeddings(head)
            if not (head.kind == "int4" and cpu_int4.proposals_in_int4(heads)):
                heads.approximate_proposals(None)

            def restore():
                model.set_output_embeddings(chosen)
                heads.approximate_proposals(proposals)
            return restore
        return swap

    return {"bf16": use(cpu_int4.Bf16Head(dense)), "int4": use(cpu_int4.Int4Head(dense))}


def projection_variants(model: nn.Module, dense_model: nn.Module) -> dict[str, Swap]:
    """"apart" and "fused": every fused group of ``model`` as one int4 matmul per projection (made from
    ``dense_model``, the same checkpoint unquantized), and as loaded."""
    dense = dict(dense_model.named_modules())
    slices = [(name, module) for name, module in model.named_modules() if isinstance(module, FusedSlice)]
    apart = {name: cpu_int4.Int4Linear.from_linear(dense[name]) for name, _ in slices}
    parents = dict(model.named_modules())

    def put(modules: dict[str, nn.Module]) -> None:
        for name, module in modules.items():
            parent, _, child = name.rpartition(".")
            setattr(parents[parent], child, module)

    def swap():
        put(apart)
        return lambda: put(dict(slices))

    return {"apart": swap, "fused": lambda: (lambda: None)}


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_core.benchmarks.cpu_variants", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", choices=("heads", "projections"), default="heads")
    p.add_argument("--count", dest="prompts", type=int, default=6, help="how many held-out prompts (the first ones)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="rounds over every (prompt, variant, tree), interleaved")
    args = p.parse_args(argv)
    held_out = len(read_prompts(CPU_DEFAULT_PROMPTS))
    # before the load (minutes): 0 failed after it with a traceback, -1 ran all the prompts but the last
    if not 1 <= args.prompts <= held_out:
        p.error(f"--count {args.prompts} must be from 1 to {held_out} (the held-out prompts)")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--rounds", args.rounds)):
        if value < 1:
            p.error(f"{flag} {value} must be at least 1")
    try:
        loaded = load(LoadSpec(device="cpu", quant="int4"))
        # the checkpoint the load quantized, in fp32 again
        dense_model = load_backbone_dir(loaded.model.name_or_path)[0] if args.compare == "projections" else None
    except LoadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if loaded.heads is None or not isinstance(loaded.model.get_output_embeddings(), cpu_int4.RefinedHead):
        print("error: the CPU default did not load with Medusa heads and an int4 mode head", file=sys.stderr)
        return 1
    print(loaded.description, flush=True)
    if dense_model is not None:
        variants = projection_variants(loaded.model, dense_model)
        if not any(isinstance(m, FusedSlice) for m in loaded.model.modules()):
            print("error: the CPU default loaded with no fused projections", file=sys.stderr)
            return 1
    else:
        variants = head_variants(loaded.model, loaded.heads)
    prompts = read_prompts(CPU_DEFAULT_PROMPTS)[:args.prompts]
    result = compare(loaded.model, loaded.tokenizer, loaded.heads, prompts, args.max_new_tokens, args.rounds,
                     variants)
    rate = result.tokens_per_s
    first, second = variants
    print(f"{torch.get_num_threads()} threads; tokens/s, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"{args.rounds} rounds")
    print(f"{'tree':22s} {first:>10s} {second:>10s} {second + '/' + first:>12s}")
    for name in TREES:
        print(f"{name:22s} {rate[first, name]:10.1f} {rate[second, name]:10.1f} "
              f"{rate[second, name] / rate[first, name]:11.2f}x")
    print(f"greedy tokens, {second} = {first}: {result.same_across} of {result.cases}; Medusa = plain "
          f"decoding: {result.medusa_is_plain} of {2 * result.cases}")
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))   # Ctrl-C: one line, exit 130
