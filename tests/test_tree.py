import itertools
import json

import pytest
import torch

from medusa_core.decoding.tree import (MC_SIM_7B_63, PRESETS, TreeError, UnknownTreeError, build_tree_buffers, cartesian,
                                       chain, resolve_tree, tree_spelling)


def ancestors_and_self(paths, node_path):
    return {node_path[:d] for d in range(len(node_path) + 1)}


@pytest.mark.parametrize("spec", [*PRESETS, "chain-1", "chain-5", "cartesian-3x2", "cartesian-2x2x2"])
def test_mask_rows_allow_exactly_ancestors_and_self(spec):
    tb = build_tree_buffers(resolve_tree(spec), num_heads=5)
    node_paths = [()] + tb.paths                           # node id -> path (root = ())
    allowed = tb.allowed                                   # (T, T) bool
    assert allowed.dtype == torch.bool
    for i, p in enumerate(node_paths):
        expect = {j for j, q in enumerate(node_paths) if q in ancestors_and_self(tb.paths, p)}
        assert set(torch.nonzero(allowed[i]).flatten().tolist()) == expect
    assert tb.depths.tolist() == [len(p) for p in node_paths]


def test_leaf_paths_and_candidates_follow_the_paths():
    tb = build_tree_buffers(resolve_tree("mc_sim_7b_63"), num_heads=5)
    node_paths = [()] + tb.paths
    assert tb.size == 64 and tb.num_heads == 4 and tb.top_k == 10
    parents = {p[:-1] for p in tb.paths}
    leaves = [p for p in node_paths if p not in parents]
    assert tb.leaf_paths.shape == (len(leaves), 5)
    for row in tb.leaf_paths.tolist():
        nodes = [n for n in row if n >= 0]
        leaf = node_paths[nodes[-1]]
        assert [node_paths[n] for n in nodes] == [leaf[:d] for d in range(len(leaf) + 1)]
    # node [a, b] is filled by head 1's rank-b guess: index 1 + 1 * top_k + b
    i = node_paths.index((2, 1))
    assert tb.candidate_index[i] == 1 + 1 * 10 + 1
    assert [node_paths.index((2,)), i] in [row[1:3] for row in tb.leaf_paths.tolist()]   # its parent is (2,)


def test_builders():
    assert chain(3) == [(0,), (0, 0), (0, 0, 0)]
    assert len(cartesian([3, 2])) == 3 + 6
    assert resolve_tree("cartesian-3x2") == cartesian([3, 2])
    assert len(resolve_tree("mc_sim_7b_63")) == len(MC_SIM_7B_63) == 63
    base = build_tree_buffers(resolve_tree("baseline"), num_heads=0)
    assert base.size == 1 and base.num_heads == 0 and base.leaf_paths.tolist() == [[0]]


def test_tree_file(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps([[0], [0, 0], [1]]))
    assert build_tree_buffers(resolve_tree(str(f)), num_heads=2).size == 4
    f.write_text(json.dumps({"paths": [[0], [1]]}))
    assert resolve_tree(str(f)) == [(0,), (1,)]
    (tmp_path / "trees.json").mkdir()          # QA: a folder was said not to exist
    with pytest.raises(TreeError, match=f"^tree file {tmp_path / 'trees.json'} is a folder: give the path of a JSON file"):
        resolve_tree(str(tmp_path / "trees.json"))
    # as a generated tree's: 111,111 nodes asked for a 49 GB mask once a model had loaded (review)
    f.write_text(json.dumps([list(p) for depth in (1, 2, 3) for p in itertools.product(range(10), repeat=depth)]))
    with pytest.raises(TreeError, match=f"^tree file {f} has 1,111 nodes; at most 1024 are taken: use a smaller tree"):
        resolve_tree(str(f))
    with pytest.raises(TreeError, match=r"small-16, chain-1.*, baseline \(plain decoding\), or a path"):
        resolve_tree("smal-16")               # baseline is a tree to name too (--help says so; the list left it out)


