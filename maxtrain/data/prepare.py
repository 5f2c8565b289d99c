"""Tokenize a corpus once into prepared shards (maxtrain.data.prepared): the work behind `python -m
maxtrain.prepare`.

The input files are cut into pieces (maxtrain.data.sources); each piece becomes one shard, tokenized by
a pool of worker processes, each with its own tokenizer. A shard is written under a temporary name and
renamed (one object write on a bucket), its small .json record last: a shard with a record is done. An
interrupted job reruns only the pieces without one; the manifest, written last, lists the shards in piece
order whatever order the workers finished in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import time
import types

import numpy as np

from maxtrain.data import prepared, sources
from maxtrain.data.tokenizer import Tokenizer, make_tokenizer
from maxtrain.runtime import storage
from maxtrain.runtime.errors import ConfigError, RunError

PLAN = "prepare.json"  # the job's inputs: a rerun with other inputs into the same directory is refused
LOCK = ".prepare.lock"  # held (flock) by the job writing a local directory; the kernel drops it if killed
ENCODE_DOCS = 512  # documents tokenized together
REPORT_SECONDS = 10.0


class PrepareError(RunError):
    """The job stopped (a shard could not be written): one line, exit 1; finished shards stay."""
    kind = "prepare"


TOKENIZER_KEYS = ("tokenizer_type", "tokenizer_path", "hf_bos_token", "hf_eos_token", "add_bos", "add_eos")


@dataclasses.dataclass(frozen=True)
class Job:
    pieces: tuple[sources.Piece, ...]
    directory: str
    text_field: str
    settings: dict  # the tokenizer keys' values


def plan(c) -> Job:
    """The job a config describes; refuses in one line what cannot run."""
    if not c.prepared_dir:
        raise ConfigError("prepared_dir", "is empty; name the directory (local or gs://) to write the shards to")
    if not c.train_files:
        raise ConfigError("train_files", "is empty; name the files to tokenize (comma-separated globs)")
    storage.check(c.prepared_dir, "prepared_dir")
    files = sources.expand(c.train_files, "train_files")
    default = c.dataset_type if c.dataset_type in ("parquet", "array_record") else "text"
    return Job(tuple(sources.pieces(files, default)), str(c.prepared_dir).rstrip("/"), c.text_field,
               {k: getattr(c, k) for k in TOKENIZER_KEYS})


def tokenizer_of(settings: dict) -> Tokenizer:
    return make_tokenizer(types.SimpleNamespace(**settings, vocab_size=0), check_vocab=False)


def shard_name(i: int) -> str:
    return f"{i:05d}"


# ---------------------------------------------------------------------------------------------
# One piece -> one shard, in a worker process

_worker: dict = {}


def _start_worker(settings: dict) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: the pool is the parallelism
    _worker["tokenizer"] = tokenizer_of(settings)


def _write(job: Job, i: int) -> dict:
    """Tokenizes piece i into shard i; returns its record. Writes go to a local temporary file first."""
    tok: Tokenizer = _worker["tokenizer"]
    piece, name = job.pieces[i], shard_name(i)
    dtype = prepared.token_dtype(tok.vocab_size)
    tokens_path, docs_path = prepared.shard_paths(job.directory, name)
    remote = storage.is_url(job.directory)  # then written locally first, and sent as one object
    scratch = tempfile.mkdtemp(prefix="maxtrain-prepare-") if remote else None
    tmp_tokens = os.path.join(scratch, "tokens") if remote else f"{tokens_path}.tmp"
    offsets, n_tokens, n_bytes, digest = [0], 0, 0, hashlib.sha256()
    try:
        with open(tmp_tokens, "wb") as out:
            texts = []

            def flush():
                nonlocal n_tokens
                for ids in tok.encode_batch(texts):
                    data = ids.astype(dtype).tobytes()
                    out.write(data)
                    digest.update(data)
                    n_tokens += len(ids)
                    offsets.append(n_tokens)
                texts.clear()
            for text in sources.documents(piece, job.text_field):
                texts.append(text)
                n_bytes += len(text)
                if len(texts) == ENCODE_DOCS:
                    flush()
            flush()
        docs = np.asarray(offsets, "<i8").tobytes()
        record = {"name": name, "source": piece.describe(), "documents": len(offsets) - 1, "tokens": n_tokens,
                  "text_bytes": n_bytes, "sha256": digest.hexdigest()}
        if remote:
            with open(tmp_tokens, "rb") as f:
                tokens_path.write_bytes(f.read())
            docs_path.write_bytes(docs)
        else:
            storage.write_atomic(docs_path, docs)
            os.replace(tmp_tokens, tokens_path)
        storage.write_atomic(storage.path(job.directory) / "shards" / f"{name}.json", json.dumps(record))
        return record
    except OSError as e:
        raise PrepareError(f"writing {tokens_path} failed: {storage.error_text(e)}; the shards written so "
                           "far stay: rerun the same command to go on") from None
    finally:
        if scratch:
            shutil.rmtree(scratch, ignore_errors=True)
        elif os.path.exists(tmp_tokens):
            os.unlink(tmp_tokens)


def _run_piece(args) -> dict:
    return _write(*args)


def _remove_partial(job: Job) -> None:
    """Shards a stopped worker left half-written (local directories; remote ones are written whole)."""
    if not storage.is_url(job.directory):
        for tmp in (storage.path(job.directory) / "shards").glob("*.tmp"):
            tmp.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# The job


def _inputs(job: Job, tok: Tokenizer) -> dict:
    return {"pieces": [dataclasses.asdict(p) for p in job.pieces], "text_field": job.text_field,
            "tokenizer": tok.identity(), "format": prepared.FORMAT, "version": prepared.VERSION}


def _done(job: Job, dtype) -> dict[int, dict]:
    """The shards already written: a record, and files of the sizes it gives (a shard cut short, or whose
    record was removed, is written again)."""
    root = storage.path(job.directory) / "shards"
    listed = prepared.listing(job.directory)
    done = {}
    for i in range(len(job.pieces)):
        name = shard_name(i)
        if f"{name}.json" not in listed:
            continue
        try:
            record = json.loads((root / f"{name}.json").read_text())
            sizes = (int(record["tokens"]) * dtype.itemsize, (int(record["documents"]) + 1) * 8)
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (listed.get(f"{name}.tokens"), listed.get(f"{name}.docs")) == sizes:
            done[i] = record
    return done


@contextlib.contextmanager
def _holding(directory: str):
    """The directory to this job alone: a second prepare into it says who holds it (a local directory; two
    jobs into one gs:// prefix are not told apart)."""
    if storage.is_url(directory):
        yield
        return
    path = os.path.join(directory, LOCK)
    try:
        os.makedirs(directory, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError("prepared_dir", f"{directory}: cannot write: {storage.error_text(e)}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ConfigError("prepared_dir", f"{directory} is being written by another maxtrain.prepare (pid "
                              f"{holder}): wait for it to finish, or choose another prepared_dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # and the lock with it


def run(c, say=print) -> dict:
    """Runs (or resumes) the job, holding its directory; returns the manifest."""
    job = plan(c)
    with _holding(job.directory):
        return _run(c, job, say)


def _run(c, job: Job, say) -> dict:
    from maxtrain.runtime.wording import counted, duration
    tok = tokenizer_of(job.settings)
    root = storage.path(job.directory, "prepared_dir")
    inputs = _inputs(job, tok)
    try:
        finished = None
        if (root / prepared.MANIFEST).exists():
            finished = json.loads((root / prepared.MANIFEST).read_text())
            if finished.get("inputs") != inputs:
                raise ConfigError("prepared_dir", f"{job.directory} holds data prepared from other files or "
                                  "another tokenizer; choose another prepared_dir (or remove it)")
        elif (root / PLAN).exists():
            if json.loads((root / PLAN).read_text()) != inputs:
                raise ConfigError("prepared_dir", f"{job.directory} holds an unfinished job with other files or "
                                  "another tokenizer; choose another prepared_dir (or remove it)")
        else:
            (root / "shards").mkdir(parents=True, exist_ok=True)
            storage.write_atomic(root / PLAN, json.dumps(inputs))
    except OSError as e:
        raise ConfigError("prepared_dir", f"{job.directory}: cannot write: {storage.error_text(e)}") from None
    except json.JSONDecodeError:
        raise ConfigError("prepared_dir", f"{job.directory}: its {prepared.MANIFEST} or {PLAN} is not maxtrain's; "
                          "choose another prepared_dir") from None
    done = _done(job, prepared.token_dtype(tok.vocab_size))
    todo = [i for i in range(len(job.pieces)) if i not in done]
    if finished is not None and not todo:
        say(f"nothing to do: {job.directory} is prepared ({counted(finished['documents'], 'document')}, "
            f"{counted(finished['tokens'], 'token')} in {counted(len(finished['shards']), 'shard')})")
        return finished
    workers = max(1, min(len(todo), c.prepare_workers if c.prepare_workers > 0 else os.cpu_count() or 1))
    sizes = [_piece_bytes(p) for p in job.pieces]
    total_bytes = sum(sizes)
    say(f"prepare: {counted(len(job.pieces), 'piece')} of {counted(len(set(p.path for p in job.pieces)), 'file')} "
        f"({total_bytes / 1e9:.2f} GB) -> {job.directory}, {tok.kind} tokenizer (vocab {tok.vocab_size:,}), "
        f"{counted(workers, 'worker')}" + (f"; {counted(len(done), 'piece')} done before, resuming"
                                                    if done else ""))
    t0, last, done_bytes = time.perf_counter(), time.perf_counter(), 0
    new_tokens = 0
    if todo:
        _remove_partial(job)  # a killed run's
        ctx = multiprocessing.get_context("spawn")  # no fork of a process whose tokenizer holds threads
        try:
            with ctx.Pool(workers, initializer=_start_worker, initargs=(job.settings,)) as pool:
                for record in pool.imap_unordered(_run_piece, [(job, i) for i in todo]):
                    i = int(record["name"])
                    done[i] = record
                    done_bytes += sizes[i]
                    new_tokens += record["tokens"]
                    now = time.perf_counter()
                    if now - last >= REPORT_SECONDS or len(done) == len(job.pieces):
                        last = now
                        rate = done_bytes / (now - t0)
                        left = total_bytes - sum(sizes[j] for j in done)
                        eta = duration(left / rate) if rate else "?"
                        say(f"prepare: {len(done)}/{len(job.pieces)} pieces | "
                            f"{sum(r['documents'] for r in done.values()):,} documents, "
                            f"{sum(r['tokens'] for r in done.values()):,} tokens | "
                            f"{new_tokens / (now - t0):,.0f} tokens/s | ETA {eta}")
        except BaseException:  # the pool is terminated: the other workers' shards in writing are partial
            _remove_partial(job)
            raise
    shards = [done[i] for i in range(len(job.pieces))]
    manifest = {"format": prepared.FORMAT, "version": prepared.VERSION, "tokenizer": tok.identity(),
                "dtype": prepared.token_dtype(tok.vocab_size).str, "documents": sum(s["documents"] for s in shards),
                "tokens": sum(s["tokens"] for s in shards), "shards": shards, "inputs": inputs}
    try:
        manifest["tokenizer_file"] = _copy_tokenizer(job, root)
        storage.write_atomic(root / prepared.MANIFEST, json.dumps(manifest, indent=1))
    except OSError as e:
        raise PrepareError(f"writing {root / prepared.MANIFEST} failed: {storage.error_text(e)}; every shard is "
                           "written: rerun the same command to finish") from None
    seconds = time.perf_counter() - t0
    say(f"done: {counted(manifest['documents'], 'document')}, {counted(manifest['tokens'], 'token')} in "
        f"{counted(len(shards), 'shard')}"
        + (f" ({new_tokens / seconds:,.0f} tokens/s, {duration(seconds)})" if todo else "") + f"; train on it with "
        f"dataset_type=prepared train_files={job.directory}")
    return manifest


def _piece_bytes(p: sources.Piece) -> int:
    if p.end >= 0:
        return p.end - p.start
    try:
        return storage.size(storage.path(p.path)) - p.start
    except OSError:
        return 0


def _copy_tokenizer(job: Job, root) -> str:
    """The tokenizer beside its shards: a run can name it there (tokenizer_path=DIR/tokenizer.json)."""
    path = job.settings["tokenizer_path"]
    if job.settings["tokenizer_type"] == "byte" or not path:
        return ""
    name = "tokenizer.model" if job.settings["tokenizer_type"] == "sentencepiece" else "tokenizer.json"
    storage.write_atomic(root / name, storage.path(path).read_bytes())
    return name
