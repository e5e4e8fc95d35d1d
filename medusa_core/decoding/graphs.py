"""CUDA graph plumbing shared by the decoding step and the benchmarks: whether a model's steps are
captured, and the one side stream every warm-up and capture runs on."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU for every warm-up and capture. Not a new stream each time:
    cuBLAS keeps a workspace per stream it has seen, for the process's life."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> Iterator[None]:
    """Record into ``graph`` on ``stream``. thread_local: a CUDA call from another thread (a second tab's
    answer, one still running on the model a load replaces) cannot break the capture. No garbage
    collection inside it either: freeing another graph or its memory there would invalidate this one."""
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):   # records, runs nothing
            yield
    finally:
        gc.enable()


def use_graphs(model: nn.Module, graphs: bool | None) -> bool:
    """CUDA graphs by default on CUDA; eager elsewhere (and when asked, to compare)."""
    on_cuda = model.get_output_embeddings().weight.device.type == "cuda"
    if graphs and not on_cuda:
        raise ValueError("CUDA graphs were asked for but the model is not on a CUDA device: pass graphs=None or False")
    return on_cuda if graphs is None else graphs
