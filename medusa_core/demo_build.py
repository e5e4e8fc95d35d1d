"""Rebuild the demo model in ``assets/demo/`` end to end, on CPU, from the Python
standard library's own source (license-clean and present on every machine):

    python -m medusa_core.demo_build            # ~20-30 min on 2 CPU cores

Stages (each writes under --out; ``--from-stage`` restarts from one):
  1 corpus     the stdlib's .py files in a fixed order (no test suites); every
               ``HOLDOUT_EVERY``-th file is held out for evaluation prompts
  2 tokenizer  byte-level BPE (vocab 4096) trained with ``tokenizers``, saved
               as a transformers tokenizer with bos/eos/pad
  3 backbone   a small LlamaForCausalLM pretrained from scratch on the corpus
  4 heads      self-distillation: the backbone's own greedy continuations of
               corpus snippets, then Medusa heads trained on them (train.py)
  5 tree       per-head rank accuracies and the default tree (calibrate.py)

The stdlib differs between Python versions, so the corpus (and the model) is
deterministic for a given Python version, not across versions.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from . import calibrate, train
from .loading import load_backbone_dir

HOLDOUT_EVERY = 40
SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}
BOS, EOS, PAD = "<s>", "</s>", "<pad>"


@dataclass(frozen=True)
class DemoConfig:
    vocab_size: int = 4096
    hidden_size: int = 128
    num_layers: int = 8
    intermediate_size: int = 384
    num_attention_heads: int = 2
    max_positions: int = 1024
    seq_len: int = 128            # pretraining window
    batch_size: int = 16
    pretrain_steps: int = 1600
    lr: float = 3e-3
    distill_prompts: int = 1000   # corpus snippets the backbone continues for the heads
    prompt_tokens: int = 32
    answer_tokens: int = 96
    head_steps: int = 1200
    head_batch_size: int = 16
    head_lr: float = 2e-3
    own_projection: bool = True   # Medusa-1 layout: each head has its own vocabulary projection
    num_heads: int = 5
    tree_budget: str = "auto"     # calibrate.py: a node count or "auto"
    seed: int = 0


def stdlib_files() -> tuple[list[Path], list[Path]]:
    """(train files, held-out files) of the stdlib source, sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if not SKIP_DIRS & set(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if len(files) < 100:
        raise RuntimeError(f"found only {len(files)} .py files under {root}: the demo needs the stdlib source installed")
    held = [p for i, p in enumerate(files) if i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2]
    return [p for p in files if p not in held], held


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def build_tokenizer(texts: list[str], vocab_size: int, out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.save_pretrained(out)
    return fast


def pretrain(cfg: DemoConfig, tokens: torch.Tensor, tokenizer, out: Path) -> float:
    """Next-token pretraining on random windows of the concatenated corpus; returns seconds."""
    from tqdm import tqdm
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(cfg.seed)
    config = LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads, max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(cfg.seed)
    warmup = max(1, cfg.pretrain_steps // 20)
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.pretrain_steps), desc="pretrain", mininterval=10)
    for step in bar:
        # linear warmup, cosine decay to 10%: the usual schedule for a short run
        frac = min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / cfg.pretrain_steps)))
        for group in opt.param_groups:
            group["lr"] = cfg.lr * frac
        starts = torch.randint(len(tokens) - cfg.seq_len, (cfg.batch_size,), generator=gen)
        batch = torch.stack([tokens[s:s + cfg.seq_len] for s in starts.tolist()])   # (B, S)
        loss = model(input_ids=batch, labels=batch).loss   # the model shifts labels itself
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 20 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    seconds = time.perf_counter() - t0
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)  # bf16: half the size
    tokenizer.save_pretrained(out)
    return seconds


