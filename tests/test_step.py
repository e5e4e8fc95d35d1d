"""The static-shape decoding step on CPU: its device-built mask, capacity buckets, and the
steps a conversation's cache keeps (bounded, reused after Clear, dropped on a bucket change)."""

import pytest
import torch
from tiny import tiny_model, trained_heads

from medusa_core.decoding.config import DecodeConfig
from medusa_core.decoding.generate import generate, new_cache
from medusa_core.decoding.kv_cache import bucket, tree_step_mask
from medusa_core.decoding.step_store import MAX_STEPS_PER_CACHE, needs_capture
from medusa_core.decoding.tree import build_tree_buffers, resolve_tree

PROMPT = [1, 5, 7, 9, 3]


def tokens_of(steps):
    return [t for s in steps for t in s.tokens]


def test_step_mask_sees_the_prefix_and_its_ancestors_only():
    tree = build_tree_buffers(resolve_tree("mc_sim_7b_63"), 5)
    T, position, capacity = tree.size, 37, 256
    mask = tree_step_mask(tree.allowed, torch.tensor([position]), torch.arange(capacity), torch.float32)[0, 0]
    assert mask.shape == (T, capacity)
    seen = mask == 0
    assert mask[~seen].eq(torch.finfo(torch.float32).min).all()   # additive: transformers 5 reads a bool mask wrong
    assert seen[:, :position].all()                       # every committed slot
    assert not seen[:, position + T:].any()               # nothing past the tree
    assert torch.equal(seen[:, position:position + T], tree.allowed)   # the tree's own ancestor mask
    for node in range(1, T):                              # by hand: a node sees exactly its ancestors and itself
        path = set(tree.paths[node - 1][:d] for d in range(len(tree.paths[node - 1]) + 1))
        ancestors = {0} | {tree.paths.index(p) + 1 for p in path if p}
        assert set(seen[node, position:position + T].nonzero().flatten().tolist()) == ancestors


def test_capacity_buckets_double_and_stop_at_the_context():
    assert [bucket(n, 4096) for n in (1, 256, 257, 1000, 2049)] == [256, 256, 512, 1024, 4096]
    assert bucket(3000, 2048) == 2048


def test_cache_keeps_a_bounded_set_of_steps_and_reuses_them_after_clear():
    model = tiny_model("llama", seed=3)
    heads = trained_heads(model, steps=30)
    cache = new_cache(model)
    config = DecodeConfig(max_new_tokens=12)
    specs = ["chain-1", "chain-2", "chain-3", "small-8", "small-16", "mc_sim_7b_63"]
    for spec in specs:
        tree = build_tree_buffers(resolve_tree(spec), 5)
        list(generate(model, PROMPT, heads=heads, tree=tree, config=config, cache=cache))
        assert len(cache.steps) <= MAX_STEPS_PER_CACHE
        assert not needs_capture(model, cache, tree, config)   # CPU: eager, nothing to capture
    kept = list(cache.steps.values())
    assert [s.tree.size for s in kept] == [build_tree_buffers(resolve_tree(s), 5).size for s in specs[-4:]]

    tree = kept[-1].tree
    first = tokens_of(generate(model, PROMPT, heads=heads, tree=tree, config=config, cache=cache))
    cache.rewind(0)                                          # Clear: a new conversation
    assert cache.length == 0 and cache.token_ids == []
    again = tokens_of(generate(model, PROMPT, heads=heads, tree=tree, config=config, cache=cache))
    assert again == first and list(cache.steps.values())[-1] is kept[-1]


def test_a_bigger_bucket_drops_the_steps_bound_to_the_old_buffers():
    model = tiny_model("llama", seed=3)
    cache = new_cache(model)
    list(generate(model, PROMPT, config=DecodeConfig(max_new_tokens=8), cache=cache))
    (old,) = cache.steps.values()
    storage = cache.storage
    prompt = cache.token_ids + list(range(3, 40))
    out = tokens_of(generate(model, prompt, config=DecodeConfig(max_new_tokens=300), cache=cache))
    assert cache.capacity == 512 and cache.storage is not storage
    (new,) = cache.steps.values()
    assert new is not old
    assert out == tokens_of(generate(model, prompt, config=DecodeConfig(max_new_tokens=300)))


