"""NF4 layers on the repacked kernel, with q/k/v and gate/up each fused into one matmul.

Why and how the stock transformers forward stays unchanged: fused_projections.py.

bitsandbytes' modules are kept, emptied of their packed bytes (so memory stays the repacked size), and
``restore_bitsandbytes`` puts them back with bytes rebuilt exactly from the repacked codes.
"""

from __future__ import annotations

import torch
from torch import nn

from . import fused_projections
from .fused_projections import FUSE, FusedSlice, SplitLinear, place
from .model_parts import children, is_rms_norm
from .nf4_repack import RepackedNF4, bitsandbytes_bytes, check_bnb_nf4, repack_bnb


class RepackedNF4Linear(SplitLinear):
    """y = x @ W.T + b on a repacked NF4 weight: one projection, or several stacked by rows (``splits``)."""

    def __init__(self, weight: RepackedNF4, bias: torch.Tensor | None, compute_dtype: torch.dtype | None,
                 exact: bool, originals: tuple[nn.Module, ...], splits: tuple[int, ...]):
        super().__init__(splits)
        # buffers, not parameters: .to() moves them, state_dict (checkpoints: bitsandbytes') skips them
        self.register_buffer("words", weight.words, persistent=False)
        self.register_buffer("scales", weight.scales, persistent=False)
        self.register_buffer("code", weight.code, persistent=False)
        self.register_buffer("arrivals", weight.arrivals, persistent=False)
        self.register_buffer("bias", bias, persistent=False)
        self.layout = (weight.n, weight.k, weight.blocksize, weight.group)
        self.table = weight.table
        self.in_features, self.out_features = weight.k, weight.n
        self.compute_dtype = compute_dtype
        self.exact = exact
        self._originals = originals     # a tuple: not registered as submodules (no double state_dict)

    @property
    def packed(self) -> RepackedNF4:
        return RepackedNF4(self.words, self.scales, self.code, *self.layout, self.arrivals, self.table)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .nf4_repacked_matmul import repacked_matmul  # Triton only once a model uses this kernel

        compute = self.compute_dtype or x.dtype
        bias = self.bias.to(compute) if self.bias is not None else None
        return repacked_matmul(x.to(compute), self.packed, bias, exact=self.exact).to(x.dtype)


def _replace(layers: list[tuple[nn.Module, str, nn.Module]], exact: bool, group: int) -> RepackedNF4Linear:
    """One RepackedNF4Linear over ``layers`` (bitsandbytes Linear4bit NF4, same K) stacked by rows."""
    mods = [m for _, _, m in layers]
    weight = repack_bnb([(m.weight.data, m.weight.quant_state) for m in mods], group)
    splits = tuple(int(m.weight.quant_state.shape[0]) for m in mods)
    bias = None
    if any(m.bias is not None for m in mods):
        bias = torch.cat([m.bias.data if m.bias is not None else torch.zeros(n, device=weight.words.device)
                          for m, n in zip(mods, splits, strict=True)])
        bias = bias.to(mods[0].compute_dtype) if mods[0].compute_dtype is not None else bias
    fused = RepackedNF4Linear(weight, bias, mods[0].compute_dtype, exact, tuple(mods), splits)
    for m in mods:       # bitsandbytes' bytes are rebuilt from the repacked codes on restore
        m.weight.data = torch.empty(0, dtype=torch.uint8, device=m.weight.data.device)
    place(fused, layers)
    return fused


def fusable(layers: list[tuple[nn.Module, str, nn.Module]], fuse=FUSE) -> list[tuple[tuple[str, ...], list]]:
    """(names, its layers) for every ``fuse`` group found whole under one parent, with one K and dtype."""
    return fused_projections.fusable(layers, lambda m: (int(m.weight.quant_state.shape[1]), m.compute_dtype), fuse)


def repack_layers(layers: list[tuple[nn.Module, str, nn.Module]], exact: bool = False,
                  group: int = 128, fuse=FUSE) -> tuple[list[RepackedNF4Linear], list[str]]:
    """Route bitsandbytes NF4 ``layers`` ((parent, name, Linear4bit) as bnb._nf4_layers lists them) to
    the repacked kernel, fusing the ``fuse`` groups found whole under one parent. Returns (the new
    modules, "name: reason" for each layer kept on bitsandbytes)."""
    kept, ok = [], []
    for parent, name, layer in layers:
        try:
            check_bnb_nf4(layer.weight.data, layer.weight.quant_state)
            ok.append((parent, name, layer))
        except ValueError as err:
            kept.append(f"{name}: {err}")
    made, grouped = [], set()
    for _, group_layers in fusable(ok, fuse):
        made.append(_replace(group_layers, exact, group))
        grouped.update(id(e[2]) for e in group_layers)
    made.extend(_replace([entry], exact, group) for entry in ok if id(entry[2]) not in grouped)
    return made, kept


