"""The CPU int4 mode's two lm_head approximations side by side (quant/cpu_int4.py: ``Bf16Head``, ``Int4Head``):
one load of the CPU default, then each head swapped in turn (with it the Medusa heads' proposal logits: dense
fp32 beside the bf16 head, as before the int4 head; int4 beside the int4 head, ``proposals_in_int4``), plain
decoding and a few trees, greedy, over held-out prompts in interleaved rounds; tokens/s per (head, tree), the
int4 head's ratio, and whether the tokens match (across heads, and Medusa against plain decoding).

    python -m medusa_core.benchmarks.cpu_heads                  # 6 prompts x 64 tokens, 2 rounds
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from ..decoding.config import DecodeConfig
from ..decoding.generate import generate
from ..decoding.tree import build_tree_buffers
from ..errors import LoadError
from ..loading.assets import CPU_DEFAULT_PROMPTS
from ..loading.chat_format import render_chat
from ..loading.load import load
from ..loading.spec import LoadSpec
from ..quant import cpu_int4
from ..training.data import read_prompts

TREES = {"plain": [], "[[0]]": [[0]], "[[0], [1]]": [[0], [1]], "[[0], [1], [0, 0]]": [[0], [1], [0, 0]]}


@dataclass(frozen=True)
class HeadComparison:
    """tokens/s per (head, tree) and how many greedy answers matched."""

    tokens_per_s: dict[tuple[str, str], float]
    same_across_heads: int        # answers (prompt, tree) the two heads decoded alike
    medusa_is_plain: int          # answers (prompt, tree, head) equal to that head's plain decoding
    cases: int                    # (prompt, tree) pairs


def compare(model: nn.Module, tokenizer, heads, prompts: list[str], max_new_tokens: int,
            rounds: int) -> HeadComparison:
    """Each (prompt, head, tree) decoded greedily, ``rounds`` times over, interleaved; the model's own head put
    back after."""
    chosen, proposals = model.get_output_embeddings(), heads.proposals
    dense = nn.Linear(chosen.in_features, chosen.out_features, bias=chosen.bias is not None)
    dense.weight, dense.bias = chosen.weight, chosen.bias                  # the model's own (tied) weight
    variants = {"bf16": cpu_int4.Bf16Head(dense), "int4": cpu_int4.Int4Head(dense)}
    ids = [render_chat(tokenizer, [{"role": "user", "content": text}]) for text in prompts]
    trees = {name: build_tree_buffers(paths, heads.config.num_heads) for name, paths in TREES.items()}
    config = DecodeConfig(max_new_tokens=max_new_tokens)
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0])    # seconds, tokens after prefill
    tokens: dict[tuple[int, str, str], list[int]] = {}
    try:
        for _ in range(rounds):
            for i, prompt in enumerate(ids):
                for head_name, head in variants.items():
                    model.set_output_embeddings(head)
                    if not (head_name == "int4" and cpu_int4.proposals_in_int4(heads)):
                        heads.approximate_proposals(None)
                    for tree_name, tree in trees.items():
                        steps = list(generate(model, prompt, heads=heads if TREES[tree_name] else None, tree=tree,
                                              config=config))
                        decoded = [s for s in steps if not s.prefill]
                        totals[head_name, tree_name][0] += sum(s.seconds for s in decoded)
                        totals[head_name, tree_name][1] += sum(len(s.tokens) for s in decoded)
                        tokens[i, head_name, tree_name] = [t for s in steps for t in s.tokens]
    finally:
        model.set_output_embeddings(chosen)
        heads.approximate_proposals(proposals)
    cases = [(i, t) for i in range(len(ids)) for t in TREES]
    return HeadComparison({key: n / seconds for key, (seconds, n) in totals.items()},
                          sum(tokens[i, "int4", t] == tokens[i, "bf16", t] for i, t in cases),
                          sum(tokens[i, h, t] == tokens[i, h, "plain"] for i, t in cases for h in variants),
                          len(cases))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=6, help="held-out prompts (the first ones)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="rounds over every (prompt, head, tree), interleaved")
    args = p.parse_args(argv)
    try:
        loaded = load(LoadSpec(device="cpu", quant="int4"))
    except LoadError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    if loaded.heads is None or not isinstance(loaded.model.get_output_embeddings(), cpu_int4.RefinedHead):
        print("error: the CPU default did not load with Medusa heads and an int4 mode head", file=sys.stderr)
        return 1
    print(loaded.description, flush=True)
    prompts = read_prompts(CPU_DEFAULT_PROMPTS)[:args.prompts]
    result = compare(loaded.model, loaded.tokenizer, loaded.heads, prompts, args.max_new_tokens, args.rounds)
    rate = result.tokens_per_s
    print(f"{torch.get_num_threads()} threads; tokens/s, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"{args.rounds} rounds")
    print(f"{'tree':22s} {'bf16 head':>10s} {'int4 head':>10s} {'int4/bf16':>10s}")
    for name in TREES:
        print(f"{name:22s} {rate['bf16', name]:10.1f} {rate['int4', name]:10.1f} "
              f"{rate['int4', name] / rate['bf16', name]:9.2f}x")
    print(f"greedy tokens, int4 head = bf16 head: {result.same_across_heads} of {result.cases}; Medusa = plain "
          f"decoding: {result.medusa_is_plain} of {2 * result.cases}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
