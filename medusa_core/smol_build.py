"""Rebuild the CPU default's Medusa heads and tree in ``assets/smollm2/`` end to end:

    python -m medusa_core.smol_build --device cuda            # heads, on a GPU
    python -m medusa_core.smol_build --stages prompts root --device cuda   # root-conditioned heads (after vocab)
    python -m medusa_core.smol_build --stages prompts vocab tree   # on the CPU the app will run on

What each stage took: docs/cpu_default.md, "Rebuilding assets/smollm2" (build_log.json logs it again).

Stages (each writes under --work and --out; run them in order, on the machines that suit them):
  prompts  the chat prompt set (medusa_core.training.prompts: ~3,100 prompts, 14% with a follow-up turn)
  heads    self-distillation: SmolLM2-135M-Instruct (fp32) answers every prompt greedily and once
           sampled at temperature 0.7, in batches (transformers' generate); then 5 Medusa heads that
           share the model's lm_head ("version 2": a 49152x576 projection per head would outweigh the
           model) are trained on those answers (medusa_core.train)
  vocab    the proposal vocabulary: the model answers every 12th prompt greedily and at temperature 0.7
           (192 tokens), and the tokens it uses most (at most 8,192) become
           heads/proposal_vocab.json: the heads guess among those only, a far smaller projection per
           step at no loss of accuracy (MedusaHeads.restrict_proposals; docs/cpu_default.md)
  root     heads that also read the root token (the backbone's own next token, known before the heads
           run): the heads stage's heads plus a zero-initialised block per head, trained on the same
           answers' hidden states (computed once) against the proposal vocabulary (a GPU stage)
  tree     per-head rank accuracies on the hand-written held-out prompts (assets/smollm2/prompts.jsonl),
           then the tree with the most expected tokens per second on *this* machine
           (medusa_core.calibrate --budget auto): run it on the CPU the app will run on

On 2 CPU cores the heads stage would take days (answer generation is slow even batched, and every
training step runs five vocabulary-wide projections forwards and backwards); a GPU does it in minutes.
It is refused off a GPU: the default stages (prompts heads) need --device cuda.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .errors import OneLineParser, check_folder, run_command
from .loading.policy import resolve_device
from .training import tree_search
from .training import prompts as chat_prompts
from .training.loop import TrainConfig, check_answer_tokens, main_with_config, remove_stale
from .loading import smollm2
from .heads.files import save_proposal_vocab

ASSETS = Path(__file__).resolve().parent.parent / "assets" / "smollm2"
STAGES = ("prompts", "heads", "vocab", "root", "tree")


def pool_size() -> int:
    """How many distinct prompts the prompt set draws from (3,117): the most --prompt-count can give."""
    return len(chat_prompts.pool())


@dataclass(frozen=True)
class BuildConfig:
    # every prompt of the pool, shuffled: the same set the former default of 4000 gave (the pool caps it)
    prompt_count: int = field(default_factory=pool_size)
    temperatures: tuple[float, ...] = (0.0, 0.7)
    answer_tokens: int = 320
    distill_batch: int = 1024     # answers generated together on a GPU (transformers' batched generate)
    num_heads: int = 5
    num_layers: int = 1
    steps: int = 1000
    batch_size: int = 32
    lr: float = 1e-3
    eval_every: int = 200
    proposal_vocab: int = 8192        # tokens the heads guess among (measured: docs/cpu_default.md)
    vocab_every: int = 12             # the vocab stage answers every 12th prompt
    vocab_answer_tokens: int = 192
    vocab_batch: int = 48             # answers generated together; small, as the vocab stage runs on a CPU
    root_steps: int = 4000            # root stage: steps of root_positions random answer positions
    root_positions: int = 8192
    root_lr: float = 1e-3             # the new root blocks
    root_heads_lr: float = 3e-4       # the warm-started heads
    root_eval_every: int = 500
    tree_dtype: str = "float32"       # activations between the matmuls
    tree_quant: str = "int4"          # the CPU default's matmuls (loading.resolve_quant): time what serves
    max_budget: int = 16
    seed: int = 0


def run(stages: list[str], work: Path, out: Path, device: str, config: BuildConfig, model_dir: Path | None) -> dict:
    check_stages(stages, device)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "build_log.json"
    log = json.loads(log_path.read_text()) if log_path.is_file() else {}
    log["config"] = asdict(config)
    prompts = work / "prompts.jsonl"
    for stage in stages:
        start = time.perf_counter()
        if stage == "prompts":
            items = chat_prompts.prompt_set(config.prompt_count, config.seed)
            prompts.write_text("".join(json.dumps(i) + "\n" for i in items))
            detail = {"prompts": len(items), "with_followup": sum("followup" in i for i in items)}
        elif stage == "heads":
            if not prompts.is_file():
                raise FileNotFoundError(f"{prompts} is missing: run the prompts stage first (--stages prompts heads)")
            if device.startswith("cuda"):
                torch.backends.cuda.matmul.allow_tf32 = False   # distill in true fp32: the app's exact mode
            report = main_with_config(TrainConfig(
                model=str(model_dir or smollm2.converted_dir()), out=str(out / "heads"), prompts=str(prompts),
                work_dir=str(work), num_heads=config.num_heads, num_layers=config.num_layers, own_projection=False,
                answer_tokens=config.answer_tokens, distill_batch=config.distill_batch,
                temperatures=config.temperatures, steps=config.steps, batch_size=config.batch_size, lr=config.lr,
                eval_every=config.eval_every, device=device, seed=config.seed, base_model=smollm2.HUB_ID,
                train_command=False))
            detail = {"train_sequences": report["train_sequences"], "held_out_sequences": report["held_out_sequences"],
                      "final": report["final"], "history": report["history"]}
        elif stage == "vocab":
            detail = build_proposal_vocab(prompts, work, out / "heads", device, config, model_dir)
        elif stage == "root":
            detail = build_root_heads(prompts, work, out / "heads", device, config, model_dir)
        elif stage == "tree":
            reference = out / "calibration_answers.jsonl"
            quant = config.tree_quant if device == "cpu" else "none"
            if quant != "none" and not reference.is_file():
                # review: the answers made here in their place were the int4 mode's, which every load then scored
                # the int4 mode against (loading/assets.REFERENCE_ANSWERS)
                raise FileNotFoundError(f"{reference} is missing: it holds SmolLM2's fp32 greedy answers, which each "
                                        f"load scores the int4 mode against, and this stage in {quant} would write "
                                        f"{quant}'s there: restore it, or run this stage with --device cuda (fp32)")
            result = tree_search.run(tree_search.CalibrateConfig(
                model=str(model_dir or smollm2.converted_dir()), heads=str(out / "heads"), out=str(out / "tree.json"),
                # the held-out prompts' greedy fp32 answers (reused when present: they are the same on any device)
                prompts=str(ASSETS / "prompts.jsonl"), answers=str(reference),
                answer_tokens=256, budget="auto", max_budget=config.max_budget, timing_count=4, timing_tokens=48,
                dtype=config.tree_dtype, quant=quant, device=device))
            detail = {k: result[k] for k in result if k != "config"}
        else:
            raise ValueError(f"stage {stage!r} is unknown: use {', '.join(STAGES)}")
        if stage in ("heads", "vocab", "root"):
            # the tree and accuracies beside heads/ are the old heads' (training cleans only heads/ itself): the
            # loader would tune the new heads' trees by them (review); the tree stage measures them again
            remove_stale(out, keep_proposals=True)
        seconds = time.perf_counter() - start
        log[stage] = {"seconds": round(seconds, 1), "device": _device_name(device), **detail}
        log_path.write_text(json.dumps(log, indent=2) + "\n")
        print(f"stage {stage}: {seconds:.0f} s", flush=True)
    return log


def build_proposal_vocab(prompts: Path, work: Path, heads_dir: Path, device: str, config: BuildConfig,
                         model_dir: Path | None) -> dict:
    """The model's own answers to a slice of the prompts -> the ``config.proposal_vocab`` tokens it
    uses most, written beside the heads; returns what the build log keeps."""
    from .loading.load import load_backbone_dir
    from .training.data import IGNORE, backbone_label, distilled_rows

    if not prompts.is_file():
        raise FileNotFoundError(f"{prompts} is missing: run the prompts stage first (--stages prompts vocab)")
    if not heads_dir.is_dir():
        raise FileNotFoundError(f"{heads_dir} is missing: run the heads stage first, or pass --out with heads/ in it")
    lines = prompts.read_text().splitlines()[::config.vocab_every]
    sliced = work / "vocab_prompts.jsonl"
    sliced.write_text("".join(line + "\n" for line in lines))
    backbone = model_dir or smollm2.converted_dir()
    model, tokenizer = load_backbone_dir(backbone, device)
    rows = distilled_rows(model, tokenizer, sliced, False, config.vocab_answer_tokens, work / "vocab_answers.jsonl",
                          batch_size=config.vocab_batch, temperatures=config.temperatures, seed=config.seed,
                          backbone=backbone_label(str(backbone), "float32"))
    answers = [[t for t in targets if t != IGNORE] for _, targets in rows]
    ids, coverage = most_used(answers, config.proposal_vocab)
    about = {"about": "the tokens SmolLM2-135M-Instruct used most in its own answers; the heads guess among these",
             "answers": len(answers), "tokens": sum(map(len, answers)), "coverage": round(coverage, 4)}
    save_proposal_vocab(heads_dir, ids, about)
    return {"proposal_vocab": len(ids), **{k: about[k] for k in ("answers", "tokens", "coverage")}}


def build_root_heads(prompts: Path, work: Path, heads_dir: Path, device: str, config: BuildConfig,
                     model_dir: Path | None) -> dict:
    """Root-conditioned heads (heads.RootBlock) warm-started from the heads stage's, trained on cached
    hidden states of the same answers against the proposal vocabulary; written over ``heads_dir``.
    Unconditioned heads found in ``heads_dir`` (a fresh heads or vocab stage) are first copied to
    work/unconditioned_heads, so running this stage again starts from them, not from its own output."""
    base = work / "unconditioned_heads"
    if not (heads_dir / "proposal_vocab.json").is_file():
        raise FileNotFoundError(f"{heads_dir} has no proposal_vocab.json: run the heads and vocab stages first")
    if not json.loads((heads_dir / "config.json").read_text()).get("root_conditioned"):
        if base.is_dir():   # an older copy: these heads are the newer start
            shutil.rmtree(base)
        shutil.copytree(heads_dir, base)
    elif not base.is_dir():
        raise ValueError(f"{heads_dir} already holds root-conditioned heads and {base} is missing: "
                         f"run the heads and vocab stages first, or copy the unconditioned heads to {base}")
    answers = work / "distill_answers.jsonl"
    if not answers.is_file():
        raise FileNotFoundError(f"{answers} is missing: the root stage trains on the heads stage's answers; run it first")
    report = main_with_config(TrainConfig(
        model=str(model_dir or smollm2.converted_dir()), out=str(heads_dir), prompts=str(prompts),
        work_dir=str(work / "root"), answers=str(answers), answer_tokens=config.answer_tokens,
        distill_batch=config.distill_batch, temperatures=config.temperatures, init_heads=str(base),
        root_conditioned=True, cache_hidden=True, positions=config.root_positions, steps=config.root_steps,
        lr=config.root_heads_lr, root_lr=config.root_lr, eval_every=config.root_eval_every, device=device,
        seed=config.seed, base_model=smollm2.HUB_ID, train_command=False))
    return {k: report[k] for k in ("train_sequences", "held_out_sequences", "train_positions",
                                   "held_out_positions", "final", "history")}


def check_stages(stages: list[str], device: str) -> None:
    """ValueError, before any stage, for the heads stage off a GPU: the help says it would take days on 2 CPU
    cores, and the bare command (its default stages include heads) started it there without a word (QA16)."""
    if "heads" in stages and not device.startswith("cuda"):
        raise ValueError(f"the heads stage on --device {device} would take days (self-distillation of every prompt, "
                         "then vocabulary-wide training): run it with --device cuda on a GPU machine, or "
                         "--stages prompts vocab tree on the CPU")


def most_used(answers: list[list[int]], size: int) -> tuple[list[int], float]:
    """The ``size`` most frequent token ids over ``answers``, most frequent first (ties: lower id
    first), and the share of all answer tokens they cover."""
    counts = Counter(t for answer in answers for t in answer)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    total = sum(counts.values())
    return ranked, (sum(counts[t] for t in ranked) / total if total else 0.0)


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_core.smol_build", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", nargs="+", choices=STAGES, default=["prompts", "heads"])
    p.add_argument("--work", default="out/smol_build", help="prompts, answers, checkpoints")
    p.add_argument("--out", default=str(ASSETS), help="heads/, tree.json and build_log.json go here")
    p.add_argument("--model", help="converted SmolLM2 directory (default: converted from the installed package)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=BuildConfig.steps)
    p.add_argument("--prompt-count", type=int, default=pool_size(),
                   help="prompts drawn from the prompt set for the heads (default: all %(default)s)")
    p.add_argument("--answer-tokens", type=int, default=BuildConfig.answer_tokens)
    p.add_argument("--eval-every", type=int, default=BuildConfig.eval_every)
    p.add_argument("--root-steps", type=int, default=BuildConfig.root_steps)
    p.add_argument("--root-positions", type=int, default=BuildConfig.root_positions)
    a = p.parse_args(argv)
    for flag in ("steps", "prompt_count", "eval_every", "root_steps", "root_positions"):
        if getattr(a, flag) < 1:      # a negative --prompt-count dropped prompts from the end without a word
            p.error(f"--{flag.replace('_', '-')} {getattr(a, flag)} must be at least 1")
    try:                              # the train stage refused it, after the stages before it had run
        check_answer_tokens(a.answer_tokens)
    except ValueError as err:
        p.error(str(err))
    if a.prompt_count > (most := pool_size()):      # 999999 built the 3,117 there are, without a word
        p.error(f"--prompt-count {a.prompt_count} is more than the {most} prompts the prompt set holds: give at most "
                f"{most}")
    for flag in ("work", "out"):    # mkdir's "File exists" named no flag and no fix
        try:
            check_folder(getattr(a, flag), f"--{flag}")
        except ValueError as err:
            p.error(str(err))
    config = BuildConfig(steps=a.steps, prompt_count=a.prompt_count, answer_tokens=a.answer_tokens,
                         eval_every=a.eval_every, root_steps=a.root_steps, root_positions=a.root_positions)
    # the device is checked before the first stage: a stage's output must not be written by a run that cannot finish
    return run_command(lambda: run(a.stages, Path(a.work), Path(a.out), resolve_device(a.device), config,
                                   Path(a.model) if a.model else None))


if __name__ == "__main__":
    sys.exit(main())
