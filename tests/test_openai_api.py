"""The OpenAI-compatible API (app/openai_api.py) on `python launch.py` without CUDA, as an editor,
an agent or a script would use it: the official `openai` client streams and not, with the page's
engine's text and right usage counts; hostile input gets OpenAI-shaped 4xx and the server keeps
serving; concurrent and disconnecting clients share the page's line fairly; a soak keeps memory
flat and leaves no files. The key and the loading state are checked on a tiny in-process app."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
from served import free_port, launched_process

from app.engine import MEDUSA, ChatEngine
from app.openai_request import ApiError
from app.session import Session
from app.settings import Settings

openai = pytest.importorskip("openai")

MODEL = "SmolLM2-135M-Instruct"
FRANCE = "Complete the sentence: The capital of France is"   # a clear-margin greedy answer (test_default_model)


@pytest.fixture(scope="module")
def france_is_clear(default_loaded) -> None:
    """FRANCE's greedy answer is no near-tie on this machine: the tests that check what it says need it (test
    audit: they relied on test_default_model having checked it, and run alone nothing did)."""
    from test_default_model import clear_answer

    clear_answer(ChatEngine(default_loaded, max_new_tokens=32), FRANCE)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    """(base URL, process, its temp dir) of `python launch.py` on the CPU default, once the model is in."""
    root = tmp_path_factory.mktemp("api-app")
    tmp = root / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp), "GRADIO_TEMP_DIR": str(tmp / "gradio")}
    with launched_process(["--device", "cpu", "--max-new-tokens", "24"], root / "app.log", env=env) as (url, proc):
        deadline = time.time() + 240
        while not httpx.get(url + "v1/models").json()["data"]:
            assert time.time() < deadline, (root / "app.log").read_text()
            time.sleep(0.5)
        yield url.rstrip("/"), proc, tmp


@pytest.fixture(scope="module")
def client(app):
    return openai.OpenAI(base_url=app[0] + "/v1", api_key="unused", max_retries=0, timeout=120)


def engine_answer(engine: ChatEngine, question: str, max_new_tokens: int) -> tuple[str, list[int]]:
    prompt = engine.prompt_ids([{"role": "user", "content": question}], None)
    last = list(engine.answer(Session(), prompt, Settings(mode="greedy", max_new_tokens=max_new_tokens), (MEDUSA,)))[-1]
    return last.plain, list(last.tokens)


def test_the_openai_client_gets_the_engines_text_and_usage(client, default_loaded, france_is_clear):
    engine = ChatEngine(default_loaded, max_new_tokens=24)
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    # models.retrieve, which tools call to check an id, gets the same entry (it got a 404 for any id)
    assert client.models.retrieve(MODEL).model_dump() == models[0].model_dump()
    for other in ("gpt-4o", "HuggingFaceTB/SmolLM2-135M-Instruct"):      # a hub id's "/" included
        with pytest.raises(openai.NotFoundError, match=f'model "{other}" is not served here: use "{MODEL}"'):
            client.models.retrieve(other)
    # the clear-margin question twice: ending on its own, and cut at 4 tokens (a near-tie answer could
    # differ between this process and the server's, which may pick another CPU mode by its own timing)
    for question, limit in ((FRANCE, 24), (FRANCE, 4)):
        text, tokens = engine_answer(engine, question, limit)
        ended = tokens[-1] in default_loaded.stop_ids
        assert ended == (limit == 24), "one answer ends on its own, the other is cut at its limit"
        prompt_tokens = len(engine.prompt_ids([{"role": "user", "content": question}], None))
        whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                               temperature=0, max_tokens=limit)
        assert whole.choices[0].message.content == text
        assert whole.choices[0].finish_reason == ("stop" if ended else "length")
        assert whole.usage.prompt_tokens == prompt_tokens
        assert whole.usage.completion_tokens == len(tokens) - ended     # the end-of-turn token is not reply text
        assert whole.model_extra["medusa"]["tokens_per_step"] >= 1
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=limit,
            stream=True, stream_options={"include_usage": True}))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert "Paris" in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": FRANCE}],
                                                     temperature=0).choices[0].message.content


def test_stop_strings_cut_the_reply_and_plain_decoding_is_one_switch_away(client, france_is_clear):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": FRANCE}], temperature=0)
    full = client.chat.completions.create(**ask).choices[0].message.content
    cut = client.chat.completions.create(**ask, stop=[" Paris"])
    assert cut.choices[0].message.content == full[:full.index(" Paris")] and cut.choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(**ask, extra_body={"medusa": False})
    assert plain.choices[0].message.content == full and plain.model_extra["medusa"]["tree_size"] == 1
    # the response says which mode ran: sampling at temperature 0 is greedy, and gives the greedy text
    assert plain.model_extra["medusa"]["mode"] == "greedy"
    cold = client.chat.completions.create(**ask, extra_body={"medusa": {"mode": "sample"}})
    assert cold.model_extra["medusa"]["mode"] == "greedy" and cold.choices[0].message.content == full
    # top_k (local servers' field) reaches the sampler: sampling among one token is the greedy answer
    top1 = client.chat.completions.create(**{**ask, "temperature": 1.0, "seed": 3}, extra_body={"top_k": 1})
    assert top1.choices[0].message.content == full
    typical = client.chat.completions.create(**{**ask, "temperature": 0.7},
                                             extra_body={"medusa": {"mode": "typical", "epsilon": 0.1}})
    assert typical.choices[0].message.content.strip() and typical.model_extra["medusa"]["mode"] == "typical"
    # what clients send by default is taken: top_p beside temperature 0, OpenAI's own top_p and modalities
    defaults = client.chat.completions.create(**ask, top_p=0.95, modalities=["text"])
    assert defaults.choices[0].message.content == full
    client.chat.completions.create(**{**ask, "temperature": 0.7, "top_p": 1}, extra_body={"medusa": {"mode": "typical"}})


def test_a_seed_repeats_a_sampled_answer(client):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Write a short poem about the sea."}],
               temperature=1.0, max_tokens=24)
    answers = [client.chat.completions.create(**ask, seed=seed).choices[0].message.content for seed in (5, 5, 6, 7)]
    assert answers[0] == answers[1], "the same seed gave another answer"
    assert len(set(answers)) > 1, "three seeds gave one answer: the seed does not reach the sampler"
    # without a seed, one is drawn and reported, and it gives the answer again
    drawn = client.chat.completions.create(**ask)
    seed = drawn.model_extra["medusa"]["seed"]
    assert isinstance(seed, int), drawn.model_extra
    again = client.chat.completions.create(**ask, seed=seed)
    assert again.choices[0].message.content == drawn.choices[0].message.content
    # -1 draws one, as on the page (it was a fixed seed: the same answer every time)
    drawn = [client.chat.completions.create(**ask, seed=-1).model_extra["medusa"]["seed"] for _ in range(2)]
    assert -1 not in drawn and drawn[0] != drawn[1], drawn
    assert client.chat.completions.create(**{**ask, "temperature": 0}).model_extra["medusa"]["seed"] is None
    # typical acceptance draws nothing either (a seed given with it is refused, in HOSTILE; -1, "draw one", which
    # llama.cpp's clients send by default, is taken)
    typical = client.chat.completions.create(**ask, seed=-1, extra_body={"medusa": {"mode": "typical"}})
    assert typical.model_extra["medusa"]["seed"] is None


def test_the_fingerprint_changes_with_what_a_seeded_answer_depends_on(client):
    """API QA: a restart tuned another tree, and seed 42 sampled another answer with nothing in the response to say
    so. system_fingerprint, OpenAI's field for that, hashes the backbone, heads, weights, device and the tree's
    paths: the same for the same setup, another for another tree or for plain decoding."""
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}], temperature=1.0, max_tokens=4,
               seed=5)
    # (the default tree is this machine's tuning, which may have the paths of one of the two named)
    prints = [client.chat.completions.create(**ask, **extra).system_fingerprint
              for extra in ({}, {}, {"extra_body": {"medusa": {"tree": "chain-1"}}},
                            {"extra_body": {"medusa": {"tree": "small-8"}}}, {"extra_body": {"medusa": False}})]
    assert all(isinstance(p, str) and p.startswith("fp_") for p in prints), prints
    assert prints[0] == prints[1] and len(set(prints[2:])) == 3, prints
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].system_fingerprint == chunks[-2].system_fingerprint == prints[0], chunks[-2:]


HOSTILE = [
    ({"model": MODEL, "messages": []}, 400, "messages"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 1_000_000}]}, 413, "bytes"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x" * 600_000}]}, 400, "context"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hello " * 9000}]}, 400,      # tokenized: > 8192
     "context leaves for a reply: shorten them"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hello " * 8000}], "max_tokens": 1000}, 400,
     "tokens, the reply 1,000 and the last step's tree "),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}, 400, "max_tokens"),
    # values as the client wrote them in JSON, not as Python shows them (True, NoneType)
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": True}, 400,
     "max_tokens true is not an integer"),
    ({"model": MODEL, "messages": "hi"}, 400, 'messages is a string "hi": give a list of {"role": ..., "content": ...}'),
    ({"model": MODEL, "messages": [{"role": "user", "content": None}]}, 400, "message 0 content is null"),
    ({"model": MODEL, "messages": ["hi"]}, 400, 'message 0 is a string: give {"role": ..., "content": ...} objects'),
    # a mode and a temperature that disagree are refused, not settled silently
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "medusa": {"mode": "greedy"}},
     400, 'medusa.mode "greedy" with temperature 0.7'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 1e9}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
     'role "wizard": use one of system, user, assistant, developer'),
    ({"model": MODEL, "messages": [{"role": None, "content": "hi"}]}, 400, "message 0 has role null"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": None}]}]}, 400, "a part of type null"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [["hi"]]}]}, 400, "message 0 has an array as a part"),
    # a field a message or a part does not take is refused by name, as the request's own (QA: read past)
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi", "bogus": True}]}, 400,
     "message 0 has the field 'bogus' (true): a message here takes role and content: remove it"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": "ann"}]}, 400,
     "message 0 has the field 'name' (\"ann\"): this chat has no participant names: remove it"),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"text": "hi"}]}]}, 400,
     'message 0 has a part without "type" ({"text": "hi"}): give {"type": "text", "text": "..."}'),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "foo": 1}]}]}, 400,
     "message 0 has a text part with the field 'foo': remove it"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "medusa": {"mode": "typical", "delta": "x"}},
     400, 'medusa.delta "x" is not a number: use a value in (0, 1]'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": True}, 400, "n true is not a number"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": "1"}, 400,
     'n "1" is not a number: give n=1'),
    # stream_options is checked as the top level is: "yes" was taken as true, and a misspelt key went unsaid
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
      "stream_options": {"include_usage": "yes"}}, 400, 'stream_options.include_usage "yes": give true or false'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True,
      "stream_options": {"include_usage": True, "usage": True}}, 400, "unknown field 'stream_options.usage'"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream_options": False}, 400,
     "stream_options false: give an object"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "medusa": True}, 400, "medusa true: "),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "medusa": {"tree": 5}}, 400, "medusa.tree 5: "),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": [1]}, 400, "stop [1]: "),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ""}, 400, 'stop "": '),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": True}},
     400, "stream_options is only taken with stream: true"),
    # each names its field and the value it got
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, 400,
     'stream "yes": give true or false'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": "x"}, 400,
     'stream_options "x": give an object, e.g. {"include_usage": true}'),
    ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "text only"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n=1"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 0}, 400, "give n=1"),   # not "1 to 128"
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 200}, 400, "give n=1"),
    ({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]}, 404, 'model "gpt-4o" is not served here'),
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ({"model": 5, "messages": [{"role": "user", "content": "hi"}]}, 400, "model 5 is not a string: give the id"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}] * 10_000}, 400, "10,000"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "medusa": {"tree": "no-such-tree"}}, 400, "tree"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "medusa": {"mode": "warp"}}, 400, "warp"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7,
      "medusa": {"mode": "typical", "epsilon": 0}}, 400, "medusa.epsilon 0 is out of range: use a value in (0, 1] (at 0 "
                                                          "every guess the heads make is kept)"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "medusa": {"mode": "typical", "delta": 5}}, 400,
     "medusa.delta 5 is out of range: use a value in (0, 1]"),
    # a setting the decoding asked for never reads is refused by name, as the page greys it out (review: accepted
    # and unused, so a client tuning it saw nothing change)
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "medusa": {"epsilon": 0.5}}, 400,
     'medusa.epsilon sets typical acceptance, which mode "sample" does not run: remove it, or give "mode": "typical"'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "medusa": {"mode": "off", "delta": 0.5}}, 400,
     'medusa.delta sets typical acceptance, which plain decoding (mode "off") does not run'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "medusa": {"mode": "off", "tree": "chain-1"}},
     400, 'medusa.tree "chain-1" with plain decoding (mode "off"): plain decoding runs no tree: remove the tree'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "top_p": 0.1,
      "medusa": {"mode": "typical"}}, 400, 'top_p 0.1 does nothing under medusa.mode "typical", which keeps tokens by '
                                           'epsilon and delta: remove it, or use mode "sample"'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_k": 40, "medusa": {"mode": "typical"}},
     400, 'top_k 40 does nothing under medusa.mode "typical"'),
    # API QA: greedy ran with them unread; the seed was taken and the response's was null
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0,
      "medusa": {"mode": "typical", "epsilon": 0.5}}, 400,
     "medusa.epsilon 0.5 does nothing at temperature 0, where typical acceptance keeps exactly the argmax tokens "
     "(greedy): give a temperature above 0, or remove it"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": 0.7, "seed": 3,
      "medusa": {"mode": "typical"}}, 400,
     'seed 3 does nothing under medusa.mode "typical", which draws no random number: remove it, or use mode "sample"'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "modalities": ["text", "audio"]}, 400,
     'modalities ["text", "audio"]: this server answers in text only: remove it, or give ["text"]'),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "medusa": {"treee": "small-8"}}, 400,
     "unknown field 'medusa.treee': remove it (\"medusa\" takes tree, mode, epsilon, delta)"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, 400,
     'stop ["a", "b", "c", "d", "e"]: '),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "bogus_param": 1}, 400, "'bogus_param'"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "min_p": 0.1}, 400, "unknown field 'min_p'"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_k": -1}, 400, "top_k"),
    ({"model": MODEL, "messages": [{"role": "user", "content": " "}]}, 400, "the last user message, is empty"),
    ({"model": MODEL, "messages": [{"role": "assistant", "content": "hello"}]}, 400, "no user message"),
    ({"model": MODEL, "messages": [{"role": "user"}]}, 400, "message 0 has no content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "max_completion_tokens": 7},
     400, "disagree"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "seed": "abc"}, 400,
     "from -9,223,372,036,854,775,808 to 9,223,372,036,854,775,807"),
]
RAW = [
    (b'{"model": "SmolLM2-135M-Instruct", "messages": [', 400, "not valid JSON"),
    (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "UTF-8"),
    # each named by its field (review: "the number 1e400 ..." with param null, NaN as invalid JSON)
    (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     400, "temperature NaN, which JSON does not allow: give a finite number"),
    (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": Infinity}',
     400, "max_tokens Infinity, which JSON does not allow"),
    # past a float's range: it read as inf and was named "Infinity", which the client never wrote
    (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1e400}',
     400, "max_tokens 1e400 is beyond a float's range: give a number the field's range allows"),
    (b'{"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "hi"}], "medusa": {"delta": -1e999}}',
     400, "medusa.delta -1e999 is beyond a float's range"),
    (b'["a list"]', 400, "object"),
    # Python's parser gives up on deep nesting: a bare 500 and a traceback before
    (b'{"model": "SmolLM2-135M-Instruct", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, "too deeply"),
]


def test_an_integer_past_a_float_or_a_lone_surrogate_is_refused_in_one_line():
    """Review: an integer of 309 digits in a number field, and a string cut inside an emoji ("\\ud83d", valid JSON),
    made bare 500s; an id cut at 40 characters without a mark read as another id."""
    from app.openai_request import number, read_body
    from medusa_core.loading.chat_format import json_value

    huge = 10 ** 400
    for integer in (True, False):
        with pytest.raises(ApiError, match=f"^max_tokens {json_value(huge)} is out of range: "):
            number({"max_tokens": huge}, "max_tokens", 1, 1, 4096, integer=integer)
    for body in (b'{"messages": [{"role": "user", "content": "I like \\ud83d"}]}', b'{"model": "gpt-\\ud83d"}'):
        with pytest.raises(ApiError, match=r"^the body holds a lone UTF-16 surrogate \('\\ud83d'\), which is no "
                                           r"character: send whole characters \(a string cut inside an emoji\?\)$"):
            read_body(body)
    assert read_body('{"content": "😀"}'.encode()) == {"content": "😀"}      # a whole one is text
    long_id = "hf.co/bartowski/Meta-Llama-3.1-8B-Instruct-GGUF:Q4_K_M"
    assert json_value(long_id) == '"hf.co/bartowski/Meta-Llama-3.1-8B-Inst…' and len(json_value(long_id)) == 40
    assert json_value("x" * 38) == f'"{"x" * 38}"'      # 40 characters with its quotes: whole


def test_a_repeated_key_takes_its_last_value_even_after_a_number_past_a_float():
    """JSON's last value wins, as everywhere else in the body: the first one, unreadable, made a bare 500 (review)."""
    from app.openai_request import read_body

    assert read_body(b'{"temperature": 1e400, "temperature": 1}') == {"temperature": 1.0}
    assert read_body(b'{"medusa": {"delta": NaN, "delta": 0.2}}') == {"medusa": {"delta": 0.2}}
    with pytest.raises(ApiError, match="temperature 1e400 is beyond a float's range"):
        read_body(b'{"temperature": 1, "temperature": 1e400}')


