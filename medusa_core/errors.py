"""The one error type a user sees when loading fails.

Every message is one line that names the value or file at fault and says how to
fix it; the launcher prints it instead of a stack trace.
"""

from __future__ import annotations


class LoadError(Exception):
    """A model, heads or tokenizer that cannot be loaded; the message is one line with the fix."""
