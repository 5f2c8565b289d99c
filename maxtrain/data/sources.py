"""Lazy readers, one per format: a file, or a byte range of one, gives its documents' text one at a time.
Nothing here reads a whole file into memory, and a bad file is one DataError naming it.

Formats go by the file's name: .parquet (column `text_field`), .jsonl / .json (a JSON object per line,
field `text_field`), .array_record / .arrayrecord (UTF-8 or JSON records), any of those text formats
compressed as .gz or .zst, and plain text otherwise (documents separated by blank lines). A name with
no known suffix is read as `dataset_type` says.

Uncompressed text and JSON lines split into byte-range pieces (a line or paragraph belongs to the piece
its first byte is in), so one large file is shared between readers; a compressed or parquet file is one
piece.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import os
from collections.abc import Iterator

from maxtrain.runtime.errors import ConfigError
from maxtrain.runtime import storage
from maxtrain.runtime.errors import RunError, UserError

PIECE_BYTES = 32 << 20  # uncompressed text files split into pieces of this size
COMPRESSIONS = (".gz", ".zst")


class DataError(UserError, RuntimeError):
    """A data file that is missing or unreadable; the message names the file."""
    kind = "data"


class DataReadError(DataError, RunError):
    """A data file that became unreadable while the run trained: exit 1, the saved checkpoints stay."""


@dataclasses.dataclass(frozen=True)
class Piece:
    """A file, or bytes [start, end) of one (end -1: to its end)."""
    path: str
    format: str  # text | jsonl | parquet | array_record
    compression: str = ""  # "" | .gz | .zst
    start: int = 0
    end: int = -1

    def describe(self) -> str:
        return self.path if (self.start, self.end) == (0, -1) else f"{self.path} (bytes {self.start}-{self.end})"


def file_format(path: str, default: str) -> tuple[str, str]:
    """(format, compression) by the file's name; `default` (a dataset_type) for a name without a known suffix."""
    name = path.lower()
    compression = next((c for c in COMPRESSIONS if name.endswith(c)), "")
    name = name[: len(name) - len(compression)]
    if name.endswith(".parquet") and not compression:
        return "parquet", ""
    if name.endswith((".array_record", ".arrayrecord")) and not compression:
        return "array_record", ""
    if name.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl", compression
    if name.endswith(".txt") or compression or default == "text":
        return "text", compression
    return default, ""


def expand(patterns: str, key: str) -> list[str]:
    """Comma-separated globs -> sorted file list (the same on every process); one that matches nothing, or
    none at all, is a config error naming `key`."""
    files = []
    for pattern in (p.strip() for p in patterns.split(",") if p.strip()):
        matched = storage.glob(pattern, key)
        if not matched:
            raise ConfigError(key, f"no file matches {pattern!r}")
        files.extend(matched)
    if not files:
        raise ConfigError(key, "is empty; name the files to read (comma-separated globs)")
    return files


def pieces(files: list[str], default_format: str, piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """Each file as one piece, or (uncompressed text and JSON lines) pieces of `piece_bytes`. Sizes come from
    the file system's listing; nothing is opened."""
    out = []
    for f in files:
        fmt, compression = file_format(f, default_format)
        if fmt == "array_record" and storage.is_url(f):  # array_record's reader opens local files only
            raise DataError(f"{f}: array_record files must be on a local (or mounted) file system")
        if fmt in ("text", "jsonl") and not compression:
            try:
                n = storage.size(storage.path(f))
            except OSError as e:
                raise DataError(f"{f}: cannot read: {storage.error_text(e)}") from None
            bounds = list(range(0, n, piece_bytes)) or [0]
            out.extend(Piece(f, fmt, "", s, -1 if s + piece_bytes >= n else s + piece_bytes) for s in bounds)
        else:
            out.append(Piece(f, fmt, compression))
    return out


def documents(piece: Piece, text_field: str, skip: int = 0) -> Iterator[str]:
    """The piece's documents in file order, after the first `skip` of them."""
    if piece.format == "parquet":
        yield from _parquet(piece.path, text_field, skip)
    elif piece.format == "array_record":
        yield from _array_record(piece.path, text_field, skip)
    else:
        docs = _lines(piece, text_field) if piece.format == "jsonl" else _paragraphs(piece)
        for i, doc in enumerate(docs):
            if i >= skip:
                yield doc


def first_document(files: list[str], default_format: str, text_field: str, usable) -> str | None:
    """The first document for which `usable(text)` holds, reading file after file (a start-up check: stops
    at the first; only an unusable corpus is read to its end)."""
    for piece in pieces(files, default_format):
        for doc in documents(piece, text_field):
            if usable(doc):
                return doc
    return None


# ---------------------------------------------------------------------------------------------
# Text and JSON lines: a byte range of a file, or a whole compressed file


def _open_binary(piece: Piece):
    try:
        raw = storage.path(piece.path).open("rb")
    except (OSError, ValueError) as e:
        raise DataError(f"{piece.path}: cannot open: {storage.error_text(e)}") from None
    if piece.compression == ".gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if piece.compression == ".zst":
        import zstandard
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))
    return raw