def test_a_fault_outside_the_answer_reaches_the_client_and_the_console(capsys):
    """The API's worker thread: a fault before the answer's own handling (a cache's error) ends the request with
    one line for the client, and the console keeps the traceback, as the page's answers do (review: none)."""
    from types import SimpleNamespace

    from app.openai_api import generate_updates

    class Faulty:
        def answer(self, *args):
            raise RuntimeError("no room for the cache")
            yield

    emitted = []
    generate_updates(Faulty(), Session(), [1, 2], SimpleNamespace(settings=None, passes=(MEDUSA,)), emitted.append)
    assert emitted[-1] is None and emitted[0].error == "generation failed: RuntimeError: no room for the cache"
    assert "Traceback" in capsys.readouterr().err


def assert_openai_error(response: httpx.Response, status: int, says: str) -> None:
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert says in error["message"] and "\n" not in error["message"], error["message"]


def test_hostile_input_gets_openai_shaped_errors_and_the_server_keeps_serving(app, france_is_clear):
    url = app[0] + "/v1/chat/completions"
    with httpx.Client(timeout=60) as http:
        for body, status, says in HOSTILE:
            assert_openai_error(http.post(url, json=body), status, says)
        for raw, status, says in RAW:
            assert_openai_error(http.post(url, content=raw, headers={"content-type": "application/json"}), status, says)
        huge = http.post(url, content=b'{"model": "SmolLM2-135M-Instruct", "medusa": {"delta": -1e999}}',
                         headers={"content-type": "application/json"})
        assert huge.json()["error"]["param"] == "medusa.delta", huge.text
        # what is not served says what is, as an OpenAI error (a legacy client's /v1/completions, a GET)
        assert_openai_error(http.post(app[0] + "/v1/completions", json={"prompt": "hi"}), 404,
                            "POST /v1/completions is not served here: use POST /v1/chat/completions")
        refused = http.get(url)
        assert_openai_error(refused, 405, "GET /v1/chat/completions is not served: use POST")
        assert refused.headers["allow"] == "POST"
        # a served path with another method is refused as one (DELETE on a model said "not served here"; OPTIONS got
        # FastAPI's own body)
        for method, path, allow in (("DELETE", f"/v1/models/{MODEL}", "GET, HEAD"),
                                    ("OPTIONS", "/v1/chat/completions", "POST")):
            refused = http.request(method, app[0] + path)
            assert_openai_error(refused, 405, f"{method} {path} is not served: use {allow.split(',')[0]} {path}")
            assert refused.headers["allow"] == allow
        # HEAD is a GET without the body, as HTTP has it (a health check's HEAD got 405)
        for path in ("/v1/models", "/v1/models/", f"/v1/models/{MODEL}"):
            probe = http.head(app[0] + path)
            assert (probe.status_code, probe.content) == (200, b""), path
        assert http.get(app[0] + "/v1/models/").json()["data"][0]["id"] == MODEL    # a trailing slash is the same
        assert http.get(app[0] + f"/v1/models/{MODEL}/").json()["id"] == MODEL
        ok = http.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": FRANCE}], "temperature": 0})
        assert ok.status_code == 200 and "Paris" in ok.json()["choices"][0]["message"]["content"]
        # a developer message is a system message (OpenAI's newer name), not the template's default one
        briefed = [http.post(url, json={"model": MODEL, "temperature": 0, "max_tokens": 2,
                                        "messages": [{"role": role, "content": "Be brief."},
                                                     {"role": "user", "content": FRANCE}]}).json()["usage"]
                   for role in ("developer", "system")]
        assert briefed[0] == briefed[1] and briefed[0]["prompt_tokens"] != ok.json()["usage"]["prompt_tokens"]
        # a reply sent back as the openai client dumps it: its null fields are taken, and change nothing
        reply = {"role": "assistant", "content": "Paris."}
        dumped = {**reply, "refusal": None, "annotations": None, "audio": None, "function_call": None,
                  "tool_calls": None}
        usages = [http.post(url, json={"model": MODEL, "temperature": 0, "max_tokens": 2, "messages": [
            {"role": "user", "content": FRANCE}, said, {"role": "user", "content": "And Spain?"}]}).json()["usage"]
            for said in (reply, dumped)]
        assert usages[0] == usages[1], usages


