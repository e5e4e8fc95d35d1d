"""Which RMSNorm the decoder runs: transformers' own, or one Triton kernel per norm
(rows_alone_norm.py), chosen on CUDA by timing both on the user's GPU at load.

Why: transformers' LlamaRMSNorm is about seven elementwise kernels, each reading and writing the row; in
the graphed 7B step on an H100 the 65 norms took 0.83 ms of 6.1 at one row and 1.44 ms of 10.8 at 16
(docs/performance.md, "Where the step's device time goes"). One kernel reads the row once. Whether that
is faster here is measured, not assumed: both are timed as the step runs them (in a CUDA graph, no launch
overhead) for a plain step's row and a 16-node tree's rows, and the faster is kept; the load line says
both sums. Off CUDA ``auto`` keeps transformers' (the interpreter is for tests). Each row of the Triton
norm is a function of that row alone, so greedy Medusa still gives plain decoding's tokens wherever the
rest of the step does.

Exact mode (``--nf4-kernel repacked-exact``) owns the norms: it puts the same kernel in as its own and
takes every RowsAloneRMSNorm out when it leaves, so the loaders route the norms after the NF4 kernel,
every time.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

NORM_KERNELS = ("auto", "torch", "triton")


def _children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return [(parent, name, child) for parent in list(decoder.modules()) for name, child in list(parent.named_children())]


def _kind(module: nn.Module) -> str | None:
    """"exact" or "fast" for a Triton norm module (found by class name: its module imports Triton)."""
    if type(module).__name__ != "RowsAloneRMSNorm":
        return None
    return "exact" if module.exact else "fast"


def norms_routed(model: nn.Module) -> str:
    """The decoder's RMSNorms now: "exact" (exact mode's), "triton" (the fast step's) or "torch"."""
    kinds = {_kind(child) for _, _, child in _children(model)}
    return "exact" if "exact" in kinds else "triton" if "fast" in kinds else "torch"


def use_norm_kernel(model: nn.Module, choice: str) -> str:
    """Route the decoder's RMSNorms by ``choice`` (auto | torch | triton); returns one line saying what was
    chosen, or "" where nothing is to say (auto off CUDA, or exact mode's norms, which the NF4 line names)."""
    if choice not in NORM_KERNELS:
        raise ValueError(f"norm kernel {choice!r} is unknown: use one of {', '.join(NORM_KERNELS)}")
    if norms_routed(model) == "exact":
        if choice != "auto":
            raise ValueError(f"--norm-kernel {choice}: --nf4-kernel repacked-exact brings its own row-exact norms: "
                             "drop --norm-kernel")
        return ""
    for parent, name, child in _children(model):       # the fast norms of an earlier routing go first
        if _kind(child) == "fast":
            original = child.original[0]
            original.weight = child.weight              # the parameter as it is now
            setattr(parent, name, original)
    from .rows_alone_norm import is_rms_norm

    norms = [(parent, name, child) for parent, name, child in _children(model) if is_rms_norm(child)]
    if choice == "torch":
        return "norms: transformers' RMSNorm"
    if not norms:
        if choice == "triton":
            raise ValueError("--norm-kernel triton: this model has no RMSNorm of a kind the Triton norm replaces "
                             "(Llama, Mistral, Qwen2, Qwen3): use --norm-kernel auto")
        return ""
    device, note = _device_of([child for _, _, child in norms]), ""
    if device.type != "cuda":
        from .triton_runtime import INTERPRET_ENV, interpret_enabled

        if choice == "auto":
            return ""                                   # the interpreter is for tests, never chosen
        if device.type != "cpu" or not interpret_enabled():
            raise ValueError(f"--norm-kernel triton: the Triton norm needs a CUDA device (on the CPU it runs only "
                             f"under Triton's interpreter, {INTERPRET_ENV}=1, for tests): use --norm-kernel auto")
    elif choice == "auto":
        try:
            torch_us, triton_us = _timed_sums([child for _, _, child in norms], device)
        except Exception as err:  # e.g. a Triton that cannot compile the kernel for this GPU: said, never hidden
            line = str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__
            return f"norms: transformers' RMSNorm (auto: the Triton norm failed on this GPU: {line})"
        steps = " and a ".join(f"{m}-row" for m in _rows())
        if not triton_us < torch_us:
            return (f"norms: transformers' RMSNorm (auto measured {torch_us:.0f} µs against {triton_us:.0f} µs for "
                    f"the Triton norm over a {steps} step)")
        note = f" (auto measured {triton_us:.0f} µs against {torch_us:.0f} µs for transformers' over a {steps} step)"
    from .rows_alone_norm import RowsAloneRMSNorm

    for parent, name, child in norms:
        setattr(parent, name, RowsAloneRMSNorm(child, exact=False))
    return f"norms: one Triton kernel for each of {len(norms)} RMSNorms{note}"


def _device_of(norms: list[nn.Module]) -> torch.device:
    return norms[0].weight.device


def _rows() -> tuple[int, ...]:
    from .bnb import AUTO_ROWS      # the rows the NF4 kernel choice weighs too: a plain step, a 16-node tree

    return AUTO_ROWS


def _timed_sums(norms: list[nn.Module], device: torch.device) -> tuple[float, float]:
    """(transformers' µs, the Triton kernel's µs) for every norm of ``norms`` once at each of _rows(), each
    (width, dtype) timed once in a CUDA graph. A Triton result off transformers' by more than rounding
    raises."""
    from .kernel_timing import graph_time_us
    from .rows_alone_norm import rows_alone_rms_norm

    count: dict[tuple[int, torch.dtype], list[nn.Module]] = {}
    for norm in norms:
        count.setdefault((norm.weight.shape[-1], norm.weight.dtype), []).append(norm)
    torch_us = triton_us = 0.0
    for (width, dtype), same in count.items():
        norm = same[0]
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        for rows in _rows():
            x = torch.randn(rows, width, device=device, dtype=dtype)                   # (rows, width)
            with torch.no_grad():
                reference, ours = norm(x).float(), rows_alone_rms_norm(x, norm.weight, eps).float()
                error = float((ours - reference).norm() / reference.norm().clamp_min(1e-30))
                if not error <= 1e-2:
                    raise RuntimeError(f"wrong result: relative error {error:.1e} against transformers' RMSNorm")
                # 16 launches a capture: one norm is a few µs, near the events' resolution
                torch_us += len(same) * graph_time_us([functools.partial(norm, x)] * 16)
                triton_us += len(same) * graph_time_us(
                    [functools.partial(rows_alone_rms_norm, x, norm.weight, eps)] * 16)
    return torch_us, triton_us
