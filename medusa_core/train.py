"""Medusa-1 head training: the backbone frozen, the heads fitted to its own text.

Head k at position t is trained on the token k + 2 places ahead (the backbone
itself predicts t + 1), with loss sum_k 0.8^k * CE_k (DESIGN §1). Data is
either the backbone's own greedy answers to a prompt set (self-distillation,
generated first and stored as JSONL) or a text/JSONL corpus.

    python -m medusa_core.train --model DIR --out HEADS_DIR --prompts prompts.jsonl
    python -m medusa_core.train --model DIR --out HEADS_DIR --corpus a.txt b.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from . import train_data
from .heads import HeadsConfig, MedusaHeads
from .train_data import IGNORE


@dataclass(frozen=True)
class TrainConfig:
    model: str                          # backbone directory (save_pretrained layout)
    out: str                            # heads directory written with save_heads
    prompts: str | None = None          # JSONL {"prompt": ...}: self-distillation
    corpus: tuple[str, ...] = ()        # text files, or JSONL with "text" (or "prompt" + "answer")
    work_dir: str | None = None         # answers, checkpoints, report; default: --out/work
    raw_prompts: bool = False           # prompts are fed as raw text, not through the chat template
    num_heads: int = 5
    num_layers: int = 1
    own_projection: bool = True         # False: heads reuse the backbone's lm_head ("version 2")
    answer_tokens: int = 256            # tokens generated per answer (at most)
    distill_batch: int = 1              # answers generated together (transformers' batched generate if > 1)
    temperatures: tuple[float, ...] = (0.0,)   # one answer per prompt and temperature (0: greedy)
    seq_len: int = 512                  # corpus chunk length
    steps: int = 1000
    batch_size: int = 8
    lr: float = 1e-3
    decay: float = 0.8                  # lambda_k = decay**k
    eval_every: int = 200
    held_out: float = 0.05              # fraction of sequences kept for top-1/top-5 evaluation
    resume: bool = False
    load_in_4bit: bool = False          # CUDA: NF4 backbone via bitsandbytes
    device: str = "cpu"
    seed: int = 0
    dtype: str = "float32"              # backbone compute dtype (distillation and hidden states); heads train in fp32
    threads: int = 0                    # CPU threads for torch (0: torch's default)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r} is unknown: use float32, bfloat16 or float16")
        if (self.prompts is None) == (not self.corpus):
            raise ValueError("give exactly one data source: --prompts FILE.jsonl (self-distillation) or --corpus FILES")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps {self.steps} and batch_size {self.batch_size} must be at least 1")
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out {self.held_out} must be a fraction in (0, 1)")


@dataclass(frozen=True)
class HeadLoss:
    total: torch.Tensor          # scalar; differentiable unless backward() already ran per head
    per_head: list[float]        # CE of each head
    top1: list[float]            # accuracy of each head's argmax


def head_loss(heads: MedusaHeads, hidden: torch.Tensor, ids: torch.Tensor, lm_head: nn.Module,
              decay: float = 0.8, backward: bool = False) -> HeadLoss:
    """hidden (B, S, H) last hidden states of ``ids`` (B, S) -> weighted head loss.

    ``ids`` equal to IGNORE are not targets. ``backward=True`` back-propagates each head
    as soon as its loss is known: the hidden states are frozen, so the heads' graphs are
    independent and only one head's (B, S, V) logits are alive at a time (the 7B memory plan).
    """
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    per_head, top1 = [], []
    for k, head in enumerate(heads.heads):
        shift = k + 2
        if ids.shape[1] <= shift:
            break
        x = head(hidden[:, :-shift])
        logits = (x if heads.config.own_projection else lm_head(x.to(lm_head.weight.dtype))).float()  # (B, S-shift, V)
        target = ids[:, shift:]                                                # (B, S-shift)
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE)
        if backward:
            (decay**k * ce).backward()
        total = total + decay**k * (ce.detach() if backward else ce)
        valid = target != IGNORE
        per_head.append(ce.item())
        top1.append(((logits.argmax(-1) == target) & valid).sum().item() / max(1, valid.sum().item()))
    return HeadLoss(total, per_head, top1)


@torch.no_grad()
def backbone_hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(B, S) -> (B, S, H) final (post-norm) hidden states of the frozen backbone."""
    return model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state


