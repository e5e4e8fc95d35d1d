"""Side-by-side benchmark: the baseline and Medusa on the same prompts, in one
process, interleaved per prompt after a warm-up, plus transformers' own
``generate()`` and prompt-lookup decoding as outside references.

    python -m medusa_core.bench                       # the default model (SmolLM2 on CPU), its default tree
    python -m medusa_core.bench --tree chain-3 small-16 --json out/bench.json
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .benchmarks.runs import (ModuleTimer, Run, bench_prompts, format_table, peak_memory, run_hf, run_loop, summarize,
                              write_json)
from .decoding.config import DEFAULTS, GREEDY_BELOW, MODES, DecodeConfig, SettingError, limits
from .decoding.generate import new_cache
from .decoding.tree import TreeBuffers, TreeError, build_tree_buffers, named_tree, resolve_tree, tree_name
from .errors import LoadError, OneLineParser, check_writable, exit_status
from .loading.chat_format import render_chat
from .loading.load import load
from .loading.policy import resolve_device
from .loading.spec import LoadSpec
from .loading.this_machine import BUSY_SHARE, with_cpu_share
from .quant.bnb import NF4_KERNELS, flag_error as kernel_flag_error
from .quant.attention_routing import ATTENTION_CHOICES, ROTARY_CHOICES
from .quant.attention_routing import flag_error as attention_flag_error
from .quant.norm_routing import NORM_KERNELS, flag_error as norm_flag_error


def parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m medusa_core.bench", description=__doc__,
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
    p.add_argument("--mode", choices=MODES, default=DEFAULTS.mode)
    p.add_argument("--temperature", type=float, help=f"{limits('temperature').help} (default {DEFAULTS.temperature:g})")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="auto|float32|bfloat16|float16")
    p.add_argument("--quant", default="auto", help="auto|nf4|int8|int4|none (int4: torch's CPU kernel)")
    p.add_argument("--nf4-kernel", choices=NF4_KERNELS, default="auto",
                   help="4-bit matmul for multi-row tree verification: auto picks by measurement on CUDA "
                        "(bitsandbytes elsewhere), triton forces the Triton kernel, bnb keeps bitsandbytes")
    p.add_argument("--norm-kernel", choices=NORM_KERNELS, default="auto",
                   help="RMSNorm: auto times transformers' and the Triton norm on CUDA (transformers' elsewhere)")
    p.add_argument("--rotary-kernel", choices=ROTARY_CHOICES, default="auto",
                   help="rotary embedding and cache write: auto times transformers' and the Triton kernels on CUDA "
                        "(transformers' elsewhere)")
    p.add_argument("--attention-kernel", choices=ATTENTION_CHOICES, default="auto",
                   help="attention: auto times SDPA and the split Triton kernel on CUDA (SDPA elsewhere)")
    p.add_argument("--retune", action="store_true",
                   help="measure this machine afresh, as the app's --retune: the default tree, and on a GPU the kernel "
                        "timings (without it they are read from an earlier start's, as the app reads them)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=1,
                   help="warm-up runs of each decoder before timing; they also make (and on CUDA capture) each "
                   "decoder's step, which with 0 the first prompt's runs include")
    p.add_argument("--no-references", action="store_true", help="skip transformers generate() and prompt lookup")
    p.add_argument("--json", help="write every run and the summary here")
    return p


@dataclass(frozen=True)
class Setup:
    loaded: object                  # loading.load.Loaded
    config: DecodeConfig
    trees: dict[str, TreeBuffers]   # the Medusa trees to time, by the name asked (the baseline always runs)
    device: torch.device


def prepare(args) -> Setup:
    """Load the model and build the trees asked for; LoadError, TreeError or ValueError in one line. What the
    flags alone show wrong is said before the load (minutes, with a tuning on a busy machine)."""
    # a temperature given with greedy decoding would do nothing: refused, as the OpenAI API refuses it (QA)
    if args.mode == "greedy" and args.temperature is not None and args.temperature >= GREEDY_BELOW:
        raise ValueError(f"--temperature {args.temperature:g} with --mode greedy: greedy decoding draws nothing, so "
                         "the temperature would do nothing: drop --temperature, or use --mode sample or typical")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup} must be at least 0")
    temperature = DEFAULTS.temperature if args.temperature is None else args.temperature
    try:
        config = DecodeConfig(mode=args.mode, temperature=temperature, max_new_tokens=args.max_new_tokens,
                              seed=args.seed)
    except SettingError as err:       # named as the flag, not the field
        raise ValueError(f"--{err.name.replace('_', '-')} {err.problem}") from None
    for spec in args.tree or []:
        named_tree(spec)
    device = resolve_device(args.device)
    # the NF4 kernel's checks are launch.py's: a choice where the load makes no NF4 weights was ignored (QA16)
    flags_error = norm_flag_error(args.norm_kernel, args.nf4_kernel, device) or \
        kernel_flag_error(args.nf4_kernel, device, args.quant) or \
        attention_flag_error(args.rotary_kernel, args.attention_kernel, args.nf4_kernel, device)
    if flags_error:
        raise ValueError(flags_error)
    # the default tree is tuned only where it is asked for: a run of presets has no use for it
    fixed = next((t for t in args.tree if t != "default"), None) if args.tree and "default" not in args.tree else None
    loaded = load(LoadSpec(model=args.model, heads=args.heads, device=args.device, dtype=args.dtype, quant=args.quant,
                           nf4_kernel=args.nf4_kernel, norm_kernel=args.norm_kernel, rotary_kernel=args.rotary_kernel,
                           attention_kernel=args.attention_kernel, tree=fixed, retune=args.retune,
                           must_run=tuple(t for t in args.tree or [] if t not in ("default", "baseline"))))
    asked = [loaded.default_tree if t == "default" else t for t in args.tree or ["default"] * (loaded.heads is not None)]
    tree_names = list(dict.fromkeys(t for t in asked if t != "baseline"))     # the baseline always runs
    if tree_names and loaded.heads is None:
        raise LoadError(f"trees {', '.join(tree_names)} need Medusa heads, and none were loaded: "
                        "pass --heads, or --tree baseline for plain decoding only")
    names: dict[str, str] = {}
    for spec in tree_names:
        name = tree_name(spec)
        if names.setdefault(name, spec) != spec:
            raise ValueError(f"trees {names[name]} and {spec} would both be named {name!r} in the table: "
                             "rename one of the files")
    device = loaded.model.get_output_embeddings().weight.device
    trees = {tree_name(spec): build_tree_buffers(resolve_tree(spec), loaded.heads.config.num_heads,
                                                 device=device) for spec in tree_names}
    return Setup(loaded, config, trees, device)


def measure(args, setup: Setup, encoded: list[list[int]]) -> tuple[list[dict[str, Run]], float | None]:
    """Every decoder on a prompt, then the next prompt (interleaved, after a warm-up): per prompt, the runs by name;
    and on a CPU the share of it this process got meanwhile (``with_cpu_share``; None on a GPU)."""
    loaded, trees = setup.loaded, setup.trees
    timed = [loaded.model.get_decoder(), loaded.model.get_output_embeddings(), *([loaded.heads] if loaded.heads else [])]
    timer = ModuleTimer(timed) if setup.device.type == "cpu" else None
    greedy_refs = not args.no_references and args.mode == "greedy"
    # One cache per decoder for the whole run, as a chat tab keeps its own, sized for the longest prompt: every
    # run then replays the step (and CUDA graph) its decoder's first run captured, the warm-up's if there is one.
    # A graph attends over its whole bucket: prompts of very different lengths all run in the longest one's.
    capacity = max(map(len, encoded)) + args.max_new_tokens + max((t.size for t in trees.values()), default=1)
    caches = {name: new_cache(loaded.model, capacity) for name in ("baseline", *trees)}

    def one_round(ids):
        res = {"baseline": run_loop(loaded, ids, None, setup.config, timer, caches["baseline"])}
        for name, tree in trees.items():
            res[name] = run_loop(loaded, ids, tree, setup.config, timer, caches[name])
        if greedy_refs:
            res["hf_generate"] = run_hf(loaded, ids, args.max_new_tokens)
            res["prompt_lookup"] = run_hf(loaded, ids, args.max_new_tokens, prompt_lookup_num_tokens=10)
        return res

    started = time.perf_counter()
    for _ in range(args.warmup):
        one_round(encoded[0][:64])
    if args.warmup:
        print(f"warm-up done, {time.perf_counter() - started:.0f} s (each decoder's step made and, on CUDA, captured "
              "once, as a chat tab's first answer does)", file=sys.stderr, flush=True)
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    results = []
    started = time.perf_counter()

    def timed_rounds() -> None:
        for n, ids in enumerate(encoded, 1):
            results.append(one_round(ids))
            print(f"prompt {n}/{len(encoded)} done, {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)

    _, share = with_cpu_share(timed_rounds)
    if timer:
        timer.remove()
    return results, (round(share, 3) if setup.device.type == "cpu" else None)


def report(args, setup: Setup, prompts: list[str], encoded: list[list[int]], results: list[dict[str, Run]],
           cpu_share: float | None, load_seconds: float) -> None:
    """The summary table (and the --json report), and a warning under it where other programs used the CPU."""
    device, trees = setup.device, setup.trees
    base = [r["baseline"] for r in results]
    rows = [summarize("baseline (1-node tree)", base, base, True)]
    rows += [summarize(f"medusa {Path(n).name}", [r[n] for r in results], base, True) for n in trees]
    if "hf_generate" in results[0]:
        rows.append(summarize("transformers generate()", [r["hf_generate"] for r in results], base, False))
        rows.append(summarize("prompt lookup (10)", [r["prompt_lookup"] for r in results], base, False))
    print(f"{len(prompts)} prompts{' (raw)' if args.raw else ''}, {args.max_new_tokens} new tokens max, "
          f"mode {args.mode}, device {device}")
    print(format_table(rows))
    if cpu_share is not None and cpu_share < BUSY_SHARE:
        # other programs' work slows the larger tree steps more than the plain ones (QA: ratios from a busy CPU
        # were printed as the machine's, where the tree tuner in the same process said it was busy)
        print(f"warning: other programs used the CPU while this ran (the benchmark got {cpu_share:.0%} of it): the "
              "speedups above are skewed; run again with the machine otherwise idle")
    # each decoder's cache (and on CUDA its graph) held for the whole run: more than one chat pane holds
    print(f"{peak_memory(str(device))}, with the {1 + len(trees)} decoders' KV caches held at once")
    if args.json:
        out = {
            "args": vars(args), "model": setup.loaded.description, "load_seconds": round(load_seconds, 2),
            "device": str(device), "cpu_share": cpu_share,
            "torch": torch.__version__, "memory": peak_memory(str(device)),
            "trees": {n: t.size for n, t in trees.items()},
            "prompts": [{"prompt": text, "prompt_tokens": len(ids), **{k: {**asdict(v), "tokens_per_s": v.tokens_per_s}
                        for k, v in r.items()}} for text, ids, r in zip(prompts, encoded, results)],
            "summary": [asdict(r) for r in rows],
        }
        write_json(args.json, out)


def main(argv: list[str] | None = None) -> int:
    return exit_status(lambda: run_bench(argv))


def run_bench(argv: list[str] | None) -> int:
    args = parser().parse_args(argv)
    prompts = bench_prompts(args.prompts)      # before the load: a missing file is said at once
    try:
        check_writable(args.json, reads={"--prompts": args.prompts})   # not after the whole run
        started = time.perf_counter()
        setup = prepare(args)
        load_seconds = time.perf_counter() - started
    except (LoadError, TreeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    tok = setup.loaded.tokenizer
    encoded = [tok(text)["input_ids"] if args.raw else render_chat(tok, text) for text in prompts]
    print(setup.loaded.description)
    # what a user waits for at the app's start: on a GPU's first start the kernel timings, here and later read
    print(f"loaded in {load_seconds:.1f} s")
    note = setup.loaded.tree_note
    if args.tree and "default" not in args.tree and setup.trees:
        # the load's line names the default it was given, the first --tree: the run times all of them (QA)
        note = f"tree{'s' * (len(setup.trees) > 1)} {', '.join(setup.trees)} (set by --tree), beside plain decoding"
    if note:
        print(note)
    print(setup.loaded.memory)
    report(args, setup, prompts, encoded, *measure(args, setup, encoded), load_seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
