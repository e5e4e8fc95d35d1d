"""A tab's export files on disk: one current copy of its conversation, as JSON and Markdown.

They are served to the browser from where they are written. Given to the download buttons as plain
files, Gradio copied both into its cache at every change (a copy of the whole conversation per answer,
kept a day), and a stop with a tab still open left those copies for good. Here the process has one
folder, registered with Gradio as static (served as it is, never copied), a folder per tab inside it
holding the latest version and the one before, removed when the tab closes, on Clear, and when the
process ends."""

from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
import threading
from pathlib import Path

import gradio as gr

from .session import Session
from .transcript import write_exports

# this process's folder of tab folders, made at the first export
_ROOT: list[Path] = []
_ROOT_LOCK = threading.Lock()
# One write (and prune) at a time: a tab's saves may run at once (an edited system prompt left, then Compare
# clicked), and each removed the other's version (QA17b: both downloads 403, a FileNotFoundError toast)
_WRITE_LOCK = threading.Lock()
# versions a tab keeps: the current one, and the one before, which a download clicked just as a save landed
# still asks for (QA17b: 403 for a click right after leaving the system prompt)
KEPT_VERSIONS = 2


def process_folder() -> Path:
    with _ROOT_LOCK:     # two tabs' first exports at once would make two
        if not _ROOT:
            root = Path(tempfile.mkdtemp(prefix="medusa-chat-exports-"))
            gr.set_static_paths([root])
            atexit.register(remove_all)
            _ROOT.append(root)
    return _ROOT[0]


def write_tab_exports(session: Session, system: str, compare: bool) -> tuple[str, str]:
    """(JSON path, Markdown path) of the tab's conversation as it is now. Each version goes into a new
    numbered folder, and those before the last KEPT_VERSIONS are removed: a browser may keep a file it
    downloaded under its address (no Cache-Control on Gradio's file route), so an address never gets
    other content."""
    with _WRITE_LOCK:
        if session.export_dir is None:
            session.export_dir = Path(tempfile.mkdtemp(prefix="tab-", dir=process_folder()))
        versions = sorted(int(p.name) for p in session.export_dir.iterdir() if p.name.isdigit())
        version = session.export_dir / str(versions[-1] + 1 if versions else 1)
        version.mkdir()
        paths = write_exports(session.turns, session.first_turn, version, system, compare)
        for old in versions[:len(versions) - (KEPT_VERSIONS - 1)]:
            shutil.rmtree(session.export_dir / str(old), ignore_errors=True)
    return paths


def discard_tab_exports(session: Session) -> None:
    """Remove the tab's export files, if it wrote any: the tab closed or was cleared. A failure is said on
    the console, not raised: it runs where Gradio ends a tab."""
    with _WRITE_LOCK:    # not under a save that is writing into it
        folder, session.export_dir = session.export_dir, None
    if folder is None or not folder.is_dir():
        return
    try:
        shutil.rmtree(folder)
    except OSError as err:
        print(f"medusa-chat: could not remove the export folder {folder} ({err}): delete it by hand",
              file=sys.stderr, flush=True)


def remove_all() -> None:
    """Every tab's export files: at the process's exit, and by launch.py where it ends without the exit handlers."""
    for root in _ROOT:
        shutil.rmtree(root, ignore_errors=True)
