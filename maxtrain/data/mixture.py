"""Mixtures: several sources (each a prepared corpus or streamed files) drawn in the weights' proportions,
with weights that change at set steps (data_stages), read as `data_sources` in the config.

The unit is a row of the batch (max_target_length tokens, packed): a row comes whole from one source's own
reader, so each source keeps its own order and position, and with packing every row holds L tokens
whatever the source's document lengths, so the rows' shares are the tokens' shares (without packing a row
is one truncated document: the shares are of documents, and the logged token fractions show the tokens').

Which source gives each row: within a segment (a stage, or the part of one after a source was dropped)
element k of the mixture comes from the source grain's proportional mixing picks for k (MapDataset.mix:
after any k rows, each source has had its share to within one row), and its rank among that source's rows
is known in closed form; the R elements of a step are placed in the batch by a permutation seeded by
(data_shuffle_seed, step), so every row of the batch, and every lane of a streamed source, sees every
source. All of it follows from the config, the sources' sizes and the step: every process computes the
same mixture without talking to the others.

Position: the step, and for each streamed source each lane's LANE_POSITION integers (maxtrain.data.streamed):
each lane of the batch carries [step, *its lanes' states], gathered from every process at a save.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from maxtrain.data import rows as rows_lib
from maxtrain.data.readers import Reader, gather_lanes, read_ahead
from maxtrain.data.sources import DataError
from maxtrain.data.streamed import LANE_POSITION, Lane, WorkerRows

SCALE = 10**6  # weights become integer proportions of this sum (grain's own scale the smallest to 100, truncated)


def proportions(weights) -> tuple[int, ...]:
    total = float(sum(weights))
    return tuple(max(1, int(round(w / total * SCALE))) if w > 0 else 0 for w in weights)  # a tiny weight still draws


def counts(k, props: tuple[int, ...]) -> np.ndarray:
    """How many of the first k elements of grain's proportional mixing come from each source (k an int or an
    array of them): the arithmetic of grain's MapDataset.mix, which this must match (tests/test_mixture.py)."""
    k = np.asarray(k, np.int64)
    out, remaining = [], sum(props)
    for p in props:
        if remaining == 0:
            out.append(np.zeros_like(k))
            continue
        rest = k * (remaining - p) // remaining
        out.append(k - rest)
        k, remaining = rest, remaining - p
    return np.stack(out)


@dataclasses.dataclass(frozen=True)
class Segment:
    start: int  # its first step
    props: tuple[int, ...]  # integer proportions; all zero: the data has ended
    before: tuple[int, ...]  # each source's rows before it


