"""Medusa-1 head training: the backbone frozen, the heads fitted to its own text.

Head k at position t is trained on the token k + 2 places ahead (the backbone
itself predicts t + 1), with loss sum_k 0.8^k * CE_k (DESIGN §1). Data is
either the backbone's own greedy answers to a prompt set (self-distillation,
generated first and stored as JSONL) or a text/JSONL corpus.

    python -m medusa_core.train --model DIR --out HEADS_DIR --prompts prompts.jsonl
    python -m medusa_core.train --model DIR --out HEADS_DIR --corpus a.txt b.jsonl
    python -m medusa_core.train --model DIR --out HEADS_DIR --prompts p.jsonl --init-heads OLD_HEADS \
        --root-conditioned --cache-hidden      # heads that also read the root token, warm-started
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from . import train_data
from .heads import HeadsConfig, MedusaHeads
from .heads_io import PROPOSAL_FILE
from .train_data import IGNORE


@dataclass(frozen=True)
class TrainConfig:
    model: str                          # backbone directory (save_pretrained layout)
    out: str                            # heads directory written with save_heads
    prompts: str | None = None          # JSONL {"prompt": ...}: self-distillation
    corpus: tuple[str, ...] = ()        # text files, or JSONL with "text" (or "prompt" + "answer")
    work_dir: str | None = None         # answers, checkpoints, report; default: --out/work
    answers: str | None = None          # self-distilled answers (made if missing); default: WORK_DIR/distill_answers.jsonl
    base_model: str | None = None       # the backbone the heads' config names (default: model)
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
    init_heads: str | None = None       # start from these heads (their layout and proposal vocabulary)
    root_conditioned: bool = False      # heads also read the root token (heads.RootBlock; zero-initialised)
    root_lr: float | None = None        # the root blocks' learning rate (default: lr)
    cache_hidden: bool = False          # hidden states computed once, then `positions` random positions per step
    positions: int = 4096               # positions per step with cache_hidden (batch_size counts sequences otherwise)

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r} is unknown: use float32, bfloat16 or float16")
        if (self.prompts is None) == (not self.corpus):
            raise ValueError("give exactly one data source: --prompts FILE.jsonl (self-distillation) or --corpus FILES")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps {self.steps} and batch_size {self.batch_size} must be at least 1")
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out {self.held_out} must be a fraction in (0, 1)")
        if self.cache_hidden and self.positions < 1:
            raise ValueError(f"positions {self.positions} must be at least 1")


@dataclass(frozen=True)
class Positions:
    """Training positions, flattened: what the heads read at position t and what they must guess."""

    hidden: torch.Tensor     # (N, H) the backbone's last hidden state at t
    root: torch.Tensor       # (N,) the token at t + 1: the backbone's own next token, the tree's root
    targets: torch.Tensor    # (K, N) the token at t + k + 2 for head k; IGNORE where it is no target

    def __len__(self) -> int:
        return self.root.shape[0]

    def select(self, index: torch.Tensor | slice) -> "Positions":
        return Positions(self.hidden[index], self.root[index], self.targets[:, index])


def positions(hidden: torch.Tensor, ids: torch.Tensor, targets: torch.Tensor, num_heads: int) -> Positions:
    """hidden (B, S, H) of ``ids`` (B, S), ``targets`` (B, S) (IGNORE: prompt tokens, padding) ->
    every position where at least one head has a target."""
    batch, length = ids.shape
    shifted = torch.full((num_heads, batch, length), IGNORE, dtype=torch.long, device=ids.device)   # (K, B, S)
    for k in range(num_heads):
        shift = k + 2
        if length > shift:
            shifted[k, :, :length - shift] = targets[:, shift:]
    root = torch.zeros_like(ids)                                                # (B, S); last column: no target
    root[:, :-1] = ids[:, 1:]
    keep = (shifted != IGNORE).any(0)                                           # (B, S)
    return Positions(hidden[keep], root[keep], shifted[:, keep])


@dataclass(frozen=True)
class HeadLoss:
    total: torch.Tensor          # scalar; differentiable unless backward() already ran per head
    per_head: list[float]        # CE of each head
    top1: list[float]            # accuracy of each head's argmax


def head_loss(heads: MedusaHeads, batch: Positions, lm_head: nn.Module,
              decay: float = 0.8, backward: bool = False) -> HeadLoss:
    """Weighted head loss sum_k decay^k CE_k over ``batch``, over the heads' proposal vocabulary if
    they have one (targets outside it are no targets: the heads can never propose them).

    ``backward=True`` back-propagates each head as soon as its loss is known: the hidden states
    are frozen, so the heads' graphs are independent and only one head's (N, V) logits are alive
    at a time (the 7B memory plan).
    """
    total = torch.zeros((), dtype=torch.float32, device=batch.hidden.device)
    per_head, top1 = [], []
    for k in range(min(heads.config.num_heads, batch.targets.shape[0])):
        target = heads.logit_columns(batch.targets[k], IGNORE)                 # (N,)
        valid = target != IGNORE
        if not bool(valid.any()):   # possible in a small batch; a later head may still have targets
            per_head.append(float("nan"))
            top1.append(float("nan"))
            continue
        logits = heads.logits(batch.hidden[valid], lm_head, [k], batch.root[valid])[0].float()   # (n, V or S)
        ce = nn.functional.cross_entropy(logits, target[valid])
        if backward:
            (decay**k * ce).backward()
        total = total + decay**k * (ce.detach() if backward else ce)
        per_head.append(ce.item())
        top1.append((logits.argmax(-1) == target[valid]).float().mean().item())
    return HeadLoss(total, per_head, top1)


@torch.no_grad()
def backbone_hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """(B, S) -> (B, S, H) final (post-norm) hidden states of the frozen backbone."""
    return model.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state


@torch.no_grad()
def rank_counts(heads: MedusaHeads, lm_head: nn.Module, batch: Positions, top_k: int) -> torch.Tensor:
    """-> (K, top_k + 1) counts: column i < top_k counts targets that were head k's rank-i guess,
    the last column targets outside its top_k. Guesses are the decoding step's own (heads.guesses)."""
    counts = torch.zeros(heads.config.num_heads, top_k + 1, dtype=torch.long)
    dtype = next(heads.parameters()).dtype
    for k in range(min(heads.config.num_heads, batch.targets.shape[0])):
        valid = batch.targets[k] != IGNORE                                     # (N,)
        if not bool(valid.any()):
            continue
        guesses = heads.guesses(batch.hidden[valid].to(dtype), lm_head, top_k, [k], batch.root[valid])[0]  # (n, top_k)
        hit = guesses == batch.targets[k][valid][:, None]                       # (n, top_k)
        rank = torch.where(hit.any(-1), hit.long().argmax(-1), top_k)           # (n,)
        counts[k] += torch.bincount(rank.cpu(), minlength=top_k + 1)
    return counts


