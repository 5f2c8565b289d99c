"""Input pipelines. Each yields global batches: dicts of [global_batch, max_target_length] arrays
(inputs, targets, positions, segment_ids, weights) laid out with the config's batch sharding.

Real data: files -> documents -> this process's share -> shuffle (per epoch) -> tokenize ->
pack (grain concat-then-split: documents continue into the next row, segment ids and per-document
positions mark the boundaries) or pad -> batch -> global jax.Array. Iterators expose
`get_state()` / `set_state()` (plain JSON) so checkpoints hold the exact data position.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING

import jax
import numpy as np

from maxtrain.runtime import storage
from maxtrain.config.load import Config
from maxtrain.config.keys import ConfigError
from maxtrain.runtime.errors import UserError
from maxtrain.data.tokenizer import Tokenizer, make_tokenizer

if TYPE_CHECKING:  # grain, and the orbax it imports, load only where file data needs them: faster synthetic starts
    import grain


class DataError(UserError, RuntimeError):
    """A data file that is missing or unreadable; the message names the file."""
    kind = "data"


# A batch's [batch, length] arrays and their dtypes.
BATCH_DTYPES = {"inputs": np.int32, "targets": np.int32, "positions": np.int32, "segment_ids": np.int32,
                "weights": np.float32}
BATCH_KEYS = tuple(BATCH_DTYPES)


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

    def __init__(self, c: Config, batch_sharding):
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


# ---------------------------------------------------------------------------------------------
# Documents from files


def expand_files(patterns: str, key: str) -> list[str]:
    """Comma-separated globs -> sorted file list (the same on every process)."""
    files = []
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        matched = storage.glob(pattern, key)
        if not matched:
            raise ConfigError(key, f"no file matches {pattern!r}")
        files.extend(matched)
    if not files:
        raise ConfigError(key, "is empty; name the files to read (comma-separated globs)")
    return files


def _as_text(value, where: str, text_field: str) -> str:
    """A document's text field, which must be a string (a number would fail later, inside grain)."""
    if not isinstance(value, str):
        raise DataError(f"{where}: field {text_field!r} is {type(value).__name__}, not text")
    return value


def _read_text_file(path: str, text_field: str) -> list[str]:
    try:
        text = storage.path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read as UTF-8 text: {e}") from None
    if path.endswith(".jsonl"):
        docs = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)[text_field]
            except (json.JSONDecodeError, TypeError):
                raise DataError(f"{path}: line {number} is not a JSON object") from None
            except KeyError:
                raise DataError(f"{path}: line {number} has no field {text_field!r} (text_field)") from None
            docs.append(_as_text(doc, f"{path}: line {number}", text_field))
        return docs
    # Plain text: documents are separated by blank lines.
    return [d.strip("\n") for d in text.split("\n\n") if d.strip()]


def _read_parquet(path: str, text_field: str) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        table = pq.read_table(storage.path(path).open("rb") if storage.is_url(path) else path)
    except Exception as e:  # pyarrow raises several types for malformed files
        raise DataError(f"{path}: cannot read as parquet: {type(e).__name__}") from None
    if text_field not in table.column_names:
        raise DataError(f"{path}: no column {text_field!r} (text_field); columns: {table.column_names}")
    column = table.column(text_field)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise DataError(f"{path}: column {text_field!r} (text_field) holds {column.type}, not text")
    if column.null_count:
        raise DataError(f"{path}: column {text_field!r} (text_field) has {column.null_count} empty (null) rows")
    return column.to_pylist()


class _ArrayRecordText:
    """array_record records as text: UTF-8 bytes, or JSON objects with a text field."""

    def __init__(self, files: list[str], text_field: str):
        for f in files:
            if storage.is_url(f):  # array_record's reader opens local files only
                raise DataError(f"{f}: array_record files must be on a local (or mounted) file system")
            if not Path(f).is_file():
                raise DataError(f"{f}: no such file")
        import grain

        try:
            self._source = grain.sources.ArrayRecordDataSource(files)
            len(self._source)
        except Exception as e:
            raise DataError(f"{', '.join(files)}: cannot open as array_record: {type(e).__name__}") from None
        self._field, self._files = text_field, files

    def __len__(self):
        return len(self._source)

    def __getitem__(self, index):
        # Records are read lazily, in grain's threads: a bad one names the files and the record.
        where = f"{', '.join(self._files)}: record {index}"
        try:
            record = self._source[index].decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{where} is not UTF-8 text") from None
        if not record.startswith("{"):
            return record
        try:
            text = json.loads(record)[self._field]
        except (json.JSONDecodeError, TypeError, KeyError):
            raise DataError(f"{where}: not a JSON object with a {self._field!r} field (text_field)") from None
        return _as_text(text, where, self._field)


