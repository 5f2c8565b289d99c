"""Orbax's secondary noise, kept off the terminal: a failed save or restore is reported by checkpoint.py in
one line, and the tracebacks Orbax's threads, tasks and coroutines print beside it would hide that line."""

from __future__ import annotations

import logging
import sys


class _QuietOrbaxErrors(logging.Filter):
    """Orbax logs a traceback from each of its threads when a save fails; our one line replaces them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


def _from_orbax(obj) -> bool:
    code = getattr(obj, "cr_code", None) or getattr(getattr(obj, "get_coro", lambda: None)(), "cr_code", None)
    return code is not None and "orbax" in code.co_filename


def _quiet_closed_loops(unraisable, default=sys.unraisablehook):
    """Secondary noise that hides the one line that matters: after a failed save, tensorstore's callbacks
    still post to the save's closed event loop ('Event loop is closed'); after a failed restore (which the
    restore reports), Orbax's other read coroutines are dropped with their own errors unread."""
    if isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed":
        return
    if _from_orbax(unraisable.object):
        return
    default(unraisable)


class _QuietOrbaxTasks(logging.Filter):
    """asyncio's 'Task exception was never retrieved' for Orbax's reads that a failed restore abandoned."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()  # names the task's coroutine and the file it is defined in
        return not ("exception was never retrieved" in message and "orbax" in message)


def install() -> None:
    """Once, where Orbax is imported (checkpoint.py)."""
    if sys.unraisablehook is not _quiet_closed_loops:
        logging.getLogger("absl").addFilter(_QuietOrbaxErrors())
        logging.getLogger("asyncio").addFilter(_QuietOrbaxTasks())
        sys.unraisablehook = _quiet_closed_loops
