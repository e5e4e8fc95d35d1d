"""The GPU's kernel timings, remembered across starts of the app.

Why: on CUDA, ``--nf4-kernel auto`` and ``--norm-kernel auto`` choose by timing on the user's GPU at
load: bitsandbytes against the Triton kernel at one row, each NF4 tuner's candidates per shape and row
class (the repacked kernel's six row classes for every matmul shape), fused against separate
projections, and both norms. For a 7B that is a few hundred CUDA-graph timings, each compiling its
config first, at every start. The first start keeps what it measured in the user's cache; a later
start on the same GPU reads it and routes the same way without timing (``--retune`` times again).

A timing holds only for what it was measured with: the key names the GPU (name, compute capability,
memory, SMs), torch, CUDA, Triton and bitsandbytes, and a digest of the kernels' and tuners' source (every
module of medusa_core/quant), so another GPU, an upgrade or a changed kernel is timed afresh. The
benchmarks never read it: they time every run.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ..quant import kernel_timing
from .this_machine import entry_path, machine_identity, machine_line, write_atomic

MEMORY_VERSION = 1        # part of the key: a change in what is stored times everything again
FOLDER, NAME = "kernel-timings", "timings.json"
QUANT_SOURCES = Path(__file__).resolve().parent.parent / "quant"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def sources_digest(folder: Path = QUANT_SOURCES) -> str:
    """A digest of every kernel and tuner module's source: any change there times again."""
    digest = hashlib.sha256()
    for path in sorted(folder.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def memory_key(device: torch.device) -> dict:
    """Everything a kernel timing on ``device`` depends on."""
    machine = machine_identity(device)
    if device.type == "cuda":
        machine["sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    return {"version": MEMORY_VERSION, "machine": machine, "triton": _version("triton"),
            "bitsandbytes": _version("bitsandbytes"), "kernels": sources_digest()}


def read_entries(entry: Path, key: dict) -> dict:
    """The timings remembered under ``key``; {} where there are none, or for another key, or damaged."""
    if not entry.is_file():
        return {}
    try:
        saved = json.loads(entry.read_text())
    except ValueError:
        return {}             # an interrupted write: timed again, and written whole
    if not isinstance(saved, dict) or saved.get("key") != key or not isinstance(saved.get("entries"), dict):
        return {}
    return saved["entries"]


@dataclass
class KernelTimings:
    """One load's kernel timings: ``memory`` holds what an earlier start measured and what this one adds;
    ``routing()`` is where the routings read and add to it; ``save()`` writes what is new."""

    key: dict
    entry: Path
    memory: kernel_timing.Memory
    seconds: float = 0.0               # the routings' wall time

    @contextlib.contextmanager
    def routing(self) -> Iterator[None]:
        start = time.perf_counter()
        try:
            with kernel_timing.remembering(self.memory):
                yield
        finally:
            self.seconds += time.perf_counter() - start

    def save(self) -> None:
        """OSError: the cache could not be written (the loader names the path and the fix)."""
        if self.memory.measured:
            write_atomic(self.entry, json.dumps({"key": self.key, "entries": self.memory.entries}, indent=1) + "\n")

    @property
    def note(self) -> str:
        """What the load line says: read, measured now (and how long that took), or "" where nothing was timed."""
        m, where = self.memory, machine_line(self.key["machine"])
        if not m.read and not m.measured:
            return ""                  # nothing timed: bitsandbytes or transformers' norms asked for by name
        if not m.measured:
            return f"kernel timings: {m.read} read from an earlier start on this {where} (--retune times them again)"
        earlier = f", {m.read} read from an earlier start" if m.read else ""
        return f"kernel timings: {m.measured} measured now in {self.seconds:.0f} s{earlier}, kept for this {where} until --retune"


def recall(device: torch.device, cache_root: Path, retune: bool = False) -> KernelTimings:
    """The timings an earlier start kept for ``device`` (none under ``retune``: each is measured again)."""
    key = memory_key(device)
    entry = entry_path(key, cache_root, FOLDER, NAME)
    return KernelTimings(key, entry, kernel_timing.Memory(read_entries(entry, key), retune))
