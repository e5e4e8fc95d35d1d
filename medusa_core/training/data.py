"""Training data for Medusa heads: the backbone's own answers (self-distillation)
or a text/JSONL corpus, as rows of (input ids, target ids) where a target of
IGNORE (prompt tokens) is never trained on.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..decoding.config import DecodeConfig
from ..decoding.generate import generate
from ..loading.hub import backbone_name

Row = tuple[list[int], list[int]]

IGNORE = -100  # target id that no head is trained or scored on (prompt tokens, padding)


def read_jsonl(path: Path, fix: str) -> list[tuple[int, dict]]:
    """(line number, object) of a JSONL file, blank lines skipped; a line that is not a JSON object is
    a ValueError naming the file, the line and ``fix``."""
    items = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:   # a subclass of ValueError, whose text named neither the file nor the fix
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}): save it as UTF-8 and {fix}") from None
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{n} is not JSON ({err}): {fix}") from None
        if not isinstance(item, dict):
            raise ValueError(f"{path}:{n} is not a JSON object: {fix}")
        items.append((n, item))
    return items


def read_prompts(path: Path) -> list[str]:
    fix = 'write one {"prompt": ...} object per line'
    prompts = []
    for n, item in read_jsonl(path, fix):
        if not isinstance(item.get("prompt"), str):
            raise ValueError(f"{path}:{n} has no string \"prompt\": {fix}")
        if not item["prompt"].strip():   # QA: bench's raw prompts ended in generate's traceback, naming no line
            raise ValueError(f"{path}:{n} has an empty \"prompt\": write the question, or take the line out")
        prompts.append(item["prompt"])
    if not prompts:
        raise ValueError(f"{path} holds no prompts: write one {{\"prompt\": ...}} object per line")
    return prompts


def encode_prompt(tokenizer, prompt: str, raw: bool) -> list[int]:
    """Raw text, or the user turn as the app renders it, with the answer cue."""
    return encode_turns(tokenizer, [("user", prompt)], raw)


def read_prompt_items(path: Path) -> list[dict]:
    """Items of a prompts file: {"prompt": ..., "line": its line} with an optional second user turn "followup"."""
    prompts = read_prompts(path)
    items = read_jsonl(path, 'write one {"prompt": ...} object per line')
    for n, item in items:
        if "followup" in item and not isinstance(item["followup"], str):   # it was left out without a word (review)
            raise ValueError(f"{path}:{n} has a \"followup\" that is not a string: write the second user turn as "
                             "text, or take it out")
    return [{"prompt": p, "line": n, **({"followup": i["followup"]} if "followup" in i else {})}
            for p, (n, i) in zip(prompts, items)]


def encode_turns(tokenizer, turns: Sequence[tuple[str, str]], raw: bool) -> list[int]:
    """[(role, text)] ending with a user turn -> ids as the app renders the conversation (render_chat: the
    chat template, or Vicuna's format with its BOS and system prompt where the tokenizer has none), with the
    answer cue: the heads learn and are measured on the hidden states the app will give them. ``raw``: the
    texts as they are, nothing added."""
    if raw:
        return tokenizer.encode("".join(text for _, text in turns), add_special_tokens=False)
    from ..loading.chat_format import render_chat

    return render_chat(tokenizer, [{"role": r, "content": t} for r, t in turns])


def backbone_label(model: str, form: str) -> str:
    """Which backbone answered, as an answers file records it: its name, in ``form`` (its dtype, or the
    quantization it ran in: the answers of another form are other targets)."""
    return f"{backbone_name(model)} in {form}"


def distilled_rows(model: nn.Module, tokenizer, prompts_path: str | Path, raw: bool, answer_tokens: int,
                   answers_path: Path, batch_size: int = 1, temperatures: Sequence[float] = (0.0,),
                   seed: int = 0, *, backbone: str) -> list[Row]:
    """The backbone's own answers to each prompt (and to its follow-up turn, if it has one), generated
    or reused from ``answers_path``; rows train on the answer tokens only. ``backbone`` (backbone_label)
    is recorded with them: answers by another are refused, not reused.

    ``batch_size`` 1 answers one prompt at a time with the project's own loop (greedy only);
    larger batches use transformers' batched ``generate`` (left padding), which is what makes thousands
    of answers practical. Each temperature gives one answer per prompt (0: greedy).
    """
    items = read_prompt_items(Path(prompts_path))
    done: list[dict] = []
    if answers_path.is_file():
        text = answers_path.read_text()
        if text and not text.endswith("\n"):
            # a run killed while writing an answer: that answer is made again
            answers_path.write_text(text[:text.rfind("\n") + 1])
        done = [item for _, item in read_jsonl(answers_path, "delete it to answer again")]
    jobs = [(t, i) for t in temperatures for i in range(len(items))]
    if [(d.get("temperature", 0.0), d["prompt"]) for d in done if "followup_of" not in d] != \
            [(t, items[i]["prompt"]) for t, i in jobs[:sum("followup_of" not in d for d in done)]]:
        raise ValueError(f"{answers_path} holds answers to other prompts: delete it to answer these")
    # answers cut at another length are other targets (a calibration at 64 tokens reused 16-token answers and
    # measured the same accuracies); files written before the length was kept are taken as they are
    lengths = sorted({d["answer_tokens"] for d in done if "answer_tokens" in d} - {answer_tokens})
    if lengths:
        raise ValueError(f"{answers_path} holds answers of at most {lengths[0]} tokens, not {answer_tokens}: give "
                         f"--answer-tokens {lengths[0]} to reuse them, or delete it to answer again")
    # QA: answers to chat-template prompts were reused by a --raw-prompts run (and recorded as raw): the prompt
    # text matched, the prompt the backbone answered did not. Files written before the setting was kept: as above
    if any(d.get("raw_prompts", raw) != raw for d in done):
        fed, now = ("through the chat template", "as raw text") if raw else ("as raw text", "through the chat template")
        raise ValueError(f"{answers_path} holds answers to prompts fed {fed}, and this run feeds them {now}: "
                         f"{'drop' if raw else 'give'} --raw-prompts to reuse them, or delete it to answer again")
    # review: a second backbone trained into the same --out reused the first one's answers without a word;
    # files written before the backbone was kept: as above
    others = sorted({d["backbone"] for d in done if "backbone" in d} - {backbone})
    if others:
        raise ValueError(f"{answers_path} holds answers by {others[0]}, not by {backbone}: delete it to answer "
                         "with this backbone, or give another --out")
    if raw and any("followup" in item for item in items):   # they were left out without a word
        raise ValueError(f"{prompts_path} holds follow-up turns, which raw prompts cannot hold (raw text has no "
                         "turns): drop --raw-prompts, or take the followup fields out")
    check_prompts_fit(model, tokenizer, items, raw, Path(prompts_path))
    first_done = sum("followup_of" not in d for d in done)
    with open(answers_path, "a") as f:   # appended as we go, so an interrupted run resumes here
        def keep(*made: dict) -> None:
            """Answers that go together (a batch's first turns and their follow-ups) in one write: a run killed
            between them resumed past the first turns and never made their follow-ups (review)."""
            made = tuple({**item, "answer_tokens": answer_tokens, "raw_prompts": raw, "backbone": backbone}
                         for item in made)
            f.write("".join(json.dumps(item) + "\n" for item in made))
            f.flush()
            done.extend(made)
        if batch_size <= 1:
            if any(t > 0 for t in temperatures) or any("followup" in i for i in items):
                raise ValueError("sampled answers (--temperatures above 0) and follow-up turns need batched distillation: "
                                 "pass --distill-batch 2 or more")
            _answer_one_by_one(model, tokenizer, [items[i]["prompt"] for _, i in jobs[first_done:]], raw,
                               answer_tokens, keep, first_done, len(jobs))
        else:
            _answer_batched(model, tokenizer, items, jobs, first_done, raw, answer_tokens, batch_size, seed, keep)
    return [answer_row(d["prompt_ids"], d["answer_ids"]) for d in done]


MIN_ANSWER = 3        # answer tokens a row needs to be trained on (corpus_rows keeps rows with more than 2)


def check_prompts_fit(model: nn.Module, tokenizer, items: list[dict], raw: bool, path: Path) -> None:
    """ValueError naming the first prompt that leaves the backbone's context no room for an answer, before any
    answer is made (review: the one-by-one path stopped there with the chat page's "shorten the conversation", and
    the batched one answered past the context without a word). Answers that would run past it end there."""
    from ..decoding.generate import max_context

    context = max_context(model)
    for item in items:
        length = len(encode_prompt(tokenizer, item["prompt"], raw))
        if length + MIN_ANSWER > context:
            raise ValueError(f"{path}:{item['line']}: its prompt is {length:,} tokens, which leaves no room for an "
                             f"answer in the backbone's context of {context:,}: shorten it, or take it out")


def _answer_one_by_one(model, tokenizer, prompts: list[str], raw: bool, answer_tokens: int, keep,
                       start: int, total: int) -> None:
    from tqdm import tqdm

    from ..loading.chat_format import stop_token_ids

    stops = list(stop_token_ids(tokenizer))   # every turn end, as in the batched path
    for prompt in tqdm(prompts, desc="self-distillation", initial=start, total=total):
        ids = encode_prompt(tokenizer, prompt, raw)
        answer = [t for s in generate(model, ids, config=DecodeConfig(max_new_tokens=answer_tokens),
                                      stop_ids=stops) for t in s.tokens]
        keep({"prompt": prompt, "prompt_ids": ids, "answer_ids": answer, "answer": tokenizer.decode(answer)})


def _answer_batched(model, tokenizer, items: list[dict], jobs: list[tuple[float, int]], first: int, raw: bool,
                    answer_tokens: int, batch_size: int, seed: int, keep) -> None:
    """First turns in batches of ``batch_size`` from job ``first`` (the ones before are answered); then, per
    batch, the follow-up turns of its prompts (the conversation so far, the first answer included, is their
    prompt). Each batch's seed is its place among all the jobs: a resumed run samples what one run would have."""
    from tqdm import tqdm

    from ..decoding.generate import max_context

    context = max_context(model)
    left_out: list[int] = []           # lines whose follow-up turn the context could not answer
    bar = tqdm(total=len(jobs), initial=first, desc="self-distillation (batched)", mininterval=5)
    for start in range(first, len(jobs), batch_size):
        chunk = jobs[start:start + batch_size]
        firsts = []
        for temperature, i in chunk:
            ids = encode_turns(tokenizer, [("user", items[i]["prompt"])], raw)
            firsts.append((temperature, i, ids))
        answers = _generate_batch(model, tokenizer, [ids for _, _, ids in firsts], [t for t, _, _ in firsts],
                                  answer_tokens, seed + start)
        follow, made = [], []
        for (temperature, i, ids), answer in zip(firsts, answers):
            made.append({"prompt": items[i]["prompt"], "temperature": temperature, "prompt_ids": ids,
                         "answer_ids": answer, "answer": tokenizer.decode(answer)})
            if "followup" in items[i]:
                text = tokenizer.decode(answer, skip_special_tokens=True)
                turns = [("user", items[i]["prompt"]), ("assistant", text), ("user", items[i]["followup"])]
                ids = encode_turns(tokenizer, turns, raw)
                if len(ids) + MIN_ANSWER > context:   # review: it stopped the whole run, hours in, naming no line
                    left_out.append(items[i]["line"])
                    continue
                follow.append((temperature, i, ids))
        if follow:
            for (temperature, i, ids), answer in zip(follow, _generate_batch(
                    model, tokenizer, [ids for _, _, ids in follow], [t for t, _, _ in follow], answer_tokens,
                    seed + start + 1)):
                made.append({"prompt": items[i]["followup"], "followup_of": items[i]["prompt"],
                             "temperature": temperature, "prompt_ids": ids, "answer_ids": answer,
                             "answer": tokenizer.decode(answer)})
        keep(*made)
        bar.update(len(chunk))
    bar.close()
    if left_out:
        print(f"{len(left_out)} follow-up turn(s) left out: the conversation before them fills the backbone's context "
              f"of {context:,} (the first at line {left_out[0]}): shorten their prompts, or lower --answer-tokens",
              flush=True)


@torch.no_grad()
def _generate_batch(model, tokenizer, prompts: list[list[int]], temperatures: list[float], answer_tokens: int,
                    seed: int) -> list[list[int]]:
    """Left-padded batched generate; each answer ends at (and keeps) its first turn-end token. One
    temperature per call: the batch is split by temperature."""
    from ..loading.chat_format import stop_token_ids

    from ..decoding.generate import max_context

    out: list[list[int] | None] = [None] * len(prompts)
    device = model.get_output_embeddings().weight.device
    context = max_context(model)
    # every turn-end token, not only tokenizer.eos_token_id: a GGUF-converted tokenizer's EOS differs
    # between transformers versions (<|im_start|> under 5.17, <|im_end|> under 5.23)
    stops = list(stop_token_ids(tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    for temperature in sorted(set(temperatures)):
        idx = [j for j, t in enumerate(temperatures) if t == temperature]
        width = max(len(prompts[j]) for j in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), width), dtype=torch.long)
        for r, j in enumerate(idx):
            ids[r, width - len(prompts[j]):] = torch.tensor(prompts[j])
            mask[r, width - len(prompts[j]):] = 1
        torch.manual_seed(seed)
        sample = dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0) if temperature > 0 else \
            dict(do_sample=False, temperature=None, top_p=None, top_k=None)
        # transformers' generate runs past the context without a word: the batch's longest prompt sets the room (the
        # others' answers may end before their own room); every prompt leaves MIN_ANSWER (check_prompts_fit, and
        # _answer_batched for follow-ups)
        room = context - width
        gen = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             max_new_tokens=min(answer_tokens, room), eos_token_id=stops, pad_token_id=pad, **sample)
        for r, j in enumerate(idx):
            answer = gen[r, width:].tolist()
            end = next((n for n, t in enumerate(answer) if t in stops), None)
            out[j] = answer if end is None else answer[:end + 1]
    return out


