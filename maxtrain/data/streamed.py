"""Streamed files (text, JSON lines, parquet, array_record; local or gs://), read as they are and tokenized
on the fly, never held whole.

Row j of every global batch is lane j, a reader with its own share of the files: each epoch shuffles the
order of the pieces (maxtrain.data.sources) by data_shuffle_seed and the epoch, and lane j of R takes
pieces j, j + R, j + 2R, ... of that order; with fewer pieces than rows, the lanes on one piece take every
m-th of its documents each. Within a piece, documents are shuffled in windows of
grain_shuffle_buffer_size, each window by its own seed, and tokenized a window at a time.

A lane's position is LANE_POSITION integers; the run's data position is every lane's, which does not depend
on the number of processes: a process runs the lanes of its rows, from whatever position the checkpoint holds.
"""

from __future__ import annotations

import dataclasses
import os
import zlib

import numpy as np

from maxtrain.data import rows as rows_lib
from maxtrain.data.readers import Reader, gather_lanes
from maxtrain.data.sources import DataError, Piece, documents

EMPTY_EPOCHS = 16  # a lane that finds no token in this many passes over its share stops the run

# A lane's position (Lane.state): its epoch, the piece within that epoch's share, the shuffle window within
# the piece, the window's first document in the piece, the document within the window, the token within the
# document. Checkpoints hold it as it is, lane after lane (a mixture's, after the step).
LANE_POSITION = 6