def test_a_stop_token_cut_then_the_next_turn_equals_a_fresh_conversation():
    """The step commits its whole accepted path on the device; a stop token in the middle of it
    must rewind the cache to what was emitted, so the next turn's reuse is exact."""
    model = tiny_model("mistral", seed=4)
    heads = trained_heads(model, steps=60)
    tree = build_tree_buffers(resolve_tree("mc_sim_7b_63"), 5)
    config = DecodeConfig(max_new_tokens=60)
    full = list(generate(model, PROMPT, heads=heads, tree=tree, config=config))
    step = next(s for s in full[1:] if len(s.tokens) >= 3)        # a step that accepted several tokens
    stop = step.tokens[1]                                           # cut inside it
    cache = new_cache(model)
    turn1 = tokens_of(generate(model, PROMPT, heads=heads, tree=tree, config=config, cache=cache, stop_ids=[stop]))
    assert turn1[-1] == stop and cache.token_ids == PROMPT + turn1[:-1]
    turn2 = PROMPT + turn1 + [7, 8, 9]
    reused = tokens_of(generate(model, turn2, heads=heads, tree=tree, config=config, cache=cache))
    assert reused == tokens_of(generate(model, turn2, heads=heads, tree=tree, config=config))


def test_a_dropped_conversation_frees_its_steps_at_once():
    """No reference cycle between a cache and its steps: dropping the cache frees its steps (and
    on CUDA their graphs) right away, not in a later garbage collection that could run inside
    another graph's capture."""
    import gc
    import weakref

    model = tiny_model("llama", seed=3)
    cache = new_cache(model)
    list(generate(model, PROMPT, config=DecodeConfig(max_new_tokens=4), cache=cache))
    (step,) = cache.steps.values()
    alive = weakref.ref(step)
    del step
    gc.disable()
    try:
        del cache
        assert alive() is None
    finally:
        gc.enable()


def test_eager_steps_attend_over_the_used_slots_and_decode_as_the_whole_bucket_does(monkeypatch):
    """Off CUDA a step attends over committed + T slots, not the 256-slot bucket (a graph's
    shape); hiding the empty tail by mask or by not reading it gives the same tokens, greedy,
    sampled and across a second turn that reuses the prefix."""
    from medusa_core.decoding.kv_cache import KVCache, _Layer

    model = tiny_model("llama", seed=5)
    heads = trained_heads(model, steps=30)
    tree = build_tree_buffers(resolve_tree("small-8"), 5)
    seen: list[tuple[int, int, int]] = []     # (keys attended over, committed length, new entries)
    update, narrowed = _Layer.update, KVCache.narrowed

    def spy(self, key_states, value_states, *args, **kwargs):
        keys, values = update(self, key_states, value_states, *args, **kwargs)
        seen.append((keys.shape[2], self.owner.length, key_states.shape[2]))
        return keys, values

    def conversation():
        cache = new_cache(model)
        out = []
        for mode, prompt in (("greedy", PROMPT), ("sample", PROMPT + [11, 12])):
            config = DecodeConfig(mode=mode, max_new_tokens=20, seed=4)
            out.append(tokens_of(generate(model, prompt, heads=heads, tree=tree, config=config, cache=cache)))
        return out, cache.capacity

    monkeypatch.setattr(_Layer, "update", spy)
    narrow, capacity = conversation()
    assert seen[0] == (len(PROMPT), 0, len(PROMPT))                      # the prefill: the prompt only
    assert {q for _, _, q in seen} >= {tree.size} and all(keys == length + q for keys, length, q in seen)
    seen.clear()
    monkeypatch.setattr(KVCache, "narrowed", lambda self, width: narrowed(self, None))   # as a graph does
    assert conversation() == (narrow, capacity)
    assert {keys for keys, _, _ in seen} == {capacity}


