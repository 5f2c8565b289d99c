"""The output directory of a conversion (--out): checked before any work, written under a temporary
sibling name, renamed when complete. A failure (a file in the way, a read-only or full disk, bad input
found half-way) is one line naming --out and leaves nothing behind. An --out URL (gs://) has no rename:
the output is written into a local temporary directory and uploaded when complete, one object per file."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from maxtrain.runtime import storage
from maxtrain.checkpoint.describe import os_error_text
from maxtrain.runtime.errors import UserError
from maxtrain.runtime.errors import ConvertError


def unwritable(out_path: Path, e: BaseException) -> ConvertError:
    return ConvertError(f"--out: cannot write {out_path}: {os_error_text(e)}")


def check_out(out_path: Path) -> None:
    """Refuses an --out that holds something or cannot be written, before any work is done."""
    if storage.is_url(out_path):
        try:
            taken = out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir()))
        except Exception as e:  # an object store's own error types (no such bucket, no permission)
            raise unwritable(out_path, e) from None
        if taken:
            raise ConvertError(f"--out: {out_path} already exists and is not empty")
        return
    try:
        taken = out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir()))
        existing = next(p for p in out_path.parents if p.exists())
    except OSError as e:
        raise unwritable(out_path, e) from None
    if taken:
        raise ConvertError(f"--out: {out_path} already exists and is not empty")
    if not existing.is_dir():
        raise ConvertError(f"--out: cannot write {out_path}: {existing} is a file, not a directory")
    with staged(out_path, keep=False):  # can the directory beside it be written?
        pass


@contextmanager
def staged(out_path: Path, keep: bool = True):
    """Yields a temporary sibling directory to write into, renamed to `out_path` when the block completes
    (`keep`). On any failure nothing stays: not the temporary directory, nor the parents made for it."""
    if storage.is_url(out_path):
        with _staged_upload(out_path, keep) as tmp:
            yield tmp
        return
    made: list[Path] = []
    tmp, done = None, False
    try:
        made = [p for p in (out_path.parent, *out_path.parent.parents) if not p.exists()]  # innermost first
        out_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.partial-", dir=out_path.parent))
    except OSError as e:
        _remove(tmp, made)
        raise unwritable(out_path, e) from None
    try:
        yield tmp
        if keep:
            _honour_umask(tmp)
            if out_path.exists():
                out_path.rmdir()  # empty (checked before)
            tmp.rename(out_path)
            done = True
    except UserError:
        raise
    except OSError as e:  # disk full, read-only, permissions: this is about --out
        raise unwritable(out_path, e) from None
    finally:
        if not done:
            _remove(tmp, made)


@contextmanager
def _staged_upload(out_path, keep: bool):
    """staged() for a URL: a local temporary directory, uploaded to `out_path` when the block completes."""
    tmp = Path(tempfile.mkdtemp(prefix=f"maxtrain-{out_path.name}.partial-"))
    try:
        yield tmp
        if keep:
            try:
                storage.upload_tree(tmp, out_path)
            except Exception as e:  # an object store's own error types: a part-upload is removed
                storage.rmtree(out_path)
                raise unwritable(out_path, e) from None
    except UserError:
        raise
    except OSError as e:
        raise unwritable(out_path, e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    try:  # Linux states it; os.umask can only read it by setting it, for every thread at once
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("Umask:"))
        return int(line.split()[1], 8)
    except (OSError, StopIteration, ValueError, IndexError):
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def _honour_umask(root: Path) -> None:
    """The modes a plain mkdir and open would have given: mkdtemp makes the directory 0700 and safetensors
    writes its files 0600, so a group that shares the models could not read them."""
    mask = _umask()
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~mask)


def _remove(tmp: Path | None, made: list[Path]) -> None:
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    for p in made:
        try:
            p.rmdir()
        except OSError:  # not empty: something else put it there meanwhile
            pass
