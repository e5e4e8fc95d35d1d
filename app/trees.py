"""The trees a loaded model offers: listed with their node counts (the load's default first), each built
once, a typed-in preset checked against the heads and kept (the latest few), and what a tree other than the
default is expected to give on this machine. The engine owns one per loaded model."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import torch

from medusa_core.decoding.tree import (PRESETS, TOP_K, Paths, TreeBuffers, TreeError, UnknownTreeError,
                                      build_tree_buffers, resolve_tree, tree_name, validate_paths)

from .settings import tree_choice

TYPED_TREES = 8        # typed-in trees kept beside the listed ones (each holds its masks and buffers)


def tree_label(name: str, nodes: int) -> str:
    """How the tree picker lists a tree: its name and node count."""
    return f"{name} ({nodes} node{'s' if nodes > 1 else ''})"


class TreeCatalogue:
    """The trees of one loaded model, by the names the page and the API use."""

    def __init__(self, num_heads: int, device: torch.device, preferred: str, tuned):
        self.num_heads, self.device = num_heads, device
        self.tuned = tuned                        # the load's TunedTree (None: not tuned on this machine)
        self._built: dict[str, TreeBuffers] = {}  # spec -> buffers
        self._lock = threading.Lock()
        self._specs: dict[str, str] = {}          # shown name (tree.tree_name) -> tree spec
        self._typed: list[str] = []               # trees typed in, not listed: the oldest go first
        self.choices = self._listed(preferred)    # the user's --tree (or the tuned one) first
        self.default = self.choices[0][1]

    def listed(self, name: str) -> bool:
        """Whether ``name`` (a shown name) is on offer: listed at start, or typed in and kept."""
        return name in self._specs

    def _listed(self, preferred: str) -> list[tuple[str, str]]:
        """(label with node count, name) for every tree the loaded heads can fill; ``preferred``, the load's
        default, comes first. A named tree that does not fit raises TreeError at startup."""
        spec = tree_choice(preferred)         # CHAIN-03 is chain-3
        if self.num_heads or spec == "baseline":
            self._specs.setdefault(tree_name(spec), spec)
            self.buffers(spec)
        for spec in [*PRESETS, *(f"chain-{d}" for d in range(1, self.num_heads + 1))]:
            try:
                self.buffers(spec)
            except TreeError:
                continue  # a preset deeper than the loaded heads: not offered
            self._specs.setdefault(spec, spec)
        self._specs.setdefault("baseline", "baseline")
        return [(tree_label(name, self.buffers(spec).size), name) for name, spec in self._specs.items()]

    def typed_choice(self, tree_name: str | None) -> tuple[str, str] | None:
        """(label with node count, name) of a tree typed in the picker that these heads can run and the list
        lacks, as the listed ones are labelled (QA: a typed tree showed without its size); None otherwise."""
        name = self.shown_name(tree_choice(tree_name)) if isinstance(tree_name, str) and tree_name.strip() else ""
        if not name or name in {listed for _, listed in self.choices}:
            return None
        paths = self.paths(name)
        return (tree_label(name, len(paths) + 1), name) if paths is not None else None

    def shown_name(self, name: str) -> str:
        """The listed name of tree ``name``: a tree file read at start is listed as tree_name gives it,
        and also taken by its path or its file name; any other name is itself."""
        if name in self._specs:
            return name
        with self._lock:   # offer adds and evicts typed trees from other threads
            listed = list(self._specs.items())
        return next((shown for shown, spec in listed if name in (spec, Path(spec).name)), name)

    def buffers(self, name: str) -> TreeBuffers:
        """Tree ``name``'s buffers, built on first use."""
        spec = self._specs.get(self.shown_name(name), name)
        with self._lock:
            if spec not in self._built:
                self._built[spec] = build_tree_buffers(
                    resolve_tree(spec), self.num_heads, device=self.device)
            return self._built[spec]

    def paths(self, name: str) -> Paths | None:
        """The paths of tree ``name`` where this model can run it: a listed tree, or a preset form its heads
        can fill (checked, not built); None otherwise (unknown, too deep or too wide for these heads, or a
        tree file, which is read at start only). A tree kept from another start or another model may be any
        of those."""
        name = self.shown_name(tree_choice(name))
        if name in self._specs:      # built when it was listed: a tree file is not read again
            return self.buffers(name).paths
        if name.endswith(".json"):
            return None
        try:
            paths = resolve_tree(name)
            validate_paths(paths, self.num_heads, TOP_K)
        except TreeError:
            return None
        return paths

    def outlook(self, tree_name: str | None) -> str | None:
        """A few words on what a tree other than the default is expected to give on this machine, from the
        tuner's step times and the heads' accuracies; None where the tuner did not measure this machine (a
        tree set by --tree, heads without accuracies) or the tree is not one it can value. Said before the
        answer: a typed 364-node tree ran at 0.1 tokens/s on the CPU, the tuned 2-node one at 1.2x."""
        tuned = self.tuned
        name = self.shown_name(tree_choice(tree_name or "") or self.default)   # CHAIN-03 is chain-3
        if tuned is None or name == self.default:
            return None
        paths = self.paths(name)       # None: sending it says what is wrong with it
        estimate = tuned.speedup_of(paths) if paths else None
        if estimate is None:
            return None
        speedup, bound = estimate
        slower = round(speedup, 2) < 1 if not bound else speedup <= 1    # as shown: 0.998 is "1.00x"
        nodes = len(paths) + 1       # said here too: a typed tree is not in the picker, whose labels count nodes
        if not bound:
            # an average over the tuner's prompts: one prompt may differ far (chain-3, 0.85x here, ran a code
            # prompt at 1.58x), so the title says it is typical, not a promise for this prompt
            # timed beside other programs, the figure may be far off an answer's measured speedup (QA: 0.81x above
            # a measured 1.34x): said, so the two can be told apart
            busy = f", from timings taken while {tuned.busy_with} used the CPU" if tuned.contended else ""
            return f"{name} ({nodes} nodes) expected {speedup:.2f}x on this machine for a typical prompt" + \
                (", slower than plain decoding" if slower else "") + busy
        # past the largest tree timed, only a bound is known: it costs at least what that tree did (a 64-node
        # tree "at most 1.00x" read as breaking even; it ran at 0.6-0.9x). Said as "under": an 82-node tree "at
        # most 1.69x" read as better than the tuned 16-node tree's 1.57x, where it is far slower)
        largest = max(map(int, tuned.step_ms))
        return (f"{name} ({nodes} nodes) expected slower than plain decoding on this machine (under {speedup:.2f}x "
                f"even at the {largest}-node tree's cost)" if slower
                else f"{name} ({nodes} nodes) expected under {speedup:.2f}x on this machine ({speedup:.2f}x if it cost "
                     f"no more than the {largest}-node tree timed)")

    def offer(self, name: str, on_model_thread: Callable) -> None:
        """A tree typed in the page or asked for by the API, not in the list: any preset form the
        command line takes (chain-N, cartesian-AxB...) that the loaded heads can fill. Files only
        through --tree: a page or API request does not make the app read files of its choosing.
        The last TYPED_TREES typed trees are kept, so that no stream of spellings grows memory.
        ``on_model_thread`` builds it where the model runs: given per call, since a reference kept here
        would tie the engine in a cycle that outlived an unload until a garbage collection."""
        if name.endswith(".json"):
            raise ValueError(f"tree {name!r}: tree files are read at start only: run launch.py --tree {name}, "
                             "or type a preset (chain-N, cartesian-AxB...) or pick one from the list")
        if name.lstrip().startswith("["):     # a tree's paths typed in (QA: told only that the name was unknown)
            raise ValueError("a tree's paths are read from a JSON file at start only: save them in a file and run "
                             "launch.py --tree FILE.json, or type a preset (chain-N, cartesian-AxB...) or pick one "
                             "from the list")
        try:
            # checked here first: a name that is no tree is refused at once, not after the model thread's current
            # work (QA: an API request's typo waited 21 s behind a page's long prompt)
            validate_paths(resolve_tree(name), self.num_heads, TOP_K)
            on_model_thread(self.buffers, name)   # builds it (torch work: on the model thread)
        except TreeError as err:
            if not self.num_heads:
                raise ValueError(f"tree {name!r}: this model has no Medusa heads: use baseline") from None
            if isinstance(err, UnknownTreeError):   # the tree module's line offers files, which are not taken here
                names = ", ".join(choice for _, choice in self.choices)
                raise ValueError(f"unknown tree {name!r}: use one of {names}, chain-N with N from 1 to "
                                 f"{self.num_heads}, or cartesian-AxB... with at most {self.num_heads} widths "
                                 "(this model has that many heads)") from None
            line = str(err)           # a line that names a path, not the tree: say which tree
            raise ValueError(line if line.startswith(f"tree {name!r}") else f"tree {name!r}: {line}") from None
        with self._lock:
            if name in self._typed:       # two requests typed it at once (review: kept twice, evicted once)
                return
            self._specs.setdefault(name, name)
            self._typed.append(name)
            while len(self._typed) > TYPED_TREES:
                old = self._typed.pop(0)
                self._specs.pop(old, None)
                self._built.pop(old, None)
