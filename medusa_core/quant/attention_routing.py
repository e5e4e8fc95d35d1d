"""Which rotary embedding and which attention the decoder's attention modules run: transformers' own, or the
Triton kernels (rotary_kernel.py: both rotations in one launch, bit for bit transformers'; split_attention.py:
the step's rows over the cache split over the keys, hidden key blocks unread), chosen on CUDA by timing both on
the user's GPU at load.

Why: on an H200 (docs/performance.md, 2026-11-28) the one-launch rotary took the graphed 7B NF4 step from 4.45
to 3.85 ms at one node and 8.09 to 7.28 at 16, and the split attention a further 0.05 and 0.42 ms; in the app
they ran only where a benchmark flag put them. Whether they are faster on another GPU is measured there, not
assumed: each pair is timed as the step runs it (in a CUDA graph, no launch overhead), for a plain step's row
and a 16-node tree's rows at the model's shapes, and the faster is kept; the load line says both sums. The
attention is timed over the benchmarks' cache (a 512-token prefix in a 1024-slot bucket). Off CUDA ``auto``
keeps transformers' (the interpreter is for tests).

The rotary kernel changes no bit, so it serves exact mode too. The split attention sums a row's keys in an
order that depends on the call, as SDPA does: exact mode keeps its own attention, and ``auto`` leaves any
attention that is not SDPA's as it is. Triton is imported only where a kernel is asked for or timed: a machine
without it loads with transformers' functions.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

import torch
from torch import nn

from ..errors import first_line
from .kernel_timing import AUTO_ROWS, remembered

ROTARY_CHOICES = ("auto", "torch", "triton")
ATTENTION_CHOICES = ("auto", "sdpa", "split")
# the cache the attention is timed over: the step benchmarks' (bench_synthetic --context 512, bucket 1024)
TIMED_PREFIX, TIMED_BUCKET = 512, 1024


def flag_error(rotary: str, attention: str, nf4_kernel: str, device: str) -> str | None:
    """What the flags alone show wrong on ``device`` (resolved, e.g. "cpu", "cuda:0"), said by the entry points
    before any load; None if nothing."""
    if attention == "split" and nf4_kernel == "repacked-exact":
        return ("--attention-kernel split: --nf4-kernel repacked-exact brings its own row-exact attention: "
                "drop --attention-kernel")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    for flag, choice, forced, what, other in (
            ("--rotary-kernel", rotary, "triton", "the Triton rotary", "torch"),
            ("--attention-kernel", attention, "split", "the split attention", "sdpa")):
        if choice == forced and not device.startswith("cuda") and not interpreted:
            return (f"{flag} {forced}: {what} needs a CUDA device (on {device} it runs only under Triton's "
                    f"interpreter, TRITON_INTERPRET=1, slowly, for tests): use {flag} auto or {other}")
    return None


@contextlib.contextmanager
def rotary_kept_on_failure(model: nn.Module) -> Iterator[None]:
    """Within: a failure puts the model family's rotary back as it was. The routing is the family's, for every
    model of it in the process, and the app keeps answering with the model it has while another loads, and
    keeps it if that load fails (review: a failed load left the kept model's routing, which its Ready line
    names and its tuned tree is keyed by, switched)."""
    family = getattr(getattr(model, "config", None), "model_type", None)
    module = sys.modules.get(f"transformers.models.{family}.modeling_{family}")
    before = getattr(module, "apply_rotary_pos_emb", None)
    try:
        yield
    except BaseException:
        if before is not None:
            module.apply_rotary_pos_emb = before
        raise


def _device(model: nn.Module) -> torch.device:
    return model.get_output_embeddings().weight.device


def _dtype(model: nn.Module) -> torch.dtype:
    """The dtype the attention sees: the embedding's (a quantized layer's storage says nothing)."""
    return model.get_input_embeddings().weight.dtype


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return [layer.self_attn for layer in getattr(decoder, "layers", []) if hasattr(layer, "self_attn")]


def _said(err: Exception) -> str:
    return f"{type(err).__name__}: {first_line(err, 120)}"


def _steps() -> str:
    return " and a ".join(f"{m}-row" for m in AUTO_ROWS)


def rotary_routed(model: nn.Module) -> str:
    """"triton" where the model family's rotary runs the kernel now, else "torch"."""
    if "medusa_core.quant.rotary_kernel" not in sys.modules:
        return "torch"
    from .rotary_kernel import routed

    return routed(model)


def attention_routed(model: nn.Module) -> str:
    """"split" where the model attends through the split kernel now, else "sdpa" (or exact mode's own)."""
    if "medusa_core.quant.split_attention" not in sys.modules:
        return "sdpa"
    from .split_attention import NAME

    return "split" if getattr(model.config, "_attn_implementation", None) == NAME else "sdpa"


