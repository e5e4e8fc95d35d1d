"""Candidate trees: named presets, builders, and the pure function that turns
a tree's paths into the tensors one verification step needs.

A tree is a list of index paths. Path ``[a, b]`` is "rank-a guess of head 0,
then rank-b guess of head 1" below the root (the backbone's own next token).
Every prefix of a path must itself be in the tree. Node 0 is always the root;
node i >= 1 is ``paths[i - 1]`` after sorting by (depth, path).
"""

from __future__ import annotations

import heapq
import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

Paths = list[tuple[int, ...]]

# The reference's default tree for Vicuna-7B heads (63 nodes + root, depth 4).
MC_SIM_7B_63: list[list[int]] = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0],
    [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0],
    [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5],
    [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9],
    [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2], [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0],
    [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
]

# Its 15 most valuable paths (the list is ordered by value, so the prefix is a valid tree): the
# default over a 4-bit backbone on CUDA, where each verified row still costs (the step's price per
# tree size on an H100 is in docs/performance.md).
MC_SIM_7B_16: list[list[int]] = MC_SIM_7B_63[:15]

# Small trees for CPU, where verifying many nodes costs real time.
SMALL_8: list[list[int]] = [[0], [1], [0, 0], [2], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0]]
SMALL_16: list[list[int]] = [
    [0], [1], [2], [0, 0], [0, 1], [1, 0], [3], [0, 2], [0, 0, 0], [0, 0, 1], [1, 1],
    [2, 0], [0, 1, 0], [0, 0, 0, 0], [1, 0, 0], [0, 0, 0, 0, 0],
]

PRESETS: dict[str, list[list[int]]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "mc_sim_7b_16": MC_SIM_7B_16,
    "small-8": SMALL_8,
    "small-16": SMALL_16,
}


# A generated tree (chain-N, cartesian-AxB...) is refused past this many nodes before it is built:
# a typed "cartesian-1000x1000x1000" would otherwise build a billion paths. Trees that pay verify a few
# dozen rows; the published 7B tree has 64.
MAX_GENERATED_NODES = 1024
TOP_K = 10      # guesses per head a tree may use (ranks 0-9, as in the reference's trees)


class TreeError(ValueError):
    """A tree that cannot be used: unknown name, malformed paths, or one the heads cannot fill."""


class UnknownTreeError(TreeError):
    """A name that is no preset, generated form or file: a caller that offers other trees (the app)
    says which instead."""


def chain(depth: int) -> Paths:
    """Top-1 guesses of heads 0..depth-1, one after another."""
    return [tuple([0] * d) for d in range(1, depth + 1)]


def cartesian(widths: list[int]) -> Paths:
    """Every combination of the top-w_d guesses at each depth d."""
    paths: Paths = []
    for depth in range(1, len(widths) + 1):
        paths.extend(itertools.product(*(range(w) for w in widths[:depth])))
    return paths


def preset_names() -> list[str]:
    return [*PRESETS, *(f"chain-{d}" for d in range(1, 6)), "cartesian-AxB..."]


# ASCII digits only (str.isdigit() also takes "٣" and "²", which int() then refuses), and few of them: past
# 4,300 digits int() refuses too, and six already make a tree far over MAX_GENERATED_NODES
_CHAIN = re.compile(r"chain-([0-9]{1,6})", re.ASCII)
_CARTESIAN = re.compile(r"cartesian-([0-9]{1,6}(?:x[0-9]{1,6})*)", re.ASCII)


def tree_spelling(spec: str) -> str:
    """The one spelling of a named tree: " CHAIN-03 " is chain-3, Small-16 is small-16, so that a tree
    shows (and is built and kept) under one name; a file path or any other name stays as given, stripped."""
    spec = spec.strip()
    lowered = spec.lower()
    if match := _CHAIN.fullmatch(lowered):
        return f"chain-{int(match[1])}"
    if match := _CARTESIAN.fullmatch(lowered):
        return "cartesian-" + "x".join(str(int(width)) for width in match[1].split("x"))
    return lowered if lowered in PRESETS or lowered == "baseline" else spec


def resolve_tree(spec: str) -> Paths:
    """Paths for a preset name, ``chain-N``, ``cartesian-AxB...``, ``baseline`` or a JSON file."""
    spec = tree_spelling(spec)
    if spec == "baseline":
        return []
    if spec in PRESETS:
        return [tuple(p) for p in PRESETS[spec]]
    if (match := _CHAIN.fullmatch(spec)) and int(match[1]) > 0:   # chain-0 would be baseline
        _check_generated(spec, 1 + int(match[1]))
        return chain(int(match[1]))
    if match := _CARTESIAN.fullmatch(spec):
        widths = [int(width) for width in match[1].split("x")]
        if 0 in widths:
            raise TreeError(f"tree {spec!r} has a width of 0: each width of cartesian-AxB... is at least 1")
        nodes, level = 1, 1
        for width in widths:            # level by level, stopping past the limit: no huge products
            level *= width
            nodes += level
            if nodes > MAX_GENERATED_NODES:
                break
        _check_generated(spec, nodes)
        return cartesian(widths)
    if spec.endswith(".json"):
        return load_tree_file(Path(spec))
    raise UnknownTreeError(
        f"unknown tree {spec!r}: use one of {', '.join(preset_names())}, baseline (plain decoding), or a path to a "
        ".json file of paths"
    )


