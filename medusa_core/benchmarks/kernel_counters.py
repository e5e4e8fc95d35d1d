"""Why a repacked NF4 call takes what it takes: its hardware counters, read by Nsight Compute (ncu).

    python -m medusa_core.benchmarks.kernel_counters --json out/counters.json
    python -m medusa_core.benchmarks.kernel_counters --shape 11008x4096 --json out/counters.json

On the H200 of 2026-11-29 the kernel ladder (kernel_ladder.py) took the 4096->11008 call apart: at one row the
tuned kernel took 17.3 µs, loading its words and scales alone 10.4, where the bytes take 6.1 at the copy
bandwidth; at 16 rows 28.2, loading alone 15.9. The compiled code's static counts (kernel_sass.py) put the one-row
kernel at 7.9 µs of instruction issue. Timings cannot say what the rest waits on; the counters can: the DRAM
throughput each call reaches, the warps an SM keeps, and what its warps stall on (a load not back, the shared
memory's queue, a dependency, the barrier).

Per shape it profiles, once each and in this order (``LABELS``), the configs the ladder and the H200's tuner name:
at one row the untimed default (split-K summed in the same launch), the tuner's pick (two groups ahead, x a group
ahead) and the default's loading-only rung; at 16 rows the default tile (byte planes through shared memory), the
tuner's pick (the scaled table, three stages) and the default's loading-only rung. Each call is checked against
the dequantized product first, outside the profiled range.

It runs itself under ncu (``--launch``: only the kernels; ncu flushes the caches before each of its passes, so
every call reads its weights from DRAM, as the step's do), ``--clock-control none`` (METHOD.md: the clocks are
left as the machine sets them), and reads the report back twice: the details page (each section's figures, as
``ncu --page details`` prints them) and, of the raw metrics, those that say where time goes (stall reasons per
issued instruction, DRAM bytes and throughput, active warps, duration). Writes one JSON: per label, its config,
the details by section, and the raw metrics kept. Needs a CUDA GPU and ncu (Nsight Compute) with access to the
counters: a machine whose ncu cannot read them fails in one line with ncu's own reason.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ..errors import OneLineParser, check_writable, exit_status, first_line
from .nf4_kernel import parse_shape

KERNEL_NAME = "repacked_kernel"      # the Triton program's name (quant/nf4_repacked_kernel.py), as profilers list it
SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "SchedulerStats", "WarpStateStats", "MemoryWorkloadAnalysis")
# the raw metrics kept: stall reasons, the DRAM's bytes and throughput, active warps, issue, duration
RAW_KEPT = ("issue_stalled", "dram__", "gpu__time_duration", "sm__warps_active", "smsp__issue_active",
            "sm__throughput", "launch__")
LABELS = ("1 row, default", "1 row, tuned on the H200", "1 row, default, loading only",
          "16 rows, default", "16 rows, tuned on the H200", "16 rows, default, loading only")
# where ncu is when it is not on the PATH (the CUDA image's Nsight Compute)
NCU_PLACES = ("/usr/local/cuda/bin/ncu", *sorted(str(p) for p in Path("/opt/nvidia").glob("nsight-compute/*/ncu")))


@dataclasses.dataclass(frozen=True)
class Call:
    label: str
    m: int
    config: object      # RepackedConfig
    ladder: int         # the kernel's LADDER: 0 the call itself, 2 loading only (kernel_ladder.RUNGS)


def calls(n: int, k: int, sms: int, group: int = 128) -> list[Call]:
    """The profiled calls, in LABELS' order: each row count's default, the H200's pick, the default loading only."""
    from ..quant import nf4_repacked_configs as rc

    groups = -(-k // group)
    one = rc.fast_config(1, n, groups, sms)
    one = dataclasses.replace(one, serial=one.split_k > 1)          # the ladder's one-row default
    picked_one = dataclasses.replace(one, prefetch=2, x_ahead=True)
    sixteen = rc.fast_config(16, n, groups, sms)
    picked_sixteen = dataclasses.replace(sixteen, decode="scaled", num_stages=3)
    configs = ((1, one, 0), (1, picked_one, 0), (1, one, 2), (16, sixteen, 0), (16, picked_sixteen, 0),
               (16, sixteen, 2))
    return [Call(label, m, cfg, ladder) for label, (m, cfg, ladder) in zip(LABELS, configs)]


def launch(k: int, n: int) -> None:
    """``--launch``, under ncu: each call checked outside the profiled range, then each launched once inside it
    (cudaProfilerStart/Stop: ncu runs with --profile-from-start off)."""
    from ..quant import nf4_repacked_matmul as rm
    from ..quant.nf4_repack import dequantize_reference

    device = torch.device("cuda")
    w, _, gen = rm.tuning_weight(n, k, torch.bfloat16, device, 128)
    reference = dequantize_reference(w)                                   # (N, K) fp32
    todo = calls(n, k, torch.cuda.get_device_properties(device).multi_processor_count)
    xs = {m: torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=gen) for m in {c.m for c in todo}}
    for c in todo:                   # compiled, and right, before anything is profiled
        y = rm.repacked_matmul(xs[c.m], w, config=c.config, ladder=c.ladder).float()
        if c.ladder == 0:
            expected = xs[c.m].float() @ reference.T
            error = float((y - expected).norm() / expected.norm())
            if not error <= 1e-2:
                raise RuntimeError(f"{c.label} ({c.config.describe()}): relative error {error:.1e}")
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for c in todo:
        rm.repacked_matmul(xs[c.m], w, config=c.config, ladder=c.ladder)
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def find_ncu() -> str | None:
    return shutil.which("ncu") or next((p for p in NCU_PLACES if Path(p).is_file()), None)


