"""How counts and durations read in the lines a run prints. No jax here: the data layer's worker
processes import it."""

from __future__ import annotations


def counted(n: int, what: str) -> str:
    """`1 file`, `1,024 files`."""
    return f"{n:,} {what}{'s' * (n != 1)}"


def duration(seconds: float) -> str:
    """`45s`, `1m 05s`, `2h 03m`."""
    s = max(int(seconds), 0)  # elapsed time: whole seconds passed
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s // 3600}h {s % 3600 // 60:02d}m"
