"""``python launch.py`` in a subprocess on a free local port, as a user starts it; the console
goes to a log file that a failing test shows."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# launch.py with every decoder forward made ``argv[1]`` seconds longer: an answer of N steps then lasts N times
# that at least on any machine, so a test can act while it runs (test audit: the tiny model's 300 tokens took half
# a second here, and a Stop or a second tab's message raced them)
SLOW_STEPS = """
import runpy, sys, time
import torch

delay = float(sys.argv.pop(1))

def slower(module, args, output):
    if hasattr(module, "layers") and hasattr(module, "embed_tokens"):      # the decoder, once a forward
        time.sleep(delay)

torch.nn.modules.module.register_module_forward_hook(slower)
sys.argv[0] = "launch.py"
runpy.run_path("launch.py", run_name="__main__")
"""


@contextmanager
def launched(args: list[str], log: Path, timeout: float = 240, step_delay_s: float = 0.0) -> Iterator[str]:
    """The app's URL once it answers; the process is stopped on exit."""
    with launched_process(args, log, timeout, step_delay_s=step_delay_s) as (url, _):
        yield url


@contextmanager
def launched_process(args: list[str], log: Path, timeout: float = 240, env: dict[str, str] | None = None,
                     step_delay_s: float = 0.0) -> Iterator[tuple[str, subprocess.Popen]]:
    """(URL, process) of the app once it answers; the process is stopped on exit. ``step_delay_s``: each decoder
    forward takes that much longer (SLOW_STEPS)."""
    port = free_port()
    start = ["-c", SLOW_STEPS, str(step_delay_s)] if step_delay_s else ["launch.py"]
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, *start, *args, "--port", str(port)], cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT,
                                # a key in the developer's environment would put the page behind a login
                                env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "MEDUSA_CHAT_API_KEY": "",
                                     **(env or {})},
                                # Ctrl+C as at a terminal: a test run started in the background by a script ignores
                                # SIGINT (POSIX shells do so for `cmd &`), and a child inherits that, so the app's
                                # Ctrl+C test failed there while the app did nothing wrong. (preexec_fn is unsafe
                                # with threads that hold locks across a fork; this one only sets a disposition)
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.time() + timeout
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
        yield url, proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            # still busy past the stop (a long prompt on a loaded machine): killed, not left running to slow every
            # test after it, and the test still fails on it
            proc.kill()
            proc.wait()
            raise
