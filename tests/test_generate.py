import dataclasses

import pytest
import torch
from tiny import copied_heads, random_heads, tiny_model, trained_heads

from medusa_core.decoding.config import DecodeConfig
from medusa_core.decoding.generate import generate, max_context
from medusa_core.decoding.kv_cache import ContextOverflowError
from medusa_core.decoding.tree import build_tree_buffers, resolve_tree

PROMPTS = [[1, 5, 7, 9, 3], [1, 40, 2, 33, 33, 17, 8, 60, 12], [1, 11]]
TREES = ["mc_sim_7b_63", "chain-3", "small-16", "cartesian-3x2"]
NEW = 110


def tokens_of(steps):
    return [t for s in steps for t in s.tokens]


def hf_greedy(model, prompt, n):
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2"])
def backbone(request):
    model = tiny_model(request.param)
    return model, {"trained": trained_heads(model), "random": random_heads(model),
                   "root-conditioned": trained_heads(model, root_conditioned=True)}


def test_greedy_medusa_equals_baseline_and_transformers(backbone):
    model, heads_by_kind = backbone
    accepted = {}
    for prompt in PROMPTS:
        reference = hf_greedy(model, prompt, NEW)
        baseline = list(generate(model, prompt, config=DecodeConfig(max_new_tokens=NEW)))
        assert tokens_of(baseline) == reference
        assert all(len(s.tokens) == 1 and s.from_heads == 0 for s in baseline)
        for kind, heads in heads_by_kind.items():
            for spec in TREES:
                tree = build_tree_buffers(resolve_tree(spec), heads.config.num_heads)
                steps = list(generate(model, prompt, heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=NEW)))
                assert tokens_of(steps) == reference, (kind, spec, prompt)
                assert steps[-1].finish_reason == "length"
                accepted.setdefault(kind, []).extend(len(s.tokens) for s in steps[1:])
    mean = {kind: sum(v) / len(v) for kind, v in accepted.items()}
    assert mean["trained"] > 1.5      # acceptance of several tokens per step is exercised
    assert mean["root-conditioned"] > 1.5
    assert mean["random"] < 1.2       # and so is rejection


@pytest.fixture(scope="module")
def llama_trained():
    model = tiny_model("llama", seed=3)
    return model, trained_heads(model), build_tree_buffers(resolve_tree("small-16"), 5)


def test_typical_at_temperature_zero_equals_greedy(llama_trained):
    model, heads, tree = llama_trained
    for prompt in PROMPTS:
        greedy = tokens_of(generate(model, prompt, heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=60)))
        typical = generate(model, prompt, heads=heads, tree=tree,
                           config=DecodeConfig(mode="typical", temperature=0.0, max_new_tokens=60))
        assert tokens_of(typical) == greedy


def test_typical_at_temperature_runs_and_accepts(llama_trained):
    model, heads, tree = llama_trained
    steps = list(generate(model, PROMPTS[0], heads=heads, tree=tree,
                          config=DecodeConfig(mode="typical", temperature=0.7, max_new_tokens=80)))
    assert len(tokens_of(steps)) == 80
    assert sum(len(s.tokens) for s in steps[1:]) / (len(steps) - 1) > 1.2


def test_sampling_is_reproducible_with_a_seed():
    model = tiny_model("llama")
    heads = copied_heads(model)
    tree = build_tree_buffers(resolve_tree("small-16"), 5)
    config = DecodeConfig(mode="sample", temperature=1.0, top_p=0.9, max_new_tokens=40, seed=7)
    a = tokens_of(generate(model, PROMPTS[0], heads=heads, tree=tree, config=config))
    b = tokens_of(generate(model, PROMPTS[0], heads=heads, tree=tree, config=config))
    c = tokens_of(generate(model, PROMPTS[0], heads=heads, tree=tree,
                           config=DecodeConfig(mode="sample", temperature=1.0, max_new_tokens=40, seed=8)))
    assert a == b and a != c
    # API QA: torch's CPU generator keeps a seed's low 32 bits only, and 7 + 2**32 sampled what 7 did
    for other in (7 + 2**32, 7 - 2**63):
        high = tokens_of(generate(model, PROMPTS[0], heads=heads, tree=tree,
                                  config=dataclasses.replace(config, seed=other)))
        assert high != a, other