def use_rotary(model: nn.Module, choice: str) -> str:
    """Route the rotary embedding by ``choice`` (auto | torch | triton); one line saying what runs, or "" where
    nothing is to say (auto off CUDA, or a family the kernel does not serve)."""
    if choice not in ROTARY_CHOICES:
        raise ValueError(f"rotary kernel {choice!r} is unknown: use one of {', '.join(ROTARY_CHOICES)}")
    if rotary_routed(model) == "triton":        # an earlier model of this family routed it: this one decides anew
        from .rotary_kernel import use_rotary_kernel

        use_rotary_kernel(model, "torch")
    if choice == "torch":
        return "rotary: transformers' own"
    if choice == "triton":
        try:
            from .rotary_kernel import use_rotary_kernel
        except ImportError as err:
            raise ValueError(f"--rotary-kernel triton: {err}") from None
        return use_rotary_kernel(model, "triton")
    device, modules = _device(model), _attention_modules(model)
    if device.type != "cuda" or not modules:
        return ""
    try:
        from .rotary_kernel import FAMILIES, use_rotary_kernel
    except ImportError as err:  # no Triton here: its rotary cannot run, transformers' can
        return f"rotary: transformers' own (auto: {err})"
    if getattr(model.config, "model_type", None) not in FAMILIES:
        return ""
    return _faster_kept("rotary", _rotary_key(model), lambda: _timed_rotary(model), "rotary: transformers' own",
                        "transformers' and index_copy_", "the Triton rotary and cache write",
                        lambda: use_rotary_kernel(model, "triton"))


def use_attention(model: nn.Module, choice: str) -> str:
    """Route the attention by ``choice`` (auto | sdpa | split); one line saying what runs, or "" where nothing is
    to say (auto off CUDA, in fp32, or beside an attention that is not SDPA's, as exact mode's)."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention kernel {choice!r} is unknown: use one of {', '.join(ATTENTION_CHOICES)}")
    if attention_routed(model) == "split":
        from .split_attention import use_split_attention

        use_split_attention(model, "sdpa")
    implementation = getattr(model.config, "_attn_implementation", None)
    if choice == "sdpa":    # exact mode's own attention is not SDPA, and stays (the NF4 line names it)
        return "attention: transformers' SDPA" if implementation == "sdpa" else ""
    if choice == "split":
        try:
            from .split_attention import use_split_attention
        except ImportError as err:
            raise ValueError(f"--attention-kernel split: {err}") from None
        return use_split_attention(model, "split")
    device, modules = _device(model), _attention_modules(model)
    if device.type != "cuda" or not modules or implementation != "sdpa":
        return ""
    if _dtype(model) not in (torch.bfloat16, torch.float16):
        return ""       # the kernel computes 16-bit calls only (fp32's dot spilled on sm_90): SDPA runs every call
    try:
        from .rotary_kernel import FAMILIES
        from .split_attention import use_split_attention
    except ImportError as err:
        return f"attention: transformers' SDPA (auto: {err})"
    if getattr(model.config, "model_type", None) not in FAMILIES or _shapes(model)[2] > 256:
        # another family may bring softcapping or sinks, and a head wider than 256 is SDPA's: the kernel would
        # hand every call back, and a timing of SDPA against itself would name a kernel that never runs
        return ""
    return _faster_kept("attention", _attention_key(model), lambda: _timed_attention(model),
                        "attention: transformers' SDPA", "SDPA", "the split attention",
                        lambda: use_split_attention(model, "split"))


def _faster_kept(what: str, key: tuple, measure, stock_line: str, stock_name: str, kernel_name: str, route) -> str:
    """The kernel, routed by ``route()``, where ``measure()`` ((stock µs, kernel µs), remembered per GPU) times it
    faster; else the stock function, kept. One line either way, with both sums, or why nothing was timed."""
    try:
        stock_us, kernel_us = remembered(what, key, measure, lambda saved: (float(saved[0]), float(saved[1])))
    except Exception as err:  # e.g. a Triton that cannot compile the kernel for this GPU: said, never hidden
        return f"{stock_line} (auto: timing the {what} failed on this GPU: {_said(err)})"
    if not kernel_us < stock_us:
        return (f"{stock_line} (auto measured {stock_us:.0f} µs against {kernel_us:.0f} µs for {kernel_name} over a "
                f"{_steps()} step)")
    return (f"{route()} (auto measured {kernel_us:.0f} µs against {stock_us:.0f} µs for {stock_name} over a "
            f"{_steps()} step)")


def _shapes(model: nn.Module) -> tuple[int, int, int, int]:
    """(query heads, key/value heads, head width, layers) of the decoder's attention."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv_heads, dim, len(_attention_modules(model))


def _rotary_key(model: nn.Module) -> tuple:
    return (str(_dtype(model)), *_shapes(model), model.config.model_type)


def _attention_key(model: nn.Module) -> tuple:
    return (str(_dtype(model)), *_shapes(model), TIMED_PREFIX, TIMED_BUCKET)


