"""The step benchmark's results (one row per tree size, one result per backbone precision)
and their report: the printed table, the headline ``summary`` and the merged JSON that
docs/perf/<gpu>.json holds."""

from __future__ import annotations

import json
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .nf4_kernel import headline_of


@dataclass(frozen=True)
class TreeRow:
    size: int                   # nodes including the root (1 = the baseline step)
    depth: int
    eager_ms: float             # DecodeStep body, eager, steps queued back to back
    graphed_ms: float | None    # DecodeStep graph replay (CUDA only)
    loop_ms: float              # generate()'s step, wall clock: what a user gets
    stock_graphed_ms: float | None  # transformers' forward + StaticCache + tree mask in one CUDA graph
    host_ms: float | None       # loop - graphed: the device waits on the host (CUDA only)
    host_pct: float | None
    overhead: float             # loop step / baseline loop step
    expected_acceptance: float  # tokens per step, from the accuracies
    projected_speedup: float    # expected acceptance / overhead
    tokens_per_step_random_heads: float
    bytes_read: int             # weights (+ heads) + KV per step
    bandwidth_gbs: float        # bytes_read / loop step


@dataclass(frozen=True)
class QuantResult:
    quant: str                  # none | nf4 (the --nf4-kernel auto choice) | nf4-<kernel> | tinygemm (the int4 anchor),
                                # + -torch-norms or -triton-norms where --norm-kernel forced one
    routing: str                # which kernel multiplies the NF4 layers (quant/bnb.py, use_nf4_kernel)
    weights_bytes: int          # decoder layers + lm_head (the embedding table is not read, only T rows)
    heads_bytes: int
    kv_bytes: int               # the --context prefix, keys + values, all layers
    capacity: int               # cache bucket attended over
    copy_bandwidth_gbs: float   # attainable: a large device copy
    hf_generate_ms: dict[str, float | str]
    baseline_over_best_hf: float | None
    rows: tuple[TreeRow, ...]


def _figure(x: float) -> str:
    """Whole above 100, else three significant figures: a tiny model's step reads a few MB, and "0 GB/s (0% of
    it)" said nothing (QA); an H100's 1617 GB/s is not 1.62e+03 either."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def format_result(r: QuantResult, shape: str, context: int) -> str:
    gb = lambda b: f"{b / 1e9:.3f} GB" if b >= 1e8 else f"{b / 1e6:.3f} MB"  # noqa: E731
    cell = lambda v, w=10: f"{v:>{w}.3f}" if v is not None else f"{'-':>{w}}"  # noqa: E731
    base = r.rows[0]
    lines = [
        f"== backbone {_name(r.quant) if r.quant.startswith('none') else r.quant.upper() + ' (bf16 compute)'}, {shape} shapes, "
        f"context {context} (cache bucket {r.capacity}) ==",
        *([r.routing] if r.routing else []),
        f"bytes read per baseline step: weights {gb(r.weights_bytes)} + KV {gb(r.kv_bytes)}; Medusa steps add heads {gb(r.heads_bytes)}",
        f"baseline loop step {base.loop_ms:.3f} ms -> {_figure(base.bandwidth_gbs)} GB/s read; device copy bandwidth "
        f"{r.copy_bandwidth_gbs:.0f} GB/s ({_figure(100 * base.bandwidth_gbs / r.copy_bandwidth_gbs)}% of it)",
    ]
    if r.hf_generate_ms:
        cells = ", ".join(f"{k} {v:.3f} ms/token" if isinstance(v, float) else f"{k} {v}" for k, v in r.hf_generate_ms.items())
        verdict = f"; baseline loop / best = {r.baseline_over_best_hf:.2f}" if r.baseline_over_best_hf else ""
        lines.append(f"transformers generate(): {cells}{verdict}")
    head = (f"{'size':>5}{'depth':>6}{'eager ms':>10}{'graph ms':>10}{'loop ms':>10}{'stock ms':>10}"
            f"{'host ms (%)':>16}{'overhead':>10}{'exp. acc':>10}{'proj. speedup':>15}")
    lines += [head, "-" * len(head)]
    for w in r.rows:
        host = f"{w.host_ms:>9.3f} ({w.host_pct:4.1f}%)" if w.host_ms is not None else f"{'-':>16}"
        lines.append(f"{w.size:>5}{w.depth:>6}{cell(w.eager_ms)}{cell(w.graphed_ms)}{cell(w.loop_ms)}"
                     f"{cell(w.stock_graphed_ms)}{host}{w.overhead:>10.3f}{w.expected_acceptance:>10.3f}"
                     f"{w.projected_speedup:>14.2f}x")
    return "\n".join(lines)


def _name(quant: str) -> str:
    """A result's label as the report names it: the unquantized backbone is bf16."""
    return "bf16" + quant.removeprefix("none") if quant.startswith("none") else quant


