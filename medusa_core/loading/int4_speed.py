"""How much faster the CPU's int4 mode runs than fp32 on this machine: measured once per (model,
machine) and remembered, like the tuned tree.

Why: ``--quant auto`` takes int4 only where it measures at least cpu_int4.MIN_GAIN times fp32's
speed, and on some CPUs the gain sits near that line. On an emulated AVX2 CPU four starts measured
1.05x, 1.1x, 1.2x and 1.2x (QA, 2026-11-27): the first ran fp32, the others int4, and the two modes
give different greedy answers, so the same question got another answer after a restart. The first
quiet measurement now decides for this machine until ``--retune``. One taken while other programs
used the CPU is used for that start only (this_machine.BUSY_SHARE), as a tuned tree is.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..quant import cpu_int4
from ..quant.cpu_int4 import Speed
from .this_machine import BUSY_SHARE, entry_path, file_stamp, machine_identity, with_cpu_share, write_atomic

SPEED_VERSION = 1        # part of the key: a change in how cpu_int4.measure times re-measures
FOLDER, NAME = "int4-speed", "speed.json"
# how the load line goes on after "measured 1.28x fp32's matmul speed"
KEPT = ", kept for this machine until --retune"
READ = " at an earlier start on this machine, kept until --retune"


def speed_key(model) -> dict:
    """Everything the gain depends on: this CPU as torch dispatches on it, torch, the model and its files."""
    source = str(getattr(model, "name_or_path", "") or "")
    return {"measure": SPEED_VERSION, "machine": machine_identity(torch.device("cpu")), "model": source,
            "model_config": model.config.to_json_string(use_diff=True),
            "model_files": file_stamp(Path(source)) if source and Path(source).exists() else []}


def read_speed(entry: Path, key: dict) -> Speed | None:
    """The remembered figures for ``key``; None where there are none, or for another key, or damaged."""
    if not entry.is_file():
        return None
    try:
        saved = json.loads(entry.read_text())
        if not isinstance(saved, dict) or saved.get("key") != key:
            return None
        fp32_ms, int4_ms = float(saved["fp32_ms"]), float(saved["int4_ms"])
    except (ValueError, TypeError, KeyError):
        return None          # an interrupted write of an older version: measured again
    return Speed(fp32_ms, int4_ms, READ) if fp32_ms > 0 and int4_ms > 0 else None


def remembered_speed(model, cache_root: Path, retune: bool = False) -> Speed:
    """The gain for ``model`` on this machine: read from ``cache_root`` if measured before (and not
    ``retune``), otherwise measured now and written there unless the CPU was busy. OSError: the cache
    could not be written (the loader names the directory and the fix)."""
    key = speed_key(model)
    entry = entry_path(key, cache_root, FOLDER, NAME)
    kept = None if retune else read_speed(entry, key)
    if kept is not None:
        return kept
    times, share = with_cpu_share(lambda: cpu_int4.measure(model))
    if share < BUSY_SHARE:
        return Speed(times["fp32_ms"], times["int4_ms"],
                     f" while other programs used the CPU (this app got {share:.0%} of it), so not kept")
    write_atomic(entry, json.dumps({"key": key, **times, "cpu_share": round(share, 3)}, indent=1) + "\n")
    return Speed(times["fp32_ms"], times["int4_ms"], KEPT)
