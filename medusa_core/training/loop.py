"""The head training loop: warm-up and cosine schedule, periodic held-out evaluation and
resumable checkpoints; ``main_with_config`` runs a whole training from a TrainConfig (the command
line is ``python -m medusa_core.train``)."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn

from ..decoding.config import DecodeConfig, SettingError
from ..errors import check_folder, error_line, first_line
from ..heads.accuracy import CALIBRATION_FILE
from ..heads.files import PROPOSAL_FILE, HeadsFiles, check_heads_out, load_heads_files, read_heads_dir
from ..heads.medusa_heads import HeadsConfig, MedusaHeads
from ..loading.hub import backbone_name
from . import data
from .evaluation import rank_counts, rank_histogram
from .loss import Positions, backbone_hidden, cached_positions, head_loss, padded, positions

REPORT_FILE = "train_report.json"   # in the work folder, written after the heads
TREE_FILE = "tree.json"     # calibrate's tree beside the heads (README: --out my-heads/tree.json)
CHECKPOINT_FILE = "checkpoint.pt"   # in the work folder
# how torch.save says a write failed (a full disk: "unexpected pos ..."), as a RuntimeError, not an OSError
TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed", "inline_container")


@dataclass(frozen=True)
class TrainConfig:
    model: str                          # backbone: a directory (save_pretrained layout) or a hub id
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
    # messages name train's own flags (--resume, --work-dir) for how to go on; False under smol_build, which runs
    # training inside its own command, with flags of its own (review)
    train_command: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype {self.dtype!r} is unknown: use float32, bfloat16 or float16")
        if (self.prompts is None) == (not self.corpus):
            raise ValueError("give exactly one data source: --prompts FILE.jsonl (self-distillation) or --corpus FILES")
        if self.num_heads < 1:
            raise ValueError(f"num_heads {self.num_heads}: train at least 1 head (--num-heads)")
        if self.num_layers < 0:
            raise ValueError(f"num_layers {self.num_layers}: give 0 or more residual blocks per head (--num-layers)")
        if self.steps < 1 or self.batch_size < 1:
            raise ValueError(f"steps {self.steps} and batch_size {self.batch_size} must be at least 1")
        if not 0 < self.held_out < 1:
            raise ValueError(f"held_out {self.held_out} must be a fraction in (0, 1)")
        if self.cache_hidden and self.positions < 1:
            raise ValueError(f"positions {self.positions} must be at least 1")
        # each said here, before the load and the distillation (a ZeroDivisionError or torch's traceback came after)
        for flag, value in (("--eval-every", self.eval_every), ("--distill-batch", self.distill_batch),
                            ("--seq-len", self.seq_len)):
            if value < 1:
                raise ValueError(f"{flag} {value} must be at least 1")
        check_answer_tokens(self.answer_tokens)
        for flag, value in (("--lr", self.lr), ("--root-lr", self.root_lr)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ValueError(f"{flag} {value} must be a positive learning rate, e.g. 1e-3")
        for temperature in self.temperatures:
            # the limits sampling has everywhere else (bench, the page, the API): -1 was distilled and trained on (QA16)
            try:
                DecodeConfig(mode="sample", temperature=temperature)
            except SettingError as err:       # named as the flag, as bench names it
                raise ValueError(f"--temperatures {err.problem}") from None
        check_threads(self.threads)


def check_answer_tokens(answer_tokens: int) -> None:
    """ValueError where self-distilled answers would be too short to learn or score the heads on: head k reads a
    position and guesses the token k + 2 past it, so an answer of 1 or 2 tokens gave head 0 a target at most twice
    and the later heads none (review: --answer-tokens 1 trained for the whole run and reported top-1 0)."""
    if answer_tokens < data.MIN_ANSWER:
        raise ValueError(f"--answer-tokens {answer_tokens} must be at least {data.MIN_ANSWER}: shorter answers give "
                         "the heads nothing to learn")


def check_threads(threads: int) -> None:
    # past the cores, threads only wait for each other; far past them torch's pool fails to start (a MemoryError)
    cores = os.cpu_count() or 1
    if not 0 <= threads <= cores:
        raise ValueError(f"--threads {threads}: give 0 (torch's choice) or a count up to this machine's {cores} cores")


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
    ckpt_path = work / CHECKPOINT_FILE
    if config.cache_hidden:
        train_cache = cached_positions(model, rows, pad, num_heads, desc="hidden states (train)")
        held_cache = cached_positions(model, held, pad, num_heads, desc="hidden states (held-out)")
        print(f"cached {len(train_cache):,} training and {len(held_cache):,} held-out positions", flush=True)
    def next_batch() -> Positions:
        if config.cache_hidden:
            return train_cache.select(torch.randint(len(train_cache), (config.positions,), generator=gen).to(device))
        pick = torch.randint(len(rows), (min(config.batch_size, len(rows)),), generator=gen).tolist()
        ids, targets = padded([rows[i] for i in pick], pad, device)
        return positions(backbone_hidden(model, ids).to(next(heads.parameters()).dtype), ids, targets, num_heads)

    def evaluate() -> dict:
        if config.cache_hidden:
            return held_out_accuracy(heads, lambda: (rank_counts(heads, lm_head, held_cache.select(slice(i, i + 8192)), 5)
                                                     for i in range(0, len(held_cache), 8192)))
        batches = (padded(held[i:i + config.batch_size], pad, device) for i in range(0, len(held), config.batch_size))
        return held_out_accuracy(heads, lambda: [rank_histogram(heads, model, batches, top_k=5)])

    def save_checkpoint(done: int) -> None:
        # written beside it, then renamed over it: a run killed mid-save (GBs at 7B) keeps the last whole one
        partial = ckpt_path.with_name(f".{ckpt_path.name}.partial")
        try:
            torch.save({"heads": heads.state_dict(), "optimizer": opt.state_dict(), "generator": gen.get_state(),
                        "step": done, "history": json.dumps(history)}, partial)
        except (OSError, RuntimeError) as err:
            partial.unlink(missing_ok=True)       # it would keep the space it took
            if isinstance(err, RuntimeError) and not any(sign in str(err) for sign in TORCH_WRITE_FAILED):
                raise                             # not a write that failed (a CUDA error): as it is
            raise OSError(f"the checkpoint at step {done} could not be written to {ckpt_path} ({first_line(err)}): "
                          f"free space on its disk{', or give --work-dir on another' if config.train_command else ''}"
                          + (f"; --resume goes on from step {saved}" if saved and config.train_command else "")
                          ) from None
        os.replace(partial, ckpt_path)

    start, history = resume(ckpt_path, heads, opt, gen, device) if config.resume else (0, [])
    if start == config.steps:   # a finished run whose heads were not written (a full disk at the end): written now
        print(f"{ckpt_path} finished its {start} steps: its heads are written without training", flush=True)
    saved = start               # the step of the checkpoint in the work folder, once there is one

    tf32_before = torch.backends.cuda.matmul.allow_tf32
    if device.type == "cuda":
        # TF32 matmuls while training: the heads' vocabulary projections per step dominate, and their
        # gradients do not need fp32's last bits (the answers are made by now; without --cache-hidden each
        # batch's hidden states and the held-out evaluation run in TF32 too). Put back at the end, and on an error:
        # smol_build's later stages in the same process distill and calibrate in true fp32 (review)
        torch.backends.cuda.matmul.allow_tf32 = True
    heads.train()
    bar = tqdm(range(start, config.steps), desc="heads", initial=start, total=config.steps, mininterval=5)
    step = start
    try:
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
                save_checkpoint(done)
                saved = done
    except KeyboardInterrupt:   # one line saying what is kept and how to go on (review: a bare traceback)
        ckpt_path.with_name(f".{ckpt_path.name}.partial").unlink(missing_ok=True)   # cut in the middle of a save
        go_on = ": the same command with --resume goes on from there" if config.train_command else ""
        kept = f"{ckpt_path} keeps step {saved}{go_on}" if saved else \
            f"no checkpoint yet (one is written every {config.eval_every} steps)"
        raise KeyboardInterrupt(f"training at step {step} of {config.steps}; {kept}") from None
    finally:   # an error too (a full disk) leaves TF32 as it was: smol_build's later stages run in this process
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    heads.eval()
    sizes = {"train_positions": len(train_cache), "held_out_positions": len(held_cache)} if config.cache_hidden else {}
    return {**sizes, "history": history, "final": history[-1] if history else None}


def held_out_accuracy(heads: MedusaHeads, counts) -> dict:
    """Top-1 and top-5 accuracy per head from ``counts()``, an iterable of (heads, 6) rank-count
    tensors computed with the heads in eval mode."""
    heads.eval()
    total_counts = sum(counts(), torch.zeros(heads.config.num_heads, 6, dtype=torch.long))
    heads.train()
    total = total_counts.sum(1).clamp(min=1)
    return {"top1": [round(v, 4) for v in (total_counts[:, 0] / total).tolist()],
            "top5": [round(v, 4) for v in (total_counts[:, :5].sum(1) / total).tolist()]}


def resume(ckpt_path: Path, heads: MedusaHeads, opt: torch.optim.Optimizer, gen: torch.Generator,
           device: torch.device) -> tuple[int, list[dict]]:
    """Heads, optimizer and sampling state from the checkpoint (check_resumable said it is there); (its step, its history)."""
    # weights_only: a checkpoint holds tensors and numbers only
    ckpt = torch.load(ckpt_path, map_location=device, weights_only=True)
    ours = heads.state_dict()
    if {k: v.shape for k, v in ckpt["heads"].items()} != {k: v.shape for k, v in ours.items()}:
        # QA: load_state_dict's traceback, its missing and unexpected keys, after the load
        raise ValueError(f"--resume: {ckpt_path} holds {layout(ckpt['heads'])}, and this run builds {layout(ours)}: "
                         "give the flags it was trained with (--num-heads, --num-layers, --shared-projection, "
                         "--root-conditioned), or drop --resume to start fresh")
    heads.load_state_dict(ckpt["heads"])
    opt.load_state_dict(ckpt["optimizer"])
    gen.set_state(ckpt["generator"].cpu())
    print(f"resumed from {ckpt_path} at step {ckpt['step']}", flush=True)
    return ckpt["step"], json.loads(ckpt["history"])


def layout(state: dict) -> str:
    """Heads' layout as a state dict holds it, for a message: "2 heads of 1 block, a shared projection"."""
    blocks = {tuple(k.split(".")[1:3]) for k in state if k.startswith("heads.") and k.endswith(".linear.weight")}
    count = len({k.split(".")[1] for k in state if k.startswith(("heads.", "root."))})
    own = any(k.startswith("heads.") and k.count(".") == 3 and k.endswith(".weight") and ".linear." not in k
              for k in state)
    root = ", reading the root token" if any(k.startswith("root.") for k in state) else ""
    return (f"{count} head{'s' if count != 1 else ''} of {len(blocks) // max(count, 1)} block(s), "
            f"{'each its own' if own else 'a shared'} projection{root}")