def read_csv(text: str) -> list[dict[str, str]]:
    """ncu's --csv output as rows; the lines it prints before the table (==PROF== notes) are skipped."""
    start = next((i for i, line in enumerate(text.splitlines()) if line.startswith('"ID"')), None)
    if start is None:
        return []
    return list(csv.DictReader(io.StringIO("\n".join(text.splitlines()[start:]))))


def details_by_launch(rows: list[dict[str, str]]) -> dict[int, dict[str, dict[str, str]]]:
    """``--page details --csv`` rows as {launch id: {section: {metric (unit): value}}}."""
    out: dict[int, dict[str, dict[str, str]]] = {}
    for r in rows:
        if not r.get("Metric Name"):        # a rule's advice line, which names no metric
            continue
        unit = f" ({r['Metric Unit']})" if r.get("Metric Unit") else ""
        out.setdefault(int(r["ID"]), {}).setdefault(r["Section Name"], {})[r["Metric Name"] + unit] = r["Metric Value"]
    return out


def raw_by_launch(rows: list[dict[str, str]], kept: tuple[str, ...] = RAW_KEPT) -> dict[int, dict[str, str]]:
    """``--page raw --csv`` rows (one per launch, a column per metric) as {launch id: {metric (unit): value}}, only
    the metrics whose names hold one of ``kept``. The units are the row under the header (the one with no ID):
    ncu scales them per metric (Kbyte, Mbyte, usecond), so a value means nothing without its own."""
    units = next((r for r in rows if not r.get("ID")), {})
    return {int(r["ID"]): {name + (f" ({units[name]})" if units.get(name) else ""): value
                           for name, value in r.items() if any(part in name for part in kept)}
            for r in rows if r.get("ID", "").isdigit()}