def test_a_body_over_the_limit_is_refused_before_it_is_read(app):
    """By its declared length, or as a chunked body arrives: a 300 MB body was read whole first (its memory
    and more) and only then refused."""
    url = app[0] + "/v1/chat/completions"
    sent = []

    def chunks():
        for _ in range(400):               # 400 MB if it were all read
            sent.append(1)
            yield b" " * 1_000_000

    import socket
    from urllib.parse import urlsplit

    # a raw request: clients will not declare a length they do not send; the answer comes with no body sent
    where = urlsplit(app[0])
    with socket.create_connection((where.hostname, where.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 500000000\r\n\r\n")
        answer = b""
        while b"}}" not in answer:
            got = sock.recv(65536)
            assert got, answer
            answer += got
    assert answer.startswith(b"HTTP/1.1 413") and b"the request is 500,000,000 bytes; at most 1,000,000 are read" in answer
    # chunked, no length declared: the client writes all of it (httpx reads the answer after), the server keeps
    # none of it
    before = rss_mib(app[1].pid)
    with httpx.Client(timeout=60) as http:
        chunked = http.post(url, content=chunks(), headers={"content-type": "application/json"})
    assert_openai_error(chunked, 413, "the request is more than 1,000,000 bytes")
    assert len(sent) == 400 and rss_mib(app[1].pid) - before < 100, "the server held the body"


def test_usage_counts_the_tokens_up_to_the_stop_string(client):
    # one step accepts several tokens, and the run keeps stepping until it is told to stop: usage counted one
    # token past the stop (stop "1": content "", 2 completion tokens)
    ask = dict(model=MODEL, messages=[{"role": "user", "content": "List three colours, numbered."}], temperature=0,
               max_tokens=24)
    full = client.chat.completions.create(**ask).choices[0].message.content
    for stop in {full[:1], full.split()[1] if len(full.split()) > 1 else full[:2]}:
        for stream in (False, True):
            if stream:
                chunks = list(client.chat.completions.create(**ask, stop=[stop], stream=True,
                                                             stream_options={"include_usage": True}))
                text, usage = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage
            else:
                cut = client.chat.completions.create(**ask, stop=[stop])
                text, usage = cut.choices[0].message.content, cut.usage
            assert text == full[:full.index(stop)]
            # the fewest tokens of the reply whose text holds the stop string: the answer cut at that many holds it,
            # cut at one fewer it does not
            n = usage.completion_tokens
            assert stop in client.chat.completions.create(**{**ask, "max_tokens": n}).choices[0].message.content
            if n > 1:
                shorter = client.chat.completions.create(**{**ask, "max_tokens": n - 1}).choices[0].message.content
                assert stop not in shorter, (stop, stream, n)


def test_a_reply_too_long_for_the_context_is_told_numbers_that_add_up(client):
    """The refusal's figures add up past the context, and the max_tokens it suggests is taken (31 tokens and a
    reply of 8,159 were said to be more than 8,192: the room the last step's tree needs went unsaid)."""
    import re

    ask = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**ask, max_tokens=8192 - 20)
    said = refused.value.body["message"]
    figures = re.fullmatch(r"the messages take ([\d,]+) tokens, the reply 8,172 and the last step's tree ([\d,]+) "
                           r"\(([\d,]+) in all\), more than the model's 8,192-token context: give max_tokens ([\d,]+) "
                           r"or less, or shorten the messages", said)
    assert figures, said
    prompt, tree, total, room = (int(f.replace(",", "")) for f in figures.groups())
    assert prompt + 8172 + tree == total > 8192 and prompt + room + tree == 8192, said
    assert client.chat.completions.create(**ask, max_tokens=room).choices[0].message.content


def test_an_unknown_tree_is_told_the_trees_a_request_may_name(client):
    """Not a .json path (the API reads no files) but the page's list, baseline and the default tree included."""
    ask = dict(model=MODEL, messages=[{"role": "user", "content": FRANCE}], temperature=0, max_tokens=2)
    default_tree = client.chat.completions.create(**ask).model_extra["medusa"]["tree"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(**ask, extra_body={"medusa": {"tree": "no-such-tree"}})
    message = refused.value.body["message"]
    assert "'no-such-tree'" in message and ".json file" not in message and "path" not in message, message
    for offered in ("baseline", default_tree):
        assert offered in message, message
        assert client.chat.completions.create(**ask, extra_body={"medusa": {"tree": offered}}).choices


def test_a_one_token_answer_reports_no_speed_rather_than_zero(client):
    """One token comes from the prompt's pass: no decoding step timed it, so the figures are null (they read
    0.0 tokens/s, where the page says "no decoding step after the first token")."""
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           temperature=0, max_tokens=1)
    assert whole.usage.completion_tokens == 1
    medusa = whole.model_extra["medusa"]
    assert medusa["tokens_per_second"] is None and medusa["tokens_per_step"] is None, medusa
    assert medusa["time_to_first_token"] > 0, medusa


def test_null_medusa_settings_mean_the_default(client):
    ask = dict(model=MODEL, messages=[{"role": "user", "content": FRANCE}], temperature=0, max_tokens=8)
    default = client.chat.completions.create(**ask)
    for medusa in (None, {"tree": None, "mode": None, "epsilon": None, "delta": None}):
        answer = client.chat.completions.create(**ask, extra_body={"medusa": medusa})
        assert answer.choices[0].message.content == default.choices[0].message.content
        assert answer.model_extra["medusa"]["tree"] == default.model_extra["medusa"]["tree"]
    # stream too: null is not streaming (it was refused, alone among the fields)
    answer = client.chat.completions.create(**ask, extra_body={"stream": None})
    assert answer.choices[0].message.content == default.choices[0].message.content


def test_a_greedy_request_gets_the_pages_answer_and_the_figures_share_their_names(app, client):
    # README: "Greedy requests (temperature: 0) get exactly the page's answer"; one process, one engine
    from gradio_client import Client

    *_, raw, _box = Client(app[0] + "/", verbose=False).predict(
        message=FRANCE, compare=False, mode="greedy", max_new_tokens=12, api_name="/send")
    whole = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": FRANCE}],
                                           temperature=0, max_tokens=12)
    assert whole.choices[0].message.content == raw["reply"]
    medusa = whole.model_extra["medusa"]
    # a script moving between the two APIs reads each figure under one name (the page said "mean_accepted"
    # and "ttft" only)
    for key in ("tree", "tree_size", "tokens_per_step", "tokens_per_second", "time_to_first_token"):
        assert key in raw["medusa"], key
    assert (raw["medusa"]["tree"], raw["medusa"]["tree_size"]) == (medusa["tree"], medusa["tree_size"])
    assert raw["medusa"]["tokens_per_step"] == pytest.approx(medusa["tokens_per_step"], abs=1e-3)
    # a temperature too small to tell any logits apart samples as greedy (1e-40 gave NaN and special tokens)
    tiny = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": FRANCE}],
                                          temperature=1e-40, max_tokens=12)
    assert tiny.choices[0].message.content == raw["reply"] and tiny.model_extra["medusa"]["mode"] == "greedy"
    both = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": FRANCE}], temperature=1e-6,
                                          max_tokens=12, extra_body={"medusa": {"mode": "greedy"}})   # they agree
    assert both.choices[0].message.content == raw["reply"]