def tree_name(spec: str) -> str:
    """A tree as the user reads its name: a file by its stem (the tuner's cache file shows as "tuned"),
    or by its file name where the stem is itself a tree's name (chain-3.json is not the preset chain-3);
    any other spec as given."""
    if not spec.endswith(".json"):
        return spec
    stem = Path(spec).stem
    try:
        resolve_tree(stem)
    except UnknownTreeError:
        return stem
    except TreeError:      # a preset form too big to build: a name all the same
        pass
    return Path(spec).name


def _check_generated(spec: str, nodes: int) -> None:
    """Refuse a generated tree of more than MAX_GENERATED_NODES nodes, counted before it is built."""
    if nodes > MAX_GENERATED_NODES:
        raise TreeError(f"tree {spec!r} has more than {MAX_GENERATED_NODES} nodes: use a smaller one "
                        "(mc_sim_7b_63 has 64)")


def named_tree(spec: str) -> Paths | None:
    """A --tree value as the commands take it (bench, first_start): None for "default" (the model's default
    tree), else its paths. An unknown name's error offers default too, as the help does (QA)."""
    if spec == "default":
        return None
    try:
        return resolve_tree(spec)
    except UnknownTreeError as err:
        raise UnknownTreeError(str(err).replace(": use one of ", ": use default (the model's default tree), ", 1)) \
            from None


def load_tree_file(path: Path) -> Paths:
    """A JSON file holding a list of paths, or an object with a "paths" list."""
    if path.is_dir():
        raise TreeError(f"tree file {path} is a folder: give the path of a JSON file holding a list of paths")
    if not path.is_file():
        raise TreeError(f"tree file {path} does not exist: give the path of a JSON list of paths")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise TreeError(f"tree file {path} is not UTF-8 text (byte {err.start}): it must hold a JSON list of paths") from None
    except json.JSONDecodeError as err:
        raise TreeError(f"tree file {path} is not valid JSON ({err}): it must hold a list of paths") from err
    if isinstance(data, dict):
        data = data.get("paths")
    if not isinstance(data, list) or not all(
        isinstance(p, list) and p and all(type(i) is int for i in p) for p in data   # true/false are no ranks
    ):
        raise TreeError(f"tree file {path} must hold a list of non-empty integer lists, e.g. [[0], [0, 0], [1]]")
    paths = [tuple(p) for p in data]
    if not paths:   # it ran plain decoding under the file's name, which the server then listed as a tree (QA)
        raise TreeError(f"tree file {path} holds no paths, which is plain decoding: use the tree baseline for that, "
                        "or give at least one path, e.g. [[0]]")
    if len(paths) + 1 > MAX_GENERATED_NODES:   # as a generated tree: 100,000 paths asked for a 49 GB mask
        raise TreeError(f"tree file {path} has {len(paths) + 1:,} nodes; at most {MAX_GENERATED_NODES} are taken: use "
                        "a smaller tree (mc_sim_7b_63 has 64)")
    try:
        check_shape(paths)   # what the file alone shows is wrong, before any model loads
    except TreeError as err:
        raise TreeError(f"tree file {path}: {err}") from None
    return paths


@dataclass(frozen=True)
class TreeBuffers:
    """Everything a verification step needs about one tree, made once per tree.

    T = number of nodes including the root, D = max depth, P = number of leaves.
    """

    paths: Paths                 # sorted, root excluded
    allowed: torch.Tensor        # (T, T) bool: a node sees its ancestors and itself (the step makes the additive mask)
    depths: torch.Tensor         # (T,) long: 0 for the root; rotary position = prefix length + depth
    candidate_index: torch.Tensor  # (T,) long: index into [root, head0 top-k, head1 top-k, ...]
    leaf_paths: torch.Tensor     # (P, D + 1) long: node ids from the root to each leaf, padded with -1
    num_heads: int               # heads the tree uses (= D)
    top_k: int                   # candidates each head must supply (= max rank + 1)

    @property
    def size(self) -> int:
        return int(self.depths.shape[0])


def check_shape(paths: Paths) -> None:
    """Raise TreeError naming the first path that is listed twice, malformed, or without its parent:
    what is wrong with a tree whatever heads run it."""
    seen = set(paths)
    if len(seen) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise TreeError(f"tree path {list(dup)} appears twice: each path must be listed once")
    for p in paths:
        if len(p) == 0 or any(i < 0 for i in p):
            raise TreeError(f"tree path {list(p)} is invalid: paths are non-empty lists of ranks >= 0")
        if len(p) > 1 and p[:-1] not in seen:
            raise TreeError(f"tree path {list(p)} has no parent {list(p[:-1])} in the tree: add the prefix")


