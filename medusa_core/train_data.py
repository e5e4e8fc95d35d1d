"""Training data for Medusa heads: the backbone's own answers (self-distillation)
or a text/JSONL corpus, as rows of (input ids, target ids) where a target of
IGNORE (prompt tokens) is never trained on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from .generate import DecodeConfig, generate

Row = tuple[list[int], list[int]]

IGNORE = -100  # target id that no head is trained or scored on (prompt tokens, padding)


def read_prompts(path: Path) -> list[str]:
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n} is not JSON ({err}): write one {{\"prompt\": ...}} object per line") from err
        if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
            raise ValueError(f"{path}:{n} has no string \"prompt\": write one {{\"prompt\": ...}} object per line")
        prompts.append(item["prompt"])
    if not prompts:
        raise ValueError(f"{path} holds no prompts: write one {{\"prompt\": ...}} object per line")
    return prompts


def encode_prompt(tokenizer, prompt: str, raw: bool) -> list[int]:
    """Raw text, or the user turn through the tokenizer's chat template with the answer cue."""
    if raw:
        return tokenizer.encode(prompt, add_special_tokens=False)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "the tokenizer has no chat template: pass --raw-prompts and write each prompt in the model's "
            "own prompt format (e.g. vicuna's 'USER: ... ASSISTANT:')"
        )
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def distilled_rows(model: nn.Module, tokenizer, prompts_path: str | Path, raw: bool, answer_tokens: int,
                   answers_path: Path) -> list[Row]:
    """Generate (or reuse from ``answers_path``) the backbone's greedy answer to each prompt
    with the project's own loop (baseline tree), and train only on the answer tokens."""
    from tqdm import tqdm

    prompts = read_prompts(Path(prompts_path))
    done: list[dict] = []
    if answers_path.is_file():
        done = [json.loads(line) for line in answers_path.read_text().splitlines() if line.strip()]
        if [d["prompt"] for d in done] != prompts[:len(done)]:
            raise ValueError(f"{answers_path} holds answers to other prompts: delete it or choose another --work-dir")
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    with open(answers_path, "a") as f:   # appended as we go, so an interrupted run resumes here
        for prompt in tqdm(prompts[len(done):], desc="self-distillation", initial=len(done), total=len(prompts)):
            ids = encode_prompt(tokenizer, prompt, raw)
            answer = [t for s in generate(model, ids, config=DecodeConfig(max_new_tokens=answer_tokens),
                                          stop_ids=eos) for t in s.tokens]
            item = {"prompt": prompt, "prompt_ids": ids, "answer_ids": answer, "answer": tokenizer.decode(answer)}
            f.write(json.dumps(item) + "\n")
            f.flush()
            done.append(item)
    return [answer_row(d["prompt_ids"], d["answer_ids"]) for d in done]


def answer_row(prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> Row:
    ids = [*prompt_ids, *answer_ids]
    return ids, [IGNORE] * len(prompt_ids) + list(answer_ids)


def read_answers(path: Path) -> list[Row]:
    """Rows of a stored self-distillation file (the calibration set for calibrate.py)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `python -m medusa_core.train --prompts ...` first")
    items = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not items or not all("prompt_ids" in d and "answer_ids" in d for d in items):
        raise ValueError(f"{path} is not an answers file with prompt_ids/answer_ids: use the distill_answers.jsonl "
                         "that medusa_core.train writes")
    return [answer_row(d["prompt_ids"], d["answer_ids"]) for d in items]


def corpus_rows(tokenizer, files: Sequence[str], seq_len: int) -> list[Row]:
    """Text files are cut into ``seq_len``-token chunks; JSONL lines give one row each:
    "text" (every token a target) or "prompt" + "answer" (answer tokens only)."""
    rows: list[Row] = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} does not exist: check the --corpus paths")
        if path.suffix == ".jsonl":
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if not line.strip():
                    continue
                item = json.loads(line)
                if "text" in item:
                    ids = tokenizer.encode(item["text"], add_special_tokens=False)[:seq_len]
                    rows.append((ids, ids))
                elif "prompt" in item and "answer" in item:
                    p = tokenizer.encode(item["prompt"], add_special_tokens=False)
                    a = tokenizer.encode(item["answer"], add_special_tokens=False)
                    rows.append(answer_row(p, a[:max(0, seq_len - len(p))]))
                else:
                    raise ValueError(f"{path}:{n} needs \"text\" or \"prompt\" + \"answer\"")
        else:
            ids = tokenizer.encode(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=False)
            rows.extend((ids[i:i + seq_len], ids[i:i + seq_len]) for i in range(0, len(ids) - 8, seq_len))
    rows = [r for r in rows if sum(t != IGNORE for t in r[1]) > 2]
    if not rows:
        raise ValueError(f"the corpus {list(files)} gave no sequence longer than 2 tokens")
    return rows


def split_rows(rows: list[Row], held_out: float, seed: int) -> tuple[list[Row], list[Row]]:
    """A fixed shuffled split: (train, held-out), at least one row each."""
    if len(rows) < 2:
        raise ValueError(f"only {len(rows)} training sequence(s): give more prompts or corpus text")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    n_held = min(len(rows) - 1, max(1, round(held_out * len(rows))))
    return [rows[i] for i in order[n_held:]], [rows[i] for i in order[:n_held]]


def load_backbone_4bit(directory: str, device: str):
    """CUDA: the backbone's linear layers in NF4 (bf16 compute), embeddings and lm_head in bf16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .quantization import bnb_config

    if not device.startswith("cuda"):
        raise ValueError(f"--load-in-4bit needs a CUDA device, got --device {device}: drop --load-in-4bit on CPU")
    model = AutoModelForCausalLM.from_pretrained(directory, quantization_config=bnb_config("nf4", torch.bfloat16),
                                                 dtype=torch.bfloat16,
                                                 device_map={"": device}).eval()
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(directory)
