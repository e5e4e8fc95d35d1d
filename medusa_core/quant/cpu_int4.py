"""Weight-only 4-bit matmuls on the CPU: the decoder's Linear layers as 4-bit codes in groups of 32
(asymmetric, the layout of GGUF's Q4_1), multiplied by torch's int4 CPU kernel with bf16 activations;
the lm_head approximated in int4 or in bf16 (whichever this CPU runs faster), its top logits recomputed
in fp32. Everything between the matmuls (norms, rotary, attention, residuals) stays in the model's own
dtype.

Why: a CPU decoding step reads every weight once, so it costs what the weights weigh. fp32 sgemm
also repacks each weight per call once a few rows come in, which makes a tree of a few nodes cost
far more than a 1-row step (docs/cpu_default.md, "What a verified row costs on 2 CPU cores"). The
int4 kernel reads 1/7 of the bytes and computes every output row on its own: a T-row verification
gives, bit for bit, the rows T 1-row steps give (``row_invariant`` checks it on this machine).
bf16 rounding magnifies any last-bit difference upstream, so attention must be row-exact too
(exact_attention.py); with both, greedy Medusa stays identical to greedy plain decoding in this
mode (docs/design.md, "Exactness rules").

SmolLM2-135M-Instruct ships as Q4_1 (group 32, 4-bit codes with an fp16 scale and minimum): its fp32
weights are already 16 levels per group, and requantizing them finds those levels again, with the
scale rounded to bf16 (the kernel's scale dtype). A model given in fp32 is really quantized here,
which is why only the CPU default uses this mode unless ``--quant int4`` asks for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import fused_projections
from .exact_attention import NAME as EXACT_ATTENTION
from .exact_attention import use_exact_rows
from .fused_projections import SplitLinear, place

GROUP = 32          # weights per (scale, zero) pair along the input dimension, as in Q4_1
_LEVELS = 15        # codes 0..15
_N_MULTIPLE = 16    # the kernel's packing needs out_features in multiples of 16
PROBE_ROWS = (5, 64, 256)   # row counts the row-invariance check compares with single rows: trees, prefills
HEAD_PROBE_ROWS = (5, 17, 33, 64)   # the lm_head sees a tree's rows (a prefill's last row only)
# The bf16 head's GEMM takes at most this many rows per call, the largest at which this CPU keeps a row's
# bits whatever the call's row count (head_rows_per_call): oneDNN picks its kernel by row count, and on a
# Xeon with AMX 33 rows and more took another path that rounds otherwise (2026-11-27), so 64-node trees
# left plain decoding there and auto kept the whole model in fp32. Each call reads the head's weights once.
HEAD_ROWS_PER_CALL = (64, 32, 16, 8)
HEAD_TIMED_ROWS = (1, 4)    # the head's two approximations are timed at a plain step's row and a small tree's
REFINED = 16        # each row's top logits recomputed in fp32 by the head (RefinedHead)
MIN_GAIN = 1.1      # auto takes int4 only if at least this much faster: no flip-flop near parity
# auto takes int4 only if faithful to fp32 on a reference text. SmolLM2 scores well inside both limits
# on AVX2 and AVX-512 CPUs (docs/cpu_default.md, "Fidelity of the int4 mode on each CPU"): falling
# far below them means a broken kernel, not rounding
MIN_AGREEMENT = 0.9     # share of next-token argmaxes equal to fp32's
MAX_NLL_RATIO = 1.05    # int4's mean NLL over fp32's

# A reference text: (token ids, position of the first scored token), e.g. a prompt and its answer.
Reference = Sequence[tuple[list[int], int]]


@dataclass(frozen=True)
class Fidelity:
    """How close the int4 model's next-token predictions are to fp32's on a reference text."""

    tokens: int            # positions scored
    agreement: float       # share of them where int4's argmax is fp32's
    nll_fp32: float        # mean negative log-likelihood of the text's own next tokens
    nll_int4: float

    @property
    def faithful(self) -> bool:
        return self.agreement >= MIN_AGREEMENT and self.nll_int4 <= self.nll_fp32 * MAX_NLL_RATIO

    def line(self) -> str:
        return (f"on a {self.tokens}-token reference text {100 * self.agreement:.1f}% of next-token argmaxes as "
                f"fp32's, NLL {self.nll_int4:.4f} vs {self.nll_fp32:.4f}")


@dataclass(frozen=True)
class Speed:
    """The decoder's and head's matmuls in fp32 against int4 on this CPU (``measure``), and where the
    figures come from: measured by this start, or remembered from an earlier one (loading/int4_speed.py)."""

    fp32_ms: float
    int4_ms: float
    source: str = "measured now"    # the load line's words after the gain: how the figures were had and kept
    head_bf16_ms: float | None = None   # the lm_head alone, approximated in bf16 and in int4 (measure_heads);
    head_int4_ms: float | None = None   # None: not measured with the rest (choose_head measures them then)

    @property
    def gain(self) -> float:
        return self.fp32_ms / self.int4_ms

    def line(self, verdict: str = "") -> str:
        """``verdict`` goes beside the gain, before where it comes from."""
        return f"{self.gain:.2f}x fp32's matmul speed{verdict}, {self.source}"


@torch.no_grad()
def reference_logits(model: nn.Module, reference: Reference) -> list[torch.Tensor]:
    """Teacher-forced logits predicting each scored token: one (n, V) float32 tensor per text."""
    out = []
    for ids, start in reference:
        logits = model(torch.tensor([ids])).logits[0].float()                     # (L, V)
        out.append(logits[start - 1:len(ids) - 1])                                # (n, V): predicts ids[start:]
    return out


def fidelity(fp32: list[torch.Tensor], int4: list[torch.Tensor], reference: Reference) -> Fidelity:
    targets = torch.cat([torch.tensor(ids[start:]) for ids, start in reference])      # (N,)
    a, b = torch.cat(fp32), torch.cat(int4)                                             # (N, V)
    return Fidelity(tokens=int(targets.numel()),
                    agreement=(a.argmax(-1) == b.argmax(-1)).float().mean().item(),
                    nll_fp32=F.cross_entropy(a, targets).item(), nll_int4=F.cross_entropy(b, targets).item())


def kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) float -> codes (N, K) int32 in 0..15 and scales_zeros (K/GROUP, N, 2) bf16 with
    w ~ (code - 8) * scale + zero: round to nearest between each group's minimum and maximum.
    The codes are computed against the bf16 scale and zero the kernel will use."""
    n, k = weight.shape
    groups = weight.float().reshape(n, k // GROUP, GROUP)                      # (N, K/G, G)
    low, high = groups.amin(-1), groups.amax(-1)                               # (N, K/G)
    scale = ((high - low) / _LEVELS).bfloat16().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))              # a constant group: code 0
    zero = (low + 8 * scale).bfloat16().float()
    # a group far from 0 with a small range: zero's bf16 rounding can leave the range outside the
    # 16 levels; widen its scale (rounded up) to cover [low, high] again. Q4_1 groups stay as they are.
    needed = torch.maximum((zero - low) / 8, (high - zero) / 7)
    covered = (zero - 8 * scale <= low + scale / 2) & (zero + 7 * scale >= high - scale / 2)
    scale = torch.where(covered, scale, (needed * (1 + 2 ** -7)).bfloat16().float())
    codes = torch.round((groups - (zero - 8 * scale)[..., None]) / scale[..., None]).clamp(0, _LEVELS)
    scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous().bfloat16()   # (K/G, N, 2)
    return codes.reshape(n, k).to(torch.int32), scales_zeros


