"""Tree calibration (paper §2.3.3): measure a[k][i], the accuracy of head k's
rank-i guess, on a calibration set; grow the tree that maximizes the expected
accepted length for a node budget; time verification per tree size on this
device and pick the size with the most expected tokens per second ("auto") as the app's
tuner picks it (loading/tree_tuning.choose: step times made non-decreasing in the tree size, load
noise pooled and real jumps kept, none below the plain step's, and plain decoding unless a tree is
expected MIN_SPEEDUP faster).

The command line is ``python -m medusa_core.calibrate``.

A node's value is the product of a along its path: the chance that the whole
path is accepted if the heads' hits were independent. Siblings are distinct
tokens, so at most one child of a node is accepted, and the expected number of
tokens per step is 1 (the backbone's own token) + the sum of the node values.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..quant.cpu_int4 import use_int4
from ..decoding.tree import MAX_GENERATED_NODES, TOP_K, expected_tokens_per_step, grow_tree
from ..loading.tree_tuning import choose
from .loop import check_answer_tokens, check_threads
from ..errors import check_writable
from ..heads.files import HEADS_FILES, PROPOSAL_FILE

OWN_FILES = ("config.json", *HEADS_FILES, PROPOSAL_FILE)   # a heads folder's files that no tree file replaces
TIMED_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)   # tree sizes without the root


@dataclass(frozen=True)
class CalibrateConfig:
    model: str
    heads: str
    out: str                          # the JSON tree file (a list of paths)
    prompts: str | None = None        # JSONL {"prompt": ...}: the backbone answers them, heads are scored on that
    data: str | None = None           # or an answers file written by medusa_core.train (distill_answers.jsonl)
    answers: str | None = None        # where --prompts' answers are stored (default: next to --out)
    budget: str = "auto"              # node count (root excluded), or "auto"
    max_budget: int = 64
    top_k: int = 10                   # ranks measured per head
    raw_prompts: bool = False
    answer_tokens: int = 128
    timing_prompts: str | None = None  # prompts to time decoding with (default: the calibration prompts)
    timing_tokens: int = 64
    timing_count: int = 8             # timing prompts used (the first ones): each is decoded once per size and repeat
    dtype: str = "float32"            # compute dtype of the backbone while measuring
    quant: str = "none"               # none | int4 (torch's CPU kernel, as the app's CPU default runs)
    threads: int = 0                  # CPU threads for torch (0: torch's default)
    repeats: int = 3
    device: str = "cpu"

    def __post_init__(self) -> None:
        if (self.prompts is None) == (self.data is None):
            raise ValueError("give exactly one calibration set: --prompts FILE.jsonl or --data answers.jsonl")
        if self.budget != "auto" and not (self.budget.isdecimal() and 1 <= int(self.budget) < MAX_GENERATED_NODES):
            # QA: --budget 100000 wrote a tree of 1,219 nodes, which every loader then refused
            raise ValueError(f"--budget {self.budget!r} must be a node count from 1 to {MAX_GENERATED_NODES - 1} (the "
                             "root not counted), or 'auto'")
        if not 1 <= self.top_k <= TOP_K:      # a tree using rank 10 or more is one no loader runs
            raise ValueError(f"top_k {self.top_k}: measure from rank 1 to a tree's most, {TOP_K}, of each head (--top-k)")
        if self.max_budget < 1:
            raise ValueError(f"max_budget {self.max_budget}: allow at least 1 node besides the root (--max-budget)")
        if self.quant not in ("none", "int4"):
            raise ValueError(f"quant {self.quant!r} is unknown: use none or int4")
        if self.quant == "int4" and self.device != "cpu":
            raise ValueError(f"quant int4 is torch's CPU kernel and the device is {self.device}: add --device cpu")
        # each said here, before the load and the measuring (a ZeroDivisionError came after)
        for flag, value in (("--timing-count", self.timing_count), ("--timing-tokens", self.timing_tokens),
                            ("repeats", self.repeats)):
            if value < 1:
                raise ValueError(f"{flag} {value} must be at least 1")
        check_answer_tokens(self.answer_tokens)
        check_threads(self.threads)


def report_path(out: Path) -> Path:
    """Where calibrate writes its report beside the tree file ``out`` (tree.json -> tree_calibration.json)."""
    return out.with_name(out.stem + "_calibration.json")


def accuracy_table(counts: torch.Tensor) -> list[list[float]]:
    """(K, top_k + 1) rank counts (last column: miss) -> a[k][i] = P(target is head k's rank-i guess)."""
    total = counts.sum(1, keepdim=True).clamp(min=1)
    return (counts[:, :-1].double() / total).tolist()


def time_sizes(model, heads, acc, prompt_ids: list[list[int]], sizes: Sequence[int], tokens: int,
               repeats: int) -> dict[int, dict]:
    """Mean seconds per decoding step and measured tokens per step for each tree size, with the size the app's
    tuner would choose from them (tree_tuning.choose: step times made non-decreasing, none below the plain step's,
    and a tree only where it is expected MIN_SPEEDUP faster). Sizes are interleaved within each repeat so that load
    changes hit all alike; the fastest repeat is kept. Size 1 counts the root only: the plain baseline."""
    from tqdm import tqdm

    from ..decoding.config import DecodeConfig
    from ..decoding.generate import generate, new_cache
    from ..decoding.tree import build_tree_buffers

    device = model.get_output_embeddings().weight.device
    trees = {n: build_tree_buffers(grow_tree(acc, n - 1), heads.config.num_heads, top_k=len(acc[0]), device=device)
             for n in sizes}
    # one cache per size for every prompt and repeat, with room for the longest: on CUDA each size's step is
    # captured once, in the warm-up round, where a new cache per reply captured it inside the timed steps
    # (as bench's did: runs.run_loop), and the smaller trees' fewer steps hid less of it
    capacity = max(map(len, prompt_ids)) + tokens + max(tree.size for tree in trees.values())
    caches = {n: new_cache(model, capacity) for n in sizes}
    samples: dict[int, list[tuple[float, float]]] = {n: [] for n in sizes}
    config = DecodeConfig(max_new_tokens=tokens)
    for _ in tqdm(range(repeats + 1), desc="timing trees"):   # the first round warms up and is dropped
        for n in sizes:
            seconds, steps, emitted = 0.0, 0, 0
            for ids in prompt_ids:
                for step in generate(model, ids, heads=heads, tree=trees[n], config=config, cache=caches[n]):
                    if not step.prefill and step.tokens:
                        seconds, steps, emitted = seconds + step.seconds, steps + 1, emitted + len(step.tokens)
            samples[n].append((seconds / max(1, steps), emitted / max(1, steps)))
    # The fastest repeat: other load on the machine only ever adds time.
    fastest = {n: min(s for s, _ in samples[n][1:]) for n in sizes}
    chosen, _, _, _, fitted = choose(acc, fastest)
    out = {}
    for n in sizes:
        out[n] = {"step_ms": round(1e3 * fastest[n], 3), "fitted_step_ms": round(1e3 * fitted[n], 3),
                  "measured_tokens_per_step": round(samples[n][-1][1], 3),
                  "expected_tokens_per_step": round(expected_tokens_per_step(grow_tree(acc, n - 1), acc), 3),
                  "chosen": n == chosen}
        out[n]["expected_tokens_per_s"] = round(out[n]["expected_tokens_per_step"] / fitted[n], 1)
    return out


def run(config: CalibrateConfig) -> dict:
    """Measure, grow, (time), write the tree file; returns the report (also written next to it)."""
    from ..heads.files import load_heads_dir
    from ..loading.load import load_backbone_dir
    from .evaluation import rank_histogram
    from .loss import padded
    from .data import backbone_label, distilled_rows, encode_prompt, read_answers, read_prompts

    if config.threads:
        torch.set_num_threads(config.threads)
    # said before the load and the measuring (minutes), not after them
    if config.data:
        read_answers(Path(config.data))
    # QA: --out at the prompts or answers file it reads wrote the tree over it
    check_writable(config.out, "--out", reads={"--prompts": config.prompts, "--data": config.data,
                                               "--timing-prompts": config.timing_prompts})
    heads_dir, out = Path(config.heads), Path(config.out)
    if not heads_dir.is_dir():     # QA: a missing path or a file was said to hold "no heads"
        raise ValueError(f"--heads {heads_dir} is {'a file' if heads_dir.exists() else 'not there'}: give the folder "
                         "that python -m medusa_core.train wrote")
    if not any((heads_dir / name).is_file() for name in HEADS_FILES):   # QA: said after the load and a minute's timing
        raise ValueError(f"{heads_dir} holds no heads ({' or '.join(HEADS_FILES)}): give the folder that "
                         "python -m medusa_core.train wrote")
    if out.resolve().parent == heads_dir.resolve() and out.name in OWN_FILES:
        # QA: --out heads/config.json wrote the tree over the heads' config, and the heads no longer loaded
        raise ValueError(f"--out {config.out} is one of the heads' own files: give a tree file, such as "
                         f"{heads_dir / 'tree.json'}")
    timing = config.timing_prompts or config.prompts
    if config.budget == "auto" and not (timing and Path(timing).is_file()):
        raise ValueError(f"--budget auto times decoding on prompts, and {timing} does not exist: give an existing file"
                         if timing else "--budget auto times decoding: give --timing-prompts FILE.jsonl (or calibrate "
                         "with --prompts)")
    model, tokenizer = load_backbone_dir(config.model, device=config.device, dtype=getattr(torch, config.dtype))
    if config.quant == "int4":
        print(use_int4(model, measured=False)[1], flush=True)
    heads = load_heads_dir(config.heads, model)
    out = Path(config.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if config.prompts:
        answers = Path(config.answers or out.with_name(out.stem + "_calibration_answers.jsonl"))
        form = "int4" if config.quant == "int4" else config.dtype
        rows = distilled_rows(model, tokenizer, config.prompts, config.raw_prompts, config.answer_tokens, answers,
                              backbone=backbone_label(config.model, form))
    else:
        rows = read_answers(Path(config.data), vocab_size=model.get_input_embeddings().weight.shape[0])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = (padded(rows[i:i + 8], pad, config.device) for i in range(0, len(rows), 8))
    counts = rank_histogram(heads, model, batches, top_k=config.top_k)
    acc = accuracy_table(counts)
    # --data's answers were cut by the run that made them: answer_tokens did not apply (QA: it recorded 128)
    report: dict = {"config": {**asdict(config), **({"answer_tokens": None} if config.data else {})},
                    "accuracy": [[round(v, 4) for v in row] for row in acc],
                    "top1": [round(row[0], 4) for row in acc]}
    if config.budget == "auto":
        timing_file = Path(config.timing_prompts or config.prompts)     # checked before the load
        timing_prompts = read_prompts(timing_file)
        prompt_ids = [encode_prompt(tokenizer, p, config.raw_prompts) for p in timing_prompts[:config.timing_count]]
        print(f"timing tree sizes on {len(prompt_ids)} of the {len(timing_prompts)} prompts in {timing_file} "
              "(--timing-count sets how many)", flush=True)
        sizes = [n for n in TIMED_SIZES if n <= config.max_budget + 1]
        timing = time_sizes(model, heads, acc, prompt_ids, sizes, config.timing_tokens, config.repeats)
        best = next(n for n, t in timing.items() if t["chosen"])
        report["timing"] = {str(n): t for n, t in timing.items()}
        report["auto_size"] = best
        budget = best - 1
    else:
        budget = int(config.budget)
    paths = grow_tree(acc, budget)
    report["budget"] = budget
    report["nodes"] = len(paths) + 1        # root included, as the app counts; the heads may fill fewer than the budget
    report["expected_tokens_per_step"] = round(expected_tokens_per_step(paths, acc), 4)
    if paths:
        out.write_text(json.dumps([list(p) for p in paths]) + "\n")
    elif out.is_file():     # no tree pays: plain decoding, which a tree file cannot name ([] is refused as one)
        out.unlink()        # one left from an earlier measuring would say otherwise
        report["removed"] = str(out)
    report_path(out).write_text(json.dumps(report, indent=2) + "\n")
    return report