def check_resumable(work: Path, steps: int) -> None:
    """FileNotFoundError where --resume has no checkpoint to continue from; ValueError where it is past --steps.
    Said before the backbone loads: the checkpoint's step is read without its tensors."""
    path = work / CHECKPOINT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"--resume given but {path} does not exist: drop --resume to start fresh")
    done = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["step"]
    if done > steps:   # QA: it trained nothing, and wrote the heads again as if it had
        raise ValueError(f"--resume: {path} is at step {done}, past --steps {steps}: give --steps {done} to write its "
                         f"heads, or more to train on")
    if done == steps and finished_step(work) == done:
        # its heads were written (the report comes after them): writing them again removed the tree calibrated
        # for them (review). A run whose last save failed has no report of that step, and writes its heads now
        raise ValueError(f"--resume: {path} is at step {done}, and that run finished and wrote its heads: give "
                         f"--steps above {done} to train on")


def finished_step(work: Path) -> int | None:
    """The last step of the run whose report is in ``work`` (written once its heads are), None where there is none
    or it cannot be read."""
    try:
        history = json.loads((work / REPORT_FILE).read_text())["history"]
        return int(history[-1]["step"])
    except (OSError, ValueError, KeyError, IndexError, TypeError):
        return None


def warm_start(files: HeadsFiles, model: nn.Module, root_conditioned: bool) -> MedusaHeads:
    """Heads read from their folder (checked against ``model``, with their proposal vocabulary), given
    zero root blocks if ``root_conditioned`` and they have none: they start exactly where they were."""
    saved = load_heads_files(files, model)
    if not root_conditioned or saved.config.root_conditioned:
        return saved
    heads = MedusaHeads(replace(saved.config, root_conditioned=True))
    heads.heads.load_state_dict(saved.heads.state_dict())
    heads.zero_root_blocks()
    if saved.proposal_ids is not None:
        heads.restrict_proposals(saved.proposal_ids, model.get_output_embeddings())
    return heads


