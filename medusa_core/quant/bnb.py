"""How the backbone's Linear layers are quantized (bitsandbytes) and which kernel multiplies them.

The loaders ask ``bnb_config`` for their ``BitsAndBytesConfig``; the random benchmark model uses
``quantize_linear_nf4_``; ``use_nf4_kernel`` routes NF4 layers' multi-row inputs (Medusa's tree
verification, 2..64 rows) to the Triton kernels in nf4_storage_kernels.py, or (``repacked``, ``repacked-exact``)
every NF4 layer to the kernel in nf4_repacked_kernel.py over weights repacked in memory, q/k/v and
gate/up fused (nf4_fused.py). On CUDA, ``auto`` times both on the GPU at load and keeps the faster.
bitsandbytes and Triton are imported only where used, so the rest of the project imports without them.
"""

from __future__ import annotations

import functools
import gc
import os

import torch
from torch import nn

from .kernel_timing import AUTO_ROWS

NF4_KERNELS = ("auto", "triton", "bnb", "repacked", "repacked-exact")


def flag_error(choice: str, device: str, quant: str | None = None, heads_quant: str = "none") -> str | None:
    """What the flags alone show wrong with --nf4-kernel ``choice`` on ``device`` (resolved, e.g. "cpu",
    "cuda:0") beside --quant ``quant`` (None: the caller makes NF4 weights) and --heads-quant ``heads_quant``:
    said by the entry points before any load; None if nothing."""
    # a kernel choice where the load makes no NF4 weights was ignored without a word (launch, then bench: QA16)
    nf4_backbone = quant is None or quant == "nf4" or (quant == "auto" and device.startswith("cuda"))
    if choice != "auto" and not nf4_backbone and heads_quant != "nf4":
        return (f"--nf4-kernel {choice} picks the kernel of NF4 weights, and --quant {quant} on {device} "
                "makes none: add --quant nf4, or drop --nf4-kernel")
    if choice == "repacked-exact" and not nf4_backbone:     # the heads only propose: no exact mode of theirs
        return (f"--nf4-kernel repacked-exact makes an NF4 backbone's steps row-exact, and --quant {quant} on "
                f"{device} makes none (the NF4 heads never run exact): use --nf4-kernel repacked, or add --quant nf4")
    if choice not in ("auto", "bnb") and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        return (f"--nf4-kernel {choice}: the Triton kernels need a CUDA device (on {device} they run only under "
                "Triton's interpreter, TRITON_INTERPRET=1, slowly, for tests): use --nf4-kernel bnb or auto")
    return None
KERNEL_MAX_ROWS = 64     # tree verification sizes; longer inputs (prefill) are GEMM-bound: bnb's dequant + cuBLAS


def bnb_config(quant: str, compute_dtype: torch.dtype):
    """transformers' ``BitsAndBytesConfig`` for ``quant`` (nf4 | int8), or None for none."""
    from transformers import BitsAndBytesConfig

    if quant == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,   # explicit: bnb's float32 default is the slow path on GPUs
        )
    if quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    if quant == "none":
        return None
    raise ValueError(f"quant {quant!r} is unknown: use nf4, int8 or none")


@torch.no_grad()
def quantize_linear_nf4_(model: nn.Module, compute_dtype: torch.dtype) -> None:
    """Every Linear of the decoder layers -> bitsandbytes NF4 (double quant), as ``bnb_config("nf4")``
    makes transformers do; lm_head and embeddings stay unquantized as there."""
    import bitsandbytes as bnb

    for layer in model.get_decoder().layers:
        for parent in list(layer.modules()):
            for name, dense in list(parent.named_children()):
                if not isinstance(dense, nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(dense.in_features, dense.out_features, bias=dense.bias is not None,
                                      compute_dtype=compute_dtype, compress_statistics=True, quant_type="nf4",
                                      device="meta")
                # .to() quantizes; one layer's temporary at a time
                q.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False, compress_statistics=True,
                                             quant_type="nf4", module=q).to(dense.weight.device)
                if dense.bias is not None:
                    q.bias = nn.Parameter(dense.bias.data, requires_grad=False)
                setattr(parent, name, q)
    gc.collect()