def snippets(texts: list[str], tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """``count`` windows of ``length`` tokens, each starting at a line start in a random file."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        text = texts[rng.randrange(len(texts))]
        lines = text.splitlines(keepends=True)
        if len(lines) < 20:
            continue
        start = rng.randrange(len(lines) - 10)
        ids = tokenizer.encode("".join(lines[start:start + 60]), add_special_tokens=False)
        if len(ids) >= length:
            out.append(ids[:length])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m medusa_core.demo_build", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="assets/demo", help="output directory")
    parser.add_argument("--from-stage", type=int, default=1, choices=range(1, 6),
                        help="restart from this stage, reusing the earlier stages' outputs in --out")
    parser.add_argument("--work", default="out/demo_build",
                        help="distillation data, checkpoints and reports that are not shipped")
    parser.add_argument("--stop-after", type=int, default=5, choices=range(1, 6), help="last stage to run")
    parser.add_argument("--pretrain-steps", type=int, default=DemoConfig.pretrain_steps)
    parser.add_argument("--head-steps", type=int, default=DemoConfig.head_steps)
    args = parser.parse_args(argv)
    cfg = DemoConfig(pretrain_steps=args.pretrain_steps, head_steps=args.head_steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "build_log.json"
    log = json.loads(log_path.read_text()) if args.from_stage > 1 and log_path.is_file() else {}
    log["config"] = asdict(cfg)
    log["python"] = sys.version.split()[0]
    t_all = time.perf_counter()

    train_files, held_files = stdlib_files()
    train_texts = [read(p) for p in train_files]
    held_texts = [read(p) for p in held_files]
    log["corpus"] = {"train_files": len(train_files), "held_out_files": len(held_files),
                     "train_bytes": sum(len(t.encode()) for t in train_texts)}
    backbone_dir = out / "backbone"

    if args.from_stage <= 3:
        t0 = time.perf_counter()
        tokenizer = build_tokenizer(train_texts, cfg.vocab_size, backbone_dir)
        log["tokenizer_seconds"] = round(time.perf_counter() - t0, 1)
        ids = tokenizer(train_texts, add_special_tokens=False)["input_ids"]
        tokens = torch.tensor([t for doc in ids for t in [tokenizer.eos_token_id, *doc]])
        log["corpus"]["train_tokens"] = len(tokens)
        print(f"corpus: {len(train_files)} files, {len(tokens)} tokens", flush=True)
        log["pretrain_seconds"] = round(pretrain(cfg, tokens, tokenizer, backbone_dir), 1)
        log_path.write_text(json.dumps(log, indent=2) + "\n")
    if args.stop_after <= 3:
        return

    model, tokenizer = load_backbone_dir(backbone_dir)
    # Evaluation prompts: raw snippets of held-out files, never seen in any training stage.
    held_prompts = snippets(held_texts, tokenizer, 12, 48, seed=cfg.seed + 1)
    with open(out / "prompts.jsonl", "w") as f:
        for p in held_prompts:
            f.write(json.dumps({"prompt": tokenizer.decode(p)}) + "\n")

    heads_dir = out / "heads"
    work = Path(args.work)
    if args.from_stage <= 4:
        t0 = time.perf_counter()
        prompts = snippets(train_texts, tokenizer, cfg.distill_prompts, cfg.prompt_tokens, seed=cfg.seed)
        prompt_file = work / "distill_prompts.jsonl"
        prompt_file.parent.mkdir(parents=True, exist_ok=True)
        with open(prompt_file, "w") as f:
            for p in prompts:
                f.write(json.dumps({"prompt": tokenizer.decode(p)}) + "\n")
        result = train.main_with_config(train.TrainConfig(
            model=str(backbone_dir), out=str(heads_dir), work_dir=str(work), prompts=str(prompt_file),
            raw_prompts=True, num_heads=cfg.num_heads, num_layers=1, own_projection=cfg.own_projection,
            answer_tokens=cfg.answer_tokens, steps=cfg.head_steps, batch_size=cfg.head_batch_size, lr=cfg.head_lr,
            eval_every=300, seed=cfg.seed,
        ))
        log["heads_seconds"] = round(time.perf_counter() - t0, 1)
        log["heads_eval"] = result
        log_path.write_text(json.dumps(log, indent=2) + "\n")

    t0 = time.perf_counter()
    # A separate calibration set (other snippets, same files): accuracies measured on the heads'
    # training data would be optimistic.
    cal_file = work / "calibration_prompts.jsonl"
    cal_file.parent.mkdir(parents=True, exist_ok=True)
    with open(cal_file, "w") as f:
        for p in snippets(train_texts, tokenizer, 48, cfg.prompt_tokens, seed=cfg.seed + 2):
            f.write(json.dumps({"prompt": tokenizer.decode(p)}) + "\n")
    report = calibrate.run(calibrate.CalibrateConfig(
        model=str(backbone_dir), heads=str(heads_dir), prompts=str(cal_file), raw_prompts=True,
        answers=str(work / "calibration_answers.jsonl"), answer_tokens=cfg.answer_tokens,
        out=str(out / "tree.json"), budget=cfg.tree_budget,
    ))
    log["calibrate_seconds"] = round(time.perf_counter() - t0, 1)
    log["calibration"] = report
    log["total_seconds_this_run"] = round(time.perf_counter() - t_all, 1)
    log_path.write_text(json.dumps(log, indent=2) + "\n")
    print(f"demo model written to {out} in {log['total_seconds_this_run']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