@torch.no_grad()
def rank_histogram(heads: MedusaHeads, model: nn.Module, batches, top_k: int = 10) -> torch.Tensor:
    """-> (K, top_k + 1) counts: column i < top_k counts targets that were head k's rank-i
    guess, the last column targets outside its top_k. ``batches`` yields (ids, targets) (B, S)."""
    lm_head = model.get_output_embeddings()
    counts = torch.zeros(heads.config.num_heads, top_k + 1, dtype=torch.long)
    for ids, targets in batches:
        hidden = backbone_hidden(model, ids).to(next(heads.parameters()).dtype)
        for k in range(heads.config.num_heads):
            shift = k + 2
            # the decoding step's own guesses (its proposal vocabulary, if the heads have one)
            guesses = heads.guesses(hidden[:, :-shift], lm_head, top_k, [k])[0]  # (B, S-shift, top_k)
            target = targets[:, shift:]                                          # (B, S-shift)
            hit = guesses == target[..., None]                                   # (B, S-shift, top_k)
            valid = target != IGNORE
            rank = torch.where(hit.any(-1), hit.long().argmax(-1), top_k)[valid]  # (N,)
            counts[k] += torch.bincount(rank.cpu(), minlength=top_k + 1)
    return counts


def padded(rows: Sequence[tuple[list[int], list[int]]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[(ids, targets)] of any lengths -> (ids, targets) (B, S_max), padded on the right."""
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    targets = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (i, t) in enumerate(rows):
        ids[r, :len(i)] = torch.tensor(i)
        targets[r, :len(t)] = torch.tensor(t)
    return ids.to(device), targets.to(device)


def fit_heads(
    model: nn.Module,
    heads: MedusaHeads,
    sequences: Sequence[Sequence[int]],
    steps: int = 200,
    lr: float = 1e-3,
    batch_size: int = 8,
    seed: int = 0,
) -> list[float]:
    """Train ``heads`` on token sequences of the backbone's own text (every token a target);
    returns the loss curve. Hidden states are computed once: for small in-memory data sets."""
    device = model.get_output_embeddings().weight.device
    data = padded([(list(s), list(s)) for s in sequences], pad=0, device=device)
    hidden_all = torch.cat([backbone_hidden(model, data[0][i:i + batch_size]) for i in range(0, len(data[0]), batch_size)])
    lm_head = model.get_output_embeddings()
    opt = torch.optim.AdamW(heads.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    heads.train()
    for _ in range(steps):
        pick = torch.randint(len(data[0]), (min(batch_size, len(data[0])),), generator=gen)
        opt.zero_grad()
        loss = head_loss(heads, hidden_all[pick], data[1][pick], lm_head, backward=True)
        opt.step()
        losses.append(loss.total.item())
    heads.eval()
    return losses


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warmup over 5% of the steps, then cosine decay to 10%."""
    warmup = max(1, steps // 20)
    return lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))


def train_heads(model: nn.Module, heads: MedusaHeads, rows: list[tuple[list[int], list[int]]],
                held: list[tuple[list[int], list[int]]], config: TrainConfig, pad: int, work: Path) -> dict:
    """The training loop with progress bar, periodic evaluation and resumable checkpoints."""
    from tqdm import tqdm

    device = model.get_output_embeddings().weight.device
    if device.type == "cuda":
        # TF32 matmuls: the heads' five vocabulary projections per step dominate, and their gradients
        # do not need fp32's last bits (the distilled answers were generated before this point)
        torch.backends.cuda.matmul.allow_tf32 = True
    lm_head = model.get_output_embeddings()
    opt = torch.optim.AdamW(heads.parameters(), lr=config.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(config.seed)
    ckpt_path = work / "checkpoint.pt"
    start, history = 0, []
    if config.resume and ckpt_path.is_file():
        # weights_only: a checkpoint holds tensors and numbers only
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=True)
        heads.load_state_dict(ckpt["heads"])
        opt.load_state_dict(ckpt["optimizer"])
        gen.set_state(ckpt["generator"].cpu())
        start, history = ckpt["step"], json.loads(ckpt["history"])
        print(f"resumed from {ckpt_path} at step {start}", flush=True)
    elif config.resume:
        raise FileNotFoundError(f"--resume given but {ckpt_path} does not exist: drop --resume to start fresh")

    def evaluate() -> dict:
        heads.eval()
        batches = (padded(held[i:i + config.batch_size], pad, device) for i in range(0, len(held), config.batch_size))
        counts = rank_histogram(heads, model, batches, top_k=5)
        total = counts.sum(1).clamp(min=1)
        heads.train()
        return {"top1": [round(v, 4) for v in (counts[:, 0] / total).tolist()],
                "top5": [round(v, 4) for v in (counts[:, :5].sum(1) / total).tolist()]}

    heads.train()
    bar = tqdm(range(start, config.steps), desc="heads", initial=start, total=config.steps, mininterval=5)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, config.steps, config.lr)
        pick = torch.randint(len(rows), (min(config.batch_size, len(rows)),), generator=gen).tolist()
        ids, targets = padded([rows[i] for i in pick], pad, device)
        hidden = backbone_hidden(model, ids).to(next(heads.parameters()).dtype)
        opt.zero_grad(set_to_none=True)
        loss = head_loss(heads, hidden, targets, lm_head, config.decay, backward=True)
        opt.step()
        # the batch's own top-1 flatters (the heads just trained on it): show the last held-out figure
        held_top1 = f"{history[-1]['top1'][0]:.2f}" if history else "-"
        bar.set_postfix(loss=f"{loss.total.item():.3f}", held_out_top1=held_top1, refresh=False)
        done = step + 1
        if done % config.eval_every == 0 or done == config.steps:
            result = {"step": done, "loss": round(loss.total.item(), 4), **evaluate()}
            history.append(result)
            tqdm.write(f"step {done}: held-out top-1 {result['top1']} top-5 {result['top5']}")
            torch.save({"heads": heads.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                        "step": done, "history": json.dumps(history)}, ckpt_path)
    heads.eval()
    return {"history": history, "final": history[-1] if history else None}