def _on_device(device: torch.device):
    # captures on the model's GPU, not the current one (a CPU test's stand-in times nothing there)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _timed_rotary(model: nn.Module) -> tuple[float, float]:
    """(transformers' µs, the kernels' µs) for every layer's rotation and cache write once at each of AUTO_ROWS
    tokens, the queries and keys laid out as the attention module makes them (a transposed view of the
    projection), written at TIMED_PREFIX of a TIMED_BUCKET-slot cache (with ``index_copy_``, or the kernel). A
    kernel result that is not transformers' or ``index_copy_``'s bit for bit raises."""
    from .cache_write_kernel import NAME
    from .kernel_timing import graph_time_us
    from .rotary_kernel import _family_module, fused_rotary

    heads, kv_heads, dim, layers = _shapes(model)
    device, dtype = _device(model), _dtype(model)
    module = _family_module(model)
    original = getattr(module.apply_rotary_pos_emb, "original", module.apply_rotary_pos_emb)
    torch_us = triton_us = 0.0
    with _on_device(device), torch.no_grad():
        for tokens in AUTO_ROWS:
            q = torch.randn(1, tokens, heads, dim, device=device, dtype=dtype).transpose(1, 2)       # (1, H, T, D)
            k = torch.randn(1, tokens, kv_heads, dim, device=device, dtype=dtype).transpose(1, 2)    # (1, Hkv, T, D)
            v = torch.randn_like(k)
            angles = torch.rand(1, tokens, dim, device=device) * 6.3
            cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)                               # (1, T, D)
            reference, ours = original(q, k, cos, sin), fused_rotary(q, k, cos, sin)
            if not all(torch.equal(a, b) for a, b in zip(reference, ours)):
                raise RuntimeError("wrong result: the Triton rotary is not transformers' bit for bit")
            copied, written = _cache_at_prefix(None, k, v), _cache_at_prefix(NAME, k, v)
            if not torch.equal(copied.storage, written.storage):
                raise RuntimeError("wrong result: the Triton cache write is not index_copy_'s bit for bit")
            # 16 launches a capture: one rotation is a few µs, near the events' resolution
            torch_us += layers * graph_time_us([functools.partial(original, q, k, cos, sin),
                                                functools.partial(copied.layers[0].update, k, v)] * 16)
            triton_us += layers * graph_time_us([functools.partial(fused_rotary, q, k, cos, sin),
                                                 functools.partial(written.layers[0].update, k, v)] * 16)
    return torch_us, triton_us


def _cache_at_prefix(writer: str | None, keys: torch.Tensor, values: torch.Tensor):
    """A one-layer decoding/kv_cache.KVCache of TIMED_BUCKET slots written by ``writer`` (None: index_copy_),
    TIMED_PREFIX of them committed, after one forward's write of ``keys`` and ``values`` at the position."""
    from ..decoding.kv_cache import WRITERS, KVCache

    cache = KVCache(1, TIMED_BUCKET, TIMED_BUCKET, None if writer is None else WRITERS[writer])
    cache.commit([0] * TIMED_PREFIX)
    cache.layers[0].update(keys, values)       # allocates, position TIMED_PREFIX
    return cache


def _timed_attention(model: nn.Module) -> tuple[float, float]:
    """(SDPA's µs, the split kernel's µs) for every layer's attention once at each of AUTO_ROWS rows, over a
    TIMED_BUCKET-slot cache whose first TIMED_PREFIX slots and the rows' own are seen (a chain: row t sees the
    prefix and rows up to t). A split result off SDPA's by more than rounding raises."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from .kernel_timing import graph_time_us
    from .split_attention import split_attention_forward

    heads, kv_heads, dim, layers = _shapes(model)
    device, dtype = _device(model), _dtype(model)
    module = _attention_modules(model)[0]
    scaling = getattr(module, "scaling", dim ** -0.5)
    sdpa_us = split_us = 0.0
    with _on_device(device), torch.no_grad():
        k = torch.randn(1, kv_heads, TIMED_BUCKET, dim, device=device, dtype=dtype)     # (1, Hkv, W, D)
        v = torch.randn_like(k)
        for rows in AUTO_ROWS:
            q = torch.randn(1, rows, heads, dim, device=device, dtype=dtype).transpose(1, 2)   # (1, H, T, D)
            slot = torch.arange(TIMED_BUCKET, device=device)
            seen = slot[None, :] <= TIMED_PREFIX + torch.arange(rows, device=device)[:, None]  # (T, W)
            mask = torch.zeros(1, 1, rows, TIMED_BUCKET, device=device, dtype=dtype)
            mask.masked_fill_(~seen, torch.finfo(dtype).min)
            sdpa = functools.partial(sdpa_attention_forward, module, q, k, v, mask, scaling=scaling)
            split = functools.partial(split_attention_forward, module, q, k, v, mask, scaling=scaling)
            reference, ours = sdpa()[0].float(), split()[0].float()
            error = float((ours - reference).norm() / reference.norm().clamp_min(1e-30))
            if not error <= 1e-2:
                raise RuntimeError(f"wrong result: relative error {error:.1e} against SDPA")
            sdpa_us += layers * graph_time_us([sdpa] * 4)
            split_us += layers * graph_time_us([split] * 4)
    return sdpa_us, split_us
