"""Side-by-side benchmark: the baseline and Medusa on the same prompts, in one
process, interleaved per prompt after a warm-up, plus transformers' own
``generate()`` and prompt-lookup decoding as outside references.

    python -m medusa_core.bench                       # the default model (SmolLM2 on CPU), its default tree
    python -m medusa_core.bench --tree chain-3 small-16 --json out/bench.json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from .chat_format import render_chat
from .errors import LoadError
from .generate import MODES, DecodeConfig, compute_dtype, generate
from .loading import CPU_DEFAULT_PROMPTS, LoadSpec, load
from .quantization import NF4_KERNELS
from .train_data import read_prompts
from .tree import TreeError, build_tree_buffers, resolve_tree


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
        self.handles = []
        for m in modules:
            self.handles.append(m.register_forward_pre_hook(self._start))
            self.handles.append(m.register_forward_hook(self._stop))

    # Only the outermost timed module counts: heads that share the lm_head call it inside their
    # own forward, and counting both made the time outside the model come out negative.
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


def run_loop(loaded, prompt_ids, tree, config, timer: ModuleTimer | None) -> Run:
    if timer:
        timer.total = 0.0
    t0 = time.perf_counter()
    steps = list(generate(loaded.model, prompt_ids, heads=loaded.heads if tree is not None else None,
                          tree=tree, config=config, stop_ids=loaded.stop_ids))
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
    accepted_per_step: float
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
        accepted_per_step=sum(accepted) / len(accepted) if accepted else float("nan"),
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
        for v, fmt in ((r.accepted_per_step, "10.2f"), (r.overhead, "10.2f"), (r.ttft_ms, "9.1f"), (r.host_ms_per_step, "9.2f")):
            cells.append(format(v, fmt) if v == v else f"{'-':>{fmt.split('.')[0]}}")
        lines.append(f"{r.name:<26}{''.join(cells)}  {r.identical}")
    return "\n".join(lines)


def bench_prompts(path: str | None) -> list[str]:
    """The --prompts file, else the held-out chat prompts in assets/smollm2 (no head was trained on them)."""
    path = path or str(CPU_DEFAULT_PROMPTS)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m medusa_core.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="backbone hub id or local dir (default: Vicuna-7B on CUDA, SmolLM2-135M-Instruct "
                                   "otherwise)")
    p.add_argument("--heads", help="Medusa heads hub id or local dir")
    p.add_argument("--prompts", help="JSONL file, one {\"prompt\": ...} per line (default: the held-out chat "
                                     "prompts in assets/smollm2/prompts.jsonl)")
    p.add_argument("--raw", action="store_true", help="feed prompts as they are, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--tree", nargs="+", help="tree presets or JSON files, each benchmarked; 'default' is the model's "
                                             "default tree (tuned for this machine), which also runs when --tree is not given")
    p.add_argument("--mode", choices=MODES, default="greedy")
    p.add_argument("--temperature", type=float, default=0.7, help="for sample/typical")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16")
    p.add_argument("--quant", default="auto", help="auto|nf4|int8|int4|none (int4: torch's CPU kernel)")
    p.add_argument("--nf4-kernel", choices=NF4_KERNELS, default="auto",
                   help="4-bit matmul for multi-row tree verification: auto picks by measurement on CUDA "
                        "(bitsandbytes elsewhere), triton forces the Triton kernel, bnb keeps bitsandbytes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1, help="warm-up runs of each decoder before timing")
    p.add_argument("--no-references", action="store_true", help="skip transformers generate() and prompt lookup")
    p.add_argument("--json", help="write every run and the summary here")
    args = p.parse_args(argv)

    try:
        loaded = load(LoadSpec(model=args.model, heads=args.heads, device=args.device, dtype=args.dtype, quant=args.quant,
                               nf4_kernel=args.nf4_kernel))
        config = DecodeConfig(mode=args.mode, temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
        asked = [loaded.default_tree if t == "default" else t for t in args.tree or ["default"] * (loaded.heads is not None)]
        tree_names = list(dict.fromkeys(t for t in asked if t != "baseline"))     # the baseline always runs
        if tree_names and loaded.heads is None:
            raise LoadError(f"trees {', '.join(tree_names)} need Medusa heads, and none were loaded: "
                            "pass --heads, or --tree baseline for plain decoding only")
        device = loaded.model.get_output_embeddings().weight.device
        mask_dtype = compute_dtype(loaded.model)
        trees = {name: build_tree_buffers(resolve_tree(name), loaded.heads.config.num_heads, dtype=mask_dtype, device=device)
                 for name in tree_names}
    except (LoadError, TreeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    prompts = bench_prompts(args.prompts)
    tok = loaded.tokenizer
    encoded = [tok(text)["input_ids"] if args.raw else render_chat(tok, text) for text in prompts]
    print(loaded.description)
    if loaded.tree_note:
        print(loaded.tree_note)
    print(loaded.memory)
    on_cpu = device.type == "cpu"
    timed = [loaded.model.get_decoder(), loaded.model.get_output_embeddings(), *([loaded.heads] if loaded.heads else [])]
    timer = ModuleTimer(timed) if on_cpu else None
    greedy_refs = not args.no_references and args.mode == "greedy"

    def one_round(ids):
        res = {"baseline": run_loop(loaded, ids, None, config, timer)}
        for name, tree in trees.items():
            res[name] = run_loop(loaded, ids, tree, config, timer)
        if greedy_refs:
            res["hf_generate"] = run_hf(loaded, ids, args.max_new_tokens)
            res["prompt_lookup"] = run_hf(loaded, ids, args.max_new_tokens, prompt_lookup_num_tokens=10)
        return res

    for _ in range(args.warmup):
        one_round(encoded[0][:64])
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    results = []
    started = time.perf_counter()
    for n, ids in enumerate(encoded, 1):               # interleaved: every decoder on a prompt, then the next
        results.append(one_round(ids))
        print(f"prompt {n}/{len(encoded)} done, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    if timer:
        timer.remove()

    base = [r["baseline"] for r in results]
    rows = [summarize("baseline (1-node tree)", base, base, True)]
    rows += [summarize(f"medusa {Path(n).name}", [r[n] for r in results], base, True) for n in trees]
    if greedy_refs:
        rows.append(summarize("transformers generate()", [r["hf_generate"] for r in results], base, False))
        rows.append(summarize("prompt lookup (10)", [r["prompt_lookup"] for r in results], base, False))
    print(f"{len(prompts)} prompts{' (raw)' if args.raw else ''}, {args.max_new_tokens} new tokens max, "
          f"mode {args.mode}, device {device}")
    print(format_table(rows))
    print(peak_memory(str(device)))
    if args.json:
        out = {
            "args": vars(args), "model": loaded.description, "device": str(device),
            "torch": torch.__version__, "memory": peak_memory(str(device)),
            "trees": {n: t.size for n, t in trees.items()},
            "prompts": [{"prompt": text, "prompt_tokens": len(ids), **{k: {**asdict(v), "tokens_per_s": v.tokens_per_s}
                        for k, v in r.items()}} for text, ids, r in zip(prompts, encoded, results)],
            "summary": [asdict(r) for r in rows],
        }
        write_json(args.json, out)
    return 0


def write_json(path: str, report: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=1, allow_nan=True) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