@torch.no_grad()
def rank_histogram(heads: MedusaHeads, model: nn.Module, batches, top_k: int = 10) -> torch.Tensor:
    """rank_counts over ``batches`` of (ids, targets) (B, S), hidden states from the backbone."""
    lm_head = model.get_output_embeddings()
    counts = torch.zeros(heads.config.num_heads, top_k + 1, dtype=torch.long)
    for ids, targets in batches:
        counts += rank_counts(heads, lm_head, positions(backbone_hidden(model, ids), ids, targets,
                                                        heads.config.num_heads), top_k)
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
        batch = positions(hidden_all[pick], data[0][pick], data[1][pick], heads.config.num_heads)
        loss = head_loss(heads, batch, lm_head, backward=True)
        opt.step()
        losses.append(loss.total.item())
    heads.eval()
    return losses


@torch.no_grad()
def cached_positions(model: nn.Module, rows: Sequence[tuple[list[int], list[int]]], pad: int, num_heads: int,
                     batch_tokens: int = 16384, desc: str = "hidden states") -> Positions:
    """Every training position of ``rows`` with its fp32 hidden state, computed once. Rows go through
    the backbone sorted by length, about ``batch_tokens`` padded tokens per forward, so batches carry
    little padding (SmolLM2's 1.5M answer tokens: ~3.5 GB)."""
    from tqdm import tqdm

    device = model.get_output_embeddings().weight.device
    order = sorted(range(len(rows)), key=lambda i: len(rows[i][0]))
    chunks: list[list[int]] = [[]]
    for i in order:   # ascending lengths: the row being added is the chunk's widest
        if chunks[-1] and (len(chunks[-1]) + 1) * len(rows[i][0]) > batch_tokens:
            chunks.append([])
        chunks[-1].append(i)
    parts = []
    for chunk in tqdm(chunks, desc=desc, mininterval=10):
        ids, targets = padded([rows[i] for i in chunk], pad, device)
        parts.append(positions(backbone_hidden(model, ids).float(), ids, targets, num_heads))
    return Positions(torch.cat([p.hidden for p in parts]), torch.cat([p.root for p in parts]),
                     torch.cat([p.targets for p in parts], dim=1))