def restore_bitsandbytes(model: nn.Module) -> int:
    """Put bitsandbytes' modules back where repack_layers replaced them, their packed bytes rebuilt
    exactly; returns how many."""
    count = 0
    for parent in list(model.modules()):
        if isinstance(parent, FusedSlice):
            continue            # its .fused is the shared module, not a layer of the model
        for name, child in list(parent.named_children()):
            if isinstance(child, FusedSlice):
                fused, index = child.fused, child.index
            elif isinstance(child, RepackedNF4Linear):
                fused, index = child, 0
            else:
                continue
            start = sum(fused.splits[:index])
            original = fused._originals[index]
            original.weight.data = bitsandbytes_bytes(fused.packed, slice(start, start + fused.splits[index]))
            setattr(parent, name, original)
            count += 1
    return count


def enter_exact(model: nn.Module) -> None:
    """Exact mode's attention, norms and lm_head (the repacked layers are made exact by repack_layers)."""
    from .exact_attention import use_exact_rows
    from .rows_alone_linear import RowsAloneHead
    from .rows_alone_norm import RowsAloneRMSNorm

    use_exact_rows(model)
    for parent, name, child in children(model.get_decoder()):
        if is_rms_norm(child):
            setattr(parent, name, RowsAloneRMSNorm(child))
    head = model.get_output_embeddings()
    if not isinstance(head, RowsAloneHead):
        model.set_output_embeddings(RowsAloneHead(head))


def leave_exact(model: nn.Module) -> None:
    """The attention, norms and lm_head ``model`` had before ``enter_exact`` (found by class name: their
    modules import Triton, and this runs on every kernel choice). The fast step's Triton norms go too:
    the loaders route the norms again after the kernel (norm_routing.use_norm_kernel)."""
    from .exact_attention import stop_exact_rows

    stop_exact_rows(model)
    for parent, name, child in children(model):
        if type(child).__name__ == "RowsAloneRMSNorm":
            original = child.original[0]
            original.weight = child.weight          # the parameter as it is now, were it reassigned meanwhile
            setattr(parent, name, original)
    head = model.get_output_embeddings()
    if type(head).__name__ == "RowsAloneHead":
        model.set_output_embeddings(head.dense)


# Row counts the exact mode's checks compare with single rows: trees and prefills, a spread of sizes
# (torch's CUDA reductions choose their split from the number of rows)
PROBE_ROWS = (2, 3, 5, 7, 16, 26, 42, 64, 100, 256)


def row_invariance(model: nn.Module) -> dict[str, bool]:
    """Per piece of the step exact mode could not replace (a norm class it does not know, a head it did
    not wrap; one instance stands for its class): does it give a row the same bits alone as among
    PROBE_ROWS rows, measured on this machine? Exact mode's own pieces (the repacked layers, the
    attention, RowsAloneRMSNorm, RowsAloneHead) are exact by construction, which their tests check, and
    are not measured. A decoder with no norm found is reported as unverified."""
    from .cpu_int4 import row_invariant

    head = model.get_output_embeddings()
    device, dtype = head.weight.device, head.weight.dtype
    norms, found = {}, False
    for module in model.get_decoder().modules():
        name = type(module).__name__
        if name.endswith("Norm") and isinstance(getattr(module, "weight", None), torch.Tensor):
            found = True
            if name != "RowsAloneRMSNorm":          # per class and width: a per-head q/k norm is its own piece
                norms.setdefault(name if module.weight.shape[-1] == head.in_features
                                 else f"{name} ({module.weight.shape[-1]})", module)
    pieces = {**norms, **({} if type(head).__name__ == "RowsAloneHead" else {"lm_head": head})}
    if not found:
        pieces["norm (none found)"] = None
    return {name: module is not None and all(row_invariant(_on(module, device), _width(module), rows, dtype)
                                             for rows in PROBE_ROWS) for name, module in pieces.items()}


def _width(module: nn.Module) -> int:
    """Input features of a norm (its weight's size) or of the head."""
    return module.in_features if hasattr(module, "in_features") else module.weight.shape[-1]


def _on(module: nn.Module, device: torch.device):
    """``module`` called with its input moved to ``device`` (row_invariant makes CPU inputs)."""
    return lambda x: module(x.to(device))


def exact_gaps(model: nn.Module) -> list[str]:
    """What keeps exact mode's step from being row-exact on this machine: pieces row_invariance found
    not row-invariant, and decoder layers left off the repacked kernel (kept on bitsandbytes, whose
    Linear4bit is an nn.Linear, or dense). Empty: greedy trees give plain decoding's tokens."""
    left = sum(isinstance(m, nn.Linear) for m in model.get_decoder().modules())
    return [name for name, ok in row_invariance(model).items() if not ok] + \
        ([f"{left} layer(s) off the repacked kernel"] if left else [])


def exact_mode(model: nn.Module) -> bool:
    """Whether greedy Medusa must give plain decoding's tokens on this NF4 model: every NF4 layer on the
    repacked kernel's exact mode, the row-exact attention, and no gap in the rest of the step here."""
    from ..decoding.step import ROW_EXACT_ATTENTION

    layers = [m for m in model.modules() if isinstance(m, RepackedNF4Linear)]
    return bool(layers) and all(m.exact for m in layers) and \
        getattr(model.config, "_attn_implementation", None) == ROW_EXACT_ATTENTION and not exact_gaps(model)