@functools.cache
def _kernel_linear_class():
    """``Linear4bit`` whose forward sends 2..64-row inputs (and 1-row ones when ``one_row_kernel``)
    to the Triton kernel. Built lazily: bitsandbytes is imported only when a model uses NF4."""
    import bitsandbytes as bnb

    from . import nf4_matmul

    class TritonNF4Linear(bnb.nn.Linear4bit):
        one_row_kernel: bool = False
        any_rows_kernel: bool = False     # CPU (interpreter): bnb's CPU forward would repack the weight

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            rows = x.numel() // x.shape[-1]      # a static shape: the branch is fixed inside a CUDA graph
            use = self.any_rows_kernel or (2 <= rows <= KERNEL_MAX_ROWS) or (rows == 1 and self.one_row_kernel)
            if not use:
                return super().forward(x)
            compute = self.compute_dtype or x.dtype
            bias = self.bias.to(compute) if self.bias is not None and self.bias.dtype != compute else self.bias
            y = nf4_matmul.nf4_matmul(x.to(compute), self.weight.data, self.weight.quant_state, bias)
            return y.to(x.dtype)

    return TritonNF4Linear


def _swap_class(module: nn.Module, cls: type) -> nn.Module:
    """A ``cls`` instance sharing ``module``'s parameters and buffers (the same tensors: no copy)."""
    new = cls.__new__(cls)
    new.__dict__.update(module.__dict__)
    new._parameters = dict(module._parameters)
    new._buffers = dict(module._buffers)
    new._modules = dict(module._modules)
    return new


def _nf4_layers(model: nn.Module):
    """(parent, name, module) for every bnb NF4 Linear4bit under the decoder."""
    import bitsandbytes as bnb

    root = model.get_decoder() if hasattr(model, "get_decoder") else model
    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, bnb.nn.Linear4bit) and getattr(child.weight, "quant_state", None) is not None \
                    and child.weight.quant_state.quant_type == "nf4":
                yield parent, name, child


_TIMED: dict[tuple, float] = {}   # (device name, N, K, blocksize, dtype, rows, kernel) -> µs


def _timed_us(layer, dtype: torch.dtype, rows: int, kernel: str) -> float:
    """µs of ``kernel`` (bnb: bitsandbytes' own matmul; triton: nf4_matmul) for ``rows`` rows on this
    layer's shape, in a CUDA graph over weight copies larger than L2; cached per (GPU, N, K, blocksize, dtype,
    rows) and, inside kernel_timing.remembering, across starts."""
    from .kernel_timing import remembered, remembering_now

    state = layer.weight.quant_state
    key = (torch.cuda.get_device_name(layer.weight.device), *(int(s) for s in state.shape), state.blocksize, dtype,
           rows, kernel)
    if key not in _TIMED or remembering_now():
        _TIMED[key] = remembered("nf4-layer", key, lambda: _time_layer(layer, dtype, rows, kernel), float)
    return _TIMED[key]


def _time_layer(layer, dtype: torch.dtype, rows: int, kernel: str) -> float:
    import bitsandbytes as bnb

    from . import nf4_matmul
    from .kernel_timing import graph_time_us, rotating_copies

    state, device = layer.weight.quant_state, layer.weight.device
    copies = rotating_copies(layer.weight.data, state, torch.cuda.get_device_properties(device).L2_cache_size)
    x = torch.randn(rows, int(state.shape[1]), device=device, dtype=dtype)
    if kernel == "bnb":
        calls = [functools.partial(bnb.matmul_4bit, x, p.t(), quant_state=s) for p, s in copies]
    else:
        calls = [functools.partial(nf4_matmul.nf4_matmul, x, p, s) for p, s in copies]
    return graph_time_us(calls)


def _one_row_us(layer, dtype: torch.dtype) -> tuple[float, float]:
    """(Triton kernel µs, bnb µs) for one row on this layer's shape."""
    return _timed_us(layer, dtype, 1, "triton"), _timed_us(layer, dtype, 1, "bnb")


