"""The project's error classes share one base, :class:`QkropeError`.

A ``QkropeError`` is a *user error*: a bad argument, input, file or environment that the message
explains (what was received, what was expected, the fix). The CLI prints it as one line and
exits 2; any other exception is a bug or an internal failure of a dependency and keeps its
traceback. Subclasses also derive from the builtin class callers already catch (``ValueError``,
``FileNotFoundError``, ``RuntimeError``, ``ImportError``).
"""

from __future__ import annotations


class QkropeError(Exception):
    """Base of every error qkrope raises on purpose (user errors, with the fix in the message)."""


class InputError(QkropeError, ValueError):
    """An argument or input value is outside what qkrope accepts."""


class InputFileNotFoundError(QkropeError, FileNotFoundError):
    """A file the caller named (or that qkrope needs next to it) does not exist."""


__all__ = ["QkropeError", "InputError", "InputFileNotFoundError"]