def document_source(c: Config, files: list[str]):
    """A random-access sequence of document strings."""
    if c.dataset_type == "array_record":
        return _ArrayRecordText(files, c.text_field)
    read = _read_parquet if c.dataset_type == "parquet" else _read_text_file
    docs = []
    for f in files:
        docs.extend(read(f, c.text_field))
    return docs


def split_documents(c: Config):
    """(train documents, eval documents or None), following train/eval_files and eval_split_fraction."""
    train = document_source(c, expand_files(c.train_files, "train_files"))
    if c.eval_files:
        return train, document_source(c, expand_files(c.eval_files, "eval_files"))
    if c.eval_split_fraction > 0:
        n_eval = max(1, int(len(train) * c.eval_split_fraction))
        cut = len(train) - n_eval
        import grain
        return grain.MapDataset.source(train)[:cut], grain.MapDataset.source(train)[cut:]
    return train, None


# ---------------------------------------------------------------------------------------------
# The grain pipeline


def _to_features(tokens: np.ndarray) -> dict:
    """One document's tokens -> next-token inputs/targets, shifted inside the document."""
    return {"inputs": tokens[:-1], "targets": tokens[1:]}


def _pad(features: dict, length: int) -> dict:
    """packing=false: one document per row, truncated or zero-padded to `length`."""
    out = {}
    n = min(len(features["inputs"]), length)
    for name in ("inputs", "targets"):
        row = np.zeros(length, np.int32)
        row[:n] = features[name][:n]
        out[name] = row
    out["inputs_segment_ids"] = (np.arange(length) < n).astype(np.int32)
    out["inputs_positions"] = np.where(out["inputs_segment_ids"], np.arange(length), 0).astype(np.int32)
    out["targets_segment_ids"] = out["inputs_segment_ids"]
    return out


def _to_batch(packed: dict) -> dict:
    return {
        "inputs": packed["inputs"].astype(np.int32),
        "targets": packed["targets"].astype(np.int32),
        "positions": packed["inputs_positions"].astype(np.int32),
        "segment_ids": packed["inputs_segment_ids"].astype(np.int32),
        # Padding (segment 0) is masked out of the loss; targets never cross documents because
        # each document was shifted on its own before packing.
        "weights": (packed["targets_segment_ids"] != 0).astype(np.float32),
    }


def make_dataset(c: Config, documents, tokenizer: Tokenizer, *, process_index: int, process_count: int,
                 train: bool) -> grain.IterDataset:
    """This process's batches (numpy), [global_batch / process_count, max_target_length] each."""
    import grain
    from grain import experimental as grain_exp
    ds = grain.MapDataset.source(documents)
    ds = ds[process_index::process_count]  # disjoint shares, by document
    if train:
        ds = ds.shuffle(seed=c.data_shuffle_seed + process_index)
        ds = ds.repeat(None if c.num_epochs == -1 else c.num_epochs)  # reshuffled every epoch
    ds = ds.map(lambda text: _to_features(tokenizer.encode(text)))
    ds = ds.filter(lambda f: len(f["inputs"]) > 0)
    length = c.max_target_length
    if c.packing:
        ds = grain_exp.ConcatThenSplitIterDataset(ds.to_iter_dataset(),
                                                  length_struct={"inputs": length, "targets": length})
    else:
        ds = ds.map(functools.partial(_pad, length=length)).to_iter_dataset()
    ds = ds.batch(c.global_batch_size // process_count, drop_remainder=True).map(_to_batch)
    if c.grain_worker_count > 0:
        from absl import flags  # grain's workers read absl flags; we never parse argv with absl
        if not flags.FLAGS.is_parsed():
            flags.FLAGS.mark_as_parsed()
        ds = ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=c.grain_worker_count))
    else:
        ds = grain_exp.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=2)
    return ds


