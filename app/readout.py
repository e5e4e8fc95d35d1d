"""Live speed readout: what one answer measured, and how it is shown.

``Meter`` accumulates the generation loop's Steps; ``Stats`` is a frozen
snapshot of it, cheap to hand to the UI on every update. The render functions
turn Stats into the Markdown the readout panes show.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from medusa_core.generate import Step

_BARS = "▁▂▃▄▅▆▇█"
SPARK_STEPS = 40  # the readout shows the last 40 steps' accepted lengths

FINISH_TEXT = {
    "eos": "end of answer",
    "length": "max new tokens reached",
    "context": "context window full",
    "cancelled": "stopped",
}


@dataclass(frozen=True)
class Stats:
    label: str = "Medusa"           # which decoder: "Medusa" or "Plain decoding"
    tree: str = ""                  # tree preset the answer used
    tree_size: int = 1              # its node count including the root
    tokens: int = 0                 # generated tokens, first token included
    steps: int = 0                  # decoding steps after the prefill
    accepted: tuple[int, ...] = ()  # tokens emitted per decoding step (1 = no head guess accepted)
    from_heads: int = 0             # tokens that were Medusa guesses accepted by the backbone
    ttft: float | None = None       # seconds from the request to the first token
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
    def mean_accepted(self) -> float:
        return (self.tokens - 1) / self.steps if self.steps else 0.0

    @property
    def total_seconds(self) -> float:
        return (self.ttft or 0.0) + self.decode_seconds

    def as_dict(self) -> dict:
        return {
            "label": self.label, "tree": self.tree, "tree_size": self.tree_size, "tokens": self.tokens,
            "steps": self.steps, "tokens_per_second": round(self.tokens_per_second, 2),
            "mean_accepted": round(self.mean_accepted, 3), "from_heads": self.from_heads,
            "ttft": None if self.ttft is None else round(self.ttft, 4),
            "seconds": round(self.total_seconds, 4), "finish_reason": self.finish_reason,
            "last_accepted": list(self.accepted[-SPARK_STEPS:]),
        }


@dataclass
class Meter:
    """Accumulates the Steps of one answer."""

    label: str = "Medusa"
    tree: str = ""
    tree_size: int = 1
    _accepted: list[int] = field(default_factory=list)
    _tokens: int = 0
    _from_heads: int = 0
    _ttft: float | None = None
    _decode: float = 0.0
    _finish: str | None = None

    def add(self, step: Step) -> None:
        if step.prefill:
            self._ttft = step.seconds
        elif step.tokens:
            self._accepted.append(len(step.tokens))
            self._decode += step.seconds
        self._tokens += len(step.tokens)
        self._from_heads += step.from_heads
        self._finish = step.finish_reason or self._finish

    def snapshot(self) -> Stats:
        return Stats(self.label, self.tree, self.tree_size, self._tokens, len(self._accepted),
                     tuple(self._accepted), self._from_heads, self._ttft, self._decode, self._finish)


def sparkline(values: tuple[int, ...] | list[int], top: int | None = None) -> str:
    """One block character per value, scaled so ``top`` (the tree depth + 1) is a full bar."""
    if not values:
        return ""
    top = max(top or 1, max(values), 1)
    return "".join(_BARS[min(len(_BARS) - 1, (v - 1) * (len(_BARS) - 1) // max(top - 1, 1))] for v in values)


def render_live(stats: Stats, depth: int | None = None) -> str:
    """The readout Markdown: a table of the live numbers, the sparkline, and once the
    answer is finished a one-line summary."""
    ttft = "–" if stats.ttft is None else f"{stats.ttft * 1000:.0f} ms"
    recent = stats.accepted[-SPARK_STEPS:]
    nodes = f"{stats.tree_size} node{'s' if stats.tree_size != 1 else ''}"
    tree = f" · tree `{stats.tree}` ({nodes})" if stats.tree else ""
    lines = [
        f"**{stats.label}**{tree}",
        "",
        "| tokens/s | tokens/step | time to first token | tokens |",
        "|---:|---:|---:|---:|",
        f"| {stats.tokens_per_second:.1f} | {stats.mean_accepted:.2f} | {ttft} | {stats.tokens} |",
    ]
    if recent:
        lines += ["", f"accepted per step (last {len(recent)}): `{sparkline(recent, depth)}`"]
    if stats.finish_reason:
        lines += ["", summary(stats)]
    return "\n".join(lines)


def summary(stats: Stats) -> str:
    share = f" ({100 * stats.from_heads / stats.tokens:.0f}%)" if stats.tokens else ""
    return (
        f"Answer: {stats.tokens} tokens in {stats.total_seconds:.2f} s · {stats.tokens_per_second:.1f} tokens/s · "
        f"{stats.mean_accepted:.2f} tokens/step over {stats.steps} steps · {stats.from_heads} from heads{share} · "
        f"{FINISH_TEXT.get(stats.finish_reason or '', stats.finish_reason)}"
    )


def speedup(baseline: Stats, medusa: Stats) -> float | None:
    if baseline.tokens_per_second <= 0 or medusa.tokens_per_second <= 0:
        return None
    return medusa.tokens_per_second / baseline.tokens_per_second


def render_comparison(baseline: Stats, medusa: Stats, identical: bool | None) -> str:
    """``identical`` is None when the mode samples, where equal answers are not expected."""
    ratio = speedup(baseline, medusa)
    parts = [f"**Speedup: {ratio:.2f}×**" if ratio else "**Speedup: –** (an answer was too short to time)",
             f"({medusa.tokens_per_second:.1f} vs {baseline.tokens_per_second:.1f} tokens/s)"]
    if identical is True:
        parts.append("· greedy answers are **identical**")
    elif identical is False:
        parts.append("· greedy answers **differ**")
    return " ".join(parts)
