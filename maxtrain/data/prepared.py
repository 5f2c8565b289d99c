"""Prepared data: a corpus tokenized once (python -m maxtrain.prepare) into shards of token ids, read by
index. The layout, local or on a bucket:

    DIR/manifest.json            tokenizer identity, dtype, per shard: source, documents, tokens, sha256
    DIR/shards/NNNNN.tokens      the shard's token ids, little-endian uint16 (vocab <= 65536) or uint32
    DIR/shards/NNNNN.docs        int64 offsets of its documents' first tokens, and its token count last
    DIR/tokenizer.json|.model    a copy of the tokenizer that made it

Why flat token files rather than ArrayRecord: a row is a window of consecutive tokens that crosses
documents, so a flat array reads it in one slice (a memory map locally, one ranged read on a bucket), with
no per-record framing; ArrayRecord's records would be documents (a row would gather many), and its reader
opens local files only. numpy reads the files; grain shuffles and reads them by index.

The corpus is one token stream (shards in order, documents in order). With packing, row w of an epoch is
tokens [w*L, w*L + L] of it, rows shuffled globally by index; without, row d is document d, truncated.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from maxtrain.data import rows as rows_lib
from maxtrain.data.readers import Reader, read_ahead
from maxtrain.data.sources import DataError, DataReadError
from maxtrain.runtime import storage
from maxtrain.runtime.wording import counted

FORMAT, VERSION = "maxtrain-prepared", 1
MANIFEST = "manifest.json"
REWRITE = "the same maxtrain.prepare command writes it again"  # (it checks each shard's size)
DAMAGED = "remove its record (the .json beside it) and run the same maxtrain.prepare command: it writes it again"


def token_dtype(vocab_size: int):
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_paths(directory, name: str) -> tuple:
    base = storage.path(directory) / "shards"
    return base / f"{name}.tokens", base / f"{name}.docs"


class Corpus:
    """A prepared directory, checked at open (its manifest, and each shard's size against it, from one
    listing); shards are opened when a row first needs them."""

    def __init__(self, directory: str):
        self.directory = str(directory).rstrip("/")
        root = storage.path(self.directory, "train_files")
        try:
            text = (root / MANIFEST).read_text(encoding="utf-8")
        except FileNotFoundError:
            started = (root / "shards").exists()
            raise DataError(f"{self.directory}: no {MANIFEST}: " + (
                "maxtrain.prepare did not finish here; run it again to complete it" if started else
                "not a prepared directory (python -m maxtrain.prepare makes one)")) from None
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{self.directory}/{MANIFEST}: cannot read: {storage.error_text(e)}") from None
        try:
            m = json.loads(text)
            assert m["format"] == FORMAT and m["version"] == VERSION
            self.tokenizer = dict(m["tokenizer"])
            self.dtype = np.dtype(m["dtype"])
            self.names = [s["name"] for s in m["shards"]]
            self.shard_tokens = np.array([int(s["tokens"]) for s in m["shards"]], np.int64)
            self.shard_docs = np.array([int(s["documents"]) for s in m["shards"]], np.int64)
        except (ValueError, KeyError, TypeError, AssertionError):
            raise DataError(f"{self.directory}/{MANIFEST}: not a manifest maxtrain.prepare wrote "
                            f"({FORMAT} version {VERSION})") from None
        self.manifest = m
        self.vocab_size = int(self.tokenizer["vocab_size"])
        self.token_start = np.concatenate([[0], np.cumsum(self.shard_tokens)])
        self.doc_start = np.concatenate([[0], np.cumsum(self.shard_docs)])
        self.tokens, self.documents = int(self.token_start[-1]), int(self.doc_start[-1])
        self._check_sizes()

    def _check_sizes(self) -> None:
        listed = listing(self.directory)
        for name, tokens, docs in zip(self.names, self.shard_tokens, self.shard_docs):
            for path, want in zip(shard_paths(self.directory, name), (tokens * self.dtype.itemsize, (docs + 1) * 8)):
                got = listed.get(path.name)
                if got is None:
                    raise DataError(f"{path}: missing (the manifest lists it); {REWRITE}")
                if got != want:
                    raise DataError(f"{path}: {got} bytes where the manifest says {want}: the shard is damaged "
                                    f"or incomplete; {REWRITE}")

    def describe(self) -> str:
        return (f"{self.directory}: {self.tokens:,} tokens in {self.documents:,} documents, "
                f"{counted(len(self.names), 'shard')}")

    # ---- reading

    @functools.lru_cache(maxsize=64)  # noqa: B019 (one corpus per run: the cache lives as long as it)
    def _shard(self, s: int):
        """(tokens, document offsets) of shard s: memory maps, or a reader of ranges on a bucket."""
        tokens_path, docs_path = shard_paths(self.directory, self.names[s])
        try:
            if storage.is_url(self.directory):
                offsets = _Offsets(np.frombuffer(docs_path.read_bytes(), "<i8"), str(docs_path))
                tokens = _Ranged(str(tokens_path), self.dtype)
            else:
                offsets = _Offsets(_Local(str(docs_path), np.dtype("<i8")), str(docs_path))
                tokens = _Local(str(tokens_path), self.dtype)
        except (OSError, ValueError) as e:
            raise DataReadError(f"{tokens_path}: cannot read: {storage.error_text(e)}") from None
        if len(offsets) != self.shard_docs[s] + 1 or offsets[0] != 0 or offsets.tokens != self.shard_tokens[s]:
            raise DataReadError(f"{docs_path}: its document offsets are damaged; {DAMAGED}")
        return tokens, offsets

    def _span(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [start, stop) of the corpus's stream and each one's document (a global index)."""
        pieces_t, pieces_d = [], []
        s = int(np.searchsorted(self.token_start, start, side="right")) - 1
        while start < stop:
            while self.shard_tokens[s] == 0:
                s += 1
            tokens, offsets = self._shard(s)
            lo, hi = start - self.token_start[s], min(stop, self.token_start[s + 1]) - self.token_start[s]
            chunk = np.asarray(tokens[lo:hi])
            if len(chunk) and chunk.max() >= self.vocab_size:
                raise DataReadError(f"{shard_paths(self.directory, self.names[s])[0]}: token id {int(chunk.max())} "
                                    f"is outside the vocabulary ({self.vocab_size}): the shard is damaged; {DAMAGED}")
            pieces_t.append(chunk)
            pieces_d.append(self.doc_start[s] + offsets.documents(int(lo), int(hi)))
            start += hi - lo
            s += 1
        return np.concatenate(pieces_t).astype(np.int32), np.concatenate(pieces_d)

    def windows(self, length: int) -> int:
        """Rows of length + 1 tokens the stream holds (consecutive rows share a token)."""
        return max(0, (self.tokens - 1) // length)

    def window(self, w: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        return self._span(w * length, w * length + length + 1)

    def document(self, d: int, length: int) -> np.ndarray:
        """Document d's first length + 1 tokens."""
        s = int(np.searchsorted(self.doc_start, d, side="right")) - 1
        _, offsets = self._shard(s)
        i = int(d - self.doc_start[s])
        lo, hi = self.token_start[s] + offsets[i], self.token_start[s] + offsets[i + 1]
        return self._span(int(lo), int(min(hi, lo + length + 1)))[0] if hi > lo else np.zeros(0, np.int32)


class _Offsets:
    """A shard's document offsets (n + 1, the first 0, the last its token count): a local file is read a few
    values at a time, a bucket's object whole (a shard's cache entry)."""

    BRACKET = 512  # a binary search reads one value a probe, until this many remain: then those at once

    def __init__(self, values, path: str):
        self.values, self.path = values, path
        self.tokens = self[len(self) - 1]

    def __getitem__(self, i: int) -> int:
        return int(self.values[i:i + 1][0])

    def documents(self, lo: int, hi: int) -> np.ndarray:
        """The document (its index in the shard) of each token lo .. hi - 1."""
        n = len(self) - 1
        # First a guess from the shard's mean document length: one read brackets lo, mostly (a cold disk
        # pays for each read); else a binary search, one value a probe, keeping offsets[a] <= lo < offsets[b].
        guess = lo * n // max(self.tokens, 1)
        a, b = max(0, guess - self.BRACKET), min(n, guess + self.BRACKET)
        starts = np.asarray(self.values[a:b + 1])
        if not starts[0] <= lo < starts[-1]:
            a, b = (b, n) if starts[0] <= lo else (0, a)
            while b - a > self.BRACKET:
                mid = (a + b) // 2
                a, b = (mid, b) if self[mid] <= lo else (a, mid)
            starts = np.asarray(self.values[a:b + 1])
        end = a + len(starts)
        while starts[-1] < hi and end < len(self):  # empty documents can start many times in one window
            end = min(end + self.BRACKET, len(self))
            starts = np.asarray(self.values[a:end])
        return a + np.searchsorted(starts, np.arange(lo, hi), side="right") - 1

    def __len__(self) -> int:
        return len(self.values) if isinstance(self.values, np.ndarray) else self.values.size


class _Local:
    """A local file of numbers, read a slice at a time (pread): the pages a memory map touched would stay in
    the process's resident memory, growing with the tokens a run has read; a file cut short under the run is
    an error here, where a map would end the process (SIGBUS)."""

    def __init__(self, path: str, dtype):
        self.file, self.path, self.dtype = open(path, "rb"), path, dtype
        self.size = os.fstat(self.file.fileno()).st_size // dtype.itemsize

    def __getitem__(self, sl: slice) -> np.ndarray:
        size = self.dtype.itemsize
        want = (int(sl.stop) - int(sl.start)) * size
        data = os.pread(self.file.fileno(), want, int(sl.start) * size)
        if len(data) != want:
            raise DataReadError(f"{self.path}: ends before token {int(sl.stop):,}: the shard changed under the run")
        return np.frombuffer(data, self.dtype)


class _Ranged:
    """A bucket object's tokens, read a slice at a time (one ranged request each)."""

    def __init__(self, url: str, dtype):
        import fsspec
        self.fs, self.path, self.dtype = fsspec.core.url_to_fs(url)[0], url, dtype

    def __getitem__(self, sl: slice) -> np.ndarray:
        size = self.dtype.itemsize
        data = self.fs.cat_file(self.path, start=int(sl.start) * size, end=int(sl.stop) * size)
        return np.frombuffer(data, self.dtype)


def listing(directory: str) -> dict[str, int]:
    """Each shard file's size, from one listing of DIR/shards."""
    root = storage.path(directory) / "shards"
    try:
        if storage.is_url(directory):
            import fsspec
            fs, path = fsspec.core.url_to_fs(str(root))
            return {info["name"].rsplit("/", 1)[-1]: int(info["size"]) for info in fs.ls(path, detail=True)}
        return {p.name: p.stat().st_size for p in root.iterdir()}
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise DataError(f"{root}: cannot list: {storage.error_text(e)}") from None


class PreparedReader(Reader):
    """Rows of a prepared corpus (or a part of it: `first`, `count` rows), by index. Training rows are shuffled
    by grain's index shuffle, a new permutation each epoch; global row g of a run is step g // R, row g % R.
    The position is the step: nothing else to save."""

    by_lane = False

    def __init__(self, corpus: Corpus, c, lanes: range, first: int, count: int, train: bool, seed: int | None = None):
        self.corpus, self.lanes, self.first, self.count, self.train = corpus, lanes, first, count, train
        self.rows, self.length, self.packing = c.global_batch_size, c.max_target_length, c.packing
        self.seed = c.data_shuffle_seed if seed is None else seed
        if train:
            self.steps = None if c.num_epochs == -1 else c.num_epochs * count // self.rows
        else:
            self.steps = -(-count // self.rows)

    def initial(self):
        return 0

    def open(self, step: int):
        """Batches from `step` on, each with the position after it; grain's threads read them ahead."""
        stop = self.steps if self.steps is not None else 2**62
        return read_ahead(self.batch, step, stop, self.remote)

    @property
    def remote(self) -> bool:  # (a bucket's ranged reads wait on the network: read_ahead runs more threads)
        return "://" in self.corpus.directory

    def batch(self, step: int) -> dict:
        tokens, docs, valid = rows_lib.buffers(len(self.lanes), self.length)
        for r, j in enumerate(self.lanes):
            g = step * self.rows + j
            if self.train or g < self.count:  # else the eval part ended: padding
                self.row(g, tokens[r], docs[r], valid[r])
        return rows_lib.features(tokens, docs, valid)

    def row(self, g: int, tokens_L1: np.ndarray, docs_L1: np.ndarray, valid_L1: np.ndarray) -> None:
        """Fills global row g of the run (training: the g-th row drawn, shuffled; eval: row g in order)."""
        index = self.first + (self.shuffled(g) if self.train else g)
        if self.packing:
            t, d = self.corpus.window(index, self.length)
            docs_L1[:len(t)] = d
        else:
            t = self.corpus.document(index, self.length)
        tokens_L1[:len(t)], valid_L1[:len(t)] = t, True

    def shuffled(self, g: int) -> int:
        """Global row g's place in the corpus: grain's index shuffle, seeded anew each epoch (as its
        MapDataset.shuffle().repeat() does)."""
        from grain import experimental as grain_exp
        epoch, i = divmod(g, self.count)
        return grain_exp.index_shuffle(i, max_index=self.count - 1, seed=(self.seed + epoch) % 2**32, rounds=4)

    def global_state(self, step: int) -> dict:
        return {"kind": "prepared", "step": int(step), "rows": self.count}

    def position(self, state: dict) -> int:
        if state.get("kind") != "prepared":
            raise ValueError("not a prepared corpus's position")
        import jax  # (not in maxtrain.prepare's workers)
        if state["rows"] != self.count and jax.process_index() == 0:
            print(f"warning: the prepared data has {self.count:,} rows where the checkpoint's had {state['rows']:,}: "
                  "the order of the rows from here differs from the saved run's", flush=True)
        return int(state["step"])
