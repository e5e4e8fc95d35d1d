"""GPU micro-benchmark: one NF4 projection at Medusa's row counts, every way we can multiply it.

    python -m medusa_core.benchmarks.nf4_kernel --json out/nf4.json

Per shape (Llama-7B projections and the heads' vocab projection) and M rows: bf16 F.linear,
bitsandbytes Linear4bit's own dispatch, its fused gemv forced, its dequantize + F.linear forced,
torch's tinygemm int4 (``_weight_int4pack_mm``, what gpt-fast uses; asymmetric int4, group 64 and
128: a different format, the anchor), the Triton kernel reading bitsandbytes' storage (nf4_matmul.py)
with the config its tuner picked per (shape, row class), and the repacked kernel
(nf4_repacked_matmul.py) in its fastest per-M choice (tuned here) and in exact mode. The chosen
configs are in the table's last columns; every config the tuners timed is listed after the table and in
the JSON. Then: whether exact mode gave each row the bits it gets alone on this GPU (it must) and
whether fast mode did, and fused q/k/v and gate/up against the separate projections.
Each is timed inside one CUDA graph (calls back to back, median of replays via CUDA events), rotating
among weight copies that together exceed L2. A row that fails prints one line and the run goes on.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import OneLineParser, exit_status, first_line
from ..quant.kernel_timing import graph_time_us, rotating_copies, rotation_count

SHAPES = ((4096, 11008), (11008, 4096), (4096, 4096), (4096, 32000))   # (K in, N out)
ROWS = (1, 2, 4, 8, 16, 32, 64)
METHODS = ("bf16", "bnb", "bnb_gemv", "bnb_dequant", "tinygemm_g64", "tinygemm_g128", "triton", "repacked",
           "repacked_exact")
CHECKED = ("triton", "repacked", "repacked_exact")   # ours: checked against x @ dequantized W


@dataclass(frozen=True)
class Row:
    k: int
    n: int
    m: int
    method: str
    us: float | None          # None: failed (see error)
    error: str = ""
    variant: str = ""         # triton, repacked*: the config chosen


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), the floor's denominator."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 10 / (start.elapsed_time(end) / 1000)


def bench_shape(k: int, n: int, device: torch.device, l2: int) -> tuple[list[Row], dict]:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf

    from ..quant import nf4_matmul as nm
    from ..quant import nf4_repack as rp
    from ..quant import nf4_repacked_matmul as rm
    from ..quant import tinygemm

    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    copies = rotating_copies(packed, state, l2)
    repacked = [rp.repack_bnb([(p, s)]) for p, s in copies]
    tiny = {}
    for group in (64, 128):
        q, sz = tinygemm.quantize(w, group)
        packed_q = tinygemm.pack(q)
        tiny[group] = [(packed_q, sz)] + [(packed_q.clone(), sz.clone()) for _ in range(len(copies) - 1)]
        del q
    dense = [w] + [w.clone() for _ in range(max(1, -(-2 * l2 // (w.numel() * 2))) - 1)]
    ref_w = bnbf.dequantize_4bit(packed, state).float()                       # (N, K)
    packed_bytes = packed.numel() + state.absmax.numel() * state.absmax.element_size() + \
        (state.state2.absmax.numel() * 4 + state.state2.code.numel() * 4 if state.nested else 0)
    check = {method: {} for method in CHECKED}
    rows = []
    tuned = set()
    try:        # exact mode's one config for every M, as an exact load tunes it (rows checked on this GPU first)
        rm.tune_exact(n, k, torch.bfloat16, device)
    except Exception as err:  # fail soft: one line; the exact column below runs the untuned config
        print(f"  {k}->{n} exact tuning: FAILED ({type(err).__name__}: {first_line(err)})")
    for m in ROWS:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
        for name, kernel in (("triton", nm), ("repacked", rm)):
            if (name, kernel.row_class(m)) in tuned:
                continue         # every config of the class, not the short list a model load times
            tuned.add((name, kernel.row_class(m)))
            try:
                if name == "triton":
                    nm.tune_shape(m, n, k, x.dtype, device, 64, wide=True)
                else:
                    rm.tune_shape(m, n, k, x.dtype, device)
            except Exception as err:  # fail soft: one line; the kernel's row below reports it again
                print(f"  {k}->{n} M={m} {name} tuning: FAILED ({type(err).__name__}: {first_line(err)})")
        calls = {
            "bf16": [functools.partial(F.linear, x, d) for d in dense],
            "bnb": [functools.partial(bnb.matmul_4bit, x, p.t(), quant_state=s) for p, s in copies],
            "bnb_gemv": [functools.partial(bnbf.gemv_4bit, x, p.t(), state=s) for p, s in copies] if m == 1 else None,
            "bnb_dequant": [(lambda p=p, s=s: F.linear(x, bnbf.dequantize_4bit(p, s).to(x.dtype))) for p, s in copies],
            **{f"tinygemm_g{g}": [functools.partial(torch.ops.aten._weight_int4pack_mm, x, p, g, sz)
                                  for p, sz in tiny[g]] for g in tiny},
            "triton": [functools.partial(nm.nf4_matmul, x, p, s) for p, s in copies],
            "repacked": [functools.partial(rm.repacked_matmul, x, r) for r in repacked],
            "repacked_exact": [functools.partial(rm.repacked_matmul, x, r, exact=True) for r in repacked],
        }
        variants = {"triton": functools.partial(nm.choose_config, m, n, k, x.dtype, device, 64),
                    "repacked": functools.partial(rm.choose_config, m, repacked[0], x.dtype, device, False),
                    "repacked_exact": functools.partial(rm.choose_config, m, repacked[0], x.dtype, device, True)}
        for method in METHODS:
            if calls[method] is None:
                continue             # bnb's fused gemv takes one row only
            try:
                if method in CHECKED:
                    y = calls[method][0]().float()
                    ref = x.float() @ ref_w.T
                    rel = float((y - ref).norm() / ref.norm())
                    check[method][m] = rel
                    if rel > 1e-2:
                        raise RuntimeError(f"wrong result: relative error {rel:.2e} > 1e-2")
                us = graph_time_us(calls[method])
                variant = variants[method]().describe() if method in variants else ""
                rows.append(Row(k, n, m, method, us, variant=variant))
            except Exception as err:  # fail soft per row: one line, then the next row
                line = first_line(err) or type(err).__name__
                print(f"  {k}->{n} M={m} {method}: FAILED ({type(err).__name__}: {line})")
                rows.append(Row(k, n, m, method, None, line))
    exact_rows = rows_identical(repacked[0], k, device, gen)
    del copies, dense, repacked, tiny
    return rows, {"packed_bytes": packed_bytes, "repacked_bytes": rp.repacked_nbytes(n, k), "rel_error": check,
                  "rows_identical_to_alone": exact_rows}


def rows_identical(w, k: int, device: torch.device, gen: torch.Generator) -> dict[str, dict[int, bool]]:
    """Per mode and M: does every row of an M-row call equal that row computed alone, bit for bit?
    Exact mode must say True everywhere; fast mode is free to round differently."""
    from ..quant import nf4_repacked_matmul as rm

    x = torch.randn(max(ROWS), k, device=device, dtype=torch.bfloat16, generator=gen)
    out = {}
    for mode, kw in (("exact", dict(exact=True)), ("fast", dict(exact=False))):
        alone = torch.cat([rm.repacked_matmul(x[i:i + 1], w, **kw) for i in range(x.shape[0])])
        out[mode] = {m: bool(torch.equal(rm.repacked_matmul(x[:m], w, **kw), alone[:m])) for m in ROWS if m > 1}
    return out


FUSED = {"q/k/v": (4096, (4096, 4096, 4096)), "gate/up": (4096, (11008, 11008))}   # K, then each projection's N


def bench_fusion(device: torch.device, l2: int) -> list[dict]:
    """µs per group of one fused repacked matmul against the separate ones back to back, per M, each
    inside one CUDA graph, rotating among weight copies that together exceed L2."""
    import dataclasses

    import bitsandbytes.functional as bnbf

    from ..quant import nf4_repack as rp
    from ..quant import nf4_repacked_matmul as rm

    def clone(w):
        return dataclasses.replace(w, words=w.words.clone(), scales=w.scales.clone(), arrivals=w.arrivals.clone())

    gen = torch.Generator(device=device).manual_seed(2)
    out = []
    for name, (k, ns) in FUSED.items():
        parts = [bnbf.quantize_4bit(torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02,
                                    blocksize=64, compress_statistics=True, quant_type="nf4") for n in ns]
        fused = rp.repack_bnb(parts)
        count = rotation_count(fused.nbytes, l2)
        fused_copies = [fused] + [clone(fused) for _ in range(count - 1)]
        separate_copies = [[rp.repack_bnb([p]) for p in parts]]
        separate_copies += [[clone(w) for w in separate_copies[0]] for _ in range(count - 1)]
        for m in ROWS:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
            # each side in its tuned config, as a load tunes both before it chooses: untuned, the fused shape ran
            # the default tile (the H200 of 11-29 timed gate/up at 74.1 µs at 16 rows where its tuner took 49.2)
            for n in dict.fromkeys((fused.n, *ns)):
                if rm.tuned_config(m, n, k, x.dtype, device) is not None:
                    continue    # the projections' own shapes, tuned for the main table: the same config there
                try:
                    rm.tune_shape(m, n, k, x.dtype, device)
                except Exception as err:  # fail soft: one line; the timing below runs the untuned config
                    print(f"  fusion {name} {k}->{n} M={m} tuning: FAILED ({type(err).__name__}: {first_line(err)})")
            for mode in ("fused", "separate"):
                weights = fused_copies if mode == "fused" else [w for ws in separate_copies for w in ws]
                try:
                    calls = [functools.partial(rm.repacked_matmul, x, w) for w in weights]
                    us = graph_time_us(calls) * len(calls) / count       # per group: q, k and v together
                    one_group = weights[:1] if mode == "fused" else weights[:len(ns)]     # one copy of each matmul
                    out.append({"group": name, "m": m, "mode": mode, "us": us,
                                "configs": [rm.choose_config(m, w, x.dtype, device, False).describe()
                                            for w in one_group]})
                except Exception as err:  # fail soft: one line, then the next
                    print(f"  fusion {name} M={m} {mode}: FAILED ({type(err).__name__}: {str(err).strip()[:120]})")
                    out.append({"group": name, "m": m, "mode": mode, "us": None, "configs": []})
        del fused_copies, separate_copies
    return out


def dtype_check(device: torch.device, size: int = 4096, sms: int | None = None) -> dict[str, float | str]:
    """Relative error of the stream kernel for fp16 and fp32 activations (the table is bf16 only): a
    size x size weight, 1 and 16 rows, the first stream config of each class, against x @ dequantized W."""
    import bitsandbytes.functional as bnbf

    from ..quant import nf4_matmul as nm

    gen = torch.Generator(device=device).manual_seed(1)
    w = torch.randn(size, size, device=device, dtype=torch.float32, generator=gen) * 0.02
    packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    ref_w = bnbf.dequantize_4bit(packed, state).float()
    sms = sms or torch.cuda.get_device_properties(device).multi_processor_count
    out = {}
    for dtype in (torch.float16, torch.float32):
        for m in (1, 16):
            cfg = next(c for c in nm.candidates(m, size, size, sms) if c.sub)
            x = torch.randn(m, size, device=device, dtype=dtype, generator=gen)
            key = f"{str(dtype).removeprefix('torch.')} M={m} {cfg.describe()}"
            try:
                y = nm.nf4_matmul(x, packed, state, config=cfg).float()
                ref = x.float() @ ref_w.T
                out[key] = float((y - ref).norm() / ref.norm())
            except Exception as err:  # fail soft: recorded, the run goes on
                out[key] = f"FAILED {type(err).__name__}: {str(err).strip()[:120]}"
    return out


def headline(results: list[Row], shapes: dict) -> dict:
    """The report's summary keys: 4096->11008 per method and M (None where not measured yet). ``nf4_kernel_*``
    is the kernel the app runs in fast mode (the repacked one, its fastest config per M); ``storage_kernel_*``
    the kernel on bitsandbytes' own storage, which these keys named until 2026-11-29 (an H200 report then read
    30.7 µs at one row for a kernel the app ran at 17.5)."""
    table = {(r.k, r.n, r.m, r.method): r.us for r in results}

    def get(m: int, method: str) -> float | None:
        return table.get((4096, 11008, m, method))

    return {
        **{f"nf4_kernel_m{m}_us": get(m, "repacked") for m in (1, 16, 32, 64)},
        **{f"storage_kernel_m{m}_us": get(m, "triton") for m in (1, 16, 32, 64)},
        "bnb_m1_us": get(1, "bnb"), "bnb_m64_us": get(64, "bnb"), "bf16_m64_us": get(64, "bf16"),
        "floor_us": shapes.get("4096->11008", {}).get("floor_us"),
        "tinygemm_m1_us": get(1, "tinygemm_g128"), "tinygemm_m16_us": get(16, "tinygemm_g128"),
        "tinygemm_g64_m1_us": get(1, "tinygemm_g64"),
        **{f"repacked_m{m}_us": get(m, "repacked") for m in (1, 16, 64)},
        **{f"repacked_exact_m{m}_us": get(m, "repacked_exact") for m in (1, 16, 64)},
    }


def headline_of(report: dict) -> dict:
    """``headline`` of a kernel report as its JSON holds it (rows as objects): the keys as this code names
    them, whatever the run that wrote the report called them."""
    known = {f.name for f in fields(Row)}     # a key a later version adds is not this code's
    return headline([Row(**{key: v for key, v in r.items() if key in known}) for r in report.get("rows", [])],
                    report.get("shapes", {}))


def tuning_log() -> list[dict]:
    """Every config both tuners timed so far, per (kernel, shape, row class); none where no kernel module was
    imported (a tuner never ran, and Triton need not be installed)."""
    modules = (("triton", "medusa_core.quant.nf4_matmul"), ("repacked", "medusa_core.quant.nf4_repacked_matmul"))
    return [{"kernel": kernel, "n": key[2], "k": key[3], "row_class": key[1],
             "timed": [{"config": c, "us": us} for c, us in log]}
            for kernel, name in modules if name in sys.modules
            for key, log in sys.modules[name].TUNING_LOG.items()]


def tuned_lines(log: list[dict]) -> list[str]:
    """One line per tuned (kernel, shape, row class) of ``tuning_log()``: the config kept and its µs, and
    where the split-K sum was timed both ways, the fastest of each (in one launch, or a second)."""
    lines = []
    for t in log:
        timed = [(e["config"], e["us"]) for e in t["timed"] if e["us"] is not None]
        if not timed:
            continue
        config, us = min(timed, key=lambda e: e[1])
        if t["row_class"] == "exact":       # exact mode's one config for every M (nf4_repacked_matmul.tune_exact)
            lines.append(f"{t['kernel']} {t['k']}->{t['n']} exact, every M: {config} {us:.1f} µs for a 1-row and a "
                         f"16-row call ({len(t['timed']) - len(timed)} of {len(t['timed'])} not row-exact or failed)")
            continue
        line = f"{t['kernel']} {t['k']}->{t['n']} M<={t['row_class']}: {config} {us:.1f} µs"
        serial = [u for c, u in timed if c.endswith(" serial")]
        split = [u for c, u in timed if " split1 " not in c and not c.endswith(" serial")]
        if serial and split:
            line += f" (split-K sum in one launch {min(serial):.1f}, in a second {min(split):.1f})"
        lines.append(line)
    return lines


def parse_shape(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not KxN (in x out features), e.g. 4096x11008") from None
    if min(k, n) < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r} has a side below 1: K and N are feature counts, e.g. 4096x11008")
    return k, n


def parser(cuda: bool = True) -> argparse.ArgumentParser:
    """(``cuda``: the other benchmarks' signature; this one runs on CUDA only, so nothing defaults by it.)"""
    p = OneLineParser(prog="python -m medusa_core.benchmarks.nf4_kernel", description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("out/nf4.json"),
                   help="where to write the results (rewritten after each shape, so a run cut short keeps them)")
    p.add_argument("--shapes", type=parse_shape, nargs="+", default=list(SHAPES), metavar="KxN",
                   help="projections to time, in features x out features (default: the 7B ones and the heads')")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser(torch.cuda.is_available()).parse_args(argv)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU: run it on the GPU machine")
        return 2
    import bitsandbytes
    import triton

    device = torch.device("cuda")
    props = torch.cuda.get_device_properties(device)
    bandwidth = copy_bandwidth(device)
    env = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
           "bitsandbytes": bitsandbytes.__version__, "python": platform.python_version(),
           "copy_bandwidth_gbps": round(bandwidth / 1e9, 1), "l2_bytes": props.L2_cache_size}
    print(f"{env['device']}: copy bandwidth {bandwidth / 1e9:.0f} GB/s, L2 {props.L2_cache_size >> 20} MB")
    results, shapes = [], {}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    for k, n in args.shapes:
        rows, info = bench_shape(k, n, device, props.L2_cache_size)
        # HBM time to read the packed weight and its scales once, at the rate a copy moves bytes (read +
        # write counted, see copy_bandwidth): the least any NF4 kernel can take for this shape
        floor_us = info["packed_bytes"] / bandwidth * 1e6
        shapes[f"{k}->{n}"] = {**info, "floor_us": round(floor_us, 2)}
        errors = ", ".join(f"{meth} {max(v.values(), default=float('nan')):.1e}"
                           for meth, v in info["rel_error"].items())
        print(f"{k}->{n}: packed weight + scales {info['packed_bytes'] / 1e6:.1f} MB (repacked "
              f"{info['repacked_bytes'] / 1e6:.1f} MB), floor {floor_us:.1f} us; rel error {errors}; rows equal "
              f"alone: exact {all(info['rows_identical_to_alone']['exact'].values())}, "
              f"fast {all(info['rows_identical_to_alone']['fast'].values())}")
        results.extend(rows)
        # a device call has a time limit: what is measured so far is on disk before the next shape starts
        args.json.write_text(json.dumps({"env": env, "shapes": shapes, "summary": headline(results, shapes),
                                         "partial": True, "rows": [asdict(r) for r in results],
                                         "tuning": tuning_log()}, indent=1))
        print(f"  {k}->{n} done at {time.monotonic() - started:.0f} s; wrote {args.json}")
    table = {(r.k, r.n, r.m, r.method): r.us for r in results}
    variants = {(r.k, r.n, r.m, r.method): r.variant for r in results if r.variant}
    print(f"\n{'shape':>12} {'M':>3} " + " ".join(f"{m[:11]:>11}" for m in METHODS)
          + "   (us per call)  triton | repacked config")
    for k, n in args.shapes:
        for m in ROWS:
            cells = [table.get((k, n, m, meth)) for meth in METHODS]
            print(f"{f'{k}->{n}':>12} {m:>3} " + " ".join(f"{c:>11.1f}" if c else f"{'-':>11}" for c in cells)
                  + f"  {variants.get((k, n, m, 'triton'), '')} | {variants.get((k, n, m, 'repacked'), '')}")
    fusion = bench_fusion(device, props.L2_cache_size)     # before the tuning log: it tunes the fused shapes
    print("\nfused against separate repacked matmuls (us): " + "; ".join(
        f"{f['group']} M={f['m']} {f['mode']} {f['us']:.1f}" if f["us"] is not None else
        f"{f['group']} M={f['m']} {f['mode']} -" for f in fusion))
    tuning = tuning_log()
    print("\ntuner timings (us; '-' = skipped):")
    for t in tuning:
        print(f"  {t['kernel']} {t['k']}->{t['n']} M<={t['row_class']}: " + ", ".join(
            f"{e['config']} {e['us']:.1f}" if e["us"] is not None else f"{e['config']} -" for e in t["timed"]))
    checks = dtype_check(device)
    print("\nstream kernel, other activation dtypes (relative error, want < 1e-2): " + ", ".join(
        f"{key} {v:.1e}" if isinstance(v, float) else f"{key} {v}" for key, v in checks.items()))
    summary = headline(results, shapes)
    print("\nsummary (4096->11008): " + ", ".join(f"{key} {v:.1f}" if v else f"{key} -" for key, v in summary.items()))
    args.json.write_text(json.dumps({"env": env, "shapes": shapes, "summary": summary, "partial": False,
                                     "rows": [asdict(r) for r in results], "tuning": tuning,
                                     "dtype_check": checks, "fusion": fusion}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(exit_status(main))   # Ctrl-C: one line, exit 130