def lr_at(step: int, steps: int, lr: float) -> float:
    """Linear warmup over 5% of the steps, then cosine decay to 10%."""
    warmup = max(1, steps // 20)
    return lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))


def train_heads(model: nn.Module, heads: MedusaHeads, rows: list[tuple[list[int], list[int]]],
                held: list[tuple[list[int], list[int]]], config: TrainConfig, pad: int, work: Path) -> dict:
    """The training loop with progress bar, periodic evaluation and resumable checkpoints."""
    from tqdm import tqdm

    device = model.get_output_embeddings().weight.device
    lm_head = model.get_output_embeddings()
    num_heads = heads.config.num_heads
    groups, base_lrs = [{"params": list(heads.heads.parameters())}], [config.lr]
    if heads.root is not None:
        groups.append({"params": list(heads.root.parameters())})
        base_lrs.append(config.lr if config.root_lr is None else config.root_lr)
    # the schedule's peak rates stay with this run's config, not in the optimizer state: a resumed
    # run follows the --lr / --root-lr it was given
    opt = torch.optim.AdamW(groups, lr=config.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(config.seed)
    ckpt_path = work / "checkpoint.pt"
    if config.cache_hidden:
        train_cache = cached_positions(model, rows, pad, num_heads, desc="hidden states (train)")
        held_cache = cached_positions(model, held, pad, num_heads, desc="hidden states (held-out)")
        print(f"cached {len(train_cache):,} training and {len(held_cache):,} held-out positions", flush=True)
    if device.type == "cuda":
        # TF32 matmuls from here on: the heads' vocabulary projections per step dominate, and their
        # gradients do not need fp32's last bits (answers and cached hidden states are made by now)
        torch.backends.cuda.matmul.allow_tf32 = True

    def next_batch() -> Positions:
        if config.cache_hidden:
            return train_cache.select(torch.randint(len(train_cache), (config.positions,), generator=gen).to(device))
        pick = torch.randint(len(rows), (min(config.batch_size, len(rows)),), generator=gen).tolist()
        ids, targets = padded([rows[i] for i in pick], pad, device)
        return positions(backbone_hidden(model, ids).to(next(heads.parameters()).dtype), ids, targets, num_heads)

    def held_counts() -> torch.Tensor:
        if config.cache_hidden:
            return sum((rank_counts(heads, lm_head, held_cache.select(slice(i, i + 8192)), 5)
                        for i in range(0, len(held_cache), 8192)), torch.zeros(num_heads, 6, dtype=torch.long))
        batches = (padded(held[i:i + config.batch_size], pad, device) for i in range(0, len(held), config.batch_size))
        return rank_histogram(heads, model, batches, top_k=5)

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
        counts = held_counts()
        total = counts.sum(1).clamp(min=1)
        heads.train()
        return {"top1": [round(v, 4) for v in (counts[:, 0] / total).tolist()],
                "top5": [round(v, 4) for v in (counts[:, :5].sum(1) / total).tolist()]}

    heads.train()
    bar = tqdm(range(start, config.steps), desc="heads", initial=start, total=config.steps, mininterval=5)
    for step in bar:
        for group, base_lr in zip(opt.param_groups, base_lrs):
            group["lr"] = lr_at(step, config.steps, base_lr)
        batch = next_batch()
        opt.zero_grad(set_to_none=True)
        loss = head_loss(heads, batch, lm_head, config.decay, backward=True)
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
    sizes = {"train_positions": len(train_cache), "held_out_positions": len(held_cache)} if config.cache_hidden else {}
    return {**sizes, "history": history, "final": history[-1] if history else None}


def warm_start(directory: str, model: nn.Module, root_conditioned: bool) -> MedusaHeads:
    """Heads saved in ``directory`` (checked against ``model``, with their proposal vocabulary), given
    zero root blocks if ``root_conditioned`` and they have none: they start exactly where they were."""
    from .heads_io import load_heads_dir

    saved = load_heads_dir(directory, model)
    if not root_conditioned or saved.config.root_conditioned:
        return saved
    heads = MedusaHeads(replace(saved.config, root_conditioned=True))
    heads.heads.load_state_dict(saved.heads.state_dict())
    heads.zero_root_blocks()
    if saved.proposal_ids is not None:
        heads.restrict_proposals(saved.proposal_ids, model.get_output_embeddings())
    return heads


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
                                         config.answer_tokens, Path(config.answers or work / "distill_answers.jsonl"),
                                         config.distill_batch, config.temperatures, config.seed)
    else:
        rows = train_data.corpus_rows(tokenizer, config.corpus, config.seq_len)
    rows, held = train_data.split_rows(rows, config.held_out, config.seed)
    text = model.config.get_text_config()
    lm_head = model.get_output_embeddings()
    if config.init_heads:
        heads = warm_start(config.init_heads, model, config.root_conditioned)
    else:
        heads = MedusaHeads(HeadsConfig(config.num_heads, config.num_layers, text.hidden_size,
                                        lm_head.weight.shape[0], config.own_projection, config.root_conditioned))
        heads.init_from_lm_head(lm_head)
    heads.to(device=lm_head.weight.device, dtype=torch.float32).requires_grad_(True)   # fp32 master weights for AdamW
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    result = train_heads(model, heads, rows, held, config, pad, work)
    # Saved in the backbone's dtype (bf16 for a 7B: half the file), as the loader would cast anyway.
    save_heads(heads.to(lm_head.weight.dtype), config.out, base_model=config.base_model or config.model)
    if heads.proposal_ids is not None:   # trained against that vocabulary: it travels with the heads
        source, target = Path(config.init_heads) / PROPOSAL_FILE, Path(config.out) / PROPOSAL_FILE
        if not target.exists() or not target.samefile(source):
            shutil.copyfile(source, target)
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
    p.add_argument("--init-heads", help="start from these heads (their layout and proposal_vocab.json; "
                                        "--num-heads, --num-layers and --shared-projection are then theirs)")
    p.add_argument("--root-conditioned", action="store_true",
                   help="heads also read the backbone's next token (zero-initialised root blocks; this project's own layout)")
    p.add_argument("--root-lr", type=float, help="learning rate of root-conditioned heads' root blocks (default: --lr)")
    p.add_argument("--cache-hidden", action="store_true",
                   help="compute the backbone's hidden states once (fp32, ~2.3 KB per token for a 576-wide model) "
                        "and train on --positions random positions per step")
    p.add_argument("--positions", type=int, default=4096,
                   help="positions per step with --cache-hidden (which ignores --batch-size)")
    a = p.parse_args(argv)
    main_with_config(TrainConfig(
        model=a.model, out=a.out, prompts=a.prompts, corpus=tuple(a.corpus or ()), work_dir=a.work_dir,
        raw_prompts=a.raw_prompts, num_heads=a.num_heads, num_layers=a.num_layers,
        own_projection=not a.shared_projection, answer_tokens=a.answer_tokens, distill_batch=a.distill_batch,
        temperatures=tuple(a.temperatures), seq_len=a.seq_len, steps=a.steps,
        batch_size=a.batch_size, lr=a.lr, eval_every=a.eval_every, resume=a.resume, load_in_4bit=a.load_in_4bit,
        device=a.device, seed=a.seed, dtype=a.dtype, threads=a.threads, init_heads=a.init_heads,
        root_conditioned=a.root_conditioned, root_lr=a.root_lr, cache_hidden=a.cache_hidden, positions=a.positions,
    ))


if __name__ == "__main__":
    main()
