"""CUDA graph plumbing shared by the decoding step and the benchmarks: whether a model's steps are
captured, and the one side stream every warm-up and capture runs on."""

from __future__ import annotations

import torch
from torch import nn


_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per GPU for every warm-up and capture. Not a new stream each time:
    cuBLAS keeps a workspace per stream it has seen, for the process's life."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def use_graphs(model: nn.Module, graphs: bool | None) -> bool:
    """CUDA graphs by default on CUDA; eager elsewhere (and when asked, to compare)."""
    on_cuda = model.get_output_embeddings().weight.device.type == "cuda"
    if graphs and not on_cuda:
        raise ValueError("CUDA graphs were asked for but the model is not on a CUDA device: pass graphs=None or False")
    return on_cuda if graphs is None else graphs