def summary(results: list[QuantResult]) -> dict[str, float | None]:
    """The headline figures (ms per step, medians): the loop's baseline, 16- and 64-node tree steps,
    the projected tokens/s of the best tree, the graphed stock forward at T = 1 and transformers'
    static-cache generate(). A later result of the same label replaces a figure it measured again, and
    keeps one it did not measure (a later run without --hf-generate keeps the earlier static generate())."""
    out: dict[str, float | None] = {}
    for r in results:
        name = _name(r.quant).replace("-", "_")
        by_size = {w.size: w for w in r.rows}
        static = r.hf_generate_ms.get("static")
        figures = {
            "baseline_ms": by_size[1].loop_ms,
            "baseline_graphed_ms": by_size[1].graphed_ms,
            "graphed_stock_ms": by_size[1].stock_graphed_ms,
            "static_generate_ms": static if isinstance(static, float) else None,
            "tree16_ms": by_size[16].loop_ms if 16 in by_size else None,
            "tree64_ms": by_size[64].loop_ms if 64 in by_size else None,
            # the best tree's projection: its expected tokens per step over its measured loop step
            "projected_tokens_per_s": max(1000 * w.expected_acceptance / w.loop_ms for w in r.rows),
            "host_pct_max": max((w.host_pct for w in r.rows if w.host_pct is not None), default=None),
        }
        for key, value in figures.items():
            if value is not None or f"{name}_{key}" not in out:
                out[f"{name}_{key}"] = value
    if out.get("nf4_bnb_static_generate_ms") is not None:
        # transformers' static generate() as a reference means the stock NF4 model: bitsandbytes'
        # own layers, not this project's kernel routing (which its compiler traces differently)
        out["nf4_static_generate_ms"] = out["nf4_bnb_static_generate_ms"]
    return out


def merge_kernel_runs(earlier: dict | None, later: dict) -> dict:
    """Two benchmarks.nf4_kernel reports as one: the later run's shapes, rows and tuner timings replace
    the earlier run's for the same shape; the earlier run's other shapes stay."""
    if earlier is None:
        merged = dict(later)
    else:
        shapes = {(r["k"], r["n"]) for r in later.get("rows", [])}
        merged = {**earlier, **later, "shapes": {**earlier.get("shapes", {}), **later.get("shapes", {})}}
        merged["rows"] = [r for r in earlier.get("rows", []) if (r["k"], r["n"]) not in shapes] + later.get("rows", [])
        merged["tuning"] = [t for t in earlier.get("tuning", []) if (t["k"], t["n"]) not in shapes] + \
            later.get("tuning", [])
        merged["summary"] = {**earlier["summary"], **{k: v for k, v in later["summary"].items() if v is not None}}
        merged["partial"] = later.get("partial", False)     # what the later run left unmeasured, if cut short
    if merged.get("rows"):
        # the headline keys from the rows, as this code names them: a run written before a key changed meaning
        # (nf4_kernel_* named the kernel on bitsandbytes' storage until 2026-11-29) reads as a new one would
        merged["summary"] = {**merged["summary"], **headline_of(merged)}
    return merged


def step_results(path: Path, data) -> list[QuantResult]:
    """``data``'s step results (the JSON bench_synthetic writes), or ValueError naming ``path`` and what it
    lacks: a report without them failed as "error: 'results'" or with a TypeError's traceback (QA)."""
    results = data.get("results") if isinstance(data, dict) else None
    if not isinstance(results, list):
        raise ValueError(f"{path} has no \"results\" list of step results: pass a bench_synthetic JSON (or a report "
                         "folded from one) first, then the others")
    try:
        return [QuantResult(**{**r, "rows": tuple(TreeRow(**w) for w in r["rows"])}) for r in results]
    except (TypeError, KeyError) as err:      # a result without its fields, or not an object
        raise ValueError(f"{path} holds a \"results\" entry that is not a bench_synthetic step result ({err}): "
                         "pass the JSON bench_synthetic wrote, unedited") from None