class Schedule:
    """Which source, and which of its rows, each row of each step is."""

    def __init__(self, names, stages, rows: int, seed: int, sizes=None):
        """stages: [(start_step, weights)], the first at step 0; sizes: each source's rows where it is dropped
        when they are all read (data_source_exhausted=drop), else None."""
        self.names, self.rows, self.seed = list(names), rows, seed
        self.events: list[tuple[int, str]] = []  # (step, what happens there), for the first lines
        self.segments: list[Segment] = []
        before, dropped = np.zeros(len(self.names), np.int64), set()
        for s, (start, weights) in enumerate(stages):
            end = stages[s + 1][0] if s + 1 < len(stages) else None
            while True:
                w = [0.0 if i in dropped else float(x) for i, x in enumerate(weights)]
                if sum(w) == 0:
                    self.segments.append(Segment(start, (0,) * len(w), tuple(before.tolist())))
                    self.events.append((start, "every source is used up: the data ends"))
                    return
                props = proportions(w)
                self.segments.append(Segment(start, props, tuple(before.tolist())))
                ends = {} if sizes is None else self._ends(start, props, before, sizes, end)
                if ends and (end is None or min(ends) < end):
                    stop = min(ends)
                    before = before + counts((stop - start) * rows, props)
                    out = ends[stop]
                    dropped |= set(out)
                    left = [n for i, n in enumerate(self.names) if i not in dropped and weights[i] > 0]
                    self.events.append((stop, f"{', '.join(self.names[i] for i in out)} used up "
                                              "(data_source_exhausted=drop)" +
                                              (f"; the rest ({', '.join(left)}) reweighted" if left else "")))
                    start = stop
                    continue
                if end is not None:
                    before = before + counts((end - start) * rows, props)
                break

    def _ends(self, start, props, before, sizes, end) -> dict[int, list[int]]:
        """{step: sources} for the sources that run out in this segment: the first step whose rows would need
        more than they have."""
        ends: dict[int, list[int]] = {}
        for i, p in enumerate(props):
            if p == 0:
                continue
            lo, hi = start, start + int((sizes[i] - before[i]) * SCALE / (p * self.rows)) + 2
            while lo < hi:  # the first step t whose rows go past the source's last
                t = (lo + hi) // 2
                if before[i] + counts((t + 1 - start) * self.rows, props)[i] > sizes[i]:
                    hi = t
                else:
                    lo = t + 1
            if end is None or lo < end:
                ends.setdefault(lo, []).append(i)
        return ends

    def segment(self, step: int) -> Segment:
        return next(s for s in reversed(self.segments) if s.start <= step)

    def ended(self, step: int) -> bool:
        return not any(self.segment(step).props)

    def weights(self, step: int) -> list[float]:
        props = self.segment(step).props
        return [p / max(sum(props), 1) for p in props]

    def used(self, step: int) -> np.ndarray:
        """Each source's rows in the steps before `step`."""
        seg = self.segment(step)
        return np.asarray(seg.before) + counts((step - seg.start) * self.rows, seg.props)

    def assign(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, rank among that source's rows in the run) of each row of `step`'s batch."""
        seg = self.segment(step)
        k = (step - seg.start) * self.rows + np.arange(self.rows + 1)
        c = counts(k, seg.props)  # [sources, R + 1]
        source_R = np.argmax(np.diff(c, axis=1), axis=0)  # the source whose count grows at element k
        rank_R = np.asarray(seg.before)[source_R] + c[source_R, np.arange(self.rows)]
        place = np.random.default_rng([self.seed, step]).permutation(self.rows)  # element r -> row place[r]
        out_s, out_r = np.empty_like(source_R), np.empty_like(rank_R)
        out_s[place], out_r[place] = source_R, rank_R
        return out_s, out_r


@dataclasses.dataclass(frozen=True)
class Mixture:
    """What every lane shares: the sources' readers (a PreparedReader or a StreamedReader each), the schedule."""
    names: tuple[str, ...]
    readers: tuple[Reader, ...]  # PreparedReader (rows by rank) | StreamedReader (rows by lane, of its stream)
    schedule: Schedule
    length: int

    @functools.cached_property
    def streamed(self) -> list[int]:
        """The sources read by lanes (a StreamedReader's stream); the others are read by rank (their rows)."""
        return [i for i, r in enumerate(self.readers) if r.by_lane]

    @property
    def width(self) -> int:
        return 1 + LANE_POSITION * len(self.streamed)  # a lane's position: the step, each streamed source's lane

    def lane_columns(self, n: int) -> slice:
        """Where the n-th streamed source's lane is in a lane's position."""
        return slice(1 + LANE_POSITION * n, 1 + LANE_POSITION * (n + 1))

    def rows_for(self, lanes: range, states, stop_when: str = "any"):
        return MixedRows(self, lanes, states)


class MixedRows:
    """This process's rows (`lanes`) of every step's batch from its position on; next() gives (batch of
    [len(lanes), L] arrays with "source_ids", each lane's position after it)."""

    def __init__(self, mixture: Mixture, lanes: range, states):
        self.m, self.lanes = mixture, lanes
        local = [states[j] if states and states[j] is not None else [0] * mixture.width for j in lanes]
        self.step = int(local[0][0]) if local else 0
        self._lanes = {i: [Lane(mixture.readers[i].stream, j, tuple(local[r][mixture.lane_columns(n)]))
                           for r, j in enumerate(lanes)] for n, i in enumerate(mixture.streamed)}

    def __iter__(self):
        return self

    def __next__(self):
        if self.m.schedule.ended(self.step):
            raise StopIteration
        batch = self.batch(self.step)
        self.step += 1
        return batch, [[self.step, *(x for i in self.m.streamed for x in self._lanes[i][r].state())]
                       for r in range(len(self.lanes))]

    def batch(self, step: int) -> dict:
        """This process's rows of `step`'s batch (the streamed lanes' next rows: call in order of the steps)."""
        source_R, rank_R = self.m.schedule.assign(step)
        length = self.m.length
        tokens, docs, valid = rows_lib.buffers(len(self.lanes), length)
        for r, j in enumerate(self.lanes):
            i = int(source_R[j])
            if i in self._lanes:
                if not self._lanes[i][r].row(tokens[r], docs[r], valid[r]):
                    raise DataError(f"{self.m.names[i]}: row {j} of the batch found no more tokens")
            else:
                self.m.readers[i].row(int(rank_R[j]), tokens[r], docs[r], valid[r])
        batch = rows_lib.features(tokens, docs, valid)
        batch["source_ids"] = np.repeat(source_R[self.lanes.start:self.lanes.stop, None], length, 1).astype(np.int32)
        return batch


class MixtureReader(Reader):
    """Rows of a mixture, for pipeline.Batches: this process's lanes, run on its thread (or, with streamed
    sources and grain_worker_count, in worker processes). By lane: each lane's position is [step, *its
    streamed sources' lanes]."""

    by_lane = True

    def __init__(self, mixture: Mixture, lanes: range, workers: int = 0):
        self.mixture, self.lanes = mixture, lanes
        self.workers = min(workers, len(lanes)) if mixture.streamed else 0

    def initial(self):
        return [[0] * self.mixture.width for _ in self.lanes]

    def open(self, local_states):
        states = [None] * self.mixture.schedule.rows
        states[self.lanes.start:self.lanes.stop] = local_states
        if self.workers:
            return WorkerRows(self.mixture, self.lanes, states, "any", self.workers)
        rows = MixedRows(self.mixture, self.lanes, states)
        if self.mixture.streamed:
            return rows
        # Prepared sources only: a step's rows follow from the step, so grain's threads read steps ahead.
        stop = next((g.start for g in self.mixture.schedule.segments if not any(g.props)), 2**62)
        remote = any(r.remote for r in self.mixture.readers)
        return read_ahead(rows.batch, rows.step, stop, remote, lambda step: [[step]] * len(self.lanes))

    def global_state(self, local_states) -> dict:
        lanes = gather_lanes(local_states, self.lanes, self.mixture.schedule.rows, self.mixture.width)
        step = int(lanes[:, 0].max())
        return {"kind": "mixture", "sources": list(self.mixture.names), "step": step,
                "weights": [round(w, 6) for w in self.mixture.schedule.weights(step)],
                "lanes": lanes[:, 1:].tolist()}

    def position(self, state: dict):
        if state.get("kind") != "mixture":
            raise ValueError("not a mixture's position")
        if list(state["sources"]) != list(self.mixture.names):
            raise ValueError(f"saved for the sources {', '.join(state['sources'])}, this config's are "
                             f"{', '.join(self.mixture.names)}")
        width, step = self.mixture.width, int(state["step"])
        if any(len(lane) != width - 1 for lane in state["lanes"]) or len(state["lanes"]) != self.mixture.schedule.rows:
            raise ValueError("saved with other sources or another global batch")
        now = [round(w, 6) for w in self.mixture.schedule.weights(step)]
        import jax
        if state.get("weights") != now and jax.process_index() == 0:
            print(f"warning: the checkpoint's mixture weights were {state.get('weights')} at step {step}, this "
                  f"config's are {now}: the rows from here follow the new weights", flush=True)
        return [[step, *map(int, state["lanes"][j])] for j in self.lanes]

    @property
    def events(self) -> list[tuple[int, str]]:
        return self.mixture.schedule.events

    def epochs(self, local_states) -> dict[str, float]:
        """How many times each source has been read by this position: prepared, its rows drawn over its rows;
        streamed, the passes every lane of this host has finished over its share of the files (the fewest)."""
        if not local_states:
            return {}
        used = self.mixture.schedule.used(int(local_states[0][0]))
        streamed = self.mixture.streamed
        out = {}
        for i, (name, reader) in enumerate(zip(self.mixture.names, self.mixture.readers)):
            if i in streamed:
                col = self.mixture.lane_columns(streamed.index(i)).start  # (a lane's epoch: its first integer)
                out[name] = float(min(s[col] for s in local_states))
            else:
                out[name] = float(used[i]) / reader.count
        return out
