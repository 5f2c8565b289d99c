"""Paths or URLs: every path a user gives (outputs, checkpoints, data, tokenizers, HF import/export) may be
a local path or a URL such as gs://bucket/dir.

A local path stays a pathlib.Path and behaves exactly as before. A URL becomes an etils.epath.Path, whose
file operations go through fsspec (gcsfs for gs://); checkpoints go through Orbax and tensorstore, which
write gs:// themselves. This module checks the scheme (an unknown one, or a missing backend package, is
one config line naming the key), and points every client at a local emulator when the standard
STORAGE_EMULATOR_HOST is set (gcsfs reads it itself; tensorstore and the rest are told here).

Object stores have no rename: an object write is atomic (the object appears whole or not at all), so
atomic writes write the object directly, and "append" rewrites the object with the added bytes.
"""

from __future__ import annotations

import glob as glob_lib
import logging
import os
import pathlib
import shutil
import time
from typing import Any, Union

from maxtrain.runtime.errors import UserError

# URL schemes accepted, and the package whose fsspec filesystem serves them (Orbax's tensorstore writes
# both natively).
BACKENDS = {"gs": ("gcsfs", "pip install 'maxtrain[gcs]'"), "s3": ("s3fs", "pip install s3fs")}

AnyPath = Union[pathlib.Path, Any]  # pathlib.Path, or etils.epath.Path for a URL


class StorageError(UserError, ValueError):
    """A path whose scheme cannot be used: printed as `config error: <key>: ...`, exit code 2."""
    kind = "config"

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def scheme(value: str) -> str | None:
    """'gs' for 'gs://bucket/x', None for a local path."""
    head, sep, _ = str(value).partition("://")
    return head.lower() if sep and head and "/" not in head else None


def is_url(value) -> bool:
    return scheme(str(value)) is not None


def check(value: str, key: str) -> None:
    """Refuses, in one line naming `key`, a URL whose scheme is unknown or whose backend is not installed."""
    s = scheme(value)
    if s is None:
        return
    if s not in BACKENDS:
        raise StorageError(key, f"{value}: unsupported scheme {s}:// (use a local path, "
                           f"{' or '.join(f'{b}://' for b in BACKENDS)})")
    if not _bucket(value):
        raise StorageError(key, f"{value!r} names no bucket (e.g. {s}://BUCKET/path)")
    package, install = BACKENDS[s]
    import importlib.util
    if importlib.util.find_spec(package) is None:
        raise StorageError(key, f"{value}: {s}:// needs the {package} package: {install}")
    configure()


def path(value, key: str = "path") -> AnyPath:
    """A local path as pathlib.Path (unchanged), a URL as an epath.Path (after check)."""
    if isinstance(value, pathlib.Path):
        return value
    if not is_url(value):
        return pathlib.Path(value)
    check(str(value), key)
    from etils import epath
    text = str(value)
    return epath.Path(scheme(text) + text[text.index("://"):])  # GS://b/x as gs://b/x: epath knows lower case


def absolute(value, key: str = "path") -> AnyPath:
    p = path(value, key)
    return p.absolute() if isinstance(p, pathlib.Path) else p


_configured = False


def configure() -> None:
    """Points every storage client at STORAGE_EMULATOR_HOST when it is set (a local GCS emulator): gcsfs
    reads the variable itself; tensorstore (Orbax's arrays) reads TENSORSTORE_GCS_HTTP_URL and needs a token
    it does not look up; gcsfs's bucket-layout probe uses a gRPC API no emulator serves. Listing caches are
    off: tensorstore writes objects behind gcsfs's back, so a cached listing would miss them."""
    global _configured
    if _configured:
        return
    _configured = True
    emulator = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if emulator and emulator != "default":
        url = emulator if emulator.startswith(("http://", "https://")) else f"http://{emulator}"
        os.environ.setdefault("TENSORSTORE_GCS_HTTP_URL", url)
        os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
        os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    # gcsfs logs each failed request with a traceback before it retries; a failure that remains is
    # reported by maxtrain in one line.
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)
    import fsspec.config
    for protocol in ("gs", "gcs", "s3"):
        fsspec.config.conf.setdefault(protocol, {}).setdefault("use_listings_cache", False)


# ---------------------------------------------------------------------------------------------
# Operations that differ between a local disk and an object store


def glob(pattern: str, key: str) -> list[str]:
    """Sorted matches of a glob (`**` recursive), as strings in the pattern's form (URLs keep their scheme)."""
    s = scheme(pattern)
    if s is None:
        return sorted(m for m in glob_lib.glob(pattern, recursive=True) if not os.path.isdir(m))
    check(pattern, key)
    import fsspec
    t0 = time.perf_counter()
    try:
        found = fsspec.filesystem(s).glob(pattern, detail=True)  # one listing, with each match's type
    except Exception as e:  # noqa: BLE001 - no network, no credentials: aiohttp's, google.auth's, gcsfs's own
        raise _unreachable(key, pattern, e, t0) from None
    return sorted(f"{s}://{m}" for m, info in found.items() if info.get("type") != "directory")


