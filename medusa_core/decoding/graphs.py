"""CUDA graph plumbing shared by the decoding step and the benchmarks: whether a model's steps are
captured, and how a graph is warmed up and recorded (on a side stream leased for it)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch
from torch import nn

T = TypeVar("T")


_FREE_STREAMS: dict[torch.device, list[torch.cuda.Stream]] = {}
_CAPTURES = threading.Lock()
_NO_CAPTURE = threading.Condition(_CAPTURES)   # notified as the last capture in progress ends
_capturing = 0                 # captures in progress, in all threads
CAPTURE_WAIT_S = 120.0         # how long freeing memory waits for another thread's capture to end
_gc_was_enabled = True


@contextmanager
def leased_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """A side stream for one warm-up and capture, given back after. Reused, not new each time: cuBLAS
    keeps a workspace (32 MiB) per stream it has seen, for the process's life. Not one stream for all:
    a load tuning kernels in its thread while an answer captures in another would record into the
    same stream at once. So there are as many streams as captures ever ran at once (one or two)."""
    with _CAPTURES:
        free = _FREE_STREAMS.setdefault(device, [])
        stream = free.pop() if free else torch.cuda.Stream(device)
    try:
        yield stream
    finally:
        with _CAPTURES:
            _FREE_STREAMS[device].append(stream)


def captured(record: Callable[[], T], device: torch.device, warm_up: Callable[[], object] | None = None,
             warmups: int = 2, collect: bool = True) -> tuple[torch.cuda.CUDAGraph, T]:
    """(graph, what ``record`` returned while recorded): ``warm_up`` (default ``record``) run ``warmups``
    times on a side stream first (compiles, cuBLAS handles and allocator pools stay out of the capture),
    then ``record`` captured on it. The caller replays the graph on its own stream."""
    with leased_stream(device) as side:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmups):
                (warm_up or record)()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, side, collect):
            out = record()
    return graph, out


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
            if _capturing == 0:
                if _gc_was_enabled:
                    gc.enable()
                _NO_CAPTURE.notify_all()


def outside_captures(free: Callable[[], object], timeout: float = CAPTURE_WAIT_S) -> bool:
    """Run ``free`` (gc.collect, torch.cuda.empty_cache) while no thread records a graph, none starting
    meanwhile; True once it ran. Another thread's unload or OOM handling freed memory during a capture,
    which invalidates the graph, and empty_cache asserts that no capture is underway. Not from inside a
    capture (it would wait for itself): past ``timeout`` it gives up and says so (False)."""
    with _NO_CAPTURE:
        if not _NO_CAPTURE.wait_for(lambda: _capturing == 0, timeout):
            return False
        free()
        return True


def use_graphs(model: nn.Module, graphs: bool | None) -> bool:
    """CUDA graphs by default on CUDA; eager elsewhere (and when asked, to compare)."""
    on_cuda = model.get_output_embeddings().weight.device.type == "cuda"
    if graphs and not on_cuda:
        raise ValueError("CUDA graphs were asked for but the model is not on a CUDA device: pass graphs=None or False")
    return on_cuda if graphs is None else graphs
