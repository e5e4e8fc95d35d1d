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


@contextmanager
def launched(args: list[str], log: Path, timeout: float = 240) -> Iterator[str]:
    """The app's URL once it answers; the process is stopped on exit."""
    with launched_process(args, log, timeout) as (url, _):
        yield url


@contextmanager
def launched_process(args: list[str], log: Path, timeout: float = 240,
                     env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """(URL, process) of the app once it answers; the process is stopped on exit."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "launch.py", *args, "--port", str(port)], cwd=REPO, stdout=out,
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
