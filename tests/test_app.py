"""The real app (``launch.py`` in a subprocess, on a free local port) driven with gradio_client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

REPO = Path(__file__).resolve().parent.parent
@pytest.fixture(scope="session")
def model_dirs() -> tuple[Path, Path]:
    """(backbone_dir, heads_dir) the app is launched with: the shipped demo model, which
    is what `python launch.py` runs without CUDA."""
    from medusa_core.loading import DEMO_DIR

    return DEMO_DIR / "backbone", DEMO_DIR / "heads"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def app_url(model_dirs, tmp_path_factory):
    backbone, heads = model_dirs
    port = free_port()
    log = tmp_path_factory.mktemp("app") / "app.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "launch.py", "--model", str(backbone), "--heads", str(heads), "--device", "cpu",
             "--port", str(port), "--tree", "small-16", "--max-new-tokens", "48"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"},
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + 240
        while True:
            if proc.poll() is not None:
                pytest.fail(f"launch.py exited with {proc.returncode}:\n{log.read_text()}")
            try:
                with urllib.request.urlopen(url, timeout=2):
                    break
            except OSError:
                if time.time() > deadline:
                    pytest.fail(f"the app did not come up:\n{log.read_text()}")
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def client(app_url):
    from gradio_client import Client

    return Client(app_url, verbose=False)


def send_args(message: str, *, compare=False, mode="greedy", temperature=0.7, top_p=1.0, epsilon=0.09,
              delta=0.3, max_new=48, tree="small-16", seed=-1, colour=False, system="") -> tuple:
    return (message, system, compare, mode, temperature, top_p, epsilon, delta, max_new, tree, seed, colour)


def texts(chat) -> list[tuple[str, str]]:
    """[(role, text)] of a Chatbot value as the client returns it."""
    return [(m["role"], "".join(p["text"] for p in m["content"] if p.get("type") == "text")) for m in chat or []]


def ask(client, message: str, **kw):
    """Run /send to the end; return (all streamed outputs, the final output)."""
    job = client.submit(*send_args(message, **kw), api_name="/send")
    result = job.result(timeout=120)
    return job.outputs(), result


def test_streams_answer_with_stats(client):
    outputs, (chat, _, readout, _, _, status, raw, box) = ask(client, "hello there", max_new=300)
    replies = {texts(o[0])[-1][1] for o in outputs if o[0] and texts(o[0])[-1][0] == "assistant"}
    assert len(replies) >= 3, "the answer should arrive in several updates"
    assert texts(chat)[0] == ("user", "hello there")
    stats = raw["medusa"]
    assert stats["tokens"] > 0 and stats["tokens_per_second"] > 0 and stats["ttft"] > 0
    assert stats["mean_accepted"] >= 1 and stats["last_accepted"]
    assert "tokens/s" in readout and "Answer:" in readout  # live table, then the per-answer summary
    assert status.startswith("Ready")


def test_multi_turn_keeps_history(client):
    ask(client, "first question")
    _, (chat, *_) = ask(client, "second question")
    roles = [r for r, _ in texts(chat)]
    assert roles == ["user", "assistant", "user", "assistant"]
    assert texts(chat)[2][1] == "second question"


def test_stop_cancels_and_keeps_partial(client):
    job = client.submit(*send_args("tell me a long story", max_new=300), api_name="/send")
    deadline = time.time() + 60
    while time.time() < deadline:
        outs = job.outputs()
        if outs and outs[-1][6] and outs[-1][6]["medusa"] and outs[-1][6]["medusa"]["tokens"] > 0:
            break
        time.sleep(0.02)
    client.predict(api_name="/stop")
    chat, _, _, _, _, _, raw, _ = job.result(timeout=60)
    assert raw["medusa"]["finish_reason"] == "cancelled"
    assert raw["medusa"]["tokens"] < 300
    assert texts(chat)[-1][0] == "assistant" and texts(chat)[-1][1], "the partial answer stays in the chat"
    _, (chat, *_rest) = ask(client, "and now?")
    assert len(texts(chat)) == 4


@pytest.mark.parametrize("mode", ["greedy", "typical"])
def test_comparison_gives_both_answers_and_speedup(client, mode):
    _, (chat, base_chat, readout, base_readout, comparison, _, raw, _) = ask(
        client, "compare these", compare=True, mode=mode, max_new=64)
    medusa, baseline = texts(chat)[-1], texts(base_chat)[-1]
    assert medusa[0] == baseline[0] == "assistant" and medusa[1] and baseline[1]
    assert raw["baseline"]["tree"] == "baseline" and raw["medusa"]["tree"] == "small-16"
    assert "Plain decoding" in base_readout and "Medusa" in readout
    assert "Speedup:" in comparison
    if mode == "greedy":
        assert medusa[1] == baseline[1]
        assert "identical" in comparison
    else:
        assert "identical" not in comparison  # typical acceptance is not expected to match


def test_bad_inputs_give_messages_and_next_request_works(client):
    ask(client, "keep me")
    _, (chat, *_rest) = ask(client, "   ")
    assert "empty" in texts(chat)[-1][1]
    _, (chat, *_, box) = ask(client, "x", mode="typical", epsilon=1.5)
    assert "epsilon 1.5 is out of range" in texts(chat)[-1][1]
    assert box == "x", "a message that failed goes back into the box"
    _, (chat, *_rest) = ask(client, "y", mode="sample", top_p=0.0)
    assert "top_p" in texts(chat)[-1][1]
    _, (chat, *_rest) = ask(client, " ".join(str(i) for i in range(2000)))   # past the demo's 1024-token context
    assert "context" in texts(chat)[-1][1]
    _, (chat, *_, raw, _) = ask(client, "still there?")
    assert raw["medusa"]["tokens"] > 0
    sent = [t for r, t in texts(chat) if r == "user"]
    assert sent[0] == "keep me" and sent[-1] == "still there?", "the conversation is kept"


def test_regenerate_and_clear(client):
    ask(client, "once", mode="sample", temperature=1.0)
    chat, *_ = client.submit(*send_args("")[1:], api_name="/regenerate").result(timeout=120)
    assert [r for r, _ in texts(chat)] == ["user", "assistant"]
    chat, *_ = client.predict(api_name="/clear")
    assert not chat


def test_tabs_are_independent_and_queued(app_url):
    from gradio_client import Client

    first, second = Client(app_url, verbose=False), Client(app_url, verbose=False)
    # comparison mode: two passes of ~300 tokens keep the model busy for seconds
    long_job = first.submit(*send_args("mine", max_new=320, compare=True), api_name="/send")
    deadline = time.time() + 60
    while time.time() < deadline and not any(o[6] and o[6]["baseline"] for o in long_job.outputs()):
        time.sleep(0.02)
    outputs, (chat, *_rest) = ask(second, "yours")
    first_chat = long_job.result(timeout=120)[0]
    assert any("Queued" in (o[5] or "") for o in outputs), "the waiting tab is told it is queued"
    assert [t for r, t in texts(chat) if r == "user"] == ["yours"]
    assert [t for r, t in texts(first_chat) if r == "user"] == ["mine"]


# ---- the engine's pieces, in process

def test_incremental_detokenizer_matches_full_decode():
    """Byte-level BPE splits accents and emoji over several tokens: the streamed pieces must
    join to exactly the full decode, with no U+FFFD shown on the way."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from app.engine import Detokenizer

    corpus = ["héllo wörld, ça va? 😀 naïve café", "def f(x):\n    return x  # ✓", "日本語のテキスト and spaces  "]
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(corpus * 20, vocab_size=300, min_frequency=1)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    for text in corpus:
        ids = tokenizer(text)["input_ids"]
        detok = Detokenizer(tokenizer)
        pieces = [detok.add(i) for i in ids] + [detok.flush()]
        assert "".join(pieces) == tokenizer.decode(ids)
        assert not any("\ufffd" in p for p in pieces)


