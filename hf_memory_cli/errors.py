"""The command line's one error type."""

from __future__ import annotations

__all__ = ["CLIError"]


class CLIError(Exception):
    """A user-facing failure: printed as one line, exit status 2 (as is any ValueError, the
    library's error for bad input, and any OSError)."""
