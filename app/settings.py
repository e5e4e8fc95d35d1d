"""What a request asks the engine for: the decoding settings (medusa_core/decoding/config.py,
where their defaults and limits live) plus the page's own choices, the tree and the head colouring.
The page and the OpenAI endpoint both build one by field name."""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, fields, replace

from medusa_core.decoding.config import SETTINGS, DecodeConfig, SettingError, limits, number, shortened
from medusa_core.decoding.tree import tree_spelling


def flag(name: str, value) -> bool:
    """A raw on/off value (a checkbox, or a script's argument) as a bool; ValueError names anything else
    (bool("false") is True: a script's compare="false" ran the comparison)."""
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", ""):
        return value.strip().lower() in ("true", "1")
    raise ValueError(f"{name} {value!r} is not true or false: give true or false")


def text(name: str, value) -> str:
    """A raw text value (the message box, the system prompt, or a script's argument) as a str; ValueError names
    anything else (QA: a script's message=["a", "b"] was answered as the text "['a', 'b']")."""
    if value is None or isinstance(value, str):
        return value or ""
    raise ValueError(f"{name} {shortened(repr(value))} is not text: send it as a string")


# the page's seeds (and its scripting API's, the same handler): a browser's number box holds a whole number exactly
# only up to 2**53 - 1; past it, 9007199254740993 typed ran as ...992, and 2**63 - 1 was refused as 9223372036854776000
PAGE_SEED_MAX = 2**53 - 1


_LABEL = re.compile(r"(.+?)\s*\([0-9]+ nodes?\)", re.ASCII | re.IGNORECASE)     # app/trees.tree_label's form


def tree_choice(text: str) -> str:
    """The tree ``text`` names, spelled once: a label as the picker lists trees ("cartesian-3x3 (13 nodes)") is
    its name (QA: typing or pasting a label was refused unless that tree was listed), CHAIN-03 is chain-3."""
    text = text.strip()
    if match := _LABEL.fullmatch(text):
        text = match[1]
    return tree_spelling(text)


@dataclass(frozen=True)
class Settings(DecodeConfig):
    tree: str | None = None        # a name from the engine's tree choices; None = the engine's default
    colour_heads: bool = False

    @classmethod
    def parse(cls, **raw) -> "Settings":
        """Settings from raw control (or API) values, by name; ValueError names the bad value and the fix."""
        values: dict = {}
        for name, value in raw.items():
            if name == "tree":        # any value the API sends is a name: 5 is tree '5', unknown, not a crash
                values[name] = str(value) if value is not None else None
            elif name == "colour_heads":
                values[name] = flag(name, value)
            elif name == "seed":        # blank or -1 (the page's "random"): a random seed; any other is a seed,
                # as the API takes it (-5 was random on the page and a fixed seed through the API)
                seed = None if value is None or value == "" else number("seed", value, int)
                if seed is not None and abs(seed) > PAGE_SEED_MAX:
                    raise SettingError("seed", f"{shortened(str(seed))} is past ±{PAGE_SEED_MAX}, the largest the "
                                               "page takes (its number box rounds a larger one, so this may not be "
                                               "the number typed): use a smaller seed")
                values[name] = None if seed is None or seed == -1 else seed
            elif name in SETTINGS:
                kind = limits(name).kind
                values[name] = value if kind is str else number(name, value, kind)
            else:
                raise ValueError(f"setting {name!r} is unknown: use {', '.join(f.name for f in fields(cls))}")
        return cls(**values)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tree is not None:   # one spelling per tree, from the page and the API alike: CHAIN-03 is chain-3
            object.__setattr__(self, "tree", tree_choice(self.tree) or None)

    def with_drawn_seed(self) -> "Settings":
        """These settings with a random seed drawn now where the answer samples and names none (the page's -1),
        so the answer records the seed it ran with and can be run again (its export said null). An answer that
        draws nothing (greedy, typical: its first token each step is the argmax) reports no seed: one given was
        echoed, as if it had mattered."""
        if self.mode != "sample" or self.greedy:
            return replace(self, seed=None) if self.seed is not None else self
        if self.seed is not None:
            return self
        return replace(self, seed=secrets.randbelow(2**53))   # below 2**53: a browser's number box keeps it exact

    def decode_config(self) -> DecodeConfig:
        return DecodeConfig(**{name: getattr(self, name) for name in SETTINGS})