def validate_paths(paths: Paths, num_heads: int, top_k: int) -> None:
    """Raise TreeError naming the first path that is malformed (check_shape) or that the heads cannot fill."""
    check_shape(paths)
    depth = max(map(len, paths), default=0)
    if depth > num_heads:     # the tree's depth, not its first path past the heads (chain-9's is 6 long)
        raise TreeError(f"tree depth {depth} is more than the model's {num_heads} Medusa heads: "
                        f"use a tree of depth <= {num_heads}")
    for p in paths:
        if max(p) >= top_k:
            raise TreeError(
                f"tree path {list(p)} uses rank {max(p)}, but each head offers only its top {top_k} guesses: "
                f"use ranks < {top_k} (widths <= {top_k})"
            )


def build_tree_buffers(
    paths: Paths, num_heads: int, top_k: int = TOP_K, device: torch.device | str = "cpu"
) -> TreeBuffers:
    """Pure function from paths to the tensors of one verification step."""
    paths = sorted((tuple(p) for p in paths), key=lambda p: (len(p), p))
    validate_paths(paths, num_heads, top_k)
    index = {p: i + 1 for i, p in enumerate(paths)}  # node id of each path; root is 0
    T = len(paths) + 1
    depth_max = max((len(p) for p in paths), default=0)
    used_top_k = max((max(p) + 1 for p in paths), default=1)

    allowed = torch.zeros(T, T, dtype=torch.bool)  # (T, T): row attends to column
    allowed[:, 0] = True                           # every node sees the root
    parents = [0] * T
    cand = [0] * T
    for p, i in index.items():
        allowed[i, i] = True
        for d in range(1, len(p)):
            allowed[i, index[p[:d]]] = True
        parents[i] = index[p[:-1]] if len(p) > 1 else 0
        # head (len(p) - 1) proposes this node with its rank-p[-1] guess
        cand[i] = 1 + (len(p) - 1) * used_top_k + p[-1]

    is_parent = set(parents[1:])
    leaves = [i for i in range(T) if i not in is_parent]  # (with no paths, the root is the only leaf)
    leaf_paths = torch.full((len(leaves), depth_max + 1), -1, dtype=torch.long)
    node_of = {i: p for p, i in index.items()}
    for row, leaf in enumerate(leaves):
        p = node_of.get(leaf, ())
        leaf_paths[row, 0] = 0
        for d in range(1, len(p) + 1):
            leaf_paths[row, d] = index[p[:d]]

    return TreeBuffers(
        paths=paths,
        allowed=allowed.to(device),
        depths=torch.tensor([0] + [len(p) for p in paths], dtype=torch.long, device=device),
        candidate_index=torch.tensor(cand, dtype=torch.long, device=device),
        leaf_paths=leaf_paths.to(device),
        num_heads=depth_max,
        top_k=used_top_k,
    )


# ---- growing a tree from head accuracies (paper §2.3.3)

def path_value(path: Sequence[int], acc: Sequence[Sequence[float]]) -> float:
    """P(every guess along ``path`` is right): the product of head-rank accuracies a[depth][rank]. A rank
    past a head's row (a wide cartesian tree over a table of the top few ranks) counts as never right."""
    value = 1.0
    for depth, rank in enumerate(path):
        value *= acc[depth][rank] if rank < len(acc[depth]) else 0.0
    return value


def grow_tree(acc: Sequence[Sequence[float]], budget: int) -> Paths:
    """Greedy growth: repeatedly add the frontier node (a child of the root or of a chosen
    node) of highest path value, ties to the shallower then lexicographically smaller path.
    Pure function of the accuracy table; returns paths in the order they were chosen."""
    depth_max, top_k = len(acc), len(acc[0]) if acc else 0
    frontier = [(-acc[0][i], 1, (i,)) for i in range(top_k)] if depth_max else []
    heapq.heapify(frontier)
    chosen: Paths = []
    while frontier and len(chosen) < budget:
        neg, depth, path = heapq.heappop(frontier)
        if neg == 0:
            break   # only never-right guesses are left: more nodes would cost time and add nothing
        chosen.append(path)
        if depth < depth_max:
            for i in range(top_k):
                heapq.heappush(frontier, (neg * acc[depth][i], depth + 1, (*path, i)))
    return chosen


def expected_tokens_per_step(paths: Sequence[tuple[int, ...]], acc: Sequence[Sequence[float]]) -> float:
    """Expected tokens per step with this tree: 1 + sum of node values."""
    return 1.0 + sum(path_value(p, acc) for p in paths)


def tree_of_size(table: Sequence[Sequence[float]], size: int) -> Paths:
    """The ``size``-node tree (root included) grown greedily by grow_tree (paper §2.3.3).
    Entries in [0, 1] make a child worth no more than its parent, so the greedy set is the
    prefix-closed one of largest expected acceptance."""
    if size < 1:
        raise ValueError(f"tree size {size} is below 1: the root alone is size 1")
    if any(not 0 <= p <= 1 for row in table for p in row):
        raise ValueError(f"accuracies {table} must lie in [0, 1]")
    paths = grow_tree(table, size - 1)
    if len(paths) < size - 1:
        raise ValueError(f"tree size {size} needs more nodes than {len(table)} heads x top {len(table[0]) if table else 0} "
                         "with nonzero accuracy can fill: lower it")
    return paths
