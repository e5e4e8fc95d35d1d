"""Medusa-1 head training: the backbone frozen, the heads fitted to its own text.

Head k at position t is trained on the token k + 2 places ahead (the backbone
itself predicts t + 1), with loss sum_k 0.8^k * CE_k (docs/design.md). Data is
either the backbone's own answers to a prompt set (self-distillation: greedy, or sampled
at --temperatures; generated first and stored as JSONL) or a text/JSONL corpus.

    python -m medusa_core.train --model DIR --out HEADS_DIR --prompts prompts.jsonl
    python -m medusa_core.train --model DIR --out HEADS_DIR --corpus a.txt b.jsonl
    # heads that also read the root token, warm-started from OLD_HEADS:
    python -m medusa_core.train --model DIR --out HEADS_DIR --prompts p.jsonl --init-heads OLD_HEADS --root-conditioned --cache-hidden
"""

from __future__ import annotations

import argparse
import sys

import torch

from .errors import OneLineParser, run_command
from .loading.policy import resolve_device
from .training.loop import TrainConfig, main_with_config


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_core.train", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="backbone directory (save_pretrained layout with tokenizer)")
    p.add_argument("--out", required=True, help="directory for the trained heads")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="JSONL of {\"prompt\": ...}: train on the backbone's own greedy answers")
    src.add_argument("--corpus", nargs="+",
                     help="text files, or JSONL with \"text\" (or \"prompt\" + \"answer\": trained on the answer, the "
                          "prompt read as the app renders it unless --raw-prompts), cut into --seq-len pieces")
    p.add_argument("--work-dir", help="answers, checkpoints and report (default: OUT/work)")
    p.add_argument("--raw-prompts", action="store_true",
                   help="feed prompts (--prompts, or a --corpus line's \"prompt\") as raw text, not as the app renders "
                        "them (the chat template, or Vicuna's format where the tokenizer has none)")
    p.add_argument("--num-heads", type=int, help=f"heads to train (default {TrainConfig.num_heads})")
    p.add_argument("--num-layers", type=int, help=f"residual blocks per head (default {TrainConfig.num_layers})")
    p.add_argument("--shared-projection", action="store_true", help="heads reuse the backbone's lm_head")
    p.add_argument("--answer-tokens", type=int, default=256)
    p.add_argument("--distill-batch", type=int, default=1,
                   help="answers generated together (> 1: transformers' batched generate, needed for follow-up turns)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                   help="one answer per prompt and temperature (0: greedy)")
    p.add_argument("--seq-len", type=int, help=f"--corpus: tokens per training piece (default {TrainConfig.seq_len})")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=200, help="held-out top-1/top-5 and a checkpoint every N steps")
    p.add_argument("--resume", action="store_true",
                   help="continue from WORK_DIR/checkpoint.pt (a cut run: the same --steps resumes exactly; a "
                        "larger --steps stretches the learning-rate schedule over the new total, so the rate "
                        "rises again from where it was)")
    p.add_argument("--load-in-4bit", action="store_true", help="CUDA: load the backbone in NF4 (bitsandbytes), computing in bfloat16 "
                   "(--dtype is for an unquantized backbone)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="backbone compute dtype for distillation and hidden states (heads train in float32)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--init-heads", help="start from these heads (their layout and proposal_vocab.json; "
                                        "--num-heads, --num-layers and --shared-projection are then theirs)")
    p.add_argument("--root-conditioned", action="store_true",
                   help="heads also read the backbone's next token (zero-initialised root blocks; this project's own layout)")
    p.add_argument("--root-lr", type=float, help="learning rate of root-conditioned heads' root blocks (default: --lr)")
    p.add_argument("--cache-hidden", action="store_true",
                   help="compute the backbone's hidden states once (fp32, ~2.3 KB per token for a 576-wide model) "
                        "and train on --positions random positions per step")
    p.add_argument("--positions", type=int,
                   help="positions per step with --cache-hidden (which ignores --batch-size; default "
                        f"{TrainConfig.positions})")
    a = p.parse_args(argv)
    # a flag that would change nothing is refused, not ignored (CLI QA: each was taken without a word)
    for flag, given, applies, why in (
            ("--seq-len", a.seq_len, a.corpus, "it cuts --corpus text; self-distilled answers are whole"),
            ("--positions", a.positions, a.cache_hidden, "it counts --cache-hidden's positions per step"),
            ("--root-lr", a.root_lr, a.root_conditioned or a.init_heads,
             "only root-conditioned heads have root blocks"),
            ("--num-heads", a.num_heads, not a.init_heads, "--init-heads trains those heads, in their layout"),
            ("--num-layers", a.num_layers, not a.init_heads, "--init-heads trains those heads, in their layout"),
            ("--shared-projection", a.shared_projection or None, not a.init_heads,
             "--init-heads trains those heads, in their layout")):
        if given is not None and not applies:
            p.error(f"{flag} changes nothing here ({why}): drop it")
    return run_command(lambda: main_with_config(TrainConfig(
        model=a.model, out=a.out, prompts=a.prompts, corpus=tuple(a.corpus or ()), work_dir=a.work_dir,
        raw_prompts=a.raw_prompts,
        own_projection=not a.shared_projection, answer_tokens=a.answer_tokens, distill_batch=a.distill_batch,
        temperatures=tuple(a.temperatures), steps=a.steps,
        batch_size=a.batch_size, lr=a.lr, eval_every=a.eval_every, resume=a.resume, load_in_4bit=a.load_in_4bit,
        device=resolve_device(a.device), seed=a.seed, dtype=a.dtype, threads=a.threads, init_heads=a.init_heads,
        root_conditioned=a.root_conditioned, root_lr=a.root_lr, cache_hidden=a.cache_hidden,
        # the flags left unset take TrainConfig's defaults
        **{name: value for name in ("num_heads", "num_layers", "seq_len", "positions")
           if (value := getattr(a, name)) is not None},
    )))


if __name__ == "__main__":
    sys.exit(main())
