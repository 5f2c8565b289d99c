"""Input pipelines. Each yields global batches: dicts of [global_batch, max_target_length] arrays (inputs,
targets, positions, segment_ids, weights) laid out with the config's batch sharding.

    synthetic                      made on the host, each row from its own seed
    prepared  (maxtrain.data.prepared)   shards of token ids read by index, rows shuffled globally
    text | parquet | array_record  (maxtrain.data.streamed)   files read as they are, tokenized on the fly

Each process makes only its own rows of every global batch, on a thread, ahead of the step. What a step's
global batch holds depends on the seed and the step alone, never on the number of processes; the position
(get_state / set_state, plain JSON) is the whole run's, so a checkpoint saved by 2 processes resumes on 1
or 4 and sees the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import functools
import queue
import threading
import time

import jax
import numpy as np

from maxtrain.data import rows as rows_lib
from maxtrain.data.rows import BATCH_KEYS
from maxtrain.data.sources import DataError, DataReadError  # noqa: F401 (raised by the readers)
from maxtrain.data.tokenizer import make_tokenizer

# ---------------------------------------------------------------------------------------------
# Synthetic data

SYNTHETIC_MAX_STEP = 4  # the best achievable loss on synthetic data is ln(4) = 1.386


def synthetic_batch(step: int, *, seed: int, batch: int, length: int, vocab: int, rows=None) -> dict:
    """A learnable random walk: each token is the previous one plus a uniform step in 1..4, mod vocab.

    A model that learns the successor structure reaches loss ln(4) from ln(vocab), so the curve
    means something. Row r of step s comes from its own generator, seeded by (seed, s, r): a batch is
    the same on any mesh and any number of processes, and resumes from the step alone. `rows` (a
    range, default all `batch`) picks the rows to make: each device's shard makes only its own.
    """
    rows = range(batch) if rows is None else rows
    seq_RxL1 = np.empty((len(rows), length + 1), np.int64)
    for i, row in enumerate(rows):
        rng = np.random.default_rng([seed, step, row])
        seq_RxL1[i, 0] = rng.integers(0, vocab)
        seq_RxL1[i, 1:] = rng.integers(1, SYNTHETIC_MAX_STEP + 1, length)
    seq_RxL1 = (np.cumsum(seq_RxL1, axis=1) % vocab).astype(np.int32)
    shape = (len(seq_RxL1), length)
    return {
        "inputs": seq_RxL1[:, :-1],
        "targets": seq_RxL1[:, 1:],
        "positions": np.broadcast_to(np.arange(length, dtype=np.int32), shape),
        "segment_ids": np.ones(shape, np.int32),
        "weights": np.ones(shape, np.float32),
    }


class SyntheticIterator:
    """Makes each batch on the host, a shard at a time: no compile, and the step is its whole state."""
    stats = None  # no input pipeline to measure

    def __init__(self, c, batch_sharding):
        self._rows = functools.partial(synthetic_batch, seed=c.data_shuffle_seed, batch=c.global_batch_size,
                                       length=c.max_target_length, vocab=c.vocab_size)
        self._sharding = batch_sharding
        self._shape = (c.global_batch_size, c.max_target_length)
        self.step = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        @functools.cache  # devices that hold the same rows (tensor parallelism) share one draw
        def rows(start, stop):
            return self._rows(self.step, rows=range(start, stop))

        def array(key):
            return jax.make_array_from_callback(self._shape, self._sharding, lambda index: rows(
                *index[0].indices(self._shape[0])[:2])[key][:, index[1]])

        batch = {k: array(k) for k in BATCH_KEYS}
        self.step += 1
        return batch

    def skip(self, n: int) -> None:
        self.step += n

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------------
# Batches: a reader on a thread -> global arrays


class _Ahead:
    """Runs an iterator on a daemon thread, `depth` items ahead; an exception is raised to the consumer.
    `busy` and `tokens`: the thread's time inside the iterator and the rows' tokens it made, after the first."""

    def __init__(self, it, depth: int, tokens_per_item: int):
        self._it, self._final = it, None
        self._q: queue.Queue = queue.Queue(depth)
        self._stop = threading.Event()
        self.busy, self.tokens, self.items = 0.0, 0, 0
        self._thread = threading.Thread(target=self._run, args=(it, tokens_per_item), daemon=True,
                                        name="maxtrain-data")
        self._thread.start()

    def _run(self, it, tokens_per_item: int) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                item = (next(it), None)
            except BaseException as e:  # StopIteration included: handed over, then the thread ends
                item = (None, e)
            if self.items:  # the first item's time is the reader's start-up, not its rate
                self.busy += time.perf_counter() - t0
                self.tokens += tokens_per_item
            self.items += 1
            while not self._stop.is_set():
                try:
                    self._q.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if item[1] is not None:
                return

    def __next__(self):
        if self._final is not None:  # the thread has ended: say so again, never wait on it
            raise self._final
        item, error = self._q.get()
        if error is not None:
            self._final = error
            raise error
        return item

    def close(self) -> None:
        self._stop.set()
        getattr(self._it, "close", lambda: None)()  # worker processes, where the reader has them


class Batches:
    """A reader's rows of each global batch -> global jax.Arrays with the batch sharding, made `depth` batches
    ahead on a thread. The position of the last batch handed out is what get_state() saves.

    `pad_after_end`: once this process's rows end, yield batches of weight zero instead of stopping (an eval
    pass over several processes, whose rows end at different batches: the caller stops at a batch whose
    global token count is zero)."""

    DEPTH = 4

    def __init__(self, reader, c, batch_sharding, pad_after_end: bool = False):
        self.reader, self._sharding, self._pad_after_end = reader, batch_sharding, pad_after_end
        self._shape = (c.global_batch_size, c.max_target_length)
        _, _, self._columns = host_region(batch_sharding, self._shape)
        self._local_rows = len(reader.lanes)
        self._tokens_per_batch = self._local_rows * c.max_target_length
        self.waited = 0.0  # time __next__ spent waiting for the reader
        self._position = reader.initial()
        self._ahead = None
        self._primed, self._ended = None, False
        self._start()

    def _start(self) -> None:
        self._ahead = _Ahead(self.reader.open(self._position), self.DEPTH, self._tokens_per_batch)

    def prime(self) -> None:
        """Makes the first batch now (bad input is found before the run starts, exit 2)."""
        try:
            self._primed = next(self._ahead)
        except StopIteration:
            self._primed = StopIteration

    def primed_weight(self) -> float:
        """The tokens the primed first batch scores on, over every process (a collective where there are several)."""
        item = self._primed
        local = 0.0 if item is None or item is StopIteration else float(item[0]["weights"].sum())
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils
        return float(np.sum(multihost_utils.process_allgather(np.float32(local))))

    def __iter__(self):
        return self

    def _next_local(self):
        if self._ended:
            raise StopIteration
        if self._primed is not None:
            item, self._primed = self._primed, None
            if item is StopIteration:  # the data ended before its first batch
                self._ended = True
                raise StopIteration
            return item
        try:
            return next(self._ahead)
        except StopIteration:
            self._ended = True  # the reading thread has ended: never wait on it again
            raise

    def __next__(self) -> dict:
        t0 = time.perf_counter()
        try:
            local, self._position = self._next_local()
        except StopIteration:
            if not self._pad_after_end:
                raise
            local = rows_lib.padding(self._local_rows, self._shape[1])
        except DataError as e:  # a file that became unreadable: the run stops, its checkpoints stay
            raise e if isinstance(e, DataReadError) else DataReadError(str(e)) from None
        finally:
            self.waited += time.perf_counter() - t0
        return {k: jax.make_array_from_process_local_data(self._sharding, v[:, self._columns], self._shape)
                for k, v in local.items()}

    def skip(self, n: int) -> None:
        """Drops the next n batches on the host (a rollback past the batches that led to a spike)."""
        for _ in range(n):
            try:
                _, self._position = self._next_local()
            except StopIteration:
                return

    @property
    def position(self):
        """The reader's position after the last batch handed out (this process's part of it)."""
        return self._position

    def get_state(self) -> dict:
        return self.reader.global_state(self._position)

    def set_state(self, state: dict) -> None:
        position = self.reader.position(state)
        self.close()
        self._position, self._primed, self._ended = position, None, False
        self._start()

    def close(self) -> None:
        if self._ahead is not None:
            self._ahead.close()

    @property
    def stats(self) -> tuple[float, int, float]:
        """(seconds the reader worked, tokens it made, seconds the consumer waited)."""
        return self._ahead.busy, self._ahead.tokens, self.waited


def host_region(batch_sharding, shape) -> tuple[int, int, slice]:
    """This process's part of every [global batch, length] array: (the index of its share of the rows,
    the number of shares, its columns). Processes that split rows' positions between them (the context
    axis across hosts) share rows: they read the same rows and each keeps its own columns."""
    spans = [(i[0].indices(shape[0])[:2], i[1].indices(shape[1])[:2])
             for i in batch_sharding.addressable_devices_indices_map(shape).values()]
    (r0, r1), (c0, c1) = [(min(s[d][0] for s in spans), max(s[d][1] for s in spans)) for d in (0, 1)]
    return r0 // (r1 - r0), shape[0] // (r1 - r0), slice(c0, c1)


# ---------------------------------------------------------------------------------------------
# The config's pipelines


def make_iterators(c, batch_sharding, say=None):
    """(train batches, {eval name: factory of fresh eval batches}; empty without eval data). Each reads its
    first batch before returning: a bad file or tokenizer is one line and exit 2 before anything is written.
    The eval name is the eval source's ("" for eval_files or a held-out part of train_files)."""
    if c.dataset_type == "synthetic" and not c.data_sources:
        return SyntheticIterator(c, batch_sharding), {}
    from maxtrain.data.from_config import make_readers
    tokenizer = make_tokenizer(c)
    share, shares, _ = host_region(batch_sharding, (c.global_batch_size, c.max_target_length))
    per_share = c.global_batch_size // shares
    lanes = range(share * per_share, (share + 1) * per_share)  # processes that share rows read alike
    train_reader, eval_readers, lines = make_readers(c, tokenizer, lanes)
    for line in lines:
        (say or (lambda *_: None))(line)
    batches = Batches(train_reader, c, batch_sharding)
    batches.prime()
    evals = {}
    for name, reader in eval_readers.items():
        def make_eval(reader=reader):
            return Batches(reader, c, batch_sharding, pad_after_end=jax.process_count() > 1)
        first = make_eval()
        first.prime()  # the eval files are checked now too
        empty = first.primed_weight() == 0
        first.close()
        if empty:  # its loss would be 0: a perfect score for nothing
            raise DataError(f"{_eval_set(c, name)}: no tokens to evaluate on (a document needs two tokens or more)")
        evals[name] = make_eval
    return batches, evals


def _eval_set(c, name: str) -> str:
    """An eval set as the config names it."""
    if c.eval_sources:
        return f"eval_sources.{name} ({c.eval_sources[name]['files']})"
    if c.eval_files:
        return f"eval_files ({c.eval_files})"
    held = f"data_sources.{name}" if name else f"train_files ({c.train_files})"
    return f"the held-out part of {held} (eval_split_fraction={c.eval_split_fraction})"


def make_iterator(c, batch_sharding):
    return make_iterators(c, batch_sharding)[0]