def _one_row_kernel_faster(layer, dtype: torch.dtype) -> bool:
    kernel_us, bnb_us = _one_row_us(layer, dtype)
    return kernel_us < bnb_us


def use_nf4_kernel(model: nn.Module, choice: str) -> str:
    """Route the decoder's NF4 layers by ``choice`` (auto | triton | bnb | repacked | repacked-exact);
    returns one line saying what was chosen. First, layers a previous ``repacked`` replaced get their
    bitsandbytes modules back. ``bnb`` restores bitsandbytes' own modules; triton swaps each NF4
    Linear4bit for a TritonNF4Linear holding the same packed weight; repacked* see _use_repacked; auto
    is bnb off CUDA and on CUDA whichever of triton and repacked this GPU measures faster (_use_measured)."""
    if choice not in NF4_KERNELS:
        raise ValueError(f"nf4 kernel {choice!r} is unknown: use one of {', '.join(NF4_KERNELS)}")
    from . import nf4_fused

    nf4_fused.restore_bitsandbytes(model.get_decoder() if hasattr(model, "get_decoder") else model)
    nf4_fused.leave_exact(model)        # exact mode's attention and lm_head go with its kernel
    layers = list(_nf4_layers(model))
    if not layers:
        return "nf4 kernel: no bitsandbytes NF4 layers in this model (nothing to route)"

    if choice == "bnb":
        _plain(layers)
        return f"nf4 kernel: bitsandbytes for all {len(layers)} NF4 layers"
    device = layers[0][2].weight.device
    if device.type != "cuda" and choice == "auto":
        _plain(layers)                       # auto never uses the interpreter
        return f"nf4 kernel: bitsandbytes for all {len(layers)} NF4 layers (auto: the Triton kernel needs CUDA)"
    try:
        from . import nf4_matmul  # noqa: F401 (the import is the check: no Triton is one line)
        from .triton_runtime import check_runnable
    except ImportError as err:
        raise ValueError(f"--nf4-kernel {choice}: {err}") from None
    try:
        check_runnable(device)
    except RuntimeError as err:
        raise ValueError(f"--nf4-kernel {choice}: {err}") from None

    from .kernel_timing import NoConfigCompiled

    try:
        if choice.startswith("repacked"):
            return _use_repacked(model, _plain(layers), exact=choice == "repacked-exact", device=device)
        if choice == "auto":                 # on CUDA: the kernel this GPU times faster
            return _use_measured(model, _plain(layers), device)
        return _use_triton(layers, choice, device)
    except NoConfigCompiled as err:          # a tuner found nothing that compiles on this GPU
        nf4_fused.restore_bitsandbytes(model.get_decoder() if hasattr(model, "get_decoder") else model)
        nf4_fused.leave_exact(model)         # nothing half-routed stays behind
        _plain(list(_nf4_layers(model)))
        if choice != "auto":
            raise ValueError(f"--nf4-kernel {choice}: {err}") from None
        what = err.what
    return f"nf4 kernel: bitsandbytes for all {len(layers)} NF4 layers (auto: {what})"