def test_concurrent_clients_and_a_page_request_all_complete_in_order(app, client):
    from gradio_client import Client

    finished, answered, errors = [], [], []       # answered: the order of first text, the line's
    in_line = [threading.Event() for _ in range(4)]

    def api(n: int) -> None:
        try:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count to {n}."}], "temperature": 0,
                    "max_tokens": 16, "stream": True}
            text = ""
            with httpx.stream("POST", app[0] + "/v1/chat/completions", json=body, timeout=300) as response:
                for line in response.iter_lines():
                    if line.startswith(": waiting for the model"):
                        in_line[n - 1].set()        # behind the others: in the line
                    elif line.startswith("data: {"):
                        piece = json.loads(line[6:])["choices"]
                        text += (piece[0]["delta"].get("content") or "") if piece else ""
                        if text and f"api{n}" not in answered:
                            answered.append(f"api{n}")
                            in_line[n - 1].set()    # generating: at the line's head
            assert text.strip()
            finished.append(f"api{n}")
        except Exception as err:   # collected: a failing thread must fail the test, not vanish
            errors.append(repr(err))
        finally:
            in_line[n - 1].set()

    def page() -> None:
        try:
            result = Client(app[0] + "/", verbose=False).predict(message="Hello!", compare=False, max_new_tokens=16,
                                                                 api_name="/send")
            assert result[-2]["reply"].strip()
            finished.append("page")
        except Exception as err:
            errors.append(repr(err))

    threads = [threading.Thread(target=api, args=(n,)) for n in range(1, 5)] + [threading.Thread(target=page)]
    for t, joined in zip(threads, [*in_line, None]):
        t.start()
        if joined is not None:   # the next arrives once this one is in the line (audit: sleeps set the order)
            assert joined.wait(120), "a request never reached the line"
    for t in threads:
        t.join(300)
    assert not errors, errors
    # first come, first served: each began answering in its place, and the page, last in, ended last
    assert answered == ["api1", "api2", "api3", "api4"] and finished[-1] == "page", (answered, finished)


