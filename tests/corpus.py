"""Corpora the tests make: Tiny Shakespeare's paragraphs, shuffled, written in every format maxtrain reads."""

from __future__ import annotations

import gzip
import json
import random
from pathlib import Path

from conftest import SHAKESPEARE

FORMATS = ("txt", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "array_record")


def paragraphs() -> list[str]:
    return [p.strip("\n") for p in SHAKESPEARE.read_text().split("\n\n") if p.strip()]


def write(path: Path, docs: list[str], fmt: str) -> Path:
    """`docs` as one file of format `fmt` (a name from FORMATS); returns its path."""
    path = path.with_name(f"{path.name}.{fmt}")
    if fmt == "txt":
        path.write_text("\n\n".join(docs) + "\n")
    elif fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    elif fmt == "jsonl.gz":
        with gzip.open(path, "wt") as f:
            f.writelines(json.dumps({"text": d}) + "\n" for d in docs)
    elif fmt == "jsonl.zst":
        import zstandard
        data = "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
        path.write_bytes(zstandard.ZstdCompressor().compress(data))
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"text": docs}), path, row_group_size=1000)  # as writers do: a fixed size
    elif fmt == "array_record":
        from array_record.python.array_record_module import ArrayRecordWriter
        writer = ArrayRecordWriter(str(path), "group_size:1")
        for d in docs:
            writer.write(json.dumps({"text": d}).encode())
        writer.close()
    return path


def make(directory: Path, files: int, docs_per_file: int, seed: int = 0, formats=FORMATS) -> list[list[str]]:
    """`files` files, formats in turn, of shuffled paragraphs; returns each file's documents, in the files'
    sorted order."""
    directory.mkdir(parents=True, exist_ok=True)
    rng, pool, out = random.Random(seed), paragraphs(), []
    for i in range(files):
        docs = [pool[rng.randrange(len(pool))] for _ in range(docs_per_file)]
        write(directory / f"part-{i:04d}", docs, formats[i % len(formats)])
        out.append(docs)
    return out