def use_nf4_heads(heads: nn.Module, choice: str) -> str:
    """The Medusa heads' NF4 vocabulary projections (``--heads-quant nf4``) on the kernel ``choice`` (the
    --nf4-kernel) names: the repacked one for repacked and repacked-exact; under auto, on a GPU, the repacked one
    where it times faster than bitsandbytes at one row (the one row a step's heads read; all heads share one
    shape), and bitsandbytes off CUDA; bitsandbytes for bnb and triton (on bitsandbytes' storage the Triton
    kernel's one row is the slower). Returns the load line's part, "" for heads without NF4 layers. Why: on the
    H200 (2026-11-29) a 4096->32000 head took 38.6 µs on the repacked kernel against 59.8 on bitsandbytes and 64.6
    in bf16, once a step per head the tree reads (the 16-node step's profile: 0.195 ms of bf16 heads). Never fused
    (each head reads its own input) and never in exact mode: the heads only propose, and the backbone's
    verification decides the output either way."""
    from . import nf4_fused

    if choice not in NF4_KERNELS:
        raise ValueError(f"nf4 kernel {choice!r} is unknown: use one of {', '.join(NF4_KERNELS)}")
    nf4_fused.restore_bitsandbytes(heads)       # a routing made for an earlier choice
    layers = _plain(list(_nf4_layers(heads)))
    if not layers:
        return ""
    device = layers[0][2].weight.device
    plain = f"heads: bitsandbytes for their {len(layers)} NF4 projections"
    if choice in ("bnb", "triton") or (choice == "auto" and device.type != "cuda"):
        return plain
    from .kernel_timing import NoConfigCompiled

    what = f"--nf4-kernel {choice} for the heads' NF4 projections"
    try:
        from .triton_runtime import check_runnable

        check_runnable(device)
    except (ImportError, RuntimeError) as err:      # a forced choice off CUDA (auto stopped above)
        raise ValueError(f"{what}: {err}") from None
    note = ""
    if device.type == "cuda":
        from . import nf4_repacked_matmul as rm

        head = layers[0][2]
        dtype = head.compute_dtype or torch.float32
        n, k = (int(s) for s in head.weight.quant_state.shape)
        try:            # tuned now, not later inside someone's graph capture
            repacked_us = rm.tuned_us(1, n, k, dtype, device)
        except NoConfigCompiled as err:
            if choice != "auto":
                raise ValueError(f"{what}: {err}") from None
            return f"{plain} (auto: {err.what})"
        bnb_us = _timed_us(head, dtype, 1, "bnb")
        note = f" ({repacked_us:.1f} µs a head against {bnb_us:.1f} on bitsandbytes at one row)"
        if choice == "auto" and bnb_us <= repacked_us:
            return plain + note
    made, kept = nf4_fused.repack_layers(layers, fuse=())
    if not made:            # a layout the repacking does not take (say, bitsandbytes' own CPU repacking)
        return f"{plain}{note} (the repacked kernel cannot read them: {kept[0]})"
    kept_text = f"; {len(kept)} kept on bitsandbytes ({kept[0]})" if kept else ""
    return f"heads: repacked Triton kernel for {len(made)} NF4 projections{note}{kept_text}"


def routed_kernel(model: nn.Module) -> str | None:
    """The kernel multiplying the model's NF4 layers now (repacked-exact, repacked, triton or bnb), None
    without NF4 layers: what ``auto`` became on this machine, which a tuned tree's cost depends on."""
    kinds = {type(m).__name__ for m in model.modules()}
    if "RepackedNF4Linear" in kinds:
        from . import nf4_fused

        return "repacked-exact" if nf4_fused.exact_mode(model) else "repacked"
    return "triton" if "TritonNF4Linear" in kinds else "bnb" if "Linear4bit" in kinds else None


def _plain(layers):
    """``layers`` each as bitsandbytes' own class: what the repacked path replaces and restore brings back."""
    import bitsandbytes as bnb

    plain = []
    for parent, name, layer in layers:
        if type(layer) is not bnb.nn.Linear4bit:
            layer = _swap_class(layer, bnb.nn.Linear4bit)
            setattr(parent, name, layer)
        plain.append((parent, name, layer))
    return plain


