"""User errors: bad input a user can fix, shown as one line and exit code 2 by every entry point."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class UserError(Exception):
    """Bad input a user can fix: every entry point prints it as `<kind> error: <message>`, exit code 2."""
    kind = "input"


def exit_code(run: Callable[[], Any]) -> int:
    """Runs an entry point: a UserError is one line on stderr and exit code 2, never a traceback; an int
    that `run` returns is the exit code."""
    try:
        result = run()
    except UserError as e:
        print(f"{e.kind} error: {e}", file=sys.stderr)
        return 2
    return result if isinstance(result, int) else 0
