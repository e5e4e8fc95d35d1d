"""The errors a user sees instead of a stack trace.

Every message is one line that names the value or file at fault and says how to
fix it; the launcher and the commands print it instead of a stack trace.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent


class OneLineParser(argparse.ArgumentParser):
    """An entry point's argument parser whose refusals are one line with the fix, as the commands' own checks
    are: argparse printed its whole usage before them (QA), burying the line that names the value."""

    def error(self, message: str):
        command = self.prog if self.prog.startswith("python") else f"python {self.prog}"
        self.exit(2, f"error: {message} ({command} --help lists the flags)\n")


class LoadError(Exception):
    """A model, heads or tokenizer that cannot be loaded; the message is one line with the fix."""


# What the commands (train, calibrate, export, smol_build) report in one line: a path that is missing
# or not a folder (OSError), and a model, value or data file this project refused with a message
# written for the user (LoadError, ValueError, TreeError raised by its own code). A ValueError raised
# inside a library (json, torch, transformers) names nothing a user can act on: it keeps its traceback.
USER_ERRORS = (LoadError, ValueError, OSError)


def raised_here(err: BaseException) -> bool:
    """Whether ``err`` was raised by this project's own code, not inside a library it called."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and Path(tb.tb_frame.f_code.co_filename).resolve().is_relative_to(PACKAGE)


def error_line(err: BaseException) -> str:
    """``err`` as the one line a user reads; an OSError names its file ("[Errno 2] ..." does not read well)."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    return str(err)


def first_line(err: BaseException, width: int | None = 160) -> str:
    """The first line of ``err``'s message, cut to ``width`` characters (None: whole), "" where it has none: what a
    benchmark or a tuner prints for a config or step it skips, whose traceback would bury the lines that ran.
    A first line that only says where (ends in ":", as Triton's compile errors: "at 22:31:", then the kernel's
    source, then the error) is followed by the message's last line, which says what."""
    lines = [line.strip() for line in str(err).strip().splitlines()]
    if not lines:
        return ""
    line = f"{lines[0]} {lines[-1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return line[:width]


def run_command(body: Callable[[], object]) -> int:
    """A command's body -> its exit status: 0, or 1 with the user's error on one line of stderr; Ctrl-C is 130
    (the shell's own status for it) with one line, saying what the command keeps and how to go on where its
    KeyboardInterrupt says (training: review, a traceback and nothing said of the checkpoint)."""
    try:
        body()
    except USER_ERRORS as err:
        if not isinstance(err, OSError) and not raised_here(err):
            raise
        print(f"error: {error_line(err)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        return stopped(err)
    return 0


def exit_status(main: Callable[[], int]) -> int:
    """``main()``'s status, or ``stopped``'s where Ctrl-C stopped it: for commands whose main prints its own errors,
    as bench's does."""
    try:
        return main()
    except KeyboardInterrupt as err:
        return stopped(err)


def stopped(err: KeyboardInterrupt) -> int:
    """Ctrl-C as one line (its traceback said no more), with what the command keeps where its KeyboardInterrupt
    says; 130, the shell's own status for it."""
    print(f"stopped (Ctrl-C){f': {err}' if str(err) else ''}", file=sys.stderr)
    return 130


def check_folder(path: str | Path, flag: str = "--out") -> None:
    """ValueError, before any work, where ``path``, a folder the command makes or writes into, is a file or lies
    under one (QA16: mkdir's "Not a directory" named a path below it the user never gave, with no fix), is empty
    (QA: '' wrote into the current folder), or cannot be written (QA: /proc/x said only "No such file or directory",
    after the model's load). Tried, not only asked, as check_writable does: a folder made for the try is removed."""
    if not str(path).strip():
        raise ValueError(f"{flag} is empty: give a directory")
    target = Path(path)
    existing = next((p for p in [target, *target.parents] if p.exists()), Path("."))
    if not existing.is_dir():
        where = "is a file" if existing == target else f"lies under {existing}, a file"
        raise ValueError(f"{flag} {path} {where}: give a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".medusa-write-check-", dir=existing))
    except OSError as err:
        raise ValueError(f"{flag} {path} cannot be made or written in {existing} ({err.strerror or err}): give a "
                         "folder you can write") from None


def check_writable(path: str | None, flag: str = "--json", reads: dict[str, str | Path | None] | None = None) -> None:
    """ValueError, before any work, where ``path`` could not be written at the end of the run, or is a file the
    run reads (``reads``: flag -> path; QA: bench --json wrote its report over its own --prompts file)."""
    if path is None:
        return
    if not str(path).strip():      # it ran the whole benchmark and wrote nothing (QA)
        raise ValueError(f"{flag} is empty: give a file path in a folder you can write")
    target = Path(path)
    for name, read in (reads or {}).items():
        if read is not None and target.resolve() == Path(read).resolve():
            raise ValueError(f"{flag} {path} is the {name} file this run reads, and the report would replace it: "
                             "give another file")
    folder = next((p for p in [target.parent, *target.parent.parents] if p.exists()), Path("."))
    if folder.exists() and not folder.is_dir():      # the reason named, not guessed (QA)
        raise ValueError(f"{flag} {path} cannot be written: {folder} is a file, not a folder: give a file path in a "
                         "folder you can write")
    writable = not target.is_dir() and folder.is_dir() and os.access(folder, os.W_OK) and \
        (not target.exists() or os.access(target, os.W_OK))
    if writable:
        # tried, not only asked: root passes os.access for /proc and read-only mounts (QA: a traceback after
        # the whole run). In the file's folder, or the nearest one that exists where the rest is made later; a
        # file made for the try is removed
        trial = target if folder == target.parent else folder / f".medusa-write-check-{os.getpid()}"
        existed = trial.exists()
        try:
            with trial.open("a"):
                pass
            if not existed:
                trial.unlink()
        except OSError:
            writable = False
    if not writable:
        raise ValueError(f"{flag} {path} cannot be written (a folder, or no write permission there): "
                         "give a file path in a folder you can write")