def dequantize(codes: torch.Tensor, scales_zeros: torch.Tensor) -> torch.Tensor:
    """The weight the kernel multiplies by: (N, K) float32 (a reference for the tests)."""
    scale = scales_zeros[..., 0].float().repeat_interleave(GROUP, 0).T        # (N, K)
    zero = scales_zeros[..., 1].float().repeat_interleave(GROUP, 0).T
    return (codes.float() - 8) * scale + zero


class Int4Linear(SplitLinear):
    """y = x W^T + b with W as 4-bit group codes; x is rounded to bf16 for the kernel, y (fp32
    accumulated, rounded to bf16 by the kernel) returns in x's dtype. One projection, or several that read
    the same input stacked by rows (``splits``: fused_projections.py)."""

    def __init__(self, codes: torch.Tensor, scales_zeros: torch.Tensor, bias: torch.Tensor | None,
                 splits: tuple[int, ...] | None = None):
        super().__init__(splits or (codes.shape[0],))
        self.out_features, self.in_features = codes.shape
        # innerKTiles is ignored by the CPU packing; 1 is its smallest legal value. Not persistent:
        # the packing is this CPU kernel's own layout, which no checkpoint should carry
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1), persistent=False)
        self.register_buffer("scales_zeros", scales_zeros, persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, dense: nn.Linear) -> "Int4Linear":
        return cls(*quantize_groups(dense.weight.data), dense.bias)

    @classmethod
    def from_linears(cls, denses: Sequence[nn.Linear]) -> "Int4Linear":
        """One matmul over ``denses`` (one input size and dtype) stacked by rows. Groups run along a row, so
        each projection keeps the codes and scales it has alone."""
        if len(denses) == 1:
            return cls.from_linear(denses[0])
        splits = tuple(d.out_features for d in denses)
        bias = None
        if any(d.bias is not None for d in denses):     # a missing bias adds zeros
            bias = torch.cat([d.bias.data if d.bias is not None else d.weight.new_zeros(d.out_features)
                              for d in denses])
        return cls(*quantize_groups(torch.cat([d.weight.data for d in denses])), bias, splits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16)                  # (M, K)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, GROUP, self.scales_zeros)   # (M, N)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        fused = f", fused {'+'.join(map(str, self.splits))}" if len(self.splits) > 1 else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}{fused}, group={GROUP}, "
                "bf16 activations")


