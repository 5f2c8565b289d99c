"""Whether the input pipeline keeps up with the step: read at each logged step of the loop."""

from __future__ import annotations

import jax

from maxtrain.runtime.console import say


class DataWatch:
    """How the input pipeline keeps up: its own rate, said once early, and at every logged step the share of
    the time the step loop waited for a batch (`data_wait_fraction`), with a warning when it is large."""

    WARN_FRACTION, WARN_EVERY_SECONDS = 0.1, 300.0

    def __init__(self, batches, c):
        self.batches, self.c = batches, c
        self.told_rate = False
        self.last_waited = self.last_time = self.last_warned = None

    def read(self, now: float, first: bool, step_seconds: float) -> dict:
        stats = getattr(self.batches, "stats", None)
        if stats is None:  # synthetic data: nothing read
            return {}
        busy, tokens, waited = stats
        if self.last_time is None or first:
            self.last_waited, self.last_time = waited, now
            return {}
        fraction = min(1.0, (waited - self.last_waited) / max(now - self.last_time, 1e-9))
        self.last_waited, self.last_time = waited, now
        consumed = self.c.global_batch_size * self.c.max_target_length / jax.process_count() / step_seconds
        if not self.told_rate and busy > 0:
            self.told_rate = True
            say(f"input pipeline: {tokens / busy:,.0f} tokens/s per host on its own; the step consumes "
                f"{consumed:,.0f} tokens/s per host")
        if fraction >= self.WARN_FRACTION and (self.last_warned is None or
                                               now - self.last_warned >= self.WARN_EVERY_SECONDS):
            self.last_warned = now
            say(f"warning: the step waited for data {100 * fraction:.0f}% of the time since the last log line "
                f"(the input pipeline makes {tokens / max(busy, 1e-9):,.0f} tokens/s per host, the step consumes "
                f"{consumed:,.0f}); more grain_worker_count, or dataset_type=prepared, would help")
        return {"data_wait_fraction": fraction}


class MixtureWatch:
    """A mixture's realized shares (data_sources): at every logged step each source's share of the tokens the
    steps since the last log line drew (`data/<name>/token_fraction`, counted by the step itself, so exact over
    every process) and how many times it has been read (`data/<name>/epochs`); a source read whole, or used up,
    is said once."""

    def __init__(self, batches, c):
        self.batches, self.names = batches, list(c.data_sources)
        self.tokens = [0] * len(self.names)
        self.said_repeat: set[str] = set() if c.data_source_exhausted == "repeat" else set(self.names)  # (drop: events)
        self.events = list(getattr(getattr(batches, "reader", None), "events", []))  # (step, what) of the schedule

    def add(self, m: dict) -> None:
        """Every step's metrics: takes its per-source token counts out of them."""
        counts = m.pop("source_tokens", None)
        if counts is not None:
            self.tokens = [a + int(b) for a, b in zip(self.tokens, counts)]

    def read(self, step: int) -> dict:
        if not self.names:
            return {}
        total = max(sum(self.tokens), 1)
        out = {f"{name}/token_fraction": n / total for name, n in zip(self.names, self.tokens)}
        self.tokens = [0] * len(self.names)
        reader = getattr(self.batches, "reader", None)
        epochs = reader.epochs(self.batches.position) if hasattr(reader, "epochs") else {}
        out |= {f"{name}/epochs": e for name, e in epochs.items()}
        for name, e in epochs.items():
            if e >= 1 and name not in self.said_repeat:
                self.said_repeat.add(name)
                say(f"data: source {name} has been read whole (by step {step}); it repeats from its start, in a new "
                    "order (data_source_exhausted=repeat)")
        while self.events and self.events[0][0] <= step:
            at, what = self.events.pop(0)
            say(f"data: at step {at}: {what}")
        return out
