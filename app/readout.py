"""Live speed readout: what one answer measured, and how it is shown.

``Meter`` accumulates the generation loop's Steps; ``Stats`` is a frozen
snapshot of it, cheap to hand to the UI on every update. The render functions
turn Stats into the Markdown the readout panes show.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from medusa_core.decoding.generate import StepResult, first_divergence

_BARS = "▁▂▃▄▅▆▇█"
SPARK_STEPS = 40  # the readout shows the last 40 steps' accepted lengths
RATIO_WINDOW = 8  # a comparison's speedup spread: rolling windows of 8 interleaved rounds

FINISH_TEXT = {
    "eos": "end of answer",
    "length": "max new tokens reached",
    "context": "context window full",
    "cancelled": "stopped",
    "interrupted": "interrupted: see the note",   # an error or an unload ended it (app/engine.py, DecoderRun.update)
}


@dataclass(frozen=True)
class Stats:
    label: str = "Medusa"           # which decoder: "Medusa" or "Plain decoding"
    tree: str = ""                  # tree preset the answer used
    tree_size: int = 1              # its node count including the root
    tree_depth: int = 0             # its guesses' depth: a step emits at most tree_depth + 1 tokens
    tokens: int = 0                 # generated tokens, first token included
    steps: int = 0                  # decoding steps after the prefill
    accepted: tuple[int, ...] = ()  # tokens emitted per decoding step (1 = no head guess accepted)
    from_heads: int = 0             # tokens that were Medusa guesses accepted by the backbone
    ttft: float | None = None       # seconds from decoding's start (after the wait in line) to the first token
    decode_seconds: float = 0.0     # seconds spent in the steps after the first token
    finish_reason: str | None = None

    @property
    def tokens_per_second(self) -> float:
        """Decoding speed after the first token; the prefill is reported apart as TTFT,
        so a long prompt does not hide the speed of the decoding loop."""
        if self.steps and self.decode_seconds > 0:
            return (self.tokens - 1) / self.decode_seconds
        return 0.0

    @property
    def tokens_per_step(self) -> float:
        return (self.tokens - 1) / self.steps if self.steps else 0.0

    @property
    def total_seconds(self) -> float:
        return (self.ttft or 0.0) + self.decode_seconds

    def as_dict(self) -> dict:
        return {
            "label": self.label, "tree": self.tree, "tree_size": self.tree_size, "tokens": self.tokens,
            # unrounded: the export formats these as the page does, to the same digits (rounded here first,
            # the page's 12.0 tokens/s was 11.95 in the JSON and 11.9 in the Markdown); None without a
            # decoding step (a one-token answer has no speed, not a speed of 0)
            "steps": self.steps, "tokens_per_second": self.tokens_per_second if self.steps else None,
            # the OpenAI API's names for these figures, and the page API's first names ("mean_accepted",
            # "ttft"), which scripts and saved conversations already read
            "tokens_per_step": self.tokens_per_step if self.steps else None,
            "mean_accepted": self.tokens_per_step if self.steps else None, "from_heads": self.from_heads,
            # unrounded too: a reloaded page renders its readout from these, and "9.5 ms" rounded first read
            # "9 ms" where the page had said "10 ms"
            "time_to_first_token": self.ttft, "ttft": self.ttft,
            "seconds": round(self.total_seconds, 4), "finish_reason": self.finish_reason,
            "last_accepted": list(self.accepted[-SPARK_STEPS:]), "tree_depth": self.tree_depth,
        }

    @classmethod
    def from_saved(cls, saved) -> Stats | None:
        """The Stats ``as_dict`` wrote, back from a saved conversation, to show its last answer's readout after a
        reload (QA: the readout showed its placeholder, the figures only in the export); None where the saved
        figures are missing or damaged (the browser's copy may be older, or edited)."""
        if not isinstance(saved, dict):
            return None
        counts = [saved.get(k) for k in ("tree_size", "tokens", "steps", "from_heads")]
        accepted = saved.get("last_accepted", [])
        if not all(_whole(v) for v in counts) or not isinstance(accepted, list) or not all(_whole(v) for v in accepted):
            return None
        tree_size, tokens, steps, from_heads = counts
        ttft, rate, seconds = saved.get("time_to_first_token"), saved.get("tokens_per_second"), saved.get("seconds")
        if not (ttft is None or _real(ttft)) or not _real(seconds) or (steps and not (_real(rate) and rate > 0)):
            return None
        # the decoding seconds from the unrounded rate, so the rate shows as it showed ("seconds" is rounded)
        decode = (tokens - 1) / rate if steps else max(0.0, seconds - (ttft or 0.0))
        depth = saved.get("tree_depth")
        finish = saved.get("finish_reason")
        return cls(label=str(saved.get("label") or "Medusa"), tree=str(saved.get("tree") or ""), tree_size=tree_size,
                   tree_depth=depth if _whole(depth) else max(accepted, default=1) - 1,    # older copies kept none
                   tokens=tokens, steps=steps, accepted=tuple(accepted), from_heads=from_heads, ttft=ttft,
                   decode_seconds=decode, finish_reason=finish if isinstance(finish, str) else None)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0


@dataclass
class Meter:
    """Accumulates the Steps of one answer."""

    label: str = "Medusa"
    tree: str = ""
    tree_size: int = 1
    tree_depth: int = 0
    _accepted: list[int] = field(default_factory=list)
    _tokens: int = 0
    _from_heads: int = 0
    _ttft: float | None = None
    _decode: float = 0.0
    _finish: str | None = None

    def add(self, step: StepResult) -> None:
        if step.prefill:
            self._ttft = step.seconds
        elif step.tokens:
            self._accepted.append(len(step.tokens))
            self._decode += step.seconds
        self._tokens += len(step.tokens)
        self._from_heads += step.from_heads
        self._finish = step.finish_reason or self._finish

    def snapshot(self) -> Stats:
        return Stats(self.label, self.tree, self.tree_size, self.tree_depth, self._tokens, len(self._accepted),
                     tuple(self._accepted), self._from_heads, self._ttft, self._decode, self._finish)


def sparkline(values: tuple[int, ...] | list[int], top: int | None = None) -> str:
    """One block character per value, scaled so ``top`` (the most a step can emit) is a full bar."""
    if not values:
        return ""
    top = max(top or 1, max(values), 1)
    return "".join(_BARS[min(len(_BARS) - 1, (v - 1) * (len(_BARS) - 1) // max(top - 1, 1))] for v in values)


def seconds_text(seconds: float) -> str:
    """A short time in ms, from a second on in seconds (a long prompt read on a CPU read "48274 ms")."""
    return f"{seconds * 1000:.0f} ms" if seconds < 0.9995 else f"{seconds:.1f} s"


def render_live(stats: Stats) -> str:
    """The readout Markdown: a table of the live numbers, the sparkline, and once the
    answer is finished a one-line summary."""
    ttft = "–" if stats.ttft is None else seconds_text(stats.ttft)
    recent = stats.accepted[-SPARK_STEPS:]
    nodes = f"{stats.tree_size} node{'s' if stats.tree_size != 1 else ''}"
    tree = f" · tree `{stats.tree}` ({nodes})" if stats.tree else ""
    lines = [
        f"**{stats.label}**{tree}",
        "",
        "| tokens/s | tokens/step | time to first token | tokens |",
        "|---:|---:|---:|---:|",
        # no decoding step yet (or a one-token answer): no speed to show, not a speed of 0
        f"| {f'{stats.tokens_per_second:.1f}' if stats.steps else '–'} | "
        f"{f'{stats.tokens_per_step:.2f}' if stats.steps else '–'} | {ttft} | {stats.tokens} |",
    ]
    if recent:
        lines += ["", f"accepted per step (last {len(recent)}): `{sparkline(recent, stats.tree_depth + 1)}`"]
    if stats.finish_reason:
        lines += ["", summary(stats)]
    return "\n".join(lines)


def count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def summary(stats: Stats) -> str:
    if not stats.tokens:   # Stop while a long prompt was read: nothing was timed, nothing to count
        return f"Answer: none: {FINISH_TEXT.get(stats.finish_reason or '', stats.finish_reason)} before the first token"
    share = f" ({100 * stats.from_heads / stats.tokens:.0f}%)"
    # the speed leaves the first token out: it comes from the prompt's pass, timed as time to first token
    speed = (f"{stats.tokens_per_second:.1f} tokens/s after the first · {stats.tokens_per_step:.2f} tokens/step "
             f"over {count(stats.steps, 'step')}" if stats.steps else "no decoding step after the first token")
    return (
        f"Answer: {count(stats.tokens, 'token')} in {stats.total_seconds:.2f} s · {speed} · "
        f"{stats.from_heads} from heads{share} · {FINISH_TEXT.get(stats.finish_reason or '', stats.finish_reason)}"
    )


def speedup(baseline: Stats, medusa: Stats) -> float | None:
    if baseline.tokens_per_second <= 0 or medusa.tokens_per_second <= 0:
        return None
    return medusa.tokens_per_second / baseline.tokens_per_second


@dataclass(frozen=True)
class Comparison:
    """A step-interleaved comparison of plain decoding and Medusa on one prompt."""

    baseline: Stats
    medusa: Stats
    ratios: tuple[float, ...] = ()   # speedup in rolling windows of the interleaved steps
    identical: bool | None = None    # None: sampling, or an answer was cut short
    divergence: str | None = None    # where and why greedy answers differ
    unlike: bool = False             # not greedy, and the two answers came out as different texts


def interleaved_ratios(events: list[tuple[str, int, float]], window: int = RATIO_WINDOW) -> list[float]:
    """Speedup (Medusa tokens/s over plain tokens/s) in rolling windows of ``window`` rounds.
    ``events`` are the (pass, tokens, seconds) steps in the order they ran; a round ends at
    each Medusa step, so a window holds both decoders' steps from the same stretch of time."""
    rounds: list[list[float]] = []   # [plain tokens, plain s, medusa tokens, medusa s]
    current = [0.0, 0.0, 0.0, 0.0]
    for name, tokens, seconds in events:
        offset = 2 if name == "medusa" else 0
        current[offset] += tokens
        current[offset + 1] += seconds
        if offset:
            rounds.append(current)
            current = [0.0, 0.0, 0.0, 0.0]
    ratios = []
    for i in range(len(rounds) - window + 1):
        bt, bs, mt, ms = (sum(r[k] for r in rounds[i:i + window]) for k in range(4))
        if bt and bs > 0 and mt and ms > 0:
            ratios.append((mt / ms) / (bt / bs))
    return ratios


def quartiles(values: list[float] | tuple[float, ...]) -> tuple[float, float, float, float, float]:
    """(min, lower quartile, median, upper quartile, max)."""
    ordered = sorted(values)
    q1, median, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else ordered * 3
    return ordered[0], q1, median, q3, ordered[-1]


def explain_divergence(baseline: list[int], medusa: list[int], *, decode, device: str, dtype: torch.dtype,
                       weights: str | None) -> str | None:
    """Where two greedy answers first differ, and why: rounding where the model computes in
    reduced precision, a near-tie to the last bits in fp32, a real bug where every row is exact (the CPU's row-exact
    int4 mode, NF4's exact mode).
    ``weights``: "NF4", "NF4-exact" (the repacked kernel's exact mode, row-exact), "int8", "int4" (cpu_int4.py,
    row-exact), "int4/bf16" (not) or None for the compute dtype's own weights."""
    at = first_divergence(baseline, medusa)
    if at is None:
        return None

    def token(ids: list[int]) -> str:
        return repr(decode([ids[at]])) if at < len(ids) else "(end of answer)"

    where = f"first differ at token {at}: plain decoding {token(baseline)} vs Medusa {token(medusa)}"
    exact = {"int4": "int4 mode (row-exact)", "NF4-exact": "NF4 exact mode (row-exact)"}
    precision = None if weights in exact else weights if weights in ("NF4", "int8", "int4/bf16") else \
        {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype)
    if precision:
        on = "CUDA" if device == "cuda" else device
        return (f"{where} · rounding ({precision} on {on}): a T-row tree verification and a 1-row step "
                "round differently in bf16/NF4; in fp32 only in the last bits")
    if weights not in exact:
        # fp32's matmuls sum a T-row call in another order than a 1-row one (sgemm on the CPU: last-bit differences
        # up to 5e-5, docs/cpu_default.md), so only a near-tie to that rounding parts the answers (audit: the UI
        # called it a bug, which no fp32 kernel here rules out)
        return (f"{where} · fp32 on {device}: a T-row tree verification and a 1-row step differ only in the last "
                "bits, so only two tokens that close to a tie part them: rare; if answers part often, please report "
                "it with the prompt and settings")
    # the CPU's int4 mode and NF4's exact mode, whose matmuls and attention give every row the same bits alone as in
    # a tree (cpu_int4.py, nf4_fused.py, exact_attention.py)
    return (f"{where} · in {exact[weights]} on {device} greedy Medusa must equal plain decoding: this is a bug, "
            "please report it with the prompt and settings")


def render_comparison(comparison: Comparison) -> str:
    """The speedup with its spread over the interleaved steps, and whether the answers match."""
    baseline, medusa = comparison.baseline, comparison.medusa
    ratio = speedup(baseline, medusa)
    if medusa.tree_size == 1:      # the Medusa pane ran a one-node tree: plain decoding on both sides
        headline = f"**Plain decoding on both sides** (tree `{medusa.tree}`)"
        if ratio:
            headline += f": their ratio, {ratio:.2f}×, is run-to-run noise"
    elif ratio:
        headline = f"**Speedup: {ratio:.2f}×**"
    else:
        stopped = "cancelled" in (baseline.finish_reason, medusa.finish_reason)
        headline = "**Speedup: –** " + ("(stopped before both answers could be timed)" if stopped
                                        else "(an answer was too short to time)")
    # no rates beside "–": they would read 0.0 where the readouts say "–". The headline is the whole
    # answers' ratio, the windows are stretches of both answers: on a short answer the headline can
    # fall outside the windows' range, so say which is which
    # each figure named: the panes show plain decoding first, the speedup reads Medusa first (QA: the token counts
    # came plain first, the speeds Medusa first, neither labelled)
    parts = [headline] + ([f"(whole answers: Medusa {medusa.tokens_per_second:.1f} vs plain "
                           f"{baseline.tokens_per_second:.1f} tokens/s)"] if ratio else [])
    if len(comparison.ratios) >= 2:
        low, q1, median, q3, high = quartiles(comparison.ratios)
        parts.append(f"· step-interleaved, over {len(comparison.ratios)} overlapping windows of {RATIO_WINDOW} steps: "
                     f"median {median:.2f}×, quartiles {q1:.2f}–{q3:.2f}×, range {low:.2f}–{high:.2f}×")
    elif ratio and medusa.tree_size > 1:   # "Speedup: 0.81×" off 5 tokens stopped early read as a result
        parts.append(f"· over {count(min(baseline.tokens, medusa.tokens), 'token')} only: too few steps for a spread, "
                     "so this figure is rough (a longer answer measures it)")
    if comparison.identical is True:
        parts.append("· greedy answers are **identical**")
    elif comparison.identical is False:
        parts.append(f"· greedy answers **differ**: {comparison.divergence}")
    if comparison.unlike and ratio:   # a tester read 4.22× off a 6-token plain answer beside a 40-token one
        parts.append(f"· not greedy: the answers are different texts (Medusa {count(medusa.tokens, 'token')}, plain "
                     f"{baseline.tokens}), so their speeds compare unlike work; greedy compares like for like")
    return " ".join(parts)