def slow_steps(slot) -> list[int]:
    """Every decoder forward of the loaded model takes 20 ms more, and is counted: an answer of N tokens (plain
    decoding) then takes N x 20 ms at least on any machine, and the count says how much was generated."""
    forwards: list[int] = []

    def hook(*args) -> None:
        forwards.append(1)
        time.sleep(0.02)

    slot.engine.model.get_decoder().register_forward_hook(hook)
    return forwards


LONG = {"model": "backbone", "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 400,
        "medusa": False, "temperature": 0}     # greedy: a sampled answer from the tiny model could end at once


def test_clients_that_disconnect_free_the_line(tiny_app):
    """Streamed clients that leave after their first piece stop their generation at its next step: had they kept
    generating, 5 x 400 tokens would hold the line for 40 s here. Counted in decoder steps, not timed (test audit:
    a wall-clock bound held on one machine's speed)."""
    url, slot, spec, _ = tiny_app
    slot.start(spec)
    assert slot.wait(60).phase == "ready"
    forwards = slow_steps(slot)

    def leave_after_first_chunk() -> None:
        with httpx.Client(timeout=60) as http, \
                http.stream("POST", url + "/v1/chat/completions", json={**LONG, "stream": True}) as response:
            next(response.iter_lines())

    threads = [threading.Thread(target=leave_after_first_chunk) for _ in range(5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    answer = httpx.post(url + "/v1/chat/completions", json={**LONG, "max_tokens": 4}, timeout=120).json()
    assert answer["usage"]["completion_tokens"] == 4, answer
    assert len(forwards) < 400, f"{len(forwards)} steps ran: the clients that left kept generating"


def test_whole_answers_whose_clients_gave_up_free_the_line(tiny_app):
    """A client that times out on a whole (not streamed) answer, as the openai client and editors do before a
    retry, stops its generation: it ran to its max_tokens while the requests behind it waited (disconnects
    were looked for only between pieces slower than the poll, and a running answer's pieces never were)."""
    url, slot, spec, _ = tiny_app
    slot.start(spec)
    assert slot.wait(60).phase == "ready"
    forwards = slow_steps(slot)           # 400 tokens: 8 s at least, against the clients' 1.5 s
    gave_up = []

    def give_up() -> None:
        with httpx.Client(timeout=1.5) as http:
            try:
                http.post(url + "/v1/chat/completions", json=LONG)
            except httpx.ReadTimeout:
                gave_up.append(True)

    threads = [threading.Thread(target=give_up) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(gave_up) == 4
    answer = httpx.post(url + "/v1/chat/completions", json={**LONG, "max_tokens": 4}, timeout=120).json()
    assert answer["usage"]["completion_tokens"] == 4, answer
    assert len(forwards) < 400, f"{len(forwards)} steps ran: the clients that gave up kept generating"


def test_a_conversation_sent_again_each_turn_reads_only_its_new_part(tiny_app):
    """An API client sends the whole conversation every turn. Each request decoded in a cache of its own, so every
    turn read the whole conversation again (seconds on a CPU, and on CUDA a graph captured again); the requests
    now share theirs, and a turn reads only what the cache does not hold. Counted in positions the decoder read."""
    url, slot, spec, _ = tiny_app
    slot.start(spec)
    assert slot.wait(60).phase == "ready"
    read: list[int] = []
    slot.engine.model.get_decoder().register_forward_hook(
        lambda module, args, out: read.append(out.last_hidden_state.shape[1]))
    messages = [{"role": "user", "content": "a long story about a cat"}]
    body = {"model": "backbone", "max_tokens": 8, "temperature": 0}
    with httpx.Client(timeout=120) as http:
        first = http.post(url + "/v1/chat/completions", json={**body, "messages": messages}).json()
        messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "and then?"}]
        read.clear()
        second = http.post(url + "/v1/chat/completions", json={**body, "messages": messages}).json()
    grown = second["usage"]["prompt_tokens"] - first["usage"]["prompt_tokens"]
    assert 0 < read[0] <= grown, f"read {read[0]} of the {second['usage']['prompt_tokens']} prompt tokens"


def test_a_soak_keeps_memory_flat_and_leaves_no_files(app):
    url, proc, tmp = app
    before_files = {p for p in tmp.rglob("*")}
    curve = []
    with httpx.Client(timeout=60) as http:
        for i in range(200):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"Say the number {i}."}], "max_tokens": 3,
                    "temperature": 0.7, "seed": i, "stream": i % 2 == 0}
            response = http.post(url + "/v1/chat/completions", json=body)
            assert response.status_code == 200
            if body["stream"]:
                events = [line for line in response.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]" and all(json.loads(e[6:])["object"] == "chat.completion.chunk"
                                                            for e in events[:-1])
            else:
                assert response.json()["object"] == "chat.completion"
            if i % 20 == 19:
                curve.append(rss_mib(proc.pid))
    print(f"RSS every 20 requests (MiB): {[round(r) for r in curve]}")
    assert max(curve[1:]) - curve[1] < 40, f"memory grows under load: {curve}"
    assert {p for p in tmp.rglob("*")} == before_files, "the API left files behind"


