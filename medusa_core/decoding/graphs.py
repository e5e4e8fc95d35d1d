"""CUDA graph plumbing shared by the decoding step and the benchmarks: whether a model's steps are
captured, the side stream each thread warms up and captures on, and the capture itself."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


_CAPTURE_STREAMS: dict[tuple[torch.device, int], torch.cuda.Stream] = {}
_CAPTURES = threading.Lock()
_capturing = 0                 # captures in progress, in all threads
_gc_was_enabled = True


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream this thread warms up and captures on, one per GPU and thread. Not a new stream
    each time: cuBLAS keeps a workspace per stream it has seen, for the process's life. Not one for all
    threads: a load tuning kernels in its thread while an answer captures in another would record into
    one stream at once."""
    key = (device, threading.get_ident())
    with _CAPTURES:
        if key not in _CAPTURE_STREAMS:
            _CAPTURE_STREAMS[key] = torch.cuda.Stream(device)
        return _CAPTURE_STREAMS[key]


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, collect: bool = True) -> Iterator[None]:
    """Record into ``graph`` on ``stream``. thread_local: a CUDA call from another thread (a second tab's
    answer, one still running on the model a load replaces) cannot break the capture. No garbage
    collection inside it either: freeing another graph or its memory there would invalidate this one.
    Garbage collection stays off until the last capture in any thread ends (a counter: one thread's end
    turned it on under another's capture). ``collect``: collect first, once per step capture; the kernel
    tuner's many short captures skip it (0.3 s each)."""
    global _capturing, _gc_was_enabled
    if collect:
        gc.collect()
    with _CAPTURES:
        if _capturing == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _capturing += 1
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):   # records, runs nothing
            yield
    finally:
        with _CAPTURES:
            _capturing -= 1
            if _capturing == 0 and _gc_was_enabled:
                gc.enable()


def use_graphs(model: nn.Module, graphs: bool | None) -> bool:
    """CUDA graphs by default on CUDA; eager elsewhere (and when asked, to compare)."""
    on_cuda = model.get_output_embeddings().weight.device.type == "cuda"
    if graphs and not on_cuda:
        raise ValueError("CUDA graphs were asked for but the model is not on a CUDA device: pass graphs=None or False")
    return on_cuda if graphs is None else graphs