def test_head_colouring_leaves_code_alone():
    from app.engine import render_text

    segments = [("Use", True), (" this", True), (":\n```", False), ("py", True), ("\nx = 1", True),
                ("\n```\n", False), ("done", True), (" `a", True), ("b`", True), (" \\", False), ("x", True)]
    out = render_text(segments, colour=True)
    assert out.count('<span class="from-heads">') == 3  # "Use", " this", "done"; none inside code
    assert "```py\nx = 1\n```" in out.replace('<span class="from-heads">', "").replace("</span>", "")
    assert render_text(segments, colour=False) == "".join(s for s, _ in segments)


def test_sparkline_scales_to_tree_depth():
    from app.readout import sparkline

    assert sparkline([1, 3, 5], top=5) == "▁▄█"
    assert sparkline([]) == ""


def test_out_of_memory_frees_cache_and_next_answer_works(model_dirs, monkeypatch):
    import torch

    import app.engine as engine_module
    from app.engine import ChatEngine, Session, Settings
    from medusa_core.loading import LoadSpec, load

    backbone, heads = model_dirs
    engine = ChatEngine(load(LoadSpec(model=str(backbone), heads=str(heads), device="cpu")))
    session = Session()
    prompt = engine.prompt_ids([{"role": "user", "content": "hi"}], None)
    list(engine.answer(session, prompt, Settings(tree="small-8", max_new_tokens=8)))
    assert session.caches

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        yield

    real = engine_module.generate
    monkeypatch.setattr(engine_module, "generate", out_of_memory)
    last = list(engine.answer(session, prompt, Settings(tree="small-8", max_new_tokens=8)))[-1]
    assert last.error and last.error.startswith("out of GPU memory") and not session.caches
    monkeypatch.setattr(engine_module, "generate", real)
    last = list(engine.answer(session, prompt, Settings(tree="small-8", max_new_tokens=8)))[-1]
    assert last.error is None and last.stats.tokens == 8
