"""Tree calibration for a heads directory: measure the heads' rank accuracies, grow the best
tree for a node budget and, with ``--budget auto``, time this device to pick its size
(medusa_core/training/tree_search.py).

    python -m medusa_core.calibrate --model DIR --heads DIR --prompts cal.jsonl --out tree.json --budget auto
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .errors import OneLineParser, run_command
from .heads.accuracy import CALIBRATION_FILE
from .loading.tree_tuning import MIN_SPEEDUP
from .loading.policy import resolve_device
from .training.tree_search import CalibrateConfig, report_path, run


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_core.calibrate", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="backbone directory")
    p.add_argument("--heads", required=True, help="heads directory (medusa_lm_head.safetensors)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="calibration prompts JSONL; the backbone's greedy answers are the targets")
    src.add_argument("--data", help="answers JSONL written by medusa_core.train (distill_answers.jsonl): the heads "
                                    "were trained on these, so their accuracies read high and the tree may come "
                                    "out larger than pays; --prompts with prompts the heads never saw measures them")
    p.add_argument("--out", required=True, help="tree file to write (JSON list of paths)")
    p.add_argument("--budget", default="auto", help="nodes without the root, or 'auto' (time sizes on this device)")
    p.add_argument("--max-budget", type=int, help=f"--budget auto: the largest tree timed (default "
                                                   f"{CalibrateConfig.max_budget})")
    p.add_argument("--top-k", type=int, default=10)
    p.add_argument("--raw-prompts", action="store_true", help="feed prompts as raw text, not via the chat template")
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--timing-prompts", help="--budget auto: prompts JSONL to time decoding with (default: --prompts)")
    p.add_argument("--timing-tokens", type=int, help=f"--budget auto: tokens decoded per timing prompt (default "
                                                     f"{CalibrateConfig.timing_tokens})")
    p.add_argument("--timing-count", type=int, help="--budget auto: how many timing prompts to decode (the first ones; "
                                                    f"default {CalibrateConfig.timing_count})")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="backbone compute dtype while measuring (bfloat16 is faster on CPUs with bf16 instructions)")
    p.add_argument("--quant", choices=("none", "int4"), default="none",
                   help="backbone weights while measuring: none, or int4 (torch's CPU kernel, what the app's CPU "
                        "default runs where it is faster)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    timing = ("max_budget", "timing_prompts", "timing_tokens", "timing_count")
    # a --budget that is no count is said by CalibrateConfig, not hidden behind this (review)
    if a.budget.isdecimal() and (given := next((name for name in timing if getattr(a, name) is not None), None)):
        # CLI QA: taken without a word, and a --timing-prompts file not even looked for
        p.error(f"--{given.replace('_', '-')} changes nothing with --budget {a.budget} (it is for --budget auto, "
                "which times tree sizes): drop it, or give --budget auto")
    return run_command(lambda: calibrate(a))


def calibrate(a: argparse.Namespace) -> None:
    report = run(CalibrateConfig(
        model=a.model, heads=a.heads, out=a.out, prompts=a.prompts, data=a.data, budget=a.budget,
        top_k=a.top_k, raw_prompts=a.raw_prompts, answer_tokens=a.answer_tokens, timing_prompts=a.timing_prompts,
        dtype=a.dtype, quant=a.quant, threads=a.threads, device=resolve_device(a.device),
        # the flags left unset take CalibrateConfig's defaults
        **{name: value for name in ("max_budget", "timing_tokens", "timing_count")
           if (value := getattr(a, name)) is not None},
    ))
    print("head top-1 accuracy:", report["top1"])
    for n, t in report.get("timing", {}).items():
        print(f"tree size {n:>3}: {t['step_ms']:7.2f} ms/step (fit {t['fitted_step_ms']:.2f}), expected {t['expected_tokens_per_step']:.2f} "
              f"(measured {t['measured_tokens_per_step']:.2f}) tokens/step, {t['expected_tokens_per_s']:.0f} tokens/s")
    if report.get("auto_size") == 1:
        print(f"auto: no tree pays on this device: none is expected {MIN_SPEEDUP}x faster than plain decoding (as "
              "the app's tuner decides); train the heads further or time on a faster matmul path (--dtype bfloat16)")
    elif "auto_size" in report:
        print(f"auto: tree size {report['auto_size']} (root included)")
    if report["nodes"] > 1:
        print(f"wrote {a.out}: {report['nodes']} nodes (root included, as the app counts), expected "
              f"{report['expected_tokens_per_step']:.2f} tokens/step")
    else:   # a tree file of no paths is refused by every loader: plain decoding is the tree "baseline"
        removed = f" (removed the {a.out} an earlier run wrote)" if report.get("removed") else ""
        print(f"no tree file written{removed}: plain decoding, --tree baseline, is the fastest with these heads; "
              "their accuracies are in the calibration report beside it")
    out, heads = Path(a.out), Path(a.heads)
    written = report_path(out)
    if written.resolve() != (heads / CALIBRATION_FILE).resolve():   # review: the app never read them, and nothing said
        print(f"the heads' accuracies are in {written}; the app reads them from {heads / CALIBRATION_FILE} to tune "
              f"their tree on each machine: give --out {heads / 'tree.json'} for that")


if __name__ == "__main__":
    sys.exit(main())
