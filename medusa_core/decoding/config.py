"""The decoding settings: their names, defaults, limits and help text, in one place.

Everything that offers or checks a decoding setting reads it from here: the page's controls and
its per-request Settings (app/), the CPU default's choices, the step's device parameters, the
OpenAI endpoint and the command lines. Values travel by field name, never by position.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal

Mode = Literal["greedy", "sample", "typical"]
MODES: tuple[str, ...] = ("greedy", "sample", "typical")


@dataclass(frozen=True)
class Limits:
    """What a setting may be: ``low``/``high`` bound it (None: unbounded; ``open_low``: ``low`` itself is
    refused); ``slider`` is the (min, max, step) a page offers, which may be narrower than the limits."""

    label: str
    help: str
    kind: type = float
    low: float | None = None
    high: float | None = None
    open_low: bool = False
    slider: tuple[float, float, float] | None = None
    fix: str = ""                 # how to put an out-of-range value right, for the error

    @property
    def short(self) -> str:
        """The label without its explanation ("ε: posterior threshold (typical)" → "ε"), for errors."""
        return re.split(r": | \(", self.label)[0]


class SettingError(ValueError):
    """A decoding setting's value refused, in one line that starts with the setting's field name (the
    word the API and scripts send); ``labelled`` starts with its label instead, the word the page shows."""

    def __init__(self, name: str, problem: str):
        super().__init__(f"{name} {problem}")
        self.name, self.problem = name, problem

    @property
    def labelled(self) -> str:
        return f"{limits(self.name).short} {self.problem}"


def _setting(default: Any, limits: Limits):
    return field(default=default, metadata={"limits": limits})


# A temperature below this samples as greedy: logit gaps it would still tell apart (under 1e-5 x ~20) are
# float noise, and far below it the logits over it overflow, or it rounds to 0 in float32 on the device: 1e-40
# gave NaN probabilities and a reply of special tokens (QA)
GREEDY_BELOW = 1e-5


def is_greedy(mode: str, temperature: float) -> bool:
    """The one definition: the argmax token at every position. Sampling and typical acceptance at
    temperature 0 (below GREEDY_BELOW) are greedy too (typical then accepts exactly the argmax tokens)."""
    return mode == "greedy" or temperature < GREEDY_BELOW


@dataclass(frozen=True)
class DecodeConfig:
    mode: Mode = _setting("greedy", Limits(
        "Decoding mode", "greedy: the argmax; sample: exact sampling; typical: typical acceptance", kind=str))
    temperature: float = _setting(0.7, Limits(
        "Temperature", "sample/typical; 0 (anything under 1e-5) is greedy", low=0, high=2, slider=(0, 2, 0.05),
        fix="use a value from 0 (greedy) to 2"))
    top_p: float = _setting(1.0, Limits(
        "Top-p", "sample only: keep the smallest set of tokens holding this much probability",
        low=0, high=1, open_low=True, slider=(0.01, 1, 0.01), fix="use a value in (0, 1]"))
    top_k: int = _setting(0, Limits(
        "Top-k", "sample only; 0 = off", kind=int, low=0, fix="use 0 (off) or a positive count"))
    epsilon: float = _setting(0.09, Limits(
        "ε: posterior threshold (typical)", "typical: a guess is kept while its probability is above "
        "min(ε, δ·exp(-entropy))", low=0, high=1, open_low=True, slider=(0.01, 1, 0.01),
        fix="use a value in (0, 1] (at 0 every guess the heads make is kept)"))
    delta: float = _setting(0.3, Limits(
        "δ: posterior alpha (typical)", "typical: how far the threshold falls with the entropy",
        low=0, high=1, open_low=True, slider=(0.01, 1, 0.01),
        fix="use a value in (0, 1] (at 0 every guess the heads make is kept)"))
    max_new_tokens: int = _setting(256, Limits(
        "Max new tokens", "the reply's length limit", kind=int, low=1))
    seed: int | None = _setting(None, Limits(
        "Seed (-1: random)", "exact sampling's seed; none: random", kind=int, low=-2**63, high=2**63 - 1,
        fix=f"use a whole number from {-2**63} to {2**63 - 1}"))

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SettingError("mode", f"{self.mode!r} is unknown: use one of {', '.join(MODES)}")
        for f in fields(DecodeConfig):
            limits: Limits = f.metadata["limits"]
            value = getattr(self, f.name)
            if limits.kind is str or value is None:
                continue
            # NaN passes every range check (a command line's float("nan") sampled token 0); a whole number is finite
            if isinstance(value, float) and not math.isfinite(value):
                raise SettingError(f.name, f"{value} is not a finite number: {limits.fix or 'give one'}")
            if limits.low is not None and (value < limits.low or (limits.open_low and value == limits.low)):
                raise SettingError(f.name, _below(value, limits))
            if limits.high is not None and value > limits.high:
                raise SettingError(f.name, f"{shortened(as_typed(value))} is out of range: {limits.fix}")

    @property
    def greedy(self) -> bool:
        return is_greedy(self.mode, self.temperature)

    def sampling_params(self) -> tuple[float, float, float, float]:
        """(temperature, top_p, epsilon, delta): the values a captured step reads from the device."""
        return (self.temperature, self.top_p, self.epsilon, self.delta)


def shortened(text: str) -> str:
    """A value as an error shows it: a 400-digit seed is not repeated whole."""
    return text if len(text) <= 40 else f"{text[:37]}..."


def as_typed(value) -> str:
    """A number as the user most likely typed it: a whole float without its ".0" (a script's temperature=5 was
    quoted back as 5.0, once parsed)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _below(value, limits: Limits) -> str:
    value = as_typed(value)
    if not limits.fix:
        return f"{value} must be at least {limits.low}"
    if limits.low == 0 and limits.high is None:
        return f"{value} is negative: {limits.fix}"
    return f"{value} is out of range: {limits.fix}"