def test_stops_on_eos_and_extra_stop_ids(llama_trained):
    model, heads, tree = llama_trained
    full = tokens_of(generate(model, PROMPTS[1], heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=60)))
    stop = full[25]
    first = full.index(stop)
    steps = list(generate(model, PROMPTS[1], heads=heads, tree=tree, stop_ids=[stop],
                          config=DecodeConfig(max_new_tokens=60)))
    assert tokens_of(steps) == full[: first + 1] and steps[-1].finish_reason == "eos"
    model.generation_config.eos_token_id = stop
    try:
        eos_run = tokens_of(generate(model, PROMPTS[1], heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=60)))
    finally:
        model.generation_config.eos_token_id = None
    assert eos_run == full[: first + 1]


def test_max_new_tokens_is_exact_and_cancel_stops_at_once(llama_trained):
    model, heads, tree = llama_trained
    for n in (1, 2, 7, 33):
        assert len(tokens_of(generate(model, PROMPTS[0], heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=n)))) == n
    calls = []
    steps = list(generate(model, PROMPTS[0], heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=100),
                          should_stop=lambda: calls.append(1) or len(calls) >= 5))
    assert steps[-1].finish_reason == "cancelled" and len(tokens_of(steps)) == 5


def test_a_tree_deeper_than_the_heads_is_refused_by_name():
    model = tiny_model("llama")
    heads = copied_heads(model, num_heads=2)
    tree = build_tree_buffers(resolve_tree("chain-4"), 5)              # built for 5 heads, given 2
    with pytest.raises(ValueError, match="a tree of depth 4 is more than these 2 Medusa heads"):
        next(generate(model, PROMPTS[0], heads=heads, tree=tree))


def test_context_limits_are_clear():
    model = tiny_model("llama")
    with pytest.raises(ContextOverflowError, match="the prompt has 600 tokens but the model's context is 512"):
        next(generate(model, [3] * 600))
    steps = list(generate(model, [3] * 500, config=DecodeConfig(max_new_tokens=100)))
    # positions 0..511 are fed; the token predicted at 511 is still emitted: 1 + 12 tokens
    assert steps[-1].finish_reason == "context" and len(tokens_of(steps)) == 13


def test_a_sliding_window_is_the_context_as_the_cache_attends_over_every_slot():
    """A Mistral with a sliding window attends only to the window's keys, where this cache's masks attend to
    every slot: its context stops at the window, inside which the two agree (review: greedy left transformers'
    at the third token of a 37-token prompt over an 8-token window). A window the config turns off is none."""
    model = tiny_model("mistral", context=64)
    model.config.sliding_window = 12
    with pytest.raises(ContextOverflowError, match="the prompt has 37 tokens but the model's context is 12"):
        next(generate(model, list(range(3, 40))))
    heads = trained_heads(model)
    tree = build_tree_buffers(resolve_tree("chain-3"), heads.config.num_heads)
    for prompt in PROMPTS:
        steps = list(generate(model, prompt, heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=20)))
        assert steps[-1].finish_reason == "context" and len(tokens_of(steps)) == 12 - len(prompt) + 1
        assert tokens_of(steps) == hf_greedy(model, prompt, 12 - len(prompt) + 1)
    qwen = tiny_model("qwen2", context=64)
    qwen.config.sliding_window, qwen.config.use_sliding_window = 8, False      # Qwen2's configs carry one, unused
    assert max_context(qwen) == 64


@pytest.mark.parametrize("spec", ["mc_sim_7b_63", "chain-3"])
def test_medusa_at_the_context_limit_ends_where_plain_decoding_does(llama_trained, spec):
    """The context's last slots hold no whole tree: the reply goes on with one-node steps, so greedy Medusa
    gives plain decoding's tokens up to the last slot (a 64-node tree used to stop 63 tokens short)."""
    model, heads, _ = llama_trained
    # the model's own greedy text as the prompt: where its trained heads guess right
    prompt = PROMPTS[1] + tokens_of(generate(model, PROMPTS[1], config=DecodeConfig(max_new_tokens=400 - 9)))
    tree = build_tree_buffers(resolve_tree(spec), heads.config.num_heads)
    plain = list(generate(model, prompt, config=DecodeConfig(max_new_tokens=200)))
    steps = list(generate(model, prompt, heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=200)))
    assert plain[-1].finish_reason == steps[-1].finish_reason == "context"
    assert tokens_of(steps) == tokens_of(plain) and len(tokens_of(plain)) == 512 - 400 + 1
    assert any(s.from_heads for s in steps), "the heads' guesses were accepted before the tail"


