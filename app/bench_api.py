"""Does the OpenAI-compatible API cost speed? The page's engine called directly against the same
request through ``/v1/chat/completions`` (streamed, over HTTP on 127.0.0.1), interleaved per prompt
in one process around one loaded model, greedy, so both produce the same tokens.

    python -m app.bench_api                         # the CPU default, 12 held-out prompts, 96 tokens
    python -m app.bench_api --count 24 --max-new-tokens 128 --soak 200

Reported: tokens/s (reply tokens over wall time from the request to the last token, prefill
included), time to the first token (engine) and to the first content chunk (API), and with
``--soak N`` the process's resident memory every N/10 short requests.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from medusa_core.errors import OneLineParser, exit_status


@dataclass(frozen=True)
class ApiBenchConfig:
    count: int = 12
    max_new_tokens: int = 96
    soak: int = 0


def rss_mib() -> float:
    status = Path("/proc/self/status")
    lines = status.read_text().splitlines() if status.is_file() else []
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmRSS:")), float("nan"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def direct(engine, prompt: str, max_new_tokens: int) -> tuple[int, float, float, str]:
    """(reply tokens, seconds, seconds to the first token, text) through ChatEngine.answer."""
    from app.engine import MEDUSA
    from app.session import Session
    from app.settings import Settings

    ids = engine.prompt_ids([{"role": "user", "content": prompt}], None)
    started, first, last = time.perf_counter(), None, None
    for update in engine.answer(Session(), ids, Settings(mode="greedy", max_new_tokens=max_new_tokens), (MEDUSA,)):
        if update.tokens and first is None:
            first = time.perf_counter() - started
        last = update
    tokens = [t for t in last.tokens if t not in engine.loaded.stop_ids]
    return len(tokens), time.perf_counter() - started, first or 0.0, last.plain


def through_api(http: httpx.Client, url: str, model: str, prompt: str, max_new_tokens: int
                ) -> tuple[int, float, float, str]:
    """(reply tokens, seconds, seconds to the first content chunk, text) through a streamed request."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": max_new_tokens, "stream": True, "stream_options": {"include_usage": True}}
    started, first, text, tokens = time.perf_counter(), None, [], 0
    with http.stream("POST", url, json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices", []):
                piece = choice["delta"].get("content")
                if piece:
                    first = first if first is not None else time.perf_counter() - started
                    text.append(piece)
    return tokens, time.perf_counter() - started, first or 0.0, "".join(text)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m app.bench_api", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=12, help="held-out prompts (the first ones)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--soak", type=int, default=0, help="then this many short requests, memory sampled")
    a = p.parse_args(argv)
    # CLI QA: --count 0 an IndexError after a minute's load, --max-new-tokens 0 a traceback, --soak -1 a soak of -1
    for flag, value, least in (("--count", a.count, 1), ("--max-new-tokens", a.max_new_tokens, 1),
                               ("--soak", a.soak, 0)):
        if value < least:
            p.error(f"{flag} {value} must be at least {least}")
    config = ApiBenchConfig(a.count, a.max_new_tokens, a.soak)

    from app.models import ModelSlot
    from app.openai_api import api_routes, model_id
    from app.ui import build_ui, start_queue
    from medusa_core.loading.assets import CPU_DEFAULT_PROMPTS
    from medusa_core.loading.spec import LoadSpec
    from medusa_core.training.data import read_prompts

    slot = ModelSlot(max_new_tokens=config.max_new_tokens, log=print)
    spec = LoadSpec(device="cpu")
    demo = build_ui(slot, base_spec=spec)
    start_queue(demo)
    port = free_port()
    demo.launch(server_name="127.0.0.1", server_port=port, prevent_thread_lock=True, quiet=True,
                app_kwargs={"routes": api_routes(slot)})
    slot.start(spec)
    if slot.wait(600).phase != "ready":
        print(f"error: {slot.state().line}", file=sys.stderr)
        return 1
    engine = slot.engine
    url, model = f"http://127.0.0.1:{port}/v1/chat/completions", model_id(engine)
    prompts = read_prompts(CPU_DEFAULT_PROMPTS)[:config.count]
    rows = {"engine": [], "api": []}
    with httpx.Client(timeout=600) as http:
        direct(engine, prompts[0], 16)                              # warm-up, both paths
        through_api(http, url, model, prompts[0], 16)
        for prompt in prompts:
            rows["engine"].append(direct(engine, prompt, config.max_new_tokens))
            rows["api"].append(through_api(http, url, model, prompt, config.max_new_tokens))
        same = sum(e[3] == api[3] for e, api in zip(rows["engine"], rows["api"]))
        print(f"{len(prompts)} prompts, {config.max_new_tokens} new tokens max, greedy, tree "
              f"{Path(engine.trees.default).name}; same text through both: {same}/{len(prompts)}")
        print(f"{'path':<28}{'tokens/s':>10}{'ratio':>8}{'first token / chunk, median ms':>34}")
        speed = {k: sum(r[0] for r in v) / sum(r[1] for r in v) for k, v in rows.items()}
        for name, label in (("engine", "page's engine, direct"), ("api", "/v1/chat/completions")):
            ttf = 1e3 * statistics.median(r[2] for r in rows[name])
            print(f"{label:<28}{speed[name]:>10.1f}{speed[name] / speed['engine']:>7.3f}x{ttf:>34.0f}")
        if config.soak:
            curve = [round(rss_mib())]
            every = max(1, config.soak // 10)
            for i in range(config.soak):
                body = {"model": model, "messages": [{"role": "user", "content": f"Say the number {i}."}],
                        "max_tokens": 3, "stream": i % 2 == 0, "seed": i}
                if http.post(url, json=body).status_code != 200:
                    print(f"error: soak request {i} failed", file=sys.stderr)
                    return 1
                if (i + 1) % every == 0:
                    curve.append(round(rss_mib()))
            print(f"soak of {config.soak} short requests: resident MiB at start and every {every}: {curve}")
    demo.close()
    return 0


if __name__ == "__main__":
    sys.exit(exit_status(main))   # Ctrl-C: one line, exit 130
