"""One benchmark run of the decoding loop as ``python -m medusa_core.bench`` makes it: the loop timed
per prompt (prefill apart), transformers' generate() as an outside reference, a per-module timer
for the CPU, and the summary rows with their ratios to the baseline."""

from __future__ import annotations

import json
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..decoding.generate import generate
from ..decoding.kv_cache import KVCache
from ..heads.medusa_heads import MedusaHeads
from ..loading.assets import CPU_DEFAULT_PROMPTS
from ..training.data import read_prompts


@dataclass
class Run:
    """One decoding of one prompt."""

    tokens: list[int]
    seconds: float                 # wall time, prefill included
    ttft: float                    # time to the first token
    steps: int                     # decoding steps after the prefill
    accepted: list[int] = field(default_factory=list)   # tokens per step
    host_seconds: float = 0.0      # step time outside the model's modules (CPU only: GPU time is async)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds else 0.0


class ModuleTimer:
    """Wall time spent inside the model's modules (decoder, lm_head, heads), via hooks.
    Only meaningful on CPU, where kernels run synchronously."""

    def __init__(self, modules):
        self.total, self._t0, self._depth = 0.0, 0.0, 0
        self.handles, self._wrapped = [], []
        for m in modules:
            if isinstance(m, MedusaHeads):   # the step asks for their guesses, never their forward (review)
                self._wrap(m, "guesses")
                continue
            self.handles.append(m.register_forward_pre_hook(self._start))
            self.handles.append(m.register_forward_hook(self._stop))

    def _wrap(self, owner, name: str) -> None:
        """Time ``owner.name(...)`` calls, through an instance attribute that remove() takes away."""
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            self._start()
            try:
                return method(*args, **kwargs)
            finally:
                self._stop()

        setattr(owner, name, timed)
        self._wrapped.append((owner, name))

    # Only the outermost timed module counts: heads that share the lm_head call it inside their
    # guesses, and counting both made the time outside the model come out negative.
    def _start(self, *args):
        if self._depth == 0:
            self._t0 = time.perf_counter()
        self._depth += 1

    def _stop(self, *args):
        self._depth -= 1
        if self._depth == 0:
            self.total += time.perf_counter() - self._t0

    def remove(self):
        for h in self.handles:
            h.remove()
        for owner, name in self._wrapped:
            delattr(owner, name)


def run_loop(loaded, prompt_ids, tree, config, timer: ModuleTimer | None, cache: KVCache) -> Run:
    """One decoding of ``prompt_ids`` on ``cache``, rewound first: a new conversation, as the app's New chat
    starts one, on buffers whose steps (and CUDA graphs) the decoder's earlier runs captured. A new cache each run
    timed a graph capture in every answer: on an H200 a 7B baseline read 111-117 tokens/s where its step runs 295."""
    if timer:
        timer.total = 0.0
    cache.rewind(0)
    t0 = time.perf_counter()
    steps = list(generate(loaded.model, prompt_ids, heads=loaded.heads if tree is not None else None,
                          tree=tree, config=config, cache=cache, stop_ids=loaded.stop_ids))
    seconds = time.perf_counter() - t0
    decode = [s for s in steps[1:] if s.tokens]
    model_time = timer.total if timer else 0.0
    host = (seconds - model_time) / max(1, len(steps)) if timer else 0.0
    return Run([t for s in steps for t in s.tokens], seconds, steps[0].seconds, len(decode),
               [len(s.tokens) for s in decode], host)


def run_hf(loaded, prompt_ids, max_new_tokens: int, **kwargs) -> Run:
    """transformers' own generate(): plain greedy, or prompt lookup with ``prompt_lookup_num_tokens``."""
    model = loaded.model
    ids = torch.tensor([prompt_ids], device=model.get_output_embeddings().weight.device)
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, eos_token_id=list(loaded.stop_ids) or None,
                         pad_token_id=loaded.tokenizer.pad_token_id or 0, **kwargs)
    sync()
    seconds = time.perf_counter() - t0
    return Run(out[0, len(prompt_ids):].tolist(), seconds, 0.0, 0)


@dataclass(frozen=True)
class Row:
    name: str
    tokens_per_s: float
    speedup: float
    tokens_per_step: float
    overhead: float
    ttft_ms: float
    host_ms_per_step: float
    identical: str


def summarize(name: str, runs: list[Run], base: list[Run], decoded_by_loop: bool) -> Row:
    def rate(rs):
        return sum(len(r.tokens) for r in rs) / sum(r.seconds for r in rs)

    def step_time(rs):  # mean decoding-step time, prefill excluded
        steps = sum(r.steps for r in rs)
        return sum(r.seconds - r.ttft for r in rs) / steps if steps else float("nan")

    accepted = [a for r in runs for a in r.accepted]
    same = all(r.tokens == b.tokens for r, b in zip(runs, base))
    return Row(
        name=name,
        tokens_per_s=rate(runs),
        speedup=rate(runs) / rate(base),
        tokens_per_step=sum(accepted) / len(accepted) if accepted else float("nan"),
        overhead=step_time(runs) / step_time(base) if decoded_by_loop else float("nan"),
        ttft_ms=1000 * sum(r.ttft for r in runs) / len(runs) if decoded_by_loop else float("nan"),
        host_ms_per_step=1000 * sum(r.host_seconds for r in runs) / len(runs) if decoded_by_loop else float("nan"),
        identical="yes" if same else "no",
    )


def format_table(rows: list[Row]) -> str:
    head = f"{'decoder':<26}{'tok/s':>9}{'speedup':>9}{'acc/step':>10}{'overhead':>10}{'TTFT ms':>9}{'host ms':>9}  same as baseline"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = [f"{r.tokens_per_s:9.1f}", f"{r.speedup:8.2f}x"]
        for v, fmt in ((r.tokens_per_step, "10.2f"), (r.overhead, "10.2f"), (r.ttft_ms, "9.1f"), (r.host_ms_per_step, "9.2f")):
            cells.append(format(v, fmt) if v == v else f"{'-':>{fmt.split('.')[0]}}")
        lines.append(f"{r.name:<26}{''.join(cells)}  {r.identical}")
    return "\n".join(lines)


def bench_prompts(path: str | None) -> list[str]:
    """The --prompts file, else the held-out chat prompts in assets/smollm2 (the heads were trained on one of
    them: training/prompts.py)."""
    path = path or str(CPU_DEFAULT_PROMPTS)
    if Path(path).is_dir():      # "does not exist" was said of a folder that does (QA16)
        raise SystemExit(f"error: prompts file {path} is a directory: give a .jsonl file with one {{\"prompt\": ...}} per line")
    if not Path(path).is_file():
        raise SystemExit(f"error: prompts file {path} does not exist: give a JSONL file with one {{\"prompt\": ...}} per line")
    try:
        return read_prompts(Path(path))
    except ValueError as err:
        raise SystemExit(f"error: {err}") from err


def peak_memory(device: str) -> str:
    if device.startswith("cuda"):
        return f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    return f"peak process RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10:.0f} MiB"


def write_json(path: str, report: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1, allow_nan=True) + "\n")
    print(f"wrote {path}")
