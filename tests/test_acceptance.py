import math

import torch

from medusa_core.decoding.acceptance import (
    accept_match,
    accept_typical,
    sampling_probs,
    typical_threshold,
)
from medusa_core.decoding.tree import build_tree_buffers


def test_greedy_match_takes_the_longest_agreeing_path():
    # tree: root -> a=[0], b=[1]; a -> c=[0,0]
    tb = build_tree_buffers([(0,), (1,), (0, 0)], num_heads=2)   # nodes: 0 root, 1 [0], 2 [1], 3 [0,0]
    tokens = torch.tensor([5, 7, 8, 9])
    targets = torch.tensor([8, 9, 1, 3])   # root predicts 8 -> node [1]; node [1] predicts 1 (no child)
    best, length = accept_match(tokens, targets, tb.leaf_paths)
    path = tb.leaf_paths[best][0].tolist()
    assert length.item() == 2 and path[:2] == [0, 2]
    targets = torch.tensor([7, 9, 1, 3])   # root -> [0] (7), [0] predicts 9 -> [0,0]
    best, length = accept_match(tokens, targets, tb.leaf_paths)
    assert length.item() == 3 and tb.leaf_paths[best][0].tolist() == [0, 1, 3]
    targets = torch.tensor([4, 9, 1, 3])   # nothing matches: only the root
    assert accept_match(tokens, targets, tb.leaf_paths)[1].item() == 1


def test_typical_matches_the_formula_on_hand_made_distributions():
    eps, delta = 0.09, 0.3
    peaked = torch.tensor([0.90, 0.05, 0.03, 0.02])
    flat = torch.tensor([0.25, 0.25, 0.25, 0.25])
    for p in (peaked, flat):
        h = -(p * p.log()).sum().item()
        expect = min(eps, delta * math.exp(-h))
        assert math.isclose(typical_threshold(p[None], eps, delta).item(), expect, rel_tol=1e-5)
    # flat: threshold = min(0.09, 0.3 * exp(-log 4)) = 0.075 -> every token (0.25) passes
    # peaked: H ~ 0.43, 0.3 * exp(-H) ~ 0.195 -> threshold 0.09: only token 0 passes
    tb = build_tree_buffers([(0,), (1,), (2,)], num_heads=1)       # three children of the root
    tokens = torch.tensor([0, 3, 1, 0])                            # children: 3, 1, 0
    logits = torch.stack([peaked.log(), flat.log(), flat.log(), flat.log()])
    best, length = accept_typical(tokens, logits, tb.leaf_paths, temperature=1.0, epsilon=eps, delta=delta)
    assert length.item() == 2 and tokens[tb.leaf_paths[best][0, 1]].item() == 0
    logits[0] = flat.log()
    best, length = accept_typical(tokens, logits, tb.leaf_paths, temperature=1.0, epsilon=eps, delta=delta)
    assert length.item() == 2 and tb.leaf_paths[best][0, 1].item() == 1   # ties: the first path
    # a raised threshold (epsilon and delta 1) rejects even the flat distribution's tokens
    best, length = accept_typical(tokens, logits, tb.leaf_paths, temperature=1.0, epsilon=1.0, delta=1.0)
    assert length.item() == 1


def test_typical_keeps_the_likelier_of_two_accepted_siblings():
    # root -> [0], [1]; [0] -> [0, 0]. Both root children pass the threshold, [0, 0] does not, so the
    # paths through node 1 and node 2 both accept one child. The leaf row through node 2 comes first.
    tb = build_tree_buffers([(0,), (1,), (0, 0)], num_heads=2)    # nodes: 0 root, 1 [0], 2 [1], 3 [0,0]
    assert tb.leaf_paths[0].tolist()[:2] == [0, 2]
    tokens = torch.tensor([0, 1, 2, 3])
    for likelier, other in ((1, 2), (2, 1)):
        logits = torch.full((4, 8), -10.0)
        logits[0, likelier], logits[0, other] = 5.0, 4.0             # p 0.73 and 0.27: both above 0.09
        logits[1:, 5] = 10.0                                          # no node predicts token 3
        logits[1, 3] = -30.0      # node 3 rejected by far: past a path's accepted part nothing may count
        best, length = accept_typical(tokens, logits, tb.leaf_paths, temperature=1.0, epsilon=0.09, delta=0.3)
        assert length.item() == 2 and tb.leaf_paths[best][0].tolist()[1] == likelier


def test_a_temperature_or_top_p_near_zero_gives_a_distribution_not_nan():
    # QA: temperature 1e-40 and top_p 1e-300 gave NaN probabilities, and replies of special tokens
    from medusa_core.decoding.config import DecodeConfig

    assert DecodeConfig(mode="sample", temperature=1e-40).greedy and DecodeConfig(mode="typical", temperature=1e-6).greedy
    assert not DecodeConfig(mode="sample", temperature=1e-4).greedy
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0], [0.0, 5.0, 1.0, 0.0]])
    for top_p in (1e-300, torch.tensor(1e-300, dtype=torch.float32)):     # 0 in float32, as the device holds it
        probs = sampling_probs(logits, 1.0, top_p=top_p, nucleus=True)
        assert torch.equal(probs, torch.eye(4)[[0, 1]]), "the most likely token alone stays"
    sharp = sampling_probs(logits, 1e-4, nucleus=False)
    assert not sharp.isnan().any() and torch.equal(sharp.argmax(-1), logits.argmax(-1))


def test_typical_thresholds_of_zero_are_refused():
    # QA: ε or δ at 0 makes the threshold 0, every guess is kept, and the reply is gibberish
    import pytest

    from medusa_core.decoding.config import DecodeConfig, SettingError

    for name in ("epsilon", "delta"):
        with pytest.raises(SettingError, match=rf"^{name} 0 is out of range: use a value in \(0, 1\] \(at 0 every "
                                               r"guess the heads make is kept\)$"):
            DecodeConfig(mode="typical", temperature=0.7, **{name: 0})
    DecodeConfig(mode="typical", temperature=0.7, epsilon=0.01, delta=0.01)


def test_settings_that_are_not_finite_numbers_are_refused():
    """NaN passes every range check (review: a NaN temperature sampled token 0 for a whole benchmark run)."""
    import pytest

    from medusa_core.decoding.config import DecodeConfig, SettingError

    for name, value in (("temperature", float("nan")), ("top_p", float("nan")), ("epsilon", float("nan")),
                        ("delta", float("-inf")), ("max_new_tokens", float("inf"))):
        with pytest.raises(SettingError, match=rf"^{name} -?(nan|inf) is not a finite number: "):
            DecodeConfig(mode="typical", **{name: value})


def test_sampling_probs_top_k_and_top_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    p = logits.softmax(-1)[0]
    assert torch.allclose(sampling_probs(logits, 1.0, nucleus=False)[0], p)
    top2 = sampling_probs(logits, 1.0, top_k=2, nucleus=False)[0]
    assert torch.allclose(top2, torch.cat([p[:2] / p[:2].sum(), torch.zeros(2)]))
    # top-p keeps the smallest prefix whose mass reaches p: p[0] ~ 0.64 < 0.7 <= p[0] + p[1]
    nucleus = sampling_probs(logits, 1.0, top_p=0.7, nucleus=True)[0]
    assert (nucleus > 0).tolist() == [True, True, False, False]
    assert torch.allclose(sampling_probs(logits, 0.5, nucleus=False)[0], (logits * 2).softmax(-1)[0])