class RefinedHead(nn.Module):
    """The lm_head as a fast approximation of every logit, with each row's REFINED largest logits recomputed
    from the fp32 input and weights. ``weight`` stays the model's own (tied) parameter: the heads read its rows
    for the root token and their proposal vocabulary.

    Why refine: the approximations are coarse (a bf16 GEMM rounds SmolLM2's top logits, 20-35, to steps of
    0.125-0.25), coarser than many of its near-ties. "What is the capital of France?" came out as a tie of "L"
    and "The" on an AVX2 CPU (fp32: 0.02 apart), and greedy answered "L'Étoile, la Marseillaise...". So the
    largest logits, where the argmax and most of the probability lie, are recomputed: a dot product per (row,
    token), so a row keeps its bits whatever else is in the call (0.1 ms per row on 2 cores)."""

    kind = ""                   # the approximation, for the load line

    def __init__(self, dense: nn.Linear):
        super().__init__()
        self.out_features, self.in_features = dense.out_features, dense.in_features
        self.weight = dense.weight
        self.bias = dense.bias

    def approximate(self, rows: torch.Tensor) -> torch.Tensor:
        """(R, H) -> (R, V): every logit, each row computed on its own."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:                         # (..., H) -> (..., V)
        y = self.approximate(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1).to(x.dtype)   # (..., V)
        if self.bias is not None:
            y = y + self.bias                      # before the top is picked: the largest logits as returned
        top = y.topk(min(REFINED, y.shape[-1]), dim=-1).indices                              # (..., R)
        # in fp32 whatever the model's dtype: a bf16 product would round each term again
        exact = (x.float().unsqueeze(-2) * self.weight[top].float()).sum(-1)                 # (..., R)
        if self.bias is not None:
            exact = exact + self.bias.float()[top]
        return y.scatter_(-1, top, exact.to(y.dtype))


class Bf16Head(RefinedHead):
    """The lm_head approximated in bf16 (oneDNN's bf16 GEMM, row-invariant like the int4 kernel in calls of
    at most ``rows_per_call`` rows): half the bytes of fp32 and no per-call repacking."""

    kind = "bf16"

    def __init__(self, dense: nn.Linear, rows_per_call: int = HEAD_ROWS_PER_CALL[0]):
        super().__init__(dense)
        self.rows_per_call = rows_per_call          # see HEAD_ROWS_PER_CALL
        self.register_buffer("weight_bf16", dense.weight.detach().bfloat16(), persistent=False)

    def approximate(self, rows: torch.Tensor) -> torch.Tensor:
        rows = rows.to(torch.bfloat16)                                                      # (R, H)
        parts = [F.linear(part, self.weight_bf16) for part in rows.split(self.rows_per_call)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)                            # (R, V)


class Int4Head(RefinedHead):
    """The lm_head approximated by the int4 kernel, in the decoder's format (group codes, bf16 activations): a
    quarter of the bf16 copy's bytes, which is what a 1-row step waits for. The kernel computes each row on its
    own, so it costs about as much again per row (2 cores: 0.8 ms at 1 row, 7.3 at 17, against bf16's 3.4 and
    5.5): ``choose_head`` keeps it where it measures faster at a plain step's and a small tree's rows. Outputs
    the kernel cannot pack (not a multiple of 16: the heads' proposal vocabulary) are padded with zero rows."""

    kind = "int4"

    def __init__(self, dense: nn.Linear):
        super().__init__(dense)
        weight = dense.weight.data
        padding = (-weight.shape[0]) % _N_MULTIPLE
        if padding:
            weight = torch.cat([weight, weight.new_zeros(padding, weight.shape[1])])
        self.int4 = Int4Linear(*quantize_groups(weight), None)

    def approximate(self, rows: torch.Tensor) -> torch.Tensor:
        return self.int4(rows)[:, :self.out_features]


def quantizable(dense: nn.Linear) -> bool:
    return dense.in_features % GROUP == 0 and dense.out_features % _N_MULTIPLE == 0


def _decoder_linears(model: nn.Module):
    """(parent, name, Linear) for every Linear inside the decoder layers."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"quant int4 knows decoders with a .layers list, and {type(model).__name__}'s has none: "
                         "use --quant none")
    for layer in layers:
        for parent in list(layer.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear:
                    yield parent, name, child


def _matmuls(model: nn.Module) -> list[list[tuple[nn.Module, str, nn.Linear]]]:
    """The decoder's quantizable Linear layers as the int4 mode multiplies them: q/k/v and gate/up each one
    matmul (fused_projections.FUSE, where whole under one parent with one input size and dtype), every other
    layer alone. On 2 Zen 4 cores q/k/v fused took 32 µs at 1 row against 65 apart, gate/up 67 against 82:
    the kernel's call costs as much as its bytes at SmolLM2's sizes (docs/cpu_default.md)."""
    layers = [entry for entry in _decoder_linears(model) if quantizable(entry[2])]
    groups = [group for _, group in fused_projections.fusable(layers, lambda d: (d.in_features, d.weight.dtype))]
    grouped = {id(entry[2]) for group in groups for entry in group}
    return groups + [[entry] for entry in layers if id(entry[2]) not in grouped]


def row_invariant(layer: nn.Module, in_features: int, rows: int = 5, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``layer`` gives an input row the same bits alone as among ``rows`` rows: what keeps a
    tree verification identical to plain decoding. A property of the kernel on this CPU."""
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        together = layer(x)
        alone = torch.cat([layer(x[i:i + 1]) for i in range(rows)])
    return torch.equal(together, alone)


def head_rows_per_call(head: nn.Linear) -> int | None:
    """The most rows per GEMM call (of HEAD_ROWS_PER_CALL) with which the bf16 head gives every row of a
    HEAD_PROBE_ROWS-row call the bits it gets alone on this CPU; None where not even the fewest do."""
    x = torch.randn(max(HEAD_PROBE_ROWS), head.in_features, generator=torch.Generator().manual_seed(0))
    x = x.to(head.weight.dtype)
    bf16 = Bf16Head(head)
    with torch.no_grad():
        alone = torch.cat([bf16(x[i:i + 1]) for i in range(x.shape[0])])            # (64, V), once for all
        for rows in HEAD_ROWS_PER_CALL:
            bf16.rows_per_call = rows
            if all(torch.equal(bf16(x[:n]), alone[:n]) for n in HEAD_PROBE_ROWS):
                return rows
    return None


def exact_probe(model: nn.Module) -> tuple[str | None, int | None]:
    """(what keeps trees from plain decoding's tokens on this CPU, None if nothing; the rows per call the bf16
    head is row-invariant with, None where only the int4 head is, so that it must be the head): every distinct
    decoder matmul shape (fused as _matmuls fuses) at PROBE_ROWS rows, and the head as Bf16Head (the fp32
    ``model`` before quantization; cheap enough for every load)."""
    shapes = {(sum(d.out_features for _, _, d in group), group[0][2].in_features): [d for _, _, d in group]
              for group in _matmuls(model)}                                   # as the mode multiplies them
    head = model.get_output_embeddings()
    dtype = head.weight.dtype
    if not shapes or not all(row_invariant(Int4Linear.from_linears(ds), ds[0].in_features, n, dtype)
                             for ds in shapes.values() for n in PROBE_ROWS):
        return "the int4 kernel is not row-invariant on this CPU", HEAD_ROWS_PER_CALL[0]
    if type(head) is not nn.Linear:
        return None, HEAD_ROWS_PER_CALL[0]
    rows = head_rows_per_call(head)
    if rows is not None:
        return None, rows
    # the int4 head computes each row on its own: where it keeps a row's bits, it can stand in for bf16's
    if quantizable(head) and all(row_invariant(Int4Head(head), head.in_features, n, dtype) for n in HEAD_PROBE_ROWS):
        return None, None
    return (f"the lm_head is not row-invariant on this CPU, in bf16 even {HEAD_ROWS_PER_CALL[-1]} rows per call"
            + (" nor in int4" if quantizable(head) else ""), HEAD_ROWS_PER_CALL[-1])


def exact_mode(model: nn.Module) -> bool:
    """Whether a quantized ``model`` is all int4 layers, a refined head and row-exact attention: then a
    greedy tree must give plain decoding's tokens (the kernels' row invariance checked again)."""
    layers = [m for m in model.get_decoder().modules() if isinstance(m, (nn.Linear, Int4Linear))]
    head = model.get_output_embeddings()
    if not layers or not all(isinstance(m, Int4Linear) for m in layers) or not isinstance(head, RefinedHead) \
            or getattr(model.config, "_attn_implementation", None) != EXACT_ATTENTION:
        return False
    return row_invariant(layers[0], layers[0].in_features, dtype=head.weight.dtype)


def measure_heads(bf16: "Bf16Head", int4: "Int4Head", rows: tuple[int, ...] = HEAD_TIMED_ROWS,
                  repeats: int = 15) -> dict[str, float]:
    """ms of the lm_head approximated in bf16 and in int4 (each with its refinement), summed over ``rows``:
    each call timed ``repeats`` times, the two interleaved, the fastest time kept (other load only adds)."""
    best = {"head_bf16_ms": [float("inf")] * len(rows), "head_int4_ms": [float("inf")] * len(rows)}
    with torch.no_grad():
        for n, m in enumerate(rows):
            x = torch.randn(m, bf16.in_features, dtype=bf16.weight.dtype)
            for _ in range(repeats + 1):              # the first round warms up
                for name, head in (("head_bf16_ms", bf16), ("head_int4_ms", int4)):
                    start = time.perf_counter()
                    head(x)
                    best[name][n] = min(best[name][n], time.perf_counter() - start)
    return {name: round(1e3 * sum(times), 3) for name, times in best.items()}


def measure(model: nn.Module, rows: tuple[int, ...] = (1, 4), repeats: int = 15) -> dict[str, float]:
    """ms for every decoder layer's Linear layers plus the lm_head, fp32 against int4 (fused as _matmuls
    fuses) + bf16 head, summed over ``rows`` (a plain step and a small tree): what ``auto`` chooses by. Each
    call is timed ``repeats`` times, interleaved, and its fastest time kept: other load only adds time.
    Every layer, in a step's order, not one: one layer timed again and again keeps its fp32 weights
    (14 MB in SmolLM2) in the CPU's cache, which a step streaming 30 layers does not. That hid int4's
    gain, which is memory read: on an AVX2 CPU one layer measured 0.80x while whole-model
    forwards ran 1.3-1.4x faster in int4, and auto chose fp32 (docs/cpu_default.md)."""
    head = model.get_output_embeddings()
    groups = [[d for _, _, d in group] for group in _matmuls(model)]
    pairs = [(group, Int4Linear.from_linears(group)) for group in groups]
    pairs.append(([head], Bf16Head(head)))
    best: dict[tuple, float] = {}
    with torch.no_grad():
        for m in rows:
            inputs = {k: torch.randn(m, k, dtype=head.weight.dtype) for k in {fast.in_features for _, fast in pairs}}
            for _ in range(repeats + 1):              # the first round warms up
                for n, (fp32, fast) in enumerate(pairs):
                    x = inputs[fast.in_features]
                    for kind, fn in (("fp32_ms", lambda x: [d(x) for d in fp32]), ("int4_ms", fast)):
                        start = time.perf_counter()
                        fn(x)
                        took = time.perf_counter() - start
                        best[kind, m, n] = min(best.get((kind, m, n), float("inf")), took)
    times = {kind: round(1e3 * sum(t for (k, _, _), t in best.items() if k == kind), 3) for kind in ("fp32_ms", "int4_ms")}
    if type(head) is nn.Linear and quantizable(head):     # the head's approximation, chosen apart (choose_head)
        times.update(measure_heads(pairs[-1][1], Int4Head(head), repeats=repeats))
    return times


def choose_head(head: nn.Linear, rows_per_call: int | None, timed: Speed | None,
                trees: bool) -> tuple[RefinedHead, str]:
    """The lm_head's approximation on this CPU, and the load line's words for it: int4 where the kernel takes the
    head's sizes, gives its rows the bits they get alone (where trees run) and is faster than bf16 at
    HEAD_TIMED_ROWS (``timed``'s figures, remembered with the int4 gain, or measured now); bf16 elsewhere, taking
    ``rows_per_call`` rows per call. ``rows_per_call`` None (exact_probe: only the int4 head is row-invariant
    here): int4 whatever the times."""
    if rows_per_call is None:
        return Int4Head(head), _said("int4", [f"the bf16 one is not row-invariant on this CPU even "
                                              f"{HEAD_ROWS_PER_CALL[-1]} rows per call"])
    bf16 = Bf16Head(head, rows_per_call)
    calls = [f"{rows_per_call} rows per call: row-invariant up to there on this CPU"] \
        if rows_per_call < HEAD_ROWS_PER_CALL[0] else []
    if not quantizable(head):
        return bf16, _said("bf16", calls)
    int4 = Int4Head(head)
    if trees and not all(row_invariant(int4, head.in_features, n, head.weight.dtype) for n in HEAD_PROBE_ROWS):
        return bf16, _said("bf16", [*calls, "the int4 one is not row-invariant on this CPU"])
    if timed is not None and timed.head_bf16_ms is not None and timed.head_int4_ms is not None:
        bf16_ms, int4_ms = timed.head_bf16_ms, timed.head_int4_ms
    else:
        times = measure_heads(bf16, int4)
        bf16_ms, int4_ms = times["head_bf16_ms"], times["head_int4_ms"]
    at = f"at {' and '.join(map(str, HEAD_TIMED_ROWS))} rows"
    if int4_ms < bf16_ms:
        return int4, _said("int4", [f"{int4_ms:.2f} ms against {bf16_ms:.2f} for bf16 {at}"])
    return bf16, _said("bf16", [*calls, f"{bf16_ms:.2f} ms against {int4_ms:.2f} for int4 {at}"])


def _said(kind: str, details: list[str]) -> str:
    return f"{kind} lm_head" + (f" ({'; '.join(details)})" if details else "")


def proposals_in_int4(heads) -> bool:
    """Where the int4 head runs: the Medusa heads' proposal logits (their vocabulary's rows of the lm_head) through
    the same kernel, each row's REFINED largest recomputed in fp32 as the head's are, so that their top guesses
    are fp32's. The proposals are computed at one row a step, where the kernel is fastest (2 cores: 0.12 ms for
    SmolLM2's 6,185 rows, against 1.33 for the fp32 product). Guesses only propose: the output cannot change.
    Returns whether the heads now compute so (heads without a proposal vocabulary, or of an input size the
    kernel cannot take, keep theirs)."""
    weight = heads.proposal_weight
    if weight is None or weight.shape[1] % GROUP or not weight.is_floating_point():
        return False
    dense = nn.Linear(weight.shape[1], weight.shape[0], bias=heads.proposal_bias is not None, device="meta")
    dense.weight = nn.Parameter(weight, requires_grad=False)
    if heads.proposal_bias is not None:
        dense.bias = nn.Parameter(heads.proposal_bias, requires_grad=False)
    heads.approximate_proposals(Int4Head(dense))
    return True


@torch.no_grad()
def quantize_model_int4_(model: nn.Module, replaced: list | None = None, head: RefinedHead | None = None) -> int:
    """Every decoder Linear whose input size is a multiple of GROUP -> Int4Linear (q/k/v and gate/up each one,
    read through FusedSlices: _matmuls); the lm_head -> ``head`` (made by ``choose_head`` from it; None: a
    Bf16Head). Returns how many Linear layers kept their dtype (sizes
    the kernel cannot take). ``replaced`` collects (parent, name, original) so that ``restore_`` can undo it."""
    kept = sum(not quantizable(d) for _, _, d in _decoder_linears(model))
    for group in _matmuls(model):
        place(Int4Linear.from_linears([d for _, _, d in group]), group)
        if replaced is not None:
            replaced.extend(group)
    original = model.get_output_embeddings()
    if type(original) is nn.Linear:
        model.set_output_embeddings(head if head is not None else Bf16Head(original))
        if replaced is not None:
            replaced.append((model, None, original))
    # transformers maps the fp32 safetensors file and the weights left (embeddings, norms) are views
    # of that mapping: copied, they let it go, and with it the fp32 file's resident pages
    # (docs/cpu_default.md, "The 4-bit CPU mode")
    for param in model.parameters():
        param.data = param.data.clone()
    return kept


def restore_(replaced: list) -> None:
    """Put back the layers ``quantize_model_int4_`` replaced (the originals kept their weights)."""
    for parent, name, original in reversed(replaced):
        if name is None:
            parent.set_output_embeddings(original)
        else:
            setattr(parent, name, original)


def use_int4(model: nn.Module, measured: bool, reference: Reference = (), trees: bool = True,
             speed: Callable[[], Speed] | None = None) -> tuple[bool, str]:
    """Quantize ``model`` (on the CPU) for the int4 kernel -> (applied, one line saying what and why).
    ``measured`` (quant auto): only where the kernels are row-invariant here, int4 is at least
    MIN_GAIN times faster than fp32 and, on the ``reference`` texts, faithful to it (Fidelity);
    otherwise (quant int4) always, saying so when a tree would no longer equal plain decoding.
    The fidelity is measured on this CPU's own kernels (an AVX2 CPU rounds otherwise than an
    AVX-512 one) and reported in the line either way. ``trees`` False (a model loaded without heads):
    only plain decoding runs, so row invariance is neither required nor mentioned. ``speed``: how the
    gain is had, ``measure`` now by default (the loader remembers it per machine: int4_speed.py)."""
    if not kernel_available():
        if measured:
            return False, f"fp32 matmuls (torch {torch.__version__} has no int4 CPU kernel)"
        raise ValueError(f"quant int4 needs torch's int4 CPU kernel, which torch {torch.__version__} lacks: "
                         "use --quant none, or torch>=2.6")
    if not any(quantizable(d) for _, _, d in _decoder_linears(model)):
        if measured:
            return False, f"fp32 matmuls (no decoder layer has sizes the int4 kernel takes: in % {GROUP}, out % {_N_MULTIPLE})"
        raise ValueError(f"quant int4 needs decoder layers with input sizes in multiples of {GROUP} and output sizes "
                         f"in multiples of {_N_MULTIPLE}: use --quant none")
    gap, head_rows = exact_probe(model) if trees else (None, HEAD_ROWS_PER_CALL[0])
    exact = gap is None
    timed = None
    if measured:
        if not exact:
            return False, f"fp32 matmuls ({gap}: trees would not equal plain decoding)"
        timed = speed() if speed is not None else Speed(**measure(model))
        if timed.gain < MIN_GAIN:
            return False, f"fp32 matmuls (int4 at {timed.line(f', under the {MIN_GAIN}x it needs')})"
        why = timed.line()
    else:
        why = "asked for"
    fp32 = reference_logits(model, reference) if reference else []
    original = model.get_output_embeddings()
    head, head_text = choose_head(original, head_rows, timed, trees) if type(original) is nn.Linear else \
        (None, "bf16 lm_head")
    replaced: list = []
    kept = quantize_model_int4_(model, replaced, head)
    if reference:
        faithful = fidelity(fp32, reference_logits(model, reference), reference)
        if measured and not faithful.faithful:
            restore_(replaced)
            return False, (f"fp32 matmuls (int4 is not faithful enough on this CPU: {faithful.line()}; it must "
                           f"agree on {MIN_AGREEMENT:.0%} and stay within {MAX_NLL_RATIO}x the NLL)")
        why += f"; {faithful.line()}"
    use_exact_rows(model)
    if kept:
        why += f"; {kept} layer(s) kept unquantized"
    if trees and (kept or not exact):
        why += (f"; {gap}" if not exact else "") + ", so trees may differ from plain decoding"
    # the reasons after a colon, not in brackets: read as the attention's detail there (QA)
    fused = fused_projections.fused_groups(model)
    layout = f"group {GROUP}" + (f", {' and '.join(fused)} each one matmul" if fused else "")
    return True, f"int4 weights ({layout}) with bf16 matmuls, {head_text} and row-exact attention: {why}"