def _use_triton(layers, choice: str, device: torch.device) -> str:
    """Each NF4 Linear4bit -> a TritonNF4Linear holding the same packed weight: the kernel for 2..64 rows,
    and for one row where ``choice`` is triton or the kernel measured faster than bnb."""
    from . import nf4_matmul

    cls = _kernel_linear_class()
    kept, one_row, shapes = 0, 0, set()
    for parent, name, layer in layers:
        state = layer.weight.quant_state
        n, k = (int(s) for s in state.shape)
        if k % 2 or getattr(state, "packing_format_for_cpu", False):
            kept += 1     # odd K or a CPU-repacked weight: the kernel cannot read it; said below
            continue
        dtype = layer.compute_dtype or torch.float32
        new = _swap_class(layer, cls)
        new.any_rows_kernel = device.type != "cuda"
        new.one_row_kernel = choice == "triton" or _one_row_kernel_faster(layer, dtype)
        one_row += new.one_row_kernel
        shapes.add((n, k))
        if device.type == "cuda":    # tune every row class now: not later, inside someone's graph capture
            for m in (1, 16, 32, 64):
                nf4_matmul.choose_config(m, n, k, dtype, device, state.blocksize)
        setattr(parent, name, new)
    routed = len(layers) - kept
    if device.type != "cuda":
        rows = "all row counts (Triton interpreter)"
    else:
        rows = f"2-{KERNEL_MAX_ROWS} rows; 1 row: Triton on {one_row}/{routed} layers, bitsandbytes on the rest" + \
               (" (measured)" if choice == "auto" else "") + f"; >{KERNEL_MAX_ROWS} rows: bitsandbytes"
    kept_text = f"; {kept} layer(s) kept on bitsandbytes (odd K or CPU-repacked weight)" if kept else ""
    return f"nf4 kernel: Triton for {routed} NF4 layers ({len(shapes)} shapes), {rows}{kept_text}"


REPACKED_ROW_CLASSES = (1, 2, 4, 16, 32, 64)    # the repacked kernel's row classes (nf4_repacked_configs.row_class)


def _fusions(layers, device: torch.device) -> tuple[tuple[tuple[str, ...], ...], list[str]]:
    """The FUSE groups to fuse on this GPU: those whose one matmul times faster at AUTO_ROWS than their
    projections apart (summed over every occurrence); and a line per group kept apart. On an H100
    (2026-11-27) q/k/v fused took 20.8 + 45.9 µs at 1 and 16 rows against 33.6 + 49.1 apart, gate/up
    36.5 + 82.7 against 40.1 + 74.5."""
    from . import nf4_fused
    from . import nf4_repacked_matmul as rm

    costs: dict[tuple[str, ...], list[float]] = {}
    for names, group in nf4_fused.fusable(layers):
        k = int(group[0][2].weight.quant_state.shape[1])
        dtype = group[0][2].compute_dtype or torch.float32
        ns = [int(layer.weight.quant_state.shape[0]) for _, _, layer in group]
        fused_us = sum(rm.tuned_us(m, sum(ns), k, dtype, device) for m in AUTO_ROWS)
        apart_us = sum(rm.tuned_us(m, n, k, dtype, device) for n in ns for m in AUTO_ROWS)
        total = costs.setdefault(names, [0.0, 0.0])
        total[0], total[1] = total[0] + fused_us, total[1] + apart_us
    fuse = tuple(names for names, (fused_us, apart_us) in costs.items() if fused_us < apart_us)
    apart = [f"{'/'.join(n.removesuffix('_proj') for n in names)} apart ({apart_us:.0f} µs against {fused_us:.0f} "
             "fused)" for names, (fused_us, apart_us) in costs.items() if names not in fuse]
    return fuse, apart


