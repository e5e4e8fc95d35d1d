"""How much faster the CPU's int4 mode runs than fp32 on this machine: measured once per (model,
machine) and remembered, like the tuned tree.

Why: ``--quant auto`` takes int4 only where it measures at least cpu_int4.MIN_GAIN times fp32's
speed, and on some CPUs the gain sits near that line. On an emulated AVX2 CPU four starts measured
1.05x, 1.1x, 1.2x and 1.2x (QA, 2026-11-27): the first ran fp32, the others int4, and the two modes
give different greedy answers, so the same question got another answer after a restart. The first
measurement now decides for this machine until ``--retune``.

A measurement taken while other programs used the CPU (this_machine.BUSY_SHARE) is skewed, and not
only noisy: on that AVX2 CPU busy starts measured 0.96-0.99x where quiet ones measured 1.21x (QA).
So it is kept as provisional: later starts keep using it and replace it by the first quiet measurement
(one change of mode at most, where the busy figure chose otherwise). A later start looks at the CPU
for 0.3 s first and measures only where it is quiet: measuring on a busy emulated AVX2 CPU took 40-110 s
of a start, to change nothing (QA). A busy measurement never replaces a quiet one, not even under
``--retune``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..quant import cpu_int4
from ..quant.cpu_int4 import Speed
from ..quant.kernel_timing import with_work_beside
from .smollm2 import cache_write_failed
from .this_machine import (BUSY_SHARE, cpu_share_now, entry_path, file_stamp, machine_identity, with_cpu_share,
                           write_atomic)

SPEED_VERSION = 3        # part of the key: a change in how cpu_int4.measure times re-measures (2: the head's two
#                          approximations timed too, cpu_int4.choose_head; 3: q/k/v and gate/up timed fused)
FOLDER, NAME = "int4-speed", "speed.json"
# how the load line goes on after "1.28x fp32's matmul speed, "
FRESH = "measured now and kept for this machine until --retune"
READ = "measured earlier on this machine and kept until --retune"   # an earlier start, or an earlier load (QA)
BUSY = "while other programs used the CPU, this app getting {share:.0%} of it"
# a load beside an answer still running on the model it replaces (kernel_timing.beside): the CPU that answer took is
# this app's own, not other programs' (QA: the line blamed other programs with nothing else running)
ANSWERING = "while an answer on the model this load replaces still ran"
# "load", not "start": an Unload and Load in one process reads these too, and said "at an earlier start" (QA)
PROVISIONAL = "kept until a load on a quiet CPU measures again"


@dataclass(frozen=True)
class Kept:
    """What the cache holds for a key: the figures and the CPU share they were measured with."""

    fp32_ms: float
    int4_ms: float
    cpu_share: float
    head_bf16_ms: float | None = None      # None: a model whose head the int4 kernel cannot take
    head_int4_ms: float | None = None

    @property
    def quiet(self) -> bool:
        return self.cpu_share >= BUSY_SHARE

    def speed(self, source: str) -> Speed:
        return Speed(self.fp32_ms, self.int4_ms, source, self.head_bf16_ms, self.head_int4_ms)


def speed_key(model) -> dict:
    """Everything the gain depends on: this CPU as torch dispatches on it, torch, the model and its files."""
    source = str(getattr(model, "name_or_path", "") or "")
    return {"measure": SPEED_VERSION, "machine": machine_identity(torch.device("cpu")), "model": source,
            "model_config": model.config.to_json_string(use_diff=True),
            "model_files": file_stamp(Path(source)) if source and Path(source).exists() else []}


def read_kept(entry: Path, key: dict) -> Kept | None:
    """The remembered figures for ``key``; None where there are none, or for another key, or damaged."""
    if not entry.is_file():
        return None
    try:
        saved = json.loads(entry.read_text())
        if not isinstance(saved, dict) or saved.get("key") != key:
            return None
        heads = [None if saved.get(k) is None else float(saved[k]) for k in ("head_bf16_ms", "head_int4_ms")]
        kept = Kept(float(saved["fp32_ms"]), float(saved["int4_ms"]), float(saved["cpu_share"]), *heads)
    except (OSError, ValueError, TypeError, KeyError):
        return None          # an interrupted write of an older version, or a file this user cannot read: measured again
    return kept if kept.fp32_ms > 0 and kept.int4_ms > 0 else None


def remembered_speed(model, cache_root: Path, retune: bool = False,
                     progress: Callable[[str], None] | None = None) -> Speed:
    """The gain for ``model`` on this machine (see the module docstring for which figure wins). A cache that
    cannot be written does not fail the load: this start uses what it measured and its line says why it was
    not kept, naming the path and the fix. ``progress`` hears when it measures (seconds of a load), only then:
    the load said it timed the weights at every start, where later ones read the figure (review)."""
    key = speed_key(model)
    entry = entry_path(key, cache_root, FOLDER, NAME)
    kept = read_kept(entry, key)
    if kept is not None and kept.quiet and not retune:
        return kept.speed(READ)
    provisional = f"measured at an earlier load on a busy CPU and {PROVISIONAL}"
    if kept is not None and not retune:
        share, answering = with_work_beside(cpu_share_now)
        if share < BUSY_SHARE:
            busy = "with an answer still running here" if answering else f"this app getting {share:.0%} of the CPU"
            return kept.speed(f"{provisional}; this load found it busy too, {busy}")
    if progress is not None:
        progress("timing the 4-bit weights against fp32 on this CPU")
    (times, share), answering = with_work_beside(lambda: with_cpu_share(lambda: cpu_int4.measure(model)))
    busy = ANSWERING if answering else BUSY.format(share=share)
    gain = times["fp32_ms"] / times["int4_ms"]
    if share < BUSY_SHARE and kept is not None and (kept.quiet or not retune):
        if kept.quiet:        # --retune on a busy CPU
            return kept.speed(f"measured at an earlier load on a quiet CPU and kept: this --retune measured "
                              f"{gain:.2f}x {busy}, and did not keep it")
        return kept.speed(f"{provisional}; this load measured {gain:.2f}x {busy}")
    source = FRESH if share >= BUSY_SHARE else f"measured {busy}: {PROVISIONAL}"
    try:
        write_atomic(entry, json.dumps({"key": key, **times, "cpu_share": round(share, 3)}, indent=1) + "\n")
    except OSError as err:
        # measured: this load decides by it, the next one measures again (QA: the load failed after measuring)
        measured = f"measured {busy}" if share < BUSY_SHARE else "measured now"
        source = f"{measured}, not kept: {cache_write_failed('the measured speed', err)}"
    return Speed(source=source, **times)