# ---- on a tiny model in this process: the key, and a request while a model loads

@pytest.fixture
def tiny_app(tiny_dirs, request):
    """A URL serving the tiny checkpoint with the API (key from the test's param), and its slot."""
    from app.models import ModelSlot
    from app.openai_api import api_routes
    from app.ui import build_ui, start_queue
    from medusa_core.loading.load import load
    from medusa_core.loading.spec import LoadSpec

    gate = threading.Event()
    gate.set()

    def loader(spec, progress):
        gate.wait(60)
        return load(spec, progress)

    backbone, heads = tiny_dirs
    slot = ModelSlot(loader=loader, log=lambda line: None)
    spec = LoadSpec(model=str(backbone), heads=str(heads), device="cpu")
    demo = build_ui(slot, base_spec=spec)
    start_queue(demo)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                app_kwargs={"routes": api_routes(slot, getattr(request, "param", None))})
    try:
        yield f"http://127.0.0.1:{port}", slot, spec, gate
    finally:
        demo.close()


@pytest.mark.parametrize("tiny_app", ["s3cret"], indirect=True)
def test_a_key_guards_the_api(tiny_app):
    url, slot, spec, _ = tiny_app
    slot.start(spec)
    assert slot.wait(60).phase == "ready"
    body = {"model": "backbone", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(timeout=60) as http:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}, {"Authorization": "Bearer s3cret2"}):
            assert_openai_error(http.post(url + "/v1/chat/completions", json=body, headers=headers), 401, "API key")
            for models in ("/v1/models", "/v1/models/", "/v1/models/backbone", "/v1/models/other"):
                assert_openai_error(http.get(url + models, headers=headers), 401, "API key")
        good = {"Authorization": "Bearer s3cret"}
        assert http.get(url + "/v1/models", headers=good).json()["data"][0]["id"] == "backbone"
        assert http.get(url + "/v1/models/backbone", headers=good).json()["id"] == "backbone"
        # the scheme's name is case-insensitive (a client sending "bearer" got 401)
        assert http.get(url + "/v1/models", headers={"Authorization": "bearer s3cret"}).status_code == 200
        assert http.post(url + "/v1/chat/completions", json=body, headers=good).status_code == 200


