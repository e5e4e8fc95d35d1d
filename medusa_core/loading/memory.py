"""One line on the memory a loaded model and its heads hold."""

from __future__ import annotations

import ctypes
import gc
import resource
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from ..decoding.graphs import CAPTURE_WAIT_S, outside_captures
from ..heads.medusa_heads import MedusaHeads


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def free_memory(drop: Callable[[], object] | None = None) -> None:
    """What was freed, handed back: a figure read after it is what the process holds, not what it once did.
    ``drop``: what lets go of memory first (the KV caches and their captured graphs), in the same turn between
    CUDA graph captures: freeing a graph or its memory during another thread's capture invalidates it (review)."""
    def collect() -> None:
        if drop is not None:
            drop()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    if not outside_captures(collect):
        print(f"memory: a CUDA graph capture in another thread ran past {CAPTURE_WAIT_S:.0f} s: what was freed "
              "stays with the process for now, and the memory figures count it", flush=True)
    # glibc keeps freed heap pages for the process to reuse, so an unloaded model's CPU weights still
    # counted as resident (SmolLM2 unloaded: 1.09 GiB resident, 531 MiB after a trim); other C
    # libraries have no malloc_trim, and their freed memory is what it is
    if sys.platform.startswith("linux"):
        trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
        if trim is not None:
            trim(0)


def memory_report(model, heads: MedusaHeads | None, device: str) -> str:
    """One line on the memory in use after a load, its conversions' and measurements' garbage handed back first
    (QA: SmolLM2 said 1.56 GiB after the start that converted it, about 1.0 GiB at later starts)."""
    free_memory()
    weights = model.get_memory_footprint()
    # buffers too: a proposal vocabulary's copy of lm_head rows (14 MB for SmolLM2's)
    tensors = [*heads.parameters(), *heads.buffers()] if heads is not None else []
    head_bytes = sum(t.numel() * t.element_size() for t in tensors)
    parts = f"weights {_size(weights)} + heads {_size(head_bytes)}"
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        total = torch.cuda.get_device_properties(index).total_memory
        return (f"GPU memory {_size(torch.cuda.memory_allocated(index))} allocated, "
                f"{_size(torch.cuda.memory_reserved(index))} reserved of {_size(total)} ({parts})")
    status = Path("/proc/self/status")
    if status.is_file():
        rss = next((int(l.split()[1]) * 1024 for l in status.read_text().splitlines() if l.startswith("VmRSS:")), 0)
        return f"process RSS {_size(rss)} ({parts})"
    # no /proc (macOS): the peak is what getrusage offers (bytes there)
    return f"peak RSS {_size(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)} ({parts})"
