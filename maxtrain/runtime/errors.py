"""Errors shown as one line: bad input a user can fix (exit 2) and runs stopped for cause (exit 1)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any


class UserError(Exception):
    """Bad input a user can fix: every entry point prints it as `<kind> error: <message>`, exit code 2."""
    kind = "input"
    exit_code = 2


class ConfigError(UserError, ValueError):
    """A user-fixable config problem; `str()` is the one line the CLI prints."""
    kind = "config"

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


class RunError(UserError):
    """A run stopped for cause (a non-finite loss, a failed save): one line, exit code 1, no traceback."""
    kind = "run"
    exit_code = 1


class NonFiniteState(RunError):
    """A state that a save refuses: an update overflowed it (the loop applies nan_policy)."""


class ConvertError(UserError, RuntimeError):
    """Input that cannot be converted (HF checkpoints, exports); the CLI prints it as one line and exits 2."""
    kind = "convert"


INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command Ctrl-C ended
BROKEN_PIPE = 141  # 128 + SIGPIPE: what a shell reports for a command whose reader closed the pipe


def exit_code(run: Callable[[], Any]) -> int:
    """Runs an entry point: a UserError is one line on stderr and its exit code, never a traceback; so is a
    Ctrl-C (what it was writing is removed by its own clean-up on the way out); an int that `run` returns is
    the exit code."""
    try:
        result = run()
    except UserError as e:
        sys.stdout.flush()
        print(f"{e.kind} error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("interrupted by Ctrl-C", file=sys.stderr, flush=True)
        return INTERRUPTED
    except BrokenPipeError:  # the reader left (`| head`): nothing more to print, and nowhere to print it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the interpreter's last flush is quiet
        return BROKEN_PIPE
    return result if isinstance(result, int) else 0
