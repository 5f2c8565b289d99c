"""Readers: the interface every reader offers (pipeline.Batches reads it, a mixture draws its sources' rows
through it) and what readers share: reading ahead by step, gathering lanes' positions from every process.
The config's readers are made in maxtrain.data.from_config."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, ClassVar, Protocol

import numpy as np


class Reader(Protocol):
    """What a reader offers. Its rows come by index (`by_lane` false: global row g of the run is `row(g, ...)`,
    and the position is the step: prepared.PreparedReader) or by lane (row j of every batch is lane j's next
    row, and the position is each lane's: a streamed.StreamedReader's lanes read its `stream`, LANE_POSITION
    integers each; a mixture.MixtureReader's hold the step and its streamed sources' lanes). A position is
    this process's part (its `lanes`'); the state saved is the whole run's, plain JSON, so a checkpoint
    resumes on any number of processes."""

    by_lane: ClassVar[bool]
    lanes: range  # this process's rows of every global batch

    def initial(self) -> Any:
        """The position before the first batch."""

    def open(self, position) -> Iterator[tuple[dict, Any]]:
        """(this process's rows of a batch: [len(lanes), L] arrays, the position after it), from `position` on."""

    def global_state(self, position) -> dict:
        """The run's position to save (a collective where the lanes are spread over processes)."""

    def position(self, state: dict) -> Any:
        """This process's part of a saved state; ValueError where another kind of reader saved it."""


def read_ahead(batch: Callable[[int], dict], start: int, stop: int, remote: bool,
               position: Callable[[int], Any] = int) -> Iterator[tuple[dict, Any]]:
    """(batch(step), position(step + 1)) for the steps [start, stop), read ahead on grain's threads: for rows
    by index, whose batch follows from the step alone. `remote`: a bucket's, whose ranged reads wait on the
    network."""
    import grain
    if start >= stop:
        return iter(())
    threads = 16 if remote else 2
    ds = grain.MapDataset.range(start, stop).map(batch)
    return zip(ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=2 * threads)),
               map(position, range(start + 1, stop + 1)))


def gather_lanes(local_states, lanes: range, rows: int, width: int, dtype=np.int64) -> np.ndarray:
    """Every lane's position, [rows, width] of `dtype`, from each process's own `lanes`' (a collective with
    several processes)."""
    lanes_RxW = np.full((rows, width), -1, dtype)
    lanes_RxW[lanes.start:lanes.stop] = np.asarray(local_states, np.int64).reshape(-1, width)
    import jax  # (not in the worker processes)
    if jax.process_count() > 1:  # each process knows its own rows' lanes; the others' are -1
        from jax.experimental import multihost_utils
        lanes_RxW = np.asarray(multihost_utils.process_allgather(lanes_RxW)).max(axis=0)
    return lanes_RxW