class GrainIterator:
    """Turns each process's numpy batches into global jax.Arrays with the batch sharding.

    `pad_after_end`: once this process's share is used up, yield batches of weight zero instead of
    stopping. With several processes the shares end at different batches, and a process that stopped
    would leave the others waiting in the step's collectives; the caller stops when a batch's global
    token count is zero (evaluate() in train.py).
    """

    def __init__(self, dataset: grain.IterDataset, c: Config, batch_sharding, pad_after_end: bool = False):
        self._iter = iter(dataset)
        self._sharding = batch_sharding
        self._shape = (c.global_batch_size, c.max_target_length)
        _, shares, self._columns = host_region(batch_sharding, self._shape)
        self._local_shape = (c.global_batch_size // shares, self._columns.stop - self._columns.start)
        self._pad_after_end = pad_after_end

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        try:
            local = next(self._iter)
        except StopIteration:
            if not self._pad_after_end:
                raise
            local = {k: np.zeros(self._local_shape, dtype) for k, dtype in BATCH_DTYPES.items()}
        return {k: jax.make_array_from_process_local_data(self._sharding, v[:, self._columns], self._shape)
                for k, v in local.items()}

    def skip(self, n: int) -> None:
        """Drops the next n batches on the host (a rollback past the batches that led to a spike)."""
        for _ in range(n):
            next(self._iter, None)

    def get_state(self) -> dict:
        return self._iter.get_state()

    def set_state(self, state: dict) -> None:
        self._iter.set_state(state)


def host_region(batch_sharding, shape) -> tuple[int, int, slice]:
    """This process's part of every [global batch, length] array: (the index of its share of the rows,
    the number of shares, its columns). Processes that split rows' positions between them (the context
    axis across hosts) share rows: they read the same documents and each keeps its own columns."""
    spans = [(i[0].indices(shape[0])[:2], i[1].indices(shape[1])[:2])
             for i in batch_sharding.addressable_devices_indices_map(shape).values()]
    (r0, r1), (c0, c1) = [(min(s[d][0] for s in spans), max(s[d][1] for s in spans)) for d in (0, 1)]
    return r0 // (r1 - r0), shape[0] // (r1 - r0), slice(c0, c1)


def check_usable(documents, tokenizer: Tokenizer, c: Config, share_index: int = 0, shares: int = 1) -> None:
    """This process's share must hold a document with a token to predict: otherwise the pipeline, which
    drops empty documents and repeats, would search forever. Stops at the first usable document."""
    share = range(share_index, len(documents), shares)
    for i in share:
        if len(tokenizer.encode(documents[i])) >= 2:
            return
    whose = f" for share {share_index} of {shares}" if shares > 1 else ""
    if not len(share):
        raise DataError(f"{c.train_files}: no documents{whose}: nothing to train on")
    raise DataError(f"{c.train_files}: none of its {len(share)} documents{whose} has two tokens or more "
                    f"(add_bos={c.add_bos}, add_eos={c.add_eos}): nothing to train on")


def make_iterators(c: Config, batch_sharding):
    """(train iterator, factory of fresh eval iterators or None)."""
    if c.dataset_type == "synthetic":
        return SyntheticIterator(c, batch_sharding), None
    tokenizer = make_tokenizer(c)
    train_docs, eval_docs = split_documents(c)
    share_index, shares, _ = host_region(batch_sharding, (c.global_batch_size, c.max_target_length))
    check_usable(train_docs, tokenizer, c, share_index, shares)
    where = dict(process_index=share_index, process_count=shares)  # processes sharing rows read alike
    train_iter = GrainIterator(make_dataset(c, train_docs, tokenizer, train=True, **where), c, batch_sharding)
    if eval_docs is None:
        return train_iter, None
    return train_iter, lambda: GrainIterator(make_dataset(c, eval_docs, tokenizer, train=False, **where), c,
                                             batch_sharding, pad_after_end=jax.process_count() > 1)


def make_iterator(c: Config, batch_sharding):
    return make_iterators(c, batch_sharding)[0]