def test_captures_in_two_threads_take_turns_with_garbage_collection_off_and_their_own_streams(monkeypatch):
    """Review: torch.cuda.graph's entry synchronizes and empties the allocator's cache, which asserts that no
    capture is underway in any thread, so the kernel tuner (a load's thread) capturing beside an answer's first
    step (the old model's thread) failed; the collection before a capture ran under the other's capture too.
    Captures take turns, each on its own stream, with garbage collection off inside. Runs without CUDA: the
    graph and the streams are stand-ins, the bookkeeping is graphs.py's own."""
    import contextlib
    import gc
    import threading

    from medusa_core.decoding import graphs

    recording: list[str] = []       # the threads whose capture is in torch.cuda.graph now

    @contextlib.contextmanager
    def graph(*args, **kwargs):
        recording.append(threading.current_thread().name)
        assert len(recording) == 1, f"two captures at once: {recording}"
        try:
            yield
        finally:
            recording.pop()

    collected: list[list[str]] = []
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(graphs.gc, "collect", lambda: collected.append(list(recording)))
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: object())
    monkeypatch.setattr(graphs, "_FREE_STREAMS", {})            # the stand-ins never outlive the test
    device = torch.device("cuda", 0)
    assert gc.isenabled()
    inside, release, streams, order = threading.Event(), threading.Event(), {}, []

    def other_thread():
        with graphs.leased_stream(device) as streams["other"], graphs.capturing(None, streams["other"], collect=False):
            order.append("other")
            inside.set()
            release.wait(10)

    def this_thread():
        with graphs.leased_stream(device) as streams["this"], graphs.capturing(None, streams["this"]):
            assert not gc.isenabled()
            order.append("this")

    worker = threading.Thread(target=other_thread, name="other")
    worker.start()
    inside.wait(10)
    assert not gc.isenabled()
    second = threading.Thread(target=this_thread, name="this")
    second.start()
    second.join(0.5)
    assert second.is_alive() and order == ["other"], "a second capture began under the first"
    release.set()
    worker.join(10)
    second.join(10)
    assert order == ["other", "this"] and collected == [[]], (order, collected)   # collected with no capture on
    assert streams["this"] is not streams["other"] and gc.isenabled()
    with graphs.leased_stream(device) as again:       # given back and reused: no stream (and cuBLAS workspace) more
        assert any(again is s for s in streams.values()) and len(graphs._FREE_STREAMS[device]) == 1
        # a capture started inside one in the same thread would wait for itself: said at once
        with graphs.capturing(None, again, collect=False), pytest.raises(RuntimeError, match="inside another"):
            with graphs.capturing(None, again, collect=False):
                pass
    assert gc.isenabled() and graphs._capturing == 0


def test_a_capture_warms_up_on_the_leased_stream_then_records_once(monkeypatch):
    """graphs.captured runs only on CUDA, where nothing has tested this session's version: the sequence is checked
    here with stand-ins (warm-ups, then one recorded run whose result comes back, the stream given back)."""
    import contextlib

    from medusa_core.decoding import graphs

    class Stream:
        def wait_stream(self, other):
            calls.append("wait")

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, **kw: calls.append(("capture", graph, kw["capture_error_mode"]))
                        or contextlib.nullcontext())
    monkeypatch.setattr(graphs, "_FREE_STREAMS", {})
    device = torch.device("cuda", 0)
    graph, out = graphs.captured(lambda: calls.append("record") or "logits", device,
                                 warm_up=lambda: calls.append("warm"), warmups=2)
    assert (graph, out) == ("graph", "logits")
    assert calls == ["wait", "warm", "warm", "wait", ("capture", "graph", "thread_local"), "record"]
    assert len(graphs._FREE_STREAMS[device]) == 1


def test_a_graph_capture_is_not_counted_in_a_decoding_steps_time(monkeypatch):
    """Review: the first step captured its CUDA graph inside its own timed window (~0.3 s on a 7B), which the page
    counted in tokens/s and in the comparison's speedup. Here a capture that takes 1000 s of a fake clock, on the
    CPU (a stand-in graph replays the step eagerly)."""
    from types import SimpleNamespace

    from medusa_core.decoding import generate as generate_module, step_store
    from medusa_core.decoding.step import DecodeStep

    clock = [0.0]
    captures = []

    class EagerGraph:
        def __init__(self, step):
            self.step = step

        def replay(self):
            self.step.out = self.step.run_eager()

    def capture(self):
        clock[0] += 1000.0
        captures.append(self)
        self.graph = EagerGraph(self)

    def perf_counter():
        clock[0] += 0.001
        return clock[0]

    model = tiny_model("llama", seed=5)
    heads = trained_heads(model, steps=30)
    tree = build_tree_buffers(resolve_tree("small-8"), 5)
    monkeypatch.setattr(step_store, "use_graphs", lambda model, graphs: True)
    monkeypatch.setattr(DecodeStep, "capture", capture)
    monkeypatch.setattr(generate_module, "time", SimpleNamespace(perf_counter=perf_counter))
    steps = list(generate(model, PROMPT, heads=heads, tree=tree, config=DecodeConfig(max_new_tokens=20)))
    assert len(captures) == 1 and len(steps) > 2
    assert all(s.seconds < 1.0 for s in steps), [s.seconds for s in steps]
