"""What a set of heads is worth: a[k][i], the chance that head k's rank-i guess is the token the
backbone will emit (paper §2.3.3). Trees are grown from it and their expected tokens per step
computed from it (tree.grow_tree, tree.expected_tokens_per_step); the tuner (tree_tuning.py) weighs that
against the step times it measures on the user's machine.

Where the table comes from, first match wins:
  1. a calibration report beside the heads: ``tree_calibration.json`` in the heads directory (what
     ``python -m medusa_core.calibrate --out HEADS/tree.json`` writes), measured on real answers;
  2. the published Medusa-1 Vicuna heads: their published top-1 accuracies, ranks assumed to decay;
  3. nothing: the heads carry no accuracies, and the tree is a preset (loading.policy.choose_tree).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..decoding.tree import TOP_K
from ..errors import LoadError

CALIBRATION_FILE = "tree_calibration.json"   # calibrate's report for a tree file named tree.json
# Medusa-1 heads 0-4 on Vicuna-7B, top-1 (the Medusa paper); the 13B/33B heads are assumed alike.
PUBLISHED_ACCURACIES = (0.56, 0.32, 0.20, 0.15, 0.12)
PUBLISHED_HEADS = ("FasterDecoding/medusa-vicuna-7b-v1.3", "FasterDecoding/medusa-vicuna-13b-v1.3",
                   "FasterDecoding/medusa-vicuna-33b-v1.3")
# Only top-1 accuracies are published. Assumed: head k's rank-i guess is right with a[k] * 0.35**i.
# 0.35 keeps each head's ranks (exclusive events) summing below 1 and makes the 64-node tree
# expect 2.42 tokens per step, inside the published 2.3-2.6 for Vicuna-7B heads.
RANK_DECAY = 0.35


@dataclass(frozen=True)
class HeadAccuracy:
    table: list[list[float]]      # (K, top_k): a[k][i]
    source: str                   # where it came from, for the load line


def rank_table(accuracies: Sequence[float], top_k: int = TOP_K, decay: float = RANK_DECAY) -> list[list[float]]:
    """(K, top_k) probability that head k's rank-i guess is right: a[k] * decay**i."""
    table = [[a * decay**i for i in range(top_k)] for a in accuracies]
    for k, row in enumerate(table):
        if sum(row) > 1 + 1e-9:   # a head's ranks are distinct tokens: at most one is right
            raise ValueError(f"head {k}'s rank accuracies sum to {sum(row):.2f} > 1 with accuracy {accuracies[k]} "
                             f"and rank decay {decay}: lower --rank-decay or the accuracy")
    return table


def read_calibration(path: Path, num_heads: int) -> list[list[float]]:
    """The ``accuracy`` table of a calibrate report, checked against the loaded heads."""
    try:
        table = json.loads(path.read_text())["accuracy"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise LoadError(f"{path}: not a calibration report with an 'accuracy' table ({err}): "
                        "rewrite it with python -m medusa_core.calibrate, or delete it") from None
    well_formed = isinstance(table, list) and table and all(
        isinstance(row, list) and row and all(isinstance(p, (int, float)) and 0 <= p <= 1 for p in row)
        and sum(row) <= 1 + 1e-6 for row in table)
    if not well_formed or len({len(row) for row in table}) != 1:
        raise LoadError(f"{path}: 'accuracy' must be one list of probabilities in [0, 1] per head, each summing "
                        "to at most 1, all with as many ranks: rewrite it with python -m medusa_core.calibrate, "
                        "or delete it")
    if len(table) != num_heads:
        raise LoadError(f"{path} holds accuracies for {len(table)} heads and the heads beside it are {num_heads}: "
                        "recalibrate them with python -m medusa_core.calibrate, or delete the file")
    return [[float(p) for p in row] for row in table]


def head_accuracy(heads_dir: Path | None, heads_source: str | None, num_heads: int,
                  calibration: Path | None = None) -> HeadAccuracy | None:
    """The heads' accuracy table, or None when nothing measured or published describes them.
    ``calibration``: a report kept outside the heads directory (the bundled heads' own)."""
    for path in (calibration, heads_dir / CALIBRATION_FILE if heads_dir is not None else None):
        if path is not None and path.is_file():
            return HeadAccuracy(read_calibration(path, num_heads), f"calibrated ({path.name})")
    if heads_source in PUBLISHED_HEADS:
        table = rank_table(PUBLISHED_ACCURACIES[:num_heads])
        return HeadAccuracy(table, "published Vicuna-7B head accuracies")
    return None
