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
_NO_CAPTURE = threading.Condition(_CAPTURES)   # notified as a capture ends
_capturing = 0                 # 1 while a capture is in progress (in any thread: they take turns)
_capture_owner: int | None = None     # the thread recording it
CAPTURE_WAIT_S = 120.0         # how long freeing memory waits for another thread's capture to end


@contextmanager
def leased_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """A side stream for one warm-up and capture, given back after. Reused, not new each time: cuBLAS
    keeps a workspace (32 MiB) per stream it has seen, for the process's life. Not one stream for all:
    captures take turns (``capturing``), but warm-ups do not, and a load warming a kernel up in its thread
    while an answer captures in another would put its work into that graph. So there are as many streams as
    warm-ups and captures ever ran at once (one or two)."""
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
    """Record into ``graph`` on ``stream``, one capture at a time in the process: torch.cuda.graph's entry
    synchronizes the device and empties the allocator's cache, which asserts that no capture is underway in
    any thread, so a load's kernel tuner capturing beside an answer's first step failed there (review; not
    run on a GPU). thread_local: a CUDA call from another thread (a second tab's eager answer, one still
    running on the model a load replaces) cannot break the capture. No garbage collection inside it either:
    freeing another graph or its memory there would invalidate this one. ``collect``: collect first, once
    this capture's turn has come (before it, another thread's capture could be underway), once per step
    capture; the kernel tuner's many short captures skip it (0.3 s each)."""
    global _capturing, _capture_owner
    with _NO_CAPTURE:
        if _capture_owner == threading.get_ident():    # it would wait for itself
            raise RuntimeError("a CUDA graph capture was started inside another in the same thread")
        _NO_CAPTURE.wait_for(lambda: _capturing == 0)
        _capturing, _capture_owner = 1, threading.get_ident()
    try:
        if collect:
            gc.collect()
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):   # records, runs nothing
                yield
        finally:
            if gc_was_enabled:
                gc.enable()
    finally:
        with _NO_CAPTURE:
            _capturing, _capture_owner = 0, None
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