def _use_measured(model: nn.Module, layers, device: torch.device) -> str:
    """auto on CUDA: the Triton kernel on bitsandbytes' storage (bnb for one row where that measures
    faster) or the repacked kernel (q/k/v and gate/up fused where that measures faster), whichever
    multiplies a step's projections faster on this GPU at AUTO_ROWS, timed now per shape; the loser's
    other row classes are not tuned. A repacked kernel with no config that compiles here leaves the
    Triton routing, and the line says so (a Triton kernel with none: use_nf4_kernel keeps bitsandbytes)."""
    from . import nf4_fused
    from . import nf4_matmul as nm
    from . import nf4_repacked_matmul as rm
    from .kernel_timing import NoConfigCompiled

    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    storage: dict[int, float] = {}      # id(layer) -> µs on bitsandbytes' storage, for layers the kernel reads
    for _, _, layer in layers:
        state = layer.weight.quant_state
        n, k = (int(s) for s in state.shape)
        if k % 2 or getattr(state, "packing_format_for_cpu", False):
            continue                    # kept on bnb by _use_triton; no real model has such a layer
        dtype = layer.compute_dtype or torch.float32
        storage[id(layer)] = sum(min(_one_row_us(layer, dtype)) if m == 1 else
                                 nm.tuned_us(m, n, k, dtype, device, state.blocksize) for m in AUTO_ROWS)
    try:
        fuse, apart = _fusions(layers, device)
        made, kept = nf4_fused.repack_layers(layers, fuse=fuse)
        repacked = sum(rm.tuned_us(m, f.out_features, f.in_features, f.compute_dtype or torch.float32, device)
                       for f in made for m in AUTO_ROWS)
        # a layer repack_layers left on bitsandbytes runs bitsandbytes' own matmul at every row count there
        in_made = {id(original) for f in made for original in f._originals}
        repacked += sum(_timed_us(layer, layer.compute_dtype or torch.float32, m, "bnb")
                        for _, _, layer in layers if id(layer) in storage and id(layer) not in in_made
                        for m in AUTO_ROWS)
        on_storage = sum(storage.values())
        note = (f"auto measured {repacked:.0f} µs against {on_storage:.0f} µs on bitsandbytes' storage for the "
                f"projections of a {' and a '.join(f'{m}-row' for m in AUTO_ROWS)} step")
        if repacked < on_storage:       # its other row classes are tuned in here too: a failure undoes it all
            return f"{_use_repacked(model, device=device, repacked=(made, kept, apart))} ({note})"
    except NoConfigCompiled as err:
        note = f"auto: {err.what}"
    made = None                         # the repacked copies go with restore: never two copies of the weights
    nf4_fused.restore_bitsandbytes(decoder)
    return f"{_use_triton(list(_nf4_layers(model)), 'auto', device)} ({note})"


def _use_repacked(model: nn.Module, layers=None, exact: bool = False, device: torch.device | None = None,
                  repacked: tuple | None = None) -> str:
    """Every NF4 layer -> the repacked kernel for all row counts, q/k/v and gate/up each fused where that
    times faster on this GPU (always in exact mode and off CUDA: nothing is timed there); ``repacked``:
    (the modules made, the layers kept, the groups kept apart) where auto already repacked. bitsandbytes' packed
    bytes are freed (rebuilt exactly if another choice is made later). On CUDA, the configs are timed now
    (exact mode's checked row-exact first), not later inside someone's graph capture. Exact mode takes the row-exact attention too,
    and says which other pieces of the step are row-invariant on this machine."""
    from . import nf4_fused

    if repacked is None:
        fuse, apart = _fusions(layers, device) if device.type == "cuda" and not exact else (nf4_fused.FUSE, [])
        repacked = (*nf4_fused.repack_layers(layers, exact=exact, fuse=fuse), apart)
    made, kept, apart = repacked
    if device.type == "cuda":
        from . import nf4_repacked_matmul as rm

        for n, k, dtype in {(f.out_features, f.in_features, f.compute_dtype or torch.float32) for f in made}:
            if exact:       # one config for every M, checked row-exact on this GPU before it is timed
                rm.exact_tuned(n, k, dtype, device)
                continue
            for m in REPACKED_ROW_CLASSES:
                rm.tuned_us(m, n, k, dtype, device)
    fused = sum(len(f.splits) > 1 for f in made)
    routed = sum(len(f.splits) for f in made)
    more = ", ..." if len(kept) > 1 else ""
    kept_text = f"; {len(kept)} layer(s) kept on bitsandbytes ({kept[0]}{more})" if kept else ""
    mode = "fastest path per row count"
    if exact:
        nf4_fused.enter_exact(model)
        broken = nf4_fused.exact_gaps(model)
        mode = ("exact mode (rows independent of M), row-exact attention, norms and lm_head, " +
                (f"{' and '.join(broken)} not row-invariant on this {device.type}, so trees may differ from plain "
                 "decoding" if broken else f"the rest row-invariant on this {device.type}: greedy trees give plain "
                 "decoding's tokens"))
    apart_text = f", {' and '.join(apart)}" if apart else ""
    return (f"nf4 kernel: repacked Triton kernel for {routed} NF4 layers as {len(made)} matmuls ({fused} fused "
            f"q/k/v or gate/up{apart_text}), all row counts, {mode}{kept_text}")