def remove_stale(out: Path, keep_proposals: bool) -> None:
    """Heads written over others leave nothing of theirs that describes heads: their calibration (the tuner
    would value the new heads' trees by the old heads' accuracies) and tree, and a proposal vocabulary the new
    heads were not trained against (the loader would restrict them to it)."""
    stale = [TREE_FILE, CALIBRATION_FILE, *([] if keep_proposals else [PROPOSAL_FILE])]
    for name in stale:
        if (out / name).is_file():
            (out / name).unlink()
            again = "" if name == PROPOSAL_FILE else " (python -m medusa_core.calibrate measures the new ones)"
            print(f"removed {out / name}: it described the heads this training replaced{again}", flush=True)


def main_with_config(config: TrainConfig) -> dict:
    """Load the backbone, build (or reuse) the data, train, save the heads; returns the report."""
    from ..heads.files import save_heads
    from ..loading.load import load_backbone, load_backbone_dir

    work = Path(config.work_dir or Path(config.out) / "work")
    # said before the load and the self-distillation, which can take hours (QA: these came after it)
    check_folder(config.out)
    check_heads_out(config.out)
    if config.work_dir:
        check_folder(config.work_dir, "--work-dir")
    if config.resume:
        check_resumable(work, config.steps)
    for source in ([config.prompts] if config.prompts else config.corpus):
        if not Path(source).is_file():      # QA: said after the backbone's load, with no fix
            raise ValueError(f"{'--prompts' if config.prompts else '--corpus'} {source} is not a file: give "
                             + ('a JSONL file with one {"prompt": ...} per line' if config.prompts else
                                "text files, or JSONL with a \"text\" per line"))
    # the data read and checked before the load too (review: a bad line was said after minutes of loading a 7B)
    if config.prompts:
        data.read_prompt_items(Path(config.prompts))
    else:
        data.read_corpus(config.corpus)
    init_files = read_heads_dir(config.init_heads) if config.init_heads else None
    torch.manual_seed(config.seed)
    if config.threads:
        torch.set_num_threads(config.threads)
    if config.load_in_4bit:
        if not config.device.startswith("cuda"):
            raise ValueError(f"--load-in-4bit needs a CUDA device, got --device {config.device}: "
                             "drop --load-in-4bit on CPU")
        model, tokenizer = load_backbone(config.model, config.device, "nf4", torch.bfloat16)
    else:
        model, tokenizer = load_backbone_dir(config.model, device=config.device, dtype=getattr(torch, config.dtype))
    work.mkdir(parents=True, exist_ok=True)     # once the backbone loads: a bad --model left an empty folder (QA)
    if not config.resume:   # the report of a run this one replaces: it would read as this run's, finished (--resume)
        (work / REPORT_FILE).unlink(missing_ok=True)
    groups = None
    if config.prompts:
        answers = Path(config.answers or work / "distill_answers.jsonl")
        form = "nf4" if config.load_in_4bit else config.dtype
        try:
            rows = data.distilled_rows(model, tokenizer, config.prompts, config.raw_prompts, config.answer_tokens,
                                       answers, config.distill_batch, config.temperatures, config.seed,
                                       backbone=data.backbone_label(config.model, form))
        except KeyboardInterrupt:   # each answer is kept as it is made (distilled_rows)
            raise KeyboardInterrupt(f"while making the backbone's answers; those made are kept in {answers}, and "
                                    "the same command goes on from there") from None
        groups = data.conversations(answers)      # a prompt's answers stay together: held out, or trained on
    else:
        rows = data.corpus_rows(tokenizer, config.corpus, config.seq_len, config.raw_prompts)
    rows, held = data.split_rows(rows, config.held_out, config.seed, groups)
    text = model.config.get_text_config()
    lm_head = model.get_output_embeddings()
    if init_files is not None:
        heads = warm_start(init_files, model, config.root_conditioned)
    else:
        heads = MedusaHeads(HeadsConfig(config.num_heads, config.num_layers, text.hidden_size,
                                        lm_head.weight.shape[0], config.own_projection, config.root_conditioned))
        heads.init_from_lm_head(lm_head)
    heads.to(device=lm_head.weight.device, dtype=torch.float32).requires_grad_(True)   # fp32 master weights for AdamW
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    result = train_heads(model, heads, rows, held, config, pad, work)
    # Saved in the backbone's dtype (bf16 for a 7B: half the file), as the loader would cast anyway.
    base_model = config.base_model or backbone_name(config.model)
    try:
        save_heads(heads.to(lm_head.weight.dtype), config.out, base_model=base_model)
    except OSError as err:   # a full disk after hours of training: the checkpoint has the heads (review)
        if not config.train_command:
            raise
        raise OSError(f"{error_line(err)}; then the same command with --resume writes the heads from "
                      f"{work / CHECKPOINT_FILE} without training") from None
    if heads.proposal_ids is not None:   # trained against that vocabulary: it travels with the heads
        source, target = Path(config.init_heads) / PROPOSAL_FILE, Path(config.out) / PROPOSAL_FILE
        if not target.exists() or not target.samefile(source):
            shutil.copyfile(source, target)
    remove_stale(Path(config.out), keep_proposals=heads.proposal_ids is not None)
    report = {"config": asdict(config),
              "train_sequences": len(rows), "held_out_sequences": len(held), **result}
    (work / REPORT_FILE).write_text(json.dumps(report, indent=2) + "\n")
    print(trained_line(config, work), flush=True)
    return report


def trained_line(config: TrainConfig, work: Path) -> str:
    """Where the heads are and how to use them, and what the work folder still holds (QA: the command ended
    without a word, leaving a checkpoint several times the heads' size that no document named)."""
    def shown(path: Path) -> str:
        return f"{path.name} ({path.stat().st_size / 2**20:,.0f} MiB, for --resume)" if path.name == CHECKPOINT_FILE \
            else path.name
    kept = ", ".join(shown(path) for path in sorted(work.iterdir()))
    return (f"heads written to {config.out}: chat with them by python launch.py --model {config.model} --heads "
            f"{config.out}, and tune their tree by python -m medusa_core.calibrate (README). {work} keeps {kept}: "
            "delete it once you no longer train these heads")