def error_text(e: BaseException) -> str:
    """An OSError's text and errno, or an object store's error in one line."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} [errno {e.errno}]"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _bucket(url) -> str:
    return str(url).split("://", 1)[1].split("/", 1)[0]


def _unreachable(key: str, url, e: BaseException, t0: float) -> StorageError:
    """A store that did not answer: one line naming it, what it said, and how long its client retried."""
    return StorageError(key, f"cannot reach {scheme(str(url))}://{_bucket(url)} ({error_text(e)}; the client "
                        f"retried for {time.perf_counter() - t0:.0f} s)")


def check_bucket(p: AnyPath, key: str) -> None:
    """A URL's bucket must exist before a run writes into it or reads from it (an object store would fail
    only at the first write, or answer a read it cannot make as "no such file")."""
    if isinstance(p, pathlib.Path):
        return
    s, bucket = scheme(str(p)), _bucket(p)
    t0 = time.perf_counter()
    try:
        import fsspec
        found = fsspec.filesystem(s).exists(bucket)
    except Exception as e:  # noqa: BLE001 - no credentials, no network: say what the store said
        raise _unreachable(key, p, e, t0) from None
    if not found:
        raise StorageError(key, f"{p}: no bucket {s}://{bucket} (or no access to it)")


def write_atomic(p: AnyPath, data: str | bytes) -> None:
    """`p` holds the old content or the new, never part of it: a temporary sibling renamed over it on a
    local disk; one object write (atomic by itself) on an object store."""
    binary = isinstance(data, bytes)
    if not isinstance(p, pathlib.Path):
        p.write_bytes(data) if binary else p.write_text(data)
        return
    tmp = p.with_name(p.name + ".tmp")
    try:
        tmp.write_bytes(data) if binary else tmp.write_text(data)
        os.replace(tmp, p)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def size(p: AnyPath) -> int:
    if isinstance(p, pathlib.Path):
        return p.stat().st_size
    return int(p.stat().length)


def rmtree(p: AnyPath) -> None:
    """Removes a directory tree; never raises (a clean-up)."""
    try:
        if isinstance(p, pathlib.Path):
            shutil.rmtree(p, ignore_errors=True)
        elif p.exists():
            p.rmtree()
    except Exception:  # gcsfs and friends raise their own types
        pass


def upload_tree(local: pathlib.Path, target: AnyPath) -> None:
    """Copies a local directory's files under `target` (a URL), every file one object write."""
    for f in sorted(local.rglob("*")):
        if f.is_file():
            (target / f.relative_to(local).as_posix()).write_bytes(f.read_bytes())


def download_tree(source: AnyPath, local: pathlib.Path) -> None:
    """Copies the files under `source` (a URL) into a local directory."""
    import fsspec
    s, root = str(source).split("://", 1)
    fs = fsspec.filesystem(s)
    root = root.rstrip("/")
    for f in fs.find(root):
        dest = local / f[len(root):].lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(fs.cat_file(f))


UPLOAD_SECONDS = 30.0  # an appended object is written again at most this often (and on close)


class AppendedObject:
    """A file opened for appending on an object store: objects cannot grow, so a flush writes the object
    again, its old bytes and the new ones (tensorboardX's own gs:// writer works the same way). Each log line
    would upload the whole file, a cost that grows with the run: flush() uploads at most every
    UPLOAD_SECONDS, close() always (a kill loses at most that much of the log; a resume trims it anyway).
    No fileno(): there is nothing to fsync."""

    def __init__(self, p: AnyPath):
        self.path, self.name, self.closed = p, str(p), False
        self._data = bytearray(p.read_bytes() if p.exists() else b"")
        self._written, self._uploaded_at = len(self._data), float("-inf")

    def write(self, data) -> int:
        self._data += data if isinstance(data, (bytes, bytearray)) else data.encode("utf-8")
        return len(data)

    def flush(self, now: bool = False) -> None:
        due = now or time.monotonic() - self._uploaded_at >= UPLOAD_SECONDS
        if not self.closed and len(self._data) != self._written and due:
            self.path.write_bytes(bytes(self._data))
            self._written, self._uploaded_at = len(self._data), time.monotonic()

    def close(self) -> None:
        if not self.closed:
            self.flush(now=True)
            self.closed = True


def open_append(p: AnyPath):
    """A text file to append lines to: the local file itself, or an AppendedObject for a URL."""
    return open(p, "a") if isinstance(p, pathlib.Path) else AppendedObject(p)
