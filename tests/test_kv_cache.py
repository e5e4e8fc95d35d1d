import warnings

import pytest
import torch
from tiny import tiny_model, trained_heads

from medusa_core.decoding.config import DecodeConfig
from medusa_core.decoding.generate import generate, new_cache
from medusa_core.decoding.kv_cache import cache_keyword, prefill_mask
from medusa_core.decoding.tree import build_tree_buffers, resolve_tree


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("qwen2", seed=5)
    heads = trained_heads(model)
    return model, heads, build_tree_buffers(resolve_tree("mc_sim_7b_63"), 5)


def tokens_of(steps):
    return [t for s in steps for t in s.tokens]


class CountFed:
    """Counts the tokens each decoder forward is given."""

    def __init__(self, model):
        self.fed = []
        self.handle = model.get_decoder().register_forward_pre_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs):
        self.fed.append(kwargs["input_ids"].shape[1])


def test_compacted_cache_gives_the_logits_of_a_full_recompute(setup):
    model, heads, tree = setup
    cache = new_cache(model, 0)
    steps = list(generate(model, [1, 9, 4, 22], heads=heads, tree=tree, cache=cache,
                          config=DecodeConfig(max_new_tokens=60)))
    assert max(len(s.tokens) for s in steps) > 2          # accepted paths were copied down
    out = tokens_of(steps)
    assert cache.token_ids == [1, 9, 4, 22] + out[:-1]    # the last token is emitted, not yet cached
    n = cache.length
    with torch.inference_mode():
        hidden = model.get_decoder()(
            input_ids=torch.tensor([[out[-1]]]), attention_mask=prefill_mask(n, 1, cache.capacity, torch.float32, "cpu"),
            position_ids=torch.tensor([[n]]), use_cache=True, **{cache_keyword(model.get_decoder()): cache},
        ).last_hidden_state
        cached = model.lm_head(hidden)[0, -1]
        full = model(torch.tensor([cache.token_ids + [out[-1]]])).logits[0, -1]
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def test_prefix_reuse_equals_fresh_prefill_and_rewinds_on_edits(setup):
    model, heads, tree = setup
    config = DecodeConfig(max_new_tokens=30)
    cache = new_cache(model, 0)
    turn1 = [1, 9, 4, 22, 17]
    reply1 = tokens_of(generate(model, turn1, heads=heads, tree=tree, cache=cache, config=config))

    turn2 = turn1 + reply1 + [2, 31, 8]
    counter = CountFed(model)
    reused = tokens_of(generate(model, turn2, heads=heads, tree=tree, cache=cache, config=config))
    counter.handle.remove()
    assert counter.fed[0] == 4                         # the last reply token + 3 new ones, not the whole prompt
    fresh = tokens_of(generate(model, turn2, heads=heads, tree=tree, config=config))
    assert reused == fresh

    edited = turn1[:3] + [40, 41]                      # an edited first turn diverges after 3 tokens
    counter = CountFed(model)
    rewound = tokens_of(generate(model, edited, heads=heads, tree=tree, cache=cache, config=config))
    counter.handle.remove()
    assert counter.fed[0] == 2
    assert rewound == tokens_of(generate(model, edited, heads=heads, tree=tree, config=config))

    regenerate = list(edited)                          # the same prompt again (Regenerate): one token re-run
    counter = CountFed(model)
    again = tokens_of(generate(model, regenerate, heads=heads, tree=tree, cache=cache, config=config))
    counter.handle.remove()
    assert counter.fed[0] == 1 and again == rewound


def test_cache_grows_between_turns_when_needed(setup):
    model, heads, tree = setup
    cache = new_cache(model, 0)
    short = tokens_of(generate(model, [1, 2, 3], heads=heads, tree=tree, cache=cache, config=DecodeConfig(max_new_tokens=5)))
    small = cache.capacity
    prompt = [1, 2, 3] + short + list(range(3, 40))
    long = tokens_of(generate(model, prompt, heads=heads, tree=tree, cache=cache, config=DecodeConfig(max_new_tokens=200)))
    assert cache.capacity > small
    assert long == tokens_of(generate(model, prompt, heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=200)))


def test_decoding_passes_the_cache_under_the_name_the_installed_transformers_takes(setup):
    """transformers 5.24 renamed the forward's ``past_key_values`` to ``cache``; the old name warns
    on every forward (a console full of warnings in the app) and is removed in 5.40. The step must
    use whichever name the installed version's forward declares."""
    model, heads, tree = setup

    def forward_new(input_ids, cache=None, past_key_values=None):       # 5.24 keeps both, old one deprecated
        pass

    def forward_old(input_ids, past_key_values=None):                   # 5.17-5.23
        pass

    assert cache_keyword(type("New", (), {"forward": staticmethod(forward_new)})) == "cache"
    assert cache_keyword(type("Old", (), {"forward": staticmethod(forward_old)})) == "past_key_values"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)       # a deprecated keyword would raise here
        steps = list(generate(model, [1, 9, 4, 22], heads=heads, tree=tree, cache=new_cache(model, 0),
                              config=DecodeConfig(max_new_tokens=12)))
    assert sum(len(s.tokens) for s in steps) == 12
