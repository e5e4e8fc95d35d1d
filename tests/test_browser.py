"""The page in headless Chromium: a typed message streams an answer with a live speed
readout; with comparison on, both panes fill. Leaves artifacts/chat.png behind.

Needs Debian's ``chromium`` and ``pip install playwright`` (its own browser download
is not used); skipped when either is missing.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from test_app import app_url, model_dirs  # noqa: F401  (session fixtures: one app for both files)

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture
def page(app_url):  # noqa: F811
    sync_api = pytest.importorskip("playwright.sync_api")
    if not shutil.which(CHROMIUM):
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y --no-install-recommends chromium")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.goto(app_url)
        yield page
        browser.close()


def assistant_texts(page, chat_id: str) -> list[str]:
    return page.locator(f"#{chat_id} .message.bot").all_inner_texts()


def tokens_per_second(page, readout_id: str) -> float:
    # the readout table's first data cell is tokens/s
    cells = page.locator(f"#{readout_id} td").all_inner_texts()
    return float(cells[0]) if cells else 0.0


def test_chat_streams_then_compares(page):
    page.locator("#message textarea").fill("Hello, who are you?")
    page.locator("#send").click()
    page.wait_for_function("() => document.querySelectorAll('#chat .message.bot').length >= 1", timeout=60_000)
    page.wait_for_function(
        "() => { const c = document.querySelector('#readout td'); return c && parseFloat(c.innerText) > 0; }",
        timeout=60_000)
    page.wait_for_function("() => document.querySelector('#status').innerText.includes('Ready')", timeout=60_000)
    assert assistant_texts(page, "chat")[-1].strip()
    assert tokens_per_second(page, "readout") > 0

    page.locator("#compare input[type=checkbox]").check()
    page.wait_for_selector("#chat-baseline", state="visible", timeout=10_000)
    page.locator("#message textarea").fill("How do I sort a list?")  # a prompt the demo model answers with visible text
    page.locator("#send").click()
    page.wait_for_function("() => document.querySelector('#comparison').innerText.includes('Speedup')",
                           timeout=120_000)
    # the screenshot comes first, so a failing check still leaves the page to look at
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "chat.png"), full_page=True)
    assert len(assistant_texts(page, "chat-baseline")) >= 2 and assistant_texts(page, "chat-baseline")[-1].strip()
    assert len(assistant_texts(page, "chat")) >= 2
    assert tokens_per_second(page, "readout-baseline") > 0 and tokens_per_second(page, "readout") > 0
    assert re.search(r"identical|differ", page.locator("#comparison").inner_text())