def _raw_lines(piece: Piece) -> Iterator[tuple[bytes, bool]]:
    """(line, starts inside the piece) for the piece's lines: those whose first byte is in [start, end), then
    (False) the lines after its end, for a paragraph that runs past it. A line started before `start` is
    the previous piece's. The first item is (b"", whether the line before the piece's first is blank)."""
    with _open_binary(piece) as f:
        try:
            pos, blank_before = piece.start, True
            if pos > 0:
                lo = max(0, pos - 3)
                f.seek(lo)
                before = f.read(pos - lo)  # the bytes just before the piece
                if before.endswith(b"\n"):  # the piece starts with a line: is the one before it blank?
                    ended = before[:-1]
                    cut = ended.rfind(b"\n")
                    blank_before = ended[cut + 1:] in (b"", b"\r") and (cut >= 0 or lo == 0)
                else:  # inside a line: the rest of it is the previous piece's
                    tail = f.readline()
                    blank_before = tail == b"\n" and before.endswith(b"\r") and (
                        pos == 1 or before[:-1].endswith(b"\n"))
                    pos += len(tail)
            yield b"", blank_before
            for line in f:
                yield line, piece.end < 0 or pos < piece.end
                pos += len(line)
        except (OSError, EOFError) as e:  # truncated .gz raises EOFError
            raise DataError(f"{piece.path}: cannot read: {_read_error(e)}") from None
        except Exception as e:  # zstandard.ZstdError for a truncated or corrupt .zst
            if type(e).__name__ != "ZstdError":
                raise
            raise DataError(f"{piece.path}: cannot read: {e}") from None


def _read_error(e: BaseException) -> str:
    if isinstance(e, EOFError):
        return "the compressed file ends early (truncated?)"
    return storage.error_text(e)


def _decode(line: bytes, piece: Piece, what: str) -> str:
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{piece.path}: {what} is not UTF-8 text") from None


def _lines(piece: Piece, text_field: str) -> Iterator[str]:
    number, lines = 0, _raw_lines(piece)
    next(lines)
    for line, inside in lines:
        if not inside:
            return
        number += 1
        if number == 1 and piece.start == 0:
            line = line.removeprefix(b"\xef\xbb\xbf")  # a byte-order mark some editors write
        if not line.strip():
            continue
        where = f"line {number}" if piece.start == 0 else f"line {number} after byte {piece.start}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise DataError(f"{piece.path}: {where} is not a JSON object") from None
        except UnicodeDecodeError:
            raise DataError(f"{piece.path}: {where} is not UTF-8 text") from None
        if not isinstance(record, dict):
            raise DataError(f"{piece.path}: {where} is not a JSON object")
        if text_field not in record:
            raise DataError(f"{piece.path}: {where} has no field {text_field!r} (text_field)")
        yield _as_text(record[text_field], f"{piece.path}: {where}", text_field)


def _paragraphs(piece: Piece) -> Iterator[str]:
    """Documents separated by blank lines; a paragraph belongs to the piece its first line starts in."""
    raw = _raw_lines(piece)
    lines, owned = [], next(raw)[1]
    for line, inside in raw:
        if line in (b"\n", b"\r\n"):  # a blank line
            if lines and (doc := _decode(b"\n".join(lines), piece, "a paragraph")).strip():
                yield doc
            lines, owned = [], True
            if not inside:
                return
            continue
        if not owned:  # the end of the previous piece's paragraph
            continue
        if not lines and not inside:
            return
        line = line[:-1] if line.endswith(b"\n") else line
        lines.append(line[:-1] if line.endswith(b"\r") else line)
    if lines and (doc := _decode(b"\n".join(lines), piece, "a paragraph")).strip():
        yield doc


# ---------------------------------------------------------------------------------------------
# Parquet (by row group) and array_record (by record)


def _parquet(path: str, text_field: str, skip: int) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        f = pq.ParquetFile(storage.path(path).open("rb") if storage.is_url(path) else path, pre_buffer=False)
        schema = f.schema_arrow
    except Exception as e:  # pyarrow raises several types for malformed files
        raise DataError(f"{path}: cannot read as parquet: {type(e).__name__}") from None
    if text_field not in schema.names:
        raise DataError(f"{path}: no column {text_field!r} (text_field); columns: {schema.names}")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DataError(f"{path}: column {text_field!r} (text_field) holds {kind}, not text")
    row = 0
    try:
        for g in range(f.metadata.num_row_groups):  # one row group in memory at a time; skipped ones unread
            n = f.metadata.row_group(g).num_rows
            if row + n <= skip:
                row += n
                continue
            column = f.read_row_group(g, columns=[text_field]).column(0)
            if column.null_count:
                raise DataError(f"{path}: column {text_field!r} (text_field) has empty (null) rows")
            texts = column.to_pylist()
            del column
            yield from texts[max(0, skip - row):]
            row += n
    except DataError:
        raise
    except Exception as e:
        raise DataError(f"{path}: cannot read as parquet: {type(e).__name__}: {str(e)[:200]}") from None
    finally:
        f.close()


def _array_record(path: str, text_field: str, skip: int) -> Iterator[str]:
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    import grain
    try:
        source = grain.sources.ArrayRecordDataSource([path])
        n = len(source)
    except Exception as e:
        raise DataError(f"{path}: cannot open as array_record: {type(e).__name__}") from None
    for index in range(skip, n):
        where = f"{path}: record {index}"
        try:
            record = source[index].decode("utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{where} is not UTF-8 text") from None
        except Exception as e:
            raise DataError(f"{where}: cannot read: {type(e).__name__}") from None
        if not record.startswith("{"):
            yield record
            continue
        try:
            text = json.loads(record)[text_field]
        except (json.JSONDecodeError, TypeError, KeyError):
            raise DataError(f"{where}: not a JSON object with a {text_field!r} field (text_field)") from None
        yield _as_text(text, where, text_field)


def _as_text(value, where: str, text_field: str) -> str:
    """A document's text field, which must be a string (a number would fail later, in the tokenizer)."""
    if not isinstance(value, str):
        raise DataError(f"{where}: field {text_field!r} is {type(value).__name__}, not text")
    return value
