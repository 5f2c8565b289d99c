"""The lines a run prints: from process 0 only."""

from __future__ import annotations

import jax


def say(*args) -> None:
    """Progress lines come from process 0 only; every process would print the same."""
    if jax.process_index() == 0:
        print(*args, flush=True)