def answer_row(prompt_ids: Sequence[int], answer_ids: Sequence[int]) -> Row:
    ids = [*prompt_ids, *answer_ids]
    return ids, [IGNORE] * len(prompt_ids) + list(answer_ids)


def read_answers(path: Path, vocab_size: int | None = None) -> list[Row]:
    """Rows of a stored self-distillation file (the calibration set for calibrate.py); with ``vocab_size``,
    every id is checked to be one of the model's tokens (answers from another model gave an IndexError)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: run `python -m medusa_core.train --prompts ...` first")
    fix = "use the distill_answers.jsonl that medusa_core.train writes"
    items = read_jsonl(path, fix)
    if not items or not all("prompt_ids" in d and "answer_ids" in d for _, d in items):
        raise ValueError(f"{path} is not an answers file with prompt_ids/answer_ids: {fix}")
    for n, d in items:
        lists = all(isinstance(d[k], list) for k in ("prompt_ids", "answer_ids"))
        ids = [*d["prompt_ids"], *d["answer_ids"]] if lists else [None]
        wrong = [i for i in ids if type(i) is not int or i < 0 or (vocab_size is not None and i >= vocab_size)]
        if wrong:
            raise ValueError(f"{path}:{n} holds token id {wrong[0]!r}, not one of this model's {vocab_size or 'token'} "
                             "ids: use answers made with this backbone (medusa_core.train's distill_answers.jsonl)")
    return [answer_row(d["prompt_ids"], d["answer_ids"]) for _, d in items]


@dataclass(frozen=True)
class CorpusItem:
    where: str                  # "file" or "file:line", for messages
    text: str                   # a text file's text, a JSONL line's "text", or its "answer"
    prompt: str | None = None   # a JSONL line's "prompt": its tokens are read, not trained on
    whole_file: bool = False    # a text file (its last chunk needs more than 8 tokens)


def read_corpus(files: Sequence[str]) -> list[CorpusItem]:
    """The corpus as given, checked without a tokenizer (so before the backbone loads): text files, and JSONL
    lines of "text" or "prompt" + "answer"."""
    fix = 'write one {"text": ...} or {"prompt": ..., "answer": ...} object per line'
    items: list[CorpusItem] = []
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise FileNotFoundError(f"corpus file {path} does not exist: check the --corpus paths")
        suffix = path.suffix.lower()
        if suffix == ".json":     # read as text, the heads learned JSON's syntax (review)
            raise ValueError(f"corpus file {path} is JSON: give JSONL (one object per line, named .jsonl) or text")
        if suffix != ".jsonl":
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:   # QA: read with replacement characters, it trained on them
                raise ValueError(f"corpus file {path} is not UTF-8 text (byte {err.start}): give text files, saved as "
                                 "UTF-8") from None
            items.append(CorpusItem(str(path), text, whole_file=True))
            continue
        for n, item in read_jsonl(path, fix):
            fields = ("text",) if "text" in item else ("prompt", "answer")
            if any(field not in item for field in fields):
                raise ValueError(f"{path}:{n} needs \"text\" or \"prompt\" + \"answer\": {fix}")
            wrong = next((field for field in fields if not isinstance(item[field], str)), None)
            if wrong is not None:     # transformers' traceback, naming neither the file nor the line (review)
                raise ValueError(f"{path}:{n} has a \"{wrong}\" that is not a string: {fix}")
            items.append(CorpusItem(f"{path}:{n}", item.get("text", item.get("answer")), item.get("prompt")))
    return items


def corpus_rows(tokenizer, files: Sequence[str], seq_len: int, raw: bool = False) -> list[Row]:
    """Rows of ``seq_len`` tokens at most: text files and JSONL "text" lines are cut into chunks (every token a
    target; a line was cut to its first chunk, without a word: review); "prompt" + "answer" lines train on the
    answer, whose prompt is read as the app renders it (``raw``: as raw text), as self-distillation's is. An answer
    cut to fit, and a prompt that leaves no room for one, are said."""
    rows: list[Row] = []
    cut: list[str] = []
    left_out: list[str] = []
    for item in read_corpus(files):
        if item.prompt is None:
            ids = tokenizer.encode(item.text, add_special_tokens=False)
            ends = range(0, len(ids) - 8, seq_len) if item.whole_file else range(0, len(ids), seq_len)
            rows.extend((ids[i:i + seq_len], ids[i:i + seq_len]) for i in ends)
            continue
        prompt = encode_prompt(tokenizer, item.prompt, raw)
        answer = tokenizer.encode(item.text, add_special_tokens=False)
        room = seq_len - len(prompt)
        if room < MIN_ANSWER and len(answer) >= MIN_ANSWER:
            left_out.append(item.where)
            continue
        if len(answer) > room:
            cut.append(item.where)
        rows.append(answer_row(prompt, answer[:max(room, 0)]))
    if cut:
        print(f"{len(cut)} answer(s) cut to fit --seq-len {seq_len} with their prompt (the first at {cut[0]}): raise "
              "--seq-len to train on all of them", flush=True)
    if left_out:
        print(f"{len(left_out)} line(s) left out: the prompt leaves no room in --seq-len {seq_len} for the answer "
              f"(the first at {left_out[0]}): raise --seq-len, or shorten their prompts", flush=True)
    rows = [r for r in rows if sum(t != IGNORE for t in r[1]) >= MIN_ANSWER]
    if not rows:
        raise ValueError(f"the corpus {list(files)} gave no training sequence (a text file needs more than 8 tokens, "
                         "a JSONL line more than 2 to learn from"
                         + (f", and {len(left_out)} prompt(s) filled --seq-len {seq_len}" if left_out else "")
                         + "): give longer texts" + (", or raise --seq-len" if left_out else ""))
    return rows


def conversations(answers_path: Path) -> list[str]:
    """The first-turn prompt of each answer in ``answers_path`` (distilled_rows' rows, in their order): a
    prompt's answers at each temperature and their follow-ups are one conversation."""
    return [item.get("followup_of", item["prompt"]) for _, item in read_jsonl(answers_path, "delete it to answer again")]


def split_rows(rows: list[Row], held_out: float, seed: int,
               groups: Sequence[str] | None = None) -> tuple[list[Row], list[Row]]:
    """A fixed shuffled split: (train, held-out), at least one row each. The rows of a group (``groups[i]``: row
    i's conversation; None: each row its own) go to one side: a held-out answer whose prompt was also answered
    in training, at another temperature or in a follow-up, made the held-out accuracies read high."""
    if len(rows) < 2:
        raise ValueError(f"only {len(rows)} training sequence(s): give more prompts or corpus text")
    keys = list(groups) if groups is not None else list(range(len(rows)))
    if len(keys) != len(rows):
        raise ValueError(f"{len(keys)} groups for {len(rows)} rows")
    order = list(dict.fromkeys(keys))                  # distinct, as first seen
    if len(order) < 2:
        raise ValueError(f"only {len(order)} prompt(s) to split into training and held-out: give more prompts")
    random.Random(seed).shuffle(order)
    n_held = min(len(order) - 1, max(1, round(held_out * len(order))))
    members: dict = {}
    for row, key in zip(rows, keys):
        members.setdefault(key, []).append(row)
    return ([row for key in order[n_held:] for row in members[key]],
            [row for key in order[:n_held] for row in members[key]])