@pytest.mark.parametrize(
    "paths, message",
    [
        ([(0,), (1, 0)], "has no parent"),
        ([(0,), (0, 0), (0, 0, 0)], "tree depth 3 is more than the model.s 2 Medusa heads"),
        ([(12,)], r"uses rank 12, but each head offers only its top 10 guesses: use ranks < 10 \(widths <= 10\)"),
        ([(0,), (0,)], "appears twice"),
        ([(0, -1)], "invalid"),
    ],
)
def test_malformed_trees_raise(paths, message):
    with pytest.raises(TreeError, match=message):
        build_tree_buffers(paths, num_heads=2, top_k=10)


@pytest.mark.parametrize("typed, spelled", [(" CHAIN-03 ", "chain-3"), ("Small-16", "small-16"), ("BASELINE", "baseline"),
                                            ("cartesian-02x3", "cartesian-2x3")])
def test_a_tree_has_one_spelling(typed, spelled):
    assert tree_spelling(typed) == spelled
    assert resolve_tree(typed) == resolve_tree(spelled)


def test_a_tree_file_keeps_its_path_as_typed():
    assert tree_spelling(" trees/My.json ") == "trees/My.json"


@pytest.mark.parametrize("typed", ["chain-\u0663", "chain-\u00b2", "cartesian-2x\u0663", "chain-" + "9" * 5000])
def test_tree_names_take_a_few_ascii_digits(typed):
    """"chain-٣" was built as chain-3 under its typed name, and "chain-²" raised int()'s own error."""
    with pytest.raises(UnknownTreeError, match="unknown tree"):
        resolve_tree(typed)


def test_a_cartesian_width_of_zero_says_so():
    with pytest.raises(TreeError, match=r"tree 'cartesian-0x2' has a width of 0: each width of cartesian-AxB\.\.\. is at "
                                        "least 1"):
        resolve_tree("cartesian-0x2")


def test_a_generated_tree_too_large_is_refused_before_it_is_built():
    """A typed cartesian-1000x1000x1000 would build a billion paths (and hang the app): refused by count."""
    assert len(resolve_tree("cartesian-4x4x4x3")) + 1 == 1 + 4 + 16 + 64 + 192      # 277 nodes: built
    for spec in ("cartesian-1000x1000x1000", "cartesian-32x32", "chain-1024"):
        with pytest.raises(TreeError, match=f"tree '{spec}' has more than 1024 nodes"):
            resolve_tree(spec)


def test_bad_names_and_files(tmp_path):
    with pytest.raises(TreeError, match="unknown tree 'mc_sim_9000'"):
        resolve_tree("mc_sim_9000")
    with pytest.raises(TreeError, match="does not exist"):
        resolve_tree(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("[[0], [")
    with pytest.raises(TreeError, match="not valid JSON"):
        resolve_tree(str(bad))
    bad.write_text('[[0], "x"]')
    with pytest.raises(TreeError, match="list of non-empty integer lists"):
        resolve_tree(str(bad))


def test_a_tree_file_is_named_by_its_stem_unless_that_names_another_tree():
    """What the picker, the readout and bench call a tree file: "tuned" for the tuner's tuned.json,
    but chain-3.json keeps its extension, so it is not taken for the preset chain-3."""
    from medusa_core.decoding.tree import tree_name

    assert tree_name("/cache/tuned-trees/ab12/tuned.json") == "tuned"
    assert tree_name("heads/tree.json") == "tree"
    assert tree_name("mine/chain-3.json") == "chain-3.json" and tree_name("x/small-16.json") == "small-16.json"
    assert tree_name("x/cartesian-999x999x999.json") == "cartesian-999x999x999.json"   # a preset form, too big
    assert tree_name("chain-3") == "chain-3" and tree_name("baseline") == "baseline"