def main_with_config(config: TrainConfig) -> dict:
    """Load the backbone, build (or reuse) the data, train, save the heads; returns the report."""
    from .loading import load_backbone_dir, save_heads

    torch.manual_seed(config.seed)
    if config.threads:
        torch.set_num_threads(config.threads)
    work = Path(config.work_dir or Path(config.out) / "work")
    work.mkdir(parents=True, exist_ok=True)
    if config.load_in_4bit:
        model, tokenizer = train_data.load_backbone_4bit(config.model, config.device)
    else:
        model, tokenizer = load_backbone_dir(config.model, device=config.device, dtype=getattr(torch, config.dtype))
    if config.prompts:
        rows = train_data.distilled_rows(model, tokenizer, config.prompts, config.raw_prompts,
                                         config.answer_tokens, work / "distill_answers.jsonl",
                                         config.distill_batch, config.temperatures, config.seed)
    else:
        rows = train_data.corpus_rows(tokenizer, config.corpus, config.seq_len)
    rows, held = train_data.split_rows(rows, config.held_out, config.seed)
    text = model.config.get_text_config()
    lm_head = model.get_output_embeddings()
    heads = MedusaHeads(HeadsConfig(config.num_heads, config.num_layers, text.hidden_size,
                                    lm_head.weight.shape[0], config.own_projection))
    heads.init_from_lm_head(lm_head)
    heads.to(device=lm_head.weight.device, dtype=torch.float32)   # fp32 master weights for AdamW
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    result = train_heads(model, heads, rows, held, config, pad, work)
    # Saved in the backbone's dtype (bf16 for a 7B: half the file), as the loader would cast anyway.
    save_heads(heads.to(lm_head.weight.dtype), config.out, base_model=config.model)
    report = {"config": asdict(config),
              "train_sequences": len(rows), "held_out_sequences": len(held), **result}
    (work / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m medusa_core.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="backbone directory (save_pretrained layout with tokenizer)")
    p.add_argument("--out", required=True, help="directory for the trained heads")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help="JSONL of {\"prompt\": ...}: train on the backbone's own greedy answers")
    src.add_argument("--corpus", nargs="+", help="text files, or JSONL with \"text\" (or \"prompt\" + \"answer\")")
    p.add_argument("--work-dir", help="answers, checkpoints and report (default: OUT/work)")
    p.add_argument("--raw-prompts", action="store_true", help="feed prompts as raw text, not via the chat template")
    p.add_argument("--num-heads", type=int, default=5)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--shared-projection", action="store_true", help="heads reuse the backbone's lm_head")
    p.add_argument("--answer-tokens", type=int, default=256)
    p.add_argument("--distill-batch", type=int, default=1,
                   help="answers generated together (> 1: transformers' batched generate, needed for follow-up turns)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0],
                   help="one answer per prompt and temperature (0: greedy)")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=200, help="held-out top-1/top-5 and a checkpoint every N steps")
    p.add_argument("--resume", action="store_true", help="continue from WORK_DIR/checkpoint.pt")
    p.add_argument("--load-in-4bit", action="store_true", help="CUDA: load the backbone in NF4 (bitsandbytes)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="backbone compute dtype for distillation and hidden states (heads train in float32)")
    p.add_argument("--threads", type=int, default=0, help="CPU threads for torch (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    main_with_config(TrainConfig(
        model=a.model, out=a.out, prompts=a.prompts, corpus=tuple(a.corpus or ()), work_dir=a.work_dir,
        raw_prompts=a.raw_prompts, num_heads=a.num_heads, num_layers=a.num_layers,
        own_projection=not a.shared_projection, answer_tokens=a.answer_tokens, distill_batch=a.distill_batch,
        temperatures=tuple(a.temperatures), seq_len=a.seq_len, steps=a.steps,
        batch_size=a.batch_size, lr=a.lr, eval_every=a.eval_every, resume=a.resume, load_in_4bit=a.load_in_4bit,
        device=a.device, seed=a.seed, dtype=a.dtype, threads=a.threads,
    ))


if __name__ == "__main__":
    main()