def fold_reports(step_json: Path, others: Sequence[Path]) -> dict:
    """One report for docs/perf/<gpu>.json: a bench_gpu JSON, with added to its ``summary`` the
    headline figures of later bench_gpu runs (their results appended; a re-measured figure
    replaces the earlier one), of benchmarks.nf4_kernel, and of ``bench`` runs (the demo model, or a saved
    random checkpoint), each full JSON kept beside, the step profile of benchmarks.profile_gpu_step, the
    greedy-equality counts of benchmarks.nf4_exactness (per model), and the two starts of
    benchmarks.first_start (their load seconds; the last start's bench run as the checkpoint's)."""
    report = json.loads(step_json.read_text())
    step_results(step_json, report)
    extras: dict = {}
    for path in others:
        data = json.loads(path.read_text())
        summary_ = data.get("summary") if isinstance(data, dict) else None
        if isinstance(summary_, dict) and "results" in data:                     # a later bench_gpu run
            step_results(path, data)
            report["results"] += data["results"]
        elif isinstance(summary_, dict) and any(k.startswith("nf4_kernel_") for k in summary_):   # benchmarks.nf4_kernel
            # runs split by --shapes (or one cut short, "partial") add up per shape: a shape measured again
            # replaces the earlier run's rows, a shape not measured in this run keeps them (headline keys from
            # the rows, taken after the loop)
            report["nf4_matmul"] = merge_kernel_runs(report.get("nf4_matmul"), data)
        elif isinstance(summary_, list) and "model" in data:                    # bench
            # the report is a GPU's: a CPU run (SmolLM2's, say) filed as its "checkpoint" row read as the GPU's
            if not str(data.get("device", "cuda")).startswith("cuda"):
                raise ValueError(f"{path} is a bench run on {data['device']}, and this report is a GPU's: fold a "
                                 "bench run with --device cuda, or leave it out")
            report["demo" if "demo model" in data["model"] else "checkpoint"] = data
        elif not isinstance(data, dict):
            raise ValueError(f"{path} holds no JSON object: pass a bench_synthetic, nf4_kernel, profile_gpu_step, "
                             "nf4_exactness, first_start or bench JSON, or leave it out")
        elif isinstance(data.get("step_profile"), dict):                     # benchmarks.profile_gpu_step
            # per row: a later run's rows replace the same rows, and keep the rows it did not profile
            report["step_profile"] = {**report.get("step_profile", {}), **data["step_profile"]}
        elif isinstance(data.get("exactness"), list):                        # benchmarks.nf4_exactness
            report["exactness"] = {**report.get("exactness", {}), data["model"]: data}
        elif isinstance(data.get("first_start"), dict):                     # benchmarks.first_start
            report["first_start"] = data["first_start"]
            benched = [row["bench"] for row in data["first_start"]["starts"] if "bench" in row]
            if benched:         # the last start's bench run is the checkpoint row, as a bench JSON folded alone
                report["checkpoint"] = benched[-1]
        else:
            raise ValueError(f"{path}: not a bench_synthetic, nf4_kernel, profile_gpu_step, nf4_exactness, "
                             "first_start or bench JSON: pass those, or leave it out")
    # every step result in the order measured: a later result of the same label replaces the earlier figures
    results = step_results(step_json, report)
    # the kernel figures from the merged kernel report: also those an earlier fold brought in, named anew
    if "nf4_matmul" in report:
        report["nf4_matmul"] = merge_kernel_runs(None, report["nf4_matmul"])
    kernel = report.get("nf4_matmul", {}).get("summary", {})
    # the bench runs' headlines, also those of runs an earlier fold brought in
    for key, name in (("demo", "demo_cuda"), ("checkpoint", "checkpoint")):
        if key in report:
            rows = {r["name"]: r for r in report[key]["summary"]}
            medusa = [r["tokens_per_s"] for row_name, r in rows.items() if row_name.startswith("medusa")]
            extras[f"{name}_tokens_per_s"] = rows["baseline (1-node tree)"]["tokens_per_s"]
            extras[f"{name}_medusa_tokens_per_s"] = max(medusa, default=None)
            if "transformers generate()" in rows:
                extras[f"{name}_hf_generate_tokens_per_s"] = rows["transformers generate()"]["tokens_per_s"]
    extras.update(report.get("first_start", {}).get("summary", {}))
    report["summary"] = {**summary(results), **kernel, **extras}
    return report


def environment(device: torch.device) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:
            return "not installed"

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "python": platform.python_version(), "torch": torch.__version__, "cuda": str(torch.version.cuda),
        "transformers": ver("transformers"), "bitsandbytes": ver("bitsandbytes"), "triton": ver("triton"),
    }