def run(ncu: str, k: int, n: int, report: Path, timeout_s: float) -> None:
    """The profiled launch under ncu, into ``report`` (.ncu-rep); RuntimeError with ncu's reason if it fails."""
    sections = [arg for name in SECTIONS for arg in ("--section", name)]
    command = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--kernel-name", KERNEL_NAME,
               *sections, "--export", str(report), "--force-overwrite",
               sys.executable, "-m", "medusa_core.benchmarks.kernel_counters", "--launch", "--shape", f"{k}x{n}"]
    print(" ".join(command), flush=True)
    # a group of its own: at the timeout the profiled Python goes with ncu, instead of holding the GPU
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise RuntimeError(f"ncu ran past --timeout-s {timeout_s:g} on {k}->{n}: give it more") from None
    print(output[-8000:], flush=True)
    errors = [line for line in output.splitlines() if "==ERROR==" in line or "Error" in line]
    if proc.returncode != 0 or not report.is_file():
        reason = errors[0] if errors else f"exit {proc.returncode}, no report"
        raise RuntimeError(f"ncu failed on {k}->{n}: {reason.strip()}")


def page(ncu: str, report: Path, name: str) -> str:
    done = subprocess.run([ncu, "--import", str(report), "--page", name, "--csv"], capture_output=True, text=True,
                          timeout=120)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[0]
        raise RuntimeError(f"ncu could not read {report}'s {name} page: {why}")
    return done.stdout


def parser(cuda: bool = True) -> argparse.ArgumentParser:
    """(``cuda``: the other benchmarks' signature; this one runs on CUDA only, so nothing defaults by it.)"""
    p = OneLineParser(prog="python -m medusa_core.benchmarks.kernel_counters",
                      description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=parse_shape, nargs="+", default=[(4096, 11008)], metavar="KxN",
                   help="projections, in features x out features (default: 4096x11008)")
    p.add_argument("--json", type=Path, default=Path("out/counters.json"),
                   help="where to write the counters (rewritten after each shape)")
    p.add_argument("--timeout-s", type=float, default=180,
                   help="the most one shape's ncu run may take (the runbook's device time is short)")
    p.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)   # the run ncu profiles
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("error: the kernel counters are read on a CUDA GPU and this torch sees none: run it on the GPU "
              "machine (docs/performance.md, the runbook's counters stage)", file=sys.stderr)
        return 2
    if args.launch:
        launch(*args.shape[0])
        return 0
    ncu = find_ncu()
    if ncu is None:
        print("error: ncu (Nsight Compute) is not on this machine: put its folder on PATH, or use the kernel ladder "
              "(python -m medusa_core.benchmarks.kernel_ladder), which needs no counters", file=sys.stderr)
        return 2
    try:
        check_writable(args.json)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    result: dict = {"device": torch.cuda.get_device_name(0), "ncu": ncu, "shapes": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for k, n in args.shape:
            report = Path(tmp) / f"{k}x{n}.ncu-rep"
            try:
                run(ncu, k, n, report, args.timeout_s)
                details = details_by_launch(read_csv(page(ncu, report, "details")))
                raw = raw_by_launch(read_csv(page(ncu, report, "raw")))
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:     # the pages' reads time out too
                print(f"error: {first_line(err) or type(err).__name__}", file=sys.stderr)
                return 1
            # launches in the order launch() made them: one per call
            todo = calls(n, k, sms)
            ids = sorted(details)
            if len(ids) != len(todo):
                print(f"error: ncu profiled {len(ids)} launches of {KERNEL_NAME} on {k}->{n}, {len(todo)} were made: "
                      f"see the log above", file=sys.stderr)
                return 1
            result["shapes"][f"{k}->{n}"] = {c.label: {"m": c.m, "config": c.config.describe(), "ladder": c.ladder,
                                                       "details": details[i], "raw": raw.get(i, {})}
                                             for c, i in zip(todo, ids)}
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=1))
            for c, i in zip(todo, ids):
                speed = details[i].get("GPU Speed Of Light Throughput", {})
                shown = {key: value for key, value in speed.items() if key.startswith(("Duration", "DRAM Throughput",
                                                                                          "Compute (SM) Throughput"))}
                print(f"{k}->{n} {c.label:<32} {c.config.describe():<44} {shown}", flush=True)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
