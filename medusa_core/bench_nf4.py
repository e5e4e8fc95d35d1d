"""GPU micro-benchmark: one NF4 projection at Medusa's row counts, every way we can multiply it.

    python -m medusa_core.bench_nf4 --json out/nf4.json

Per shape (Llama-7B projections and the heads' vocab projection) and M rows: bf16 F.linear,
bitsandbytes Linear4bit's own dispatch, its fused gemv forced, its dequantize + F.linear forced,
and the Triton kernel (nf4_matmul.py). Each is timed inside one CUDA graph (calls back to back,
median of replays via CUDA events), rotating among weight copies that together exceed L2.
A row that fails prints one line and the run goes on.
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = ((4096, 11008), (11008, 4096), (4096, 4096), (4096, 32000))   # (K in, N out)
ROWS = (1, 2, 4, 8, 16, 32, 64)
METHODS = ("bf16", "bnb", "bnb_gemv", "bnb_dequant", "triton")


@dataclass(frozen=True)
class Row:
    k: int
    n: int
    m: int
    method: str
    us: float | None          # None: failed (see error)
    error: str = ""


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

    from . import nf4_matmul as nm

    gen = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=gen) * 0.02
    packed, state = bnbf.quantize_4bit(w, blocksize=64, compress_statistics=True, quant_type="nf4")
    copies = nm.rotating_copies(packed, state, l2)
    dense = [w] + [w.clone() for _ in range(max(1, -(-2 * l2 // (w.numel() * 2))) - 1)]
    ref_w = bnbf.dequantize_4bit(packed, state).float()                       # (N, K)
    packed_bytes = packed.numel() + state.absmax.numel() * state.absmax.element_size() + \
        (state.state2.absmax.numel() * 4 + state.state2.code.numel() * 4 if state.nested else 0)
    check = {}
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen)
        calls = {
            "bf16": [functools.partial(F.linear, x, d) for d in dense],
            "bnb": [functools.partial(bnb.matmul_4bit, x, p.t(), quant_state=s) for p, s in copies],
            "bnb_gemv": [functools.partial(bnbf.gemv_4bit, x, p.t(), state=s) for p, s in copies] if m == 1 else None,
            "bnb_dequant": [(lambda p=p, s=s: F.linear(x, bnbf.dequantize_4bit(p, s).to(x.dtype))) for p, s in copies],
            "triton": [functools.partial(nm.nf4_matmul, x, p, s) for p, s in copies],
        }
        for method in METHODS:
            if calls[method] is None:
                continue             # bnb's fused gemv takes one row only
            try:
                if method == "triton":
                    y = nm.nf4_matmul(x, packed, state).float()
                    ref = x.float() @ ref_w.T
                    rel = float((y - ref).norm() / ref.norm())
                    check[m] = rel
                    if rel > 1e-2:
                        raise RuntimeError(f"wrong result: relative error {rel:.2e} > 1e-2")
                us = nm.graph_time_us(calls[method])
                rows.append(Row(k, n, m, method, us))
            except Exception as err:  # fail soft per row: one line, then the next row
                line = str(err).strip().splitlines()[0][:160] if str(err).strip() else type(err).__name__
                print(f"  {k}->{n} M={m} {method}: FAILED ({type(err).__name__}: {line})")
                rows.append(Row(k, n, m, method, None, line))
    del copies, dense
    return rows, {"packed_bytes": packed_bytes, "rel_error_triton": check}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("out/nf4.json"), help="where to write the results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_nf4 needs a CUDA GPU: run it on the GPU machine")
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
    for k, n in SHAPES:
        rows, info = bench_shape(k, n, device, props.L2_cache_size)
        floor_us = info["packed_bytes"] / bandwidth * 1e6     # as issue #11 counts it: bytes / copy rate
        shapes[f"{k}->{n}"] = {**info, "floor_us": round(floor_us, 2)}
        print(f"{k}->{n}: packed weight + scales {info['packed_bytes'] / 1e6:.1f} MB, floor {floor_us:.1f} us; "
              f"triton rel error {max(info['rel_error_triton'].values(), default=float('nan')):.1e}")
        results.extend(rows)
    table = {(r.k, r.n, r.m, r.method): r.us for r in results}
    print(f"\n{'shape':>12} {'M':>3} " + " ".join(f"{m:>11}" for m in METHODS) + "   (us per call)")
    for k, n in SHAPES:
        for m in ROWS:
            cells = [table.get((k, n, m, meth)) for meth in METHODS]
            print(f"{f'{k}->{n}':>12} {m:>3} " + " ".join(f"{c:>11.1f}" if c else f"{'-':>11}" for c in cells))
    get = functools.partial(lambda key: table.get(key))
    summary = {
        "nf4_kernel_m1_us": get((4096, 11008, 1, "triton")), "nf4_kernel_m16_us": get((4096, 11008, 16, "triton")),
        "nf4_kernel_m64_us": get((4096, 11008, 64, "triton")), "bnb_m1_us": get((4096, 11008, 1, "bnb")),
        "bnb_m64_us": get((4096, 11008, 64, "bnb")), "bf16_m64_us": get((4096, 11008, 64, "bf16")),
    }
    print("\nsummary (4096->11008): " + ", ".join(f"{key} {v:.1f}" if v else f"{key} -" for key, v in summary.items()))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"env": env, "shapes": shapes, "summary": summary,
                                     "rows": [asdict(r) for r in results]}, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