def limits(name: str) -> Limits:
    """The limits and help of the DecodeConfig field ``name``."""
    return SETTINGS[name].metadata["limits"]


_WHOLE = re.compile(r"[+-]?[0-9]{1,100}")


def number(name: str, value, kind: type = float):
    """A raw control or request value as the number ``name`` needs; ValueError names the value and the fix.
    Whole numbers stay exact (a seed past 2**53 is no float); the limits are checked by DecodeConfig."""
    if isinstance(value, bool):    # an int to Python: a script's max_new_tokens=True ran one token
        raise SettingError(name, f"{str(value).lower()} is not a number: give one, e.g. {kind(1)}")
    if kind is int and isinstance(value, int):
        return int(value)
    # one sign and ASCII digits: int() refuses "--5" and "²", and past 4,300 digits it refuses too
    if kind is int and isinstance(value, str) and _WHOLE.fullmatch(value.strip()):
        return int(value)
    shown = shortened(repr(value))
    try:
        as_float = float(value)
    except (TypeError, ValueError, OverflowError):
        raise SettingError(name, f"{shown} is not a number: give one, e.g. {kind(1)}") from None
    if not math.isfinite(as_float):
        raise SettingError(name, f"{shown} is not a finite number: give one, e.g. {kind(1)}")
    if kind is float:
        return as_float
    if not as_float.is_integer():    # the nearest whole numbers it may be: "give an integer" said less than the page
        low, high = (limits(name).low, limits(name).high) if name in SETTINGS else (None, None)
        near = [n for n in (math.floor(as_float), math.ceil(as_float))
                if (low is None or n >= low) and (high is None or n <= high)]
        raise SettingError(name, f"{shown} is not a whole number: give one" +
                           (f", e.g. {' or '.join(map(str, near))}" if near else ""))
    return int(as_float)


SETTINGS = {f.name: f for f in fields(DecodeConfig)}
DEFAULTS = DecodeConfig()
