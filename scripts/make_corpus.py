"""A corpus to try the data path on: Tiny Shakespeare's paragraphs, shuffled, in files of one format.

    python scripts/make_corpus.py OUT_DIR [--megabytes 100] [--file-megabytes 64]
                                  [--format jsonl|jsonl.gz|jsonl.zst|txt|parquet] [--seed 0]

Writes OUT_DIR/part-NNNNN.<format> until the corpus holds --megabytes of text (streamed out: memory stays
small whatever the size).
"""

import argparse
import gzip
import json
import random
import sys
from pathlib import Path

TEXT = Path(__file__).resolve().parent.parent / "data" / "tinyshakespeare.txt"


def open_out(path: Path, fmt: str):
    if fmt == "jsonl.gz":
        return gzip.open(path, "wt", compresslevel=1)
    if fmt == "jsonl.zst":
        import io
        import zstandard
        return io.TextIOWrapper(zstandard.ZstdCompressor(level=1).stream_writer(open(path, "wb")), "utf-8")
    return open(path, "w")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--megabytes", type=float, default=100)
    parser.add_argument("--file-megabytes", type=float, default=64)
    parser.add_argument("--format", default="jsonl", choices=["jsonl", "jsonl.gz", "jsonl.zst", "txt", "parquet"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    paragraphs = [p.strip("\n") for p in TEXT.read_text().split("\n\n") if p.strip()]
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    total, n = 0, 0
    while total < args.megabytes * 1e6:
        path = args.out / f"part-{n:05d}.{args.format}"
        size = min(args.file_megabytes * 1e6, args.megabytes * 1e6 - total)
        written, docs = 0, []
        if args.format == "parquet":
            while written < size:
                docs.append(rng.choice(paragraphs))
                written += len(docs[-1]) + 1
            import pyarrow as pa
            import pyarrow.parquet as pq
            pq.write_table(pa.table({"text": docs}), path, row_group_size=10_000)
        else:
            with open_out(path, args.format) as f:
                while written < size:
                    doc = rng.choice(paragraphs)
                    line = doc + "\n\n" if args.format == "txt" else json.dumps({"text": doc}) + "\n"
                    f.write(line)
                    written += len(line)
        total += written
        n += 1
    print(f"{n} files, {total / 1e6:,.0f} MB of text in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
