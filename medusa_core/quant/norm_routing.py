"""Which RMSNorm the decoder runs: transformers' own, or one Triton kernel per norm
(rows_alone_norm.py), chosen on CUDA by timing both on the user's GPU at load.

Why: transformers' LlamaRMSNorm is several elementwise kernels, each reading and writing the row; in
the graphed 7B step on an H100 the 65 norms took 0.83 ms of 6.1 at one row and 1.44 ms of 10.8 at 16
(docs/performance.md, "Where the step's device time goes"). One kernel reads the row once. Whether that
is faster here is measured, not assumed: both are timed as the step runs them (in a CUDA graph, no launch
overhead) for a plain step's row and a 16-node tree's rows, and the faster is kept; the load line says
both sums. Off CUDA ``auto`` keeps transformers' (the interpreter is for tests). Each row of the Triton
norm is a function of that row alone, so greedy Medusa still gives plain decoding's tokens wherever the
rest of the step does.

Exact mode (``--nf4-kernel repacked-exact``) owns the norms: it puts the same kernel in as its own and
takes every RowsAloneRMSNorm out when it leaves, so the loaders route the norms after the NF4 kernel,
every time. Triton is imported only where its norm is asked for or timed: a machine without it loads
with transformers' norms.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch import nn

from ..errors import first_line
from .kernel_timing import AUTO_ROWS, remembered
from .model_parts import children, is_rms_norm

NORM_KERNELS = ("auto", "torch", "triton")


def _exact_owns(choice: str) -> str:
    return f"--norm-kernel {choice}: --nf4-kernel repacked-exact brings its own row-exact norms: drop --norm-kernel"


def flag_error(choice: str, nf4_kernel: str, device: str) -> str | None:
    """What the flags alone show wrong with --norm-kernel ``choice`` beside ``nf4_kernel`` on ``device`` (resolved,
    e.g. "cpu", "cuda:0"): said by the entry points before any load; None if nothing."""
    if choice != "auto" and nf4_kernel == "repacked-exact":
        return _exact_owns(choice)
    if choice == "triton" and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"--norm-kernel triton: the Triton norm needs a CUDA device (on {device} it runs only under Triton's "
                "interpreter, TRITON_INTERPRET=1, slowly, for tests): use --norm-kernel auto or torch")
    return None


def _children(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    return children(model.get_decoder() if hasattr(model, "get_decoder") else model)


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
            raise ValueError(_exact_owns(choice))
        return ""
    for parent, name, child in _children(model):       # the fast norms of an earlier routing go first
        if _kind(child) == "fast":
            original = child.original[0]
            original.weight = child.weight              # the parameter as it is now
            setattr(parent, name, original)
    norms = [(parent, name, child) for parent, name, child in _children(model) if is_rms_norm(child)]
    if choice == "torch":
        return "norms: transformers' own"
    if not norms:
        if choice == "triton":
            raise ValueError("--norm-kernel triton: this model has no RMSNorm of a kind the Triton norm replaces "
                             "(Llama, Mistral, Qwen2, Qwen3): use --norm-kernel auto")
        return ""
    device, note = _device_of([child for _, _, child in norms]), ""
    if device.type != "cuda" and choice == "auto":
        return ""                                       # the interpreter is for tests, never chosen
    try:
        from .rows_alone_norm import RowsAloneRMSNorm
    except ImportError as err:  # no Triton here: its norm cannot run, transformers' can
        if choice == "triton":
            raise ValueError(f"--norm-kernel triton: {err}") from None
        return f"norms: transformers' own (auto: {err})"
    if device.type != "cuda":
        from .triton_runtime import INTERPRET_ENV, interpret_enabled

        if device.type != "cpu" or not interpret_enabled():
            raise ValueError(f"--norm-kernel triton: the Triton norm needs a CUDA device (on {device.type} it runs "
                             f"only under Triton's interpreter, {INTERPRET_ENV}=1, on CPU tensors, for tests): use "
                             "--norm-kernel auto")
    elif choice == "auto":
        try:
            modules, dtype = [child for _, _, child in norms], _activation_dtype(model)
            torch_us, triton_us = remembered("norms", _timing_key(modules, dtype),
                                             lambda: _timed_sums(modules, dtype, device),
                                             lambda saved: (float(saved[0]), float(saved[1])))
        except Exception as err:  # e.g. a Triton that cannot compile the kernel for this GPU: said, never hidden
            return ("norms: transformers' own (auto: timing the norms failed on this GPU: "
                    f"{type(err).__name__}: {first_line(err, 120)})")
        steps = " and a ".join(f"{m}-row" for m in AUTO_ROWS)
        if not triton_us < torch_us:
            return (f"norms: transformers' own (auto measured {torch_us:.0f} µs against {triton_us:.0f} µs for "
                    f"the Triton norm over a {steps} step)")
        note = f" (auto measured {triton_us:.0f} µs against {torch_us:.0f} µs for transformers' over a {steps} step)"
    for parent, name, child in norms:
        setattr(parent, name, RowsAloneRMSNorm(child, exact=False))
    return f"norms: one Triton kernel for each of {len(norms)} RMSNorms{note}"


def _device_of(norms: list[nn.Module]) -> torch.device:
    return norms[0].weight.device


def _activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the decoder's hidden states have: the embedding's (a norm's weight may be kept in fp32)."""
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(embeddings, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else torch.float32




def _timing_key(norms: list[nn.Module], dtype: torch.dtype) -> tuple:
    """What ``_timed_sums`` depends on besides the GPU (whose memory holds it): the input dtype and how many norms
    of each kind (class, width, weight dtype, epsilon): the class and epsilon decide its correctness check too."""
    counts: dict[tuple, int] = {}
    for norm in norms:
        eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
        kind = (f"{type(norm).__module__}.{type(norm).__qualname__}", int(norm.weight.shape[-1]), str(norm.weight.dtype),
                eps)
        counts[kind] = counts.get(kind, 0) + 1
    return dtype, sorted(counts.items())


def _timed_sums(norms: list[nn.Module], dtype: torch.dtype, device: torch.device) -> tuple[float, float]:
    """(transformers' µs, the Triton kernel's µs) for every norm of ``norms`` once at each of AUTO_ROWS tokens,
    each (width, weight dtype) timed once in a CUDA graph on ``dtype`` inputs. A norm narrower than the
    widest (a per-head q/k norm) sees a row per head: it is timed on as many rows as the widest holds of
    its width. A Triton result off transformers' by more than rounding raises."""
    from .kernel_timing import graph_time_us
    from .rows_alone_norm import rows_alone_rms_norm

    same: dict[tuple[int, torch.dtype], list[nn.Module]] = {}
    for norm in norms:
        same.setdefault((norm.weight.shape[-1], norm.weight.dtype), []).append(norm)
    widest = max(width for width, _ in same)
    torch_us = triton_us = 0.0
    # captures on the model's GPU, not the current one (a CPU test's stand-in times nothing there)
    on_gpu = torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
    with on_gpu, torch.no_grad():
        for (width, _), group in same.items():
            norm = group[0]
            eps = float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))
            for tokens in AUTO_ROWS:
                x = torch.randn(tokens * max(1, widest // width), width, device=device, dtype=dtype)  # (rows, width)
                reference, ours = norm(x).float(), rows_alone_rms_norm(x, norm.weight, eps).float()
                error = float((ours - reference).norm() / reference.norm().clamp_min(1e-30))
                if not error <= 1e-2:
                    raise RuntimeError(f"wrong result: relative error {error:.1e} against transformers' RMSNorm")
                # 16 launches a capture: one norm is a few µs, near the events' resolution
                torch_us += len(group) * graph_time_us([functools.partial(norm, x)] * 16)
                triton_us += len(group) * graph_time_us([functools.partial(rows_alone_rms_norm, x, norm.weight, eps)] * 16)
    return torch_us, triton_us