@pytest.mark.parametrize("bad, message", [
    (dict(mode="beam"), "mode 'beam' is unknown"),
    (dict(temperature=-1), "temperature -1 is out of range: use a value from 0 \\(greedy\\) to 2"),
    (dict(top_p=0), "top_p 0 is out of range"),
    (dict(max_new_tokens=0), "max_new_tokens 0 must be at least 1"),
])
def test_bad_config_is_one_clear_error(bad, message):
    with pytest.raises(ValueError, match=message):
        DecodeConfig(**bad)


def chi_square_p(observed: torch.Tensor, expected_p: torch.Tensor) -> float:
    """Pearson goodness of fit; bins expected below 5 counts are pooled."""
    n = observed.sum()
    expected = expected_p * n
    small = expected < 5
    obs = torch.cat([observed[~small], observed[small].sum()[None]])
    exp = torch.cat([expected[~small], expected[small].sum()[None]])
    stat = ((obs - exp) ** 2 / exp.clamp_min(1e-12)).sum()
    df = len(obs) - 1
    return torch.special.gammaincc(torch.tensor(df / 2), stat / 2).item()


def test_exact_sampling_keeps_the_distribution():
    """Tokens 2 and 3 come from the tree (accepted guesses or the bonus sample); their
    marginals must equal the backbone's exact ones, enumerated over the small vocabulary."""
    vocab, prompt, runs = 12, [1, 5, 7, 3], 1500
    model = tiny_model("llama", vocab=vocab, seed=4)
    heads = trained_heads(model, steps=100)
    tree = build_tree_buffers(resolve_tree("cartesian-4x3"), 5)
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].softmax(-1)                      # (V,)
        ctx2 = torch.tensor([prompt + [a] for a in range(vocab)])
        p2 = model(ctx2).logits[:, -1].softmax(-1)                                        # (V, V): [t1, t2]
        ctx3 = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3 = model(ctx3).logits[:, -1].softmax(-1).view(vocab, vocab, vocab)              # [t1, t2, t3]
    joint12 = p1[:, None] * p2
    marg2 = joint12.sum(0)
    marg3 = (joint12[..., None] * p3).sum((0, 1))

    counts2, counts3, from_heads = torch.zeros(vocab), torch.zeros(vocab), 0
    for seed in range(runs):
        config = DecodeConfig(mode="sample", temperature=1.0, max_new_tokens=3, seed=seed)
        steps = list(generate(model, prompt, heads=heads, tree=tree, config=config))
        out = tokens_of(steps)
        counts2[out[1]] += 1
        counts3[out[2]] += 1
        from_heads += sum(s.from_heads for s in steps)
    assert from_heads / runs > 0.3          # the tree really supplied tokens
    assert chi_square_p(counts2, marg2) > 1e-3
    assert chi_square_p(counts3, marg3) > 1e-3
    # the test can tell: the greedy choice is far from the sampled distribution
    assert chi_square_p(torch.nn.functional.one_hot(marg3.argmax(), vocab).float() * runs, marg3) < 1e-3


def test_a_long_prompt_is_read_in_pieces_and_stop_is_heard_between_them(llama_trained, monkeypatch):
    """Stop during a long prompt's prefill ends the reply before its first token, at the next piece,
    keeping what was read as the cache's prefix; the next reply reads on from there and gives the
    tokens a one-piece prefill gives (fp32)."""
    from medusa_core.decoding import generate as loop
    from medusa_core.decoding.generate import new_cache, prefill_piece

    # pieces on the CPU only: CUDA reads a prompt in one forward (fast there, and a piece re-dequantizes NF4)
    assert prefill_piece(torch.device("cpu")) == loop.PREFILL_PIECE and prefill_piece(torch.device("cuda")) > 10**6
    model, heads, tree = llama_trained
    prompt = [1, *range(20, 60)]                                               # 41 tokens
    whole = tokens_of(generate(model, prompt, heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=12)))
    monkeypatch.setattr(loop, "PREFILL_PIECE", 8)
    asked = []
    cache = new_cache(model)
    steps = list(generate(model, prompt, heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=12), cache=cache,
                          should_stop=lambda: asked.append(1) or len(asked) > 2))
    assert [(s.tokens, s.finish_reason) for s in steps] == [([], "cancelled")]
    assert cache.length == 16 and cache.token_ids == prompt[:16]             # two pieces read before Stop
    again = tokens_of(generate(model, prompt, heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=12),
                               cache=cache))
    assert again == whole == tokens_of(generate(model, prompt, heads=heads, tree=tree,
                                                config=DecodeConfig(max_new_tokens=12)))
