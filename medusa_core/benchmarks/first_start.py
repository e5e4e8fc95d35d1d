"""The app's loading path started twice on one machine, as a user starts it: a random checkpoint of real
shapes saved to disk, then ``python -m medusa_core.bench`` on it in two fresh processes sharing one new cache.

Why: on a GPU the first start times the kernels for that GPU (a few hundred CUDA-graph timings for a 7B,
loading/kernel_memory.py) and keeps them; the second reads them. How long a user waits at each start has
never been measured on a GPU, and ``bench`` through ``loading.load`` (NF4 at load, the kernels as ``auto``
routes them) against transformers' ``generate()`` on the same model is one of issue 22's rows. Each start's
line says what it measured or read ("kernel timings: N measured now in S s" / "N read from those kept").

    python -m medusa_core.benchmarks.first_start --json out/first_start.json       # 7B, NF4, on CUDA
    python -m medusa_core.benchmarks.first_start --device cpu --shape tiny --quant none --json out/f.json
        # a smoke check of the plumbing on the CPU: no claims

The JSON is rewritten after each start (a device call has a time limit), and folds into docs/perf with
``bench_synthetic --fold``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..decoding.config import DecodeConfig, SettingError
from ..decoding.tree import TreeError, build_tree_buffers, named_tree
from ..errors import LoadError, OneLineParser, check_writable, exit_status
from ..heads.accuracy import PUBLISHED_ACCURACIES
from ..loading.policy import resolve_device, resolve_quant
from .synthetic import SHAPES, save_random_checkpoint

PROMPTS = ("Explain how a hash map works.", "Write a short poem about autumn.", "What causes the seasons?")
STARTS = ("first", "second")


def parser(cuda: bool = False) -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m medusa_core.benchmarks.first_start", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--shape", choices=sorted(SHAPES), help="model shape (default: 7b on CUDA, tiny otherwise)")
    p.add_argument("--quant", default="nf4", help="bench's --quant (default nf4, the product's format)")
    p.add_argument("--tree", default="mc_sim_7b_16", help="bench's --tree: the NF4 default on CUDA")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True, help="write the starts here, after each")
    return p


def start(folder: Path, cache: Path, args, name: str) -> dict:
    """One start of ``bench`` on the saved checkpoint in a process of its own: its load line and seconds, and
    its table. A start that fails says so with its exit status; its output is in the log above."""
    out = folder / f"bench-{name}.json"
    command = [sys.executable, "-m", "medusa_core.bench", "--model", str(folder / "backbone"),
               "--heads", str(folder / "heads"), "--prompts", str(folder / "prompts.jsonl"), "--device", args.device,
               "--quant", args.quant, "--tree", args.tree, "--max-new-tokens", str(args.max_new_tokens),
               "--warmup", "1", "--json", str(out)]
    print(f"[{name} start] {' '.join(command)}", flush=True)
    began = time.perf_counter()
    code = subprocess.run(command, env={**os.environ, "MEDUSA_CHAT_CACHE": str(cache)}).returncode
    row = {"start": name, "returncode": code, "process_seconds": round(time.perf_counter() - began, 1)}
    if code == 0:
        bench = json.loads(out.read_text())
        row.update(load_seconds=bench["load_seconds"], model=bench["model"], bench=bench)
    return row


def summary(starts: list[dict]) -> dict:
    """The headline figures: each start's load seconds."""
    return {f"{row['start']}_start_load_s": row["load_seconds"] for row in starts if "load_seconds" in row}


def check_flags(args) -> str | None:
    """What bench, started on the checkpoint, would refuse in the flags passed on to it, as one line: said
    before the checkpoint is written (minutes, 13.5 GB at 7B), not by the first start after it."""
    try:
        resolve_quant(args.quant, resolve_device(args.device))
    except LoadError as err:        # "device 'x' ..." or "quant 'x' ...": named as the flag
        return f"--{err}"
    try:
        DecodeConfig(max_new_tokens=args.max_new_tokens)
    except SettingError as err:
        return f"--{err.name.replace('_', '-')} {err.problem}"
    try:
        paths = named_tree(args.tree)
        if paths is not None:   # the checkpoint has as many heads as the published accuracies: no deeper tree runs
            build_tree_buffers(paths, len(PUBLISHED_ACCURACIES))
    except TreeError as err:
        return f"--tree {args.tree}: {err}"
    return None


def main(argv: list[str] | None = None) -> int:
    p = parser(torch.cuda.is_available())
    args = p.parse_args(argv)
    if error := check_flags(args):
        p.error(error)
    args.shape = args.shape or ("7b" if args.device.startswith("cuda") else "tiny")
    try:
        check_writable(args.json)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    folder = Path(tempfile.mkdtemp(prefix="first-start-"))
    try:
        began = time.perf_counter()
        try:
            save_random_checkpoint(SHAPES[args.shape], len(PUBLISHED_ACCURACIES), folder, args.seed,
                                   torch.device(args.device))
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 1
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()        # the bench processes need the GPU's memory, not this one
        report = {"shape": args.shape, "device": args.device, "quant": args.quant, "tree": args.tree,
                  "save_seconds": round(time.perf_counter() - began, 1), "starts": []}
        (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
        for name in STARTS:
            report["starts"].append(start(folder, folder / "cache", args, name))
            report["summary"] = summary(report["starts"])
            Path(args.json).write_text(json.dumps({"first_start": report}, indent=1) + "\n")
            if report["starts"][-1]["returncode"] != 0:
                break
    finally:
        shutil.rmtree(folder, ignore_errors=True)      # a 7B checkpoint is 13.5 GB of the machine's disk
    for row in report["starts"]:
        print(f"{row['start']} start: " + (f"loaded in {row['load_seconds']:.1f} s; {row['model']}"
                                           if "load_seconds" in row else f"failed (exit {row['returncode']})"))
    print(f"wrote {args.json}")
    return 0 if all(row["returncode"] == 0 for row in report["starts"]) else 1


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