def test_the_model_list_says_which_tree_runs_and_null_without_heads(tiny_app):
    """GET /v1/models' "medusa" names the tree that runs; a model without heads has null there (it was "")."""
    from dataclasses import replace

    url, slot, spec, _ = tiny_app
    slot.start(spec)
    assert slot.wait(60).phase == "ready"
    assert "tree" in httpx.get(url + "/v1/models").json()["data"][0]["medusa"]
    slot.start(replace(spec, heads=None))
    assert slot.wait(60).phase == "ready"
    listed = httpx.get(url + "/v1/models").json()["data"][0]
    assert listed["id"] == "backbone" and listed["medusa"] is None, listed


def test_a_stream_whose_model_is_unloaded_ends_with_an_error_that_says_so(tiny_app):
    """It ended on "generation failed: RuntimeError: cannot schedule new futures after shutdown"; after
    some text it must not end as a normal "stop" either."""
    url, slot, spec, _ = tiny_app
    slot.start(spec)
    assert slot.wait(60).phase == "ready"
    slot.engine.model.get_decoder().register_forward_hook(lambda *args: time.sleep(0.02))   # unloaded mid-answer
    # greedy: a sampled answer (the default temperature, 1) from the tiny model could draw its end-of-turn token
    # within three pieces, and the test then saw a normal end instead of the unload
    body = {"model": "backbone", "messages": [{"role": "user", "content": "a long story"}], "max_tokens": 600,
            "stream": True, "medusa": False, "temperature": 0}
    events = []
    with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
                if sum(bool(e.get("choices") and e["choices"][0]["delta"].get("content")) for e in events) == 3:
                    slot.unload()
    assert events and events[-1].get("error", {}).get("message") == "stopped: the model was unloaded", events[-3:]
    assert not any(e.get("choices") and e["choices"][0]["finish_reason"] for e in events)


def test_a_request_naming_a_tree_to_build_never_holds_up_the_server(tiny_app):
    """A tree named in a request and not yet built is built on the model thread, behind whatever runs
    there: the request waits for it, the rest of the server does not (the event loop waited, so every
    page stream, Stop and request froze). If another model replaces this one meanwhile, the request is
    told so in an OpenAI-shaped 503 (a bare 500 and a traceback)."""
    url, slot, spec, _ = tiny_app
    slot.start(spec)
    assert slot.wait(60).phase == "ready"
    engine, busy = slot.engine, threading.Event()
    assert "cartesian-2x1" not in {name for _, name in engine.trees.choices}
    hold = threading.Thread(target=engine.on_model_thread, args=(busy.wait, 60))   # a long step runs
    hold.start()
    # the request's tree build, handed to the model thread behind that step (test audit: a sleep stood for it, and
    # had the request not yet arrived, the probe below passed without testing anything)
    queued, real = threading.Event(), engine.on_model_thread
    engine.on_model_thread = lambda fn, *args: queued.set() or real(fn, *args)
    body = {"model": "backbone", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "medusa": {"tree": "cartesian-2x1"}}
    answers = []
    asking = threading.Thread(target=lambda: answers.append(httpx.post(url + "/v1/chat/completions", json=body,
                                                                        timeout=90)))
    asking.start()
    try:
        assert queued.wait(30), "the request never asked the model thread for its tree"
        assert httpx.get(url + "/v1/models", timeout=20).status_code == 200, "the server waited for the tree"
    finally:
        busy.set()
        asking.join(90)
        hold.join(60)
    assert answers[0].status_code == 200, answers[0].text
    from app.openai_request import ApiError, parse_chat

    engine.close("another model was loaded: ask again to have it answer")
    with pytest.raises(ApiError) as refused:
        parse_chat({**body, "medusa": {"tree": "cartesian-2x2"}}, engine, "backbone")
    assert (refused.value.status, refused.value.message) == (503, "another model was loaded: ask again to have it answer")