@dataclasses.dataclass(frozen=True)
class Stream:
    """What every lane of one stream shares."""
    pieces: tuple[Piece, ...]
    rows: int  # lanes in all: the global batch's rows
    length: int  # max_target_length
    seed: int
    window: int  # documents shuffled together
    shuffle: bool
    epochs: int  # -1: repeat
    packing: bool
    text_field: str
    tokenizer: object
    holdout: float = 0.0  # this fraction of documents (chosen by a hash of where they are) is the eval set's
    eval_side: bool = False  # whether this stream reads the held-out documents or the rest

    def share(self, lane: int, epoch: int) -> list[tuple[int, int, int]]:
        """Lane `lane`'s (piece index, stride, phase) in `epoch`: it reads the documents d of each piece with
        d % stride == phase."""
        n = len(self.pieces)
        order = np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
        if n >= self.rows:
            return [(int(order[k]), 1, 0) for k in range(lane, n, self.rows)]
        first = lane % n
        return [(int(order[first]), len(range(first, self.rows, n)), lane // n)]

    def rows_for(self, lanes: range, states, stop_when: str) -> "StreamedRows":
        return StreamedRows(self, lanes, states, stop_when)

    def kept(self, piece: Piece, index: int) -> bool:
        """Whether document `index` of `piece` belongs to this stream's side of the held-out split."""
        if not self.holdout:
            return True
        key = f"{os.path.basename(piece.path)}:{piece.start}:{index}".encode()
        return (zlib.crc32(key) / 2**32 < self.holdout) == self.eval_side


class Lane:
    """One row of every batch: its documents in order, a shuffle window at a time, cut into rows."""

    def __init__(self, stream: Stream, index: int, state=None):
        self.s, self.index = stream, index
        # LANE_POSITION's integers, in its order
        self.epoch, self.k, self.window_no, self.first, self.i, self.t = state or (0,) * LANE_POSITION
        self.label = 0  # a new label for each document: a row tells its documents apart by it
        self.window: list[np.ndarray] = []
        self._docs = None  # (index, text) of the current piece's documents, from the next window's first
        self._next_first, self._piece_done = self.first, False
        self._tokens_in_epoch = self._empty_epochs = 0
        self.exhausted = self.s.epochs != -1 and self.epoch >= self.s.epochs
        if not self.exhausted:
            self._share = self.s.share(index, self.epoch)
            i, t = self.i, self.t
            self._load_window()
            self.i, self.t = i, t

    def state(self) -> list[int]:
        return [self.epoch, self.k, self.window_no, self.first, self.i, self.t]

    # ---- reading

    def _load_window(self) -> None:
        """The window at (epoch, k, window_no, first): read, shuffled and tokenized."""
        self.i = self.t = 0
        piece_index, stride, phase = self._share[self.k]
        piece = self.s.pieces[piece_index]
        if self._docs is None:
            self._docs = ((d, text) for d, text in enumerate(documents(piece, self.s.text_field, self.first),
                                                            self.first)
                          if d % stride == phase and self.s.kept(piece, d))
        texts = []
        for d, text in self._docs:
            texts.append(text)
            self._next_first = d + 1
            if len(texts) == self.s.window:
                break
        else:
            self._piece_done = True
        if self.s.shuffle and len(texts) > 1:
            seed = [self.s.seed, self.epoch, piece_index, phase, self.window_no]
            texts = [texts[o] for o in np.random.default_rng(seed).permutation(len(texts))]
        self.window = [ids for ids in self.s.tokenizer.encode_batch(texts) if len(ids)] if texts else []
        self._tokens_in_epoch += sum(len(ids) for ids in self.window)

    def _advance(self) -> None:
        """To the next window: in this piece, or the first of the next piece in the share, or the next epoch's."""
        if not self._piece_done:
            self.window_no, self.first = self.window_no + 1, self._next_first
        else:
            self.k, self.window_no, self.first, self._docs, self._piece_done = self.k + 1, 0, 0, None, False
            if self.k >= len(self._share):
                self._new_epoch()
                if self.exhausted:
                    return
        self._load_window()

    def _new_epoch(self) -> None:
        self._empty_epochs = 0 if self._tokens_in_epoch else self._empty_epochs + 1
        if self._empty_epochs >= EMPTY_EPOCHS:
            files = sorted({self.s.pieces[p].path for p, _, _ in self._share})
            raise DataError(f"{', '.join(files)}: row {self.index} of the batch found no tokens in "
                            f"{EMPTY_EPOCHS} passes over its share of the documents: add data")
        self._tokens_in_epoch = 0
        self.epoch, self.k = self.epoch + 1, 0
        if self.s.epochs != -1 and self.epoch >= self.s.epochs:
            self.exhausted = True
            return
        self._share = self.s.share(self.index, self.epoch)

    def _ready(self) -> bool:
        """Whether a document is at hand (loading windows, pieces, epochs as needed)."""
        while not self.exhausted and self.i >= len(self.window):
            self._advance()
        return not self.exhausted

    # ---- rows

    def row(self, tokens_L1: np.ndarray, docs_L1: np.ndarray, valid_L1: np.ndarray) -> bool:
        """Fills the next row (length + 1 tokens, the last one shared with the next row); False if the lane
        had no token left for it (the arrays are then padding)."""
        length = self.s.length
        if not self.s.packing:  # one document per row, truncated
            if not self._ready():
                return False
            doc = self.window[self.i][: length + 1]
            tokens_L1[: len(doc)], valid_L1[: len(doc)] = doc, True
            self.i += 1
            return True
        n = 0
        while n < length and self._ready():
            doc = self.window[self.i]
            take = min(len(doc) - self.t, length - n)
            tokens_L1[n:n + take] = doc[self.t:self.t + take]
            docs_L1[n:n + take], valid_L1[n:n + take] = self.label, True
            n, self.t = n + take, self.t + take
            if self.t == len(doc):
                self.i, self.t, self.label = self.i + 1, 0, self.label + 1
        if n == length and self._ready():  # the last target: read, not consumed
            tokens_L1[n], docs_L1[n], valid_L1[n] = self.window[self.i][self.t], self.label, True
        return n > 0


class StreamedRows:
    """This process's lanes (its rows of every global batch): next() gives (batch of [len(lanes), length]
    arrays, the lanes' positions after it)."""

    def __init__(self, stream: Stream, lanes: range, states: list | None, stop_when: str):
        """stop_when: "any" (training: a batch needs every row) or "all" (eval: rows that ended are padding
        until every lane of this process has ended)."""
        self.s, self.lanes, self.stop_when = stream, lanes, stop_when
        self._lanes = [Lane(stream, j, states[j] if states else None) for j in lanes]

    def __iter__(self):
        return self

    def __next__(self):
        tokens, docs, valid = rows_lib.buffers(len(self._lanes), self.s.length)
        got = [lane.row(tokens[r], docs[r], valid[r]) for r, lane in enumerate(self._lanes)]
        if (self.stop_when == "any" and not all(got)) or not any(got):
            raise StopIteration
        return rows_lib.features(tokens, docs, valid), [lane.state() for lane in self._lanes]


class WorkerRows:
    """StreamedRows (or a mixture's MixedRows: `stream` is what makes the rows) with this process's lanes split
    between `workers` processes (spawned, each a contiguous group of lanes): reading, parsing and tokenizing
    on several cores. Each worker sends its rows of every batch with its lanes' positions; they are joined in
    lane order, so the batches are the same whatever the number of workers."""

    def __init__(self, stream, lanes: range, states: list | None, stop_when: str, workers: int):
        import multiprocessing
        ctx = multiprocessing.get_context("spawn")  # no fork of a process whose runtime holds threads
        bounds = np.linspace(lanes.start, lanes.stop, workers + 1).round().astype(int)
        self.groups = [range(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        self.stop_when, self.length = stop_when, stream.length
        self._ended = [False] * len(self.groups)
        self._queues, self._procs = [], []
        for group in self.groups:
            q = ctx.Queue(2)
            p = ctx.Process(target=_work, args=(stream, group, states, stop_when, q), daemon=True,
                            name="maxtrain-data-worker")
            p.start()
            self._queues.append(q)
            self._procs.append(p)

    def __iter__(self):
        return self

    def _get(self, i: int):
        import queue
        while True:
            try:
                return self._queues[i].get(timeout=1.0)
            except queue.Empty:
                if not self._procs[i].is_alive():
                    raise DataError(f"a data worker process ended (exit code {self._procs[i].exitcode}) while "
                                    f"reading rows {self.groups[i].start}-{self.groups[i].stop - 1}") from None

    def __next__(self):
        parts = []
        for i, group in enumerate(self.groups):
            item = ("end",) if self._ended[i] else self._get(i)
            if item[0] == "error":
                raise DataError(item[1])
            if item[0] == "end":
                self._ended[i] = True
                if self.stop_when == "any":
                    raise StopIteration
                n = len(group)
                item = ("rows", rows_lib.padding(n, self.length), [[0] * LANE_POSITION] * n)  # eval: ended rows pad
            parts.append(item)
        if all(self._ended):
            raise StopIteration
        batch = {k: np.concatenate([p[1][k] for p in parts]) for k in parts[0][1]}
        return batch, [s for p in parts for s in p[2]]

    def close(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.terminate()


def _work(stream, lanes: range, states, stop_when: str, q) -> None:
    """A worker process: its lanes' rows (of a Stream, or a mixture's), batch after batch, until they end or
    the parent stops it."""
    import os
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the workers are the parallelism
    try:
        for batch, lane_states in stream.rows_for(lanes, states, stop_when):
            q.put(("rows", batch, lane_states))
        q.put(("end",))
    except DataError as e:
        q.put(("error", str(e)))


class StreamedReader(Reader):
    """Rows of streamed files, by lane: one lane per row of the global batch (maxtrain.data.streamed); the
    position is every lane's, gathered from every process when a checkpoint asks for it."""

    by_lane = True

    def __init__(self, stream: Stream, lanes: range, stop_when: str, workers: int = 0):
        self.stream, self.lanes, self.stop_when = stream, lanes, stop_when
        self.workers = min(workers, len(lanes))

    def initial(self):
        return [[0] * LANE_POSITION for _ in self.lanes]

    def open(self, local_states):
        """Batches from the lanes' positions on, each with the positions after it."""
        states = [None] * self.stream.rows
        states[self.lanes.start:self.lanes.stop] = local_states
        if self.workers:
            return WorkerRows(self.stream, self.lanes, states, self.stop_when, self.workers)
        return StreamedRows(self.stream, self.lanes, states, self.stop_when)

    def global_state(self, local_states) -> dict:
        lanes = gather_lanes(local_states, self.lanes, self.stream.rows, LANE_POSITION, np.int32)
        return {"kind": "streamed", "pieces": len(self.stream.pieces), "lanes": lanes.tolist()}

    def position(self, state: dict):
        if state.get("kind") != "streamed" or len(state["lanes"]) != self.stream.rows:
            raise ValueError("not the position of streamed files read by this many rows")
        if state["pieces"] != len(self.stream.pieces):
            raise ValueError(f"saved over {state['pieces']} pieces of files, {len(self.stream.pieces)} now")
        return [list(map(int, state["lanes"][j])) for j in self.lanes]
