"""The GPU's kernel timings, remembered across starts of the app.

Why: on CUDA, ``--nf4-kernel auto`` and ``--norm-kernel auto`` choose by timing on the user's GPU at
load: bitsandbytes against the Triton kernel at one row, each NF4 tuner's candidates per shape and row
class (the repacked kernel's six row classes for every matmul shape), fused against separate
projections, and both norms. For a 7B that is a few hundred CUDA-graph timings, each compiling its
config first, at every start. The first start keeps what it measured in the user's cache; a later
start on the same GPU reads it and routes the same way without timing (``--retune`` times again).

A timing holds only for what it was measured with: the key names the GPU (name, compute capability,
memory, SMs), torch, CUDA, Triton and bitsandbytes, and a digest of the kernels' and tuners' source (every
module of medusa_core/quant), so another GPU, an upgrade or a changed kernel is timed afresh. Whatever
loads through ``loading.load`` uses it as the app does (``bench``, which measures the app's path, included);
the step, kernel and profile benchmarks route the kernels themselves and time every run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..quant import kernel_timing
from .smollm2 import cache_write_failed
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
    except (OSError, ValueError):
        return {}             # an interrupted write, or a file this user cannot read: timed again, written whole
    if not isinstance(saved, dict) or saved.get("key") != key or not isinstance(saved.get("entries"), dict):
        return {}
    return saved["entries"]


@dataclass
class KernelTimings:
    """One load's kernel timings: ``memory`` holds what was kept before and what this load adds; ``routing()``
    is where the routings read and add to it; ``save()`` writes what is new."""

    key: dict
    entry: Path
    memory: kernel_timing.Memory
    unsaved: str = ""                  # why what was measured could not be kept, as the load line says it

    def routing(self):
        return kernel_timing.remembering(self.memory)

    def save(self) -> None:
        """Writes what was measured. A cache that cannot be written does not fail the load, whose routing is done
        (QA: a 7B load failed after its kernels were timed): the load line says why they were not kept."""
        if not self.memory.measured or self.memory.disturbed:
            return
        try:
            write_atomic(self.entry, json.dumps({"key": self.key, "entries": self.memory.entries}, indent=1) + "\n")
        except OSError as err:
            self.unsaved = cache_write_failed("them", err)

    @property
    def note(self) -> str:
        """What the load line says: timings read, measured now (and how long measuring took), or "" where nothing
        was timed."""
        m, where = self.memory, machine_line(self.key["machine"])
        if not m.read and not m.measured:
            return ""                  # nothing timed: bitsandbytes or transformers' norms asked for by name
        if not m.measured:
            return f"kernel timings: {len(m.read)} read from those kept for this {where}, --retune measures them again"
        read = f" ({len(m.read)} more read from those kept)" if m.read else ""
        kept = f"not kept: {self.unsaved}" if self.unsaved else \
            "used for this load only: measured while an answer ran on this GPU" if m.disturbed else \
            f"kept for this {where} until --retune"
        return f"kernel timings: {len(m.measured)} measured now in {m.seconds:.0f} s{read}, {kept}"


def recall(device: torch.device, cache_root: Path, retune: bool = False) -> KernelTimings:
    """The timings an earlier start kept for ``device`` (none under ``retune``: each is measured again)."""
    key = memory_key(device)
    entry = entry_path(key, cache_root, FOLDER, NAME)
    return KernelTimings(key, entry, kernel_timing.Memory(read_entries(entry, key), retune))