def test_a_request_while_the_model_loads_is_told_so_at_once(tiny_app):
    url, slot, spec, gate = tiny_app
    gate.clear()
    slot.start(spec)
    body = {"model": "backbone", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    try:
        with httpx.Client(timeout=10) as http:
            started = time.perf_counter()
            refused = http.post(url + "/v1/chat/completions", json=body)
            assert_openai_error(refused, 503, "loading")
            assert time.perf_counter() - started < 5
            # when to ask again: the openai client waits Retry-After between its retries (it gave up in 1.5 s)
            assert int(refused.headers["retry-after"]) >= 5
            assert http.get(url + "/v1/models").json()["data"] == []
            # a tool checking its model id at start is told the model is loading, not that the id is wrong
            assert_openai_error(http.get(url + "/v1/models/backbone"), 503, "the model is loading")
    finally:
        gate.set()
    assert slot.wait(60).phase == "ready"
    with httpx.Client(timeout=60) as http:
        assert http.post(url + "/v1/chat/completions", json=body).status_code == 200


def test_after_a_failed_start_the_api_gives_the_loads_error(tiny_app, tmp_path):
    """A start that failed (here a directory with no model) is explained by the API as by the page."""
    from dataclasses import replace

    url, slot, spec, _ = tiny_app
    slot.start(replace(spec, model=str(tmp_path)))
    assert slot.wait(60).phase == "failed"
    body = {"model": "backbone", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(timeout=10) as http:
        assert_openai_error(http.post(url + "/v1/chat/completions", json=body), 503, "has no config.json")


def test_a_queued_stream_tells_its_place_without_chattering(monkeypatch):
    """The queue reports a waiting request's place every 0.25 s; the stream sends a comment when the
    place changes and otherwise one per heartbeat (it sent one per report: 560 lines in a 140 s wait)."""
    import asyncio
    from types import SimpleNamespace

    from app import openai_api
    from app.engine import Update
    from app.readout import Stats

    monkeypatch.setattr(openai_api, "HEARTBEAT_S", 0.5)

    class Queued:
        loaded = SimpleNamespace(stop_ids=())

        def answer(self, session, prompt, settings, passes):
            for ahead in (2,) * 30 + (1,) * 30:      # 3 s in line, 60 reports
                yield Update(queued=ahead)
                time.sleep(0.05)
            yield Update(segments=(("Paris", False),), tokens=(7,), stats=Stats(tokens=1), done=True)

    request = openai_api.ChatRequest([{"role": "user", "content": "hi"}], Settings(), (MEDUSA,), (), True, False)

    async def stream() -> list[str]:
        run = openai_api.Completion(Queued(), [1, 2, 3], request, "m")
        return [event async for event in openai_api.stream_events(run)]

    started = time.monotonic()
    comments = [text for text in asyncio.run(stream()) if text.startswith(": waiting")]
    waited = time.monotonic() - started        # 3 s, or more on a busy machine: a heartbeat per 0.5 s of it
    assert comments[0] == ": waiting for the model, 2 ahead\n\n" and ": waiting for the model, 1 ahead\n\n" in comments
    assert len(comments) <= waited / openai_api.HEARTBEAT_S + 3, f"{len(comments)} comments for 60 reports in {waited:.1f} s"


def test_a_long_silence_is_filled_with_comments_a_client_skips(monkeypatch):
    """A long prompt being read sends no token for tens of seconds on a CPU. The stream keeps sending
    SSE comments meanwhile (naming what it waits for), so a client with a short read timeout stays, and
    the text that follows is intact. The model here is an engine that is silent for 12 heartbeats."""
    import asyncio
    from types import SimpleNamespace

    from app import openai_api
    from app.engine import Update
    from app.readout import Stats

    monkeypatch.setattr(openai_api, "HEARTBEAT_S", 0.3)
    reading = "reading 4,193 new prompt tokens\nbefore the answer (Stop works meanwhile)…"   # as the engine says it

    class SlowReader:
        loaded = SimpleNamespace(stop_ids=())

        def answer(self, session, prompt, settings, passes):
            yield Update(notice=reading)
            time.sleep(12 * openai_api.HEARTBEAT_S)
            yield Update(segments=(("Paris", False),), tokens=(7,), stats=Stats(tokens=1), done=True)

    request = openai_api.ChatRequest([{"role": "user", "content": "hi"}], Settings(), (MEDUSA,), (), True, False)

    async def stream() -> list[tuple[float, str]]:
        run = openai_api.Completion(SlowReader(), [1, 2, 3], request, "m")
        return [(time.perf_counter(), event) async for event in openai_api.stream_events(run)]

    events = asyncio.run(stream())
    comments = [text for _, text in events if text.startswith(":")]
    while comments and comments[0] == ": starting\n\n":     # a heartbeat before the notice came, on a busy machine
        comments.pop(0)
    # one line, without the page's "(Stop works meanwhile)": an API client has no Stop
    said = ": reading 4,193 new prompt tokens before the answer…\n\n"
    assert len(comments) >= 5 and all(text == said for text in comments), comments[:2]
    gaps = [later - earlier for (earlier, _), (later, _) in zip(events, events[1:])]
    assert max(gaps) < 6 * openai_api.HEARTBEAT_S, f"a silence of {max(gaps):.2f} s"
    data = [json.loads(text.removeprefix("data: ")) for _, text in events
            if text.startswith("data: {")]
    assert "".join(d["choices"][0]["delta"].get("content", "") for d in data) == "Paris"
    assert events[-1][1] == "data: [DONE]\n\n"
    assert all("usage" not in d for d in data), "no usage asked for, none sent"
    # with include_usage every chunk carries "usage", null until the last one's (the spec; it was left out)
    from dataclasses import replace

    request = replace(request, include_usage=True)
    data = [json.loads(text.removeprefix("data: ")) for _, text in asyncio.run(stream()) if text.startswith("data: {")]
    assert all(d["usage"] is None for d in data[:-1]) and data[-1]["usage"]["completion_tokens"] == 1
