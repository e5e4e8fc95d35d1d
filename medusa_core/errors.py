"""The errors a user sees instead of a stack trace.

Every message is one line that names the value or file at fault and says how to
fix it; the launcher and the commands print it instead of a stack trace.
"""

from __future__ import annotations

import sys
from collections.abc import Callable


class LoadError(Exception):
    """A model, heads or tokenizer that cannot be loaded; the message is one line with the fix."""


# What the commands (train, calibrate, export, smol_build) report in one line: a model that does not
# load, a bad value or data file (ValueError, TreeError included), a path that is missing or not a
# folder (OSError). Anything else is a bug and keeps its traceback.
USER_ERRORS = (LoadError, ValueError, OSError)


def error_line(err: BaseException) -> str:
    """``err`` as the one line a user reads; an OSError names its file ("[Errno 2] ..." does not read well)."""
    if isinstance(err, OSError) and err.filename is not None and err.strerror:
        return f"{err.filename}: {err.strerror}"
    return str(err)


def run_command(body: Callable[[], object]) -> int:
    """A command's body -> its exit status: 0, or 1 with the user's error on one line of stderr."""
    try:
        body()
    except USER_ERRORS as err:
        print(f"error: {error_line(err)}", file=sys.stderr)
        return 1
    return 0
