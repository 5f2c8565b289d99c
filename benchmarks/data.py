"""The input pipeline on this machine, in one run: maxtrain.prepare against the tokenizer's own batch encoding
(the limit), and the tokens/s each reader makes per host, drained with no training step, against what the
step of the ~22M-parameter throughput config consumes.

    python benchmarks/data.py [--megabytes 40] [--seconds 5] [--pairs 2]

The limit and maxtrain.prepare run back to back --pairs times (this machine's speed drifts); the ratio is the
median of each pair's. The whole prepare command is timed, its start-up (~2.5 s here) included.

The corpus: shuffled paragraphs of Tiny Shakespeare in jsonl files of 4 MB, made in a temporary folder. The
HF tokenizer is a byte-level BPE of 8192 tokens trained on the same text.
"""

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).parent.parent
sys.path.insert(0, str(REPO / "tests"))
TEXT = REPO / "data" / "tinyshakespeare.txt"


def make_corpus(folder: Path, megabytes: float) -> list[str]:
    import json
    paragraphs = [p for p in TEXT.read_text().split("\n\n") if p.strip()]
    rng, files, size = random.Random(0), [], 0
    folder.mkdir(parents=True, exist_ok=True)
    while size < megabytes * 1e6:
        path = folder / f"part-{len(files):04d}.jsonl"
        with open(path, "w") as f:
            while f.tell() < 4e6 and size + f.tell() < megabytes * 1e6:
                f.write(json.dumps({"text": rng.choice(paragraphs)}) + "\n")
        size += path.stat().st_size
        files.append(str(path))
    return files


def hf_tokenizer(workdir: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train([str(TEXT)], trainers.BpeTrainer(vocab_size=8192, special_tokens=["<pad>", "<s>", "</s>"],
                                               initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(workdir / "tokenizer.json"))
    return workdir / "tokenizer.json"


def encode_batch_rate(files: list[str], tokenizer_json: Path) -> float:
    """The limit: every document in memory, then the tokenizer's own encode_batch on all cores."""
    import json
    from tokenizers import Tokenizer
    docs = [json.loads(line)["text"] for f in files for line in open(f)]
    tok = Tokenizer.from_file(str(tokenizer_json))
    t0 = time.perf_counter()
    tokens = sum(len(e.ids) for e in tok.encode_batch(docs))
    return tokens / (time.perf_counter() - t0)


def prepare_rate(files_glob: str, out: Path, *tokenizer: str) -> tuple[float, float]:
    """(tokens/s of the whole command, wall seconds), from start to the last shard written."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "maxtrain.prepare", str(REPO / "configs" / "base.yml"),
                           f"train_files={files_glob}", f"prepared_dir={out}", *tokenizer],
                          capture_output=True, text=True, cwd=REPO)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(proc.stderr)
    import json
    tokens = json.loads((out / "manifest.json").read_text())["tokens"]
    return tokens / seconds, seconds


def drain(c, seconds: float) -> float:
    """Tokens/s of the train iterator alone, one process, its thread reading ahead."""
    import jax
    import numpy as np
    from maxtrain.data import pipeline as data
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    it = data.make_iterator(c, sharding)
    next(it)
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        next(it)
        tokens += c.global_batch_size * c.max_target_length
    rate = tokens / (time.perf_counter() - t0)
    it.close()
    return rate


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--megabytes", type=float, default=40)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    from throughput import CONFIG, measure  # same folder
    from maxtrain import train
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        files = make_corpus(tmp / "corpus", args.megabytes)
        tok = hf_tokenizer(tmp)
        hf = ("tokenizer_type=huggingface", f"tokenizer_path={tok}", "hf_bos_token=<s>", "hf_eos_token=</s>")
        pairs = []
        for i in range(args.pairs):
            limit = encode_batch_rate(files, tok)
            pairs.append((limit, *prepare_rate(f"{tmp}/corpus/*.jsonl", tmp / f"tok-hf{i}", *hf)))
        limit, rate, seconds = (statistics.median(x) for x in zip(*pairs))
        ratio = statistics.median(r / lim for lim, r, _ in pairs)
        byte_rate, byte_seconds = prepare_rate(f"{tmp}/corpus/*.jsonl", tmp / "tok-byte")
        print(f"corpus: {len(files)} jsonl files, {sum(os.path.getsize(f) for f in files) / 1e6:.0f} MB; "
              f"{os.cpu_count()} cores")
        print(f"| prepare (medians of {args.pairs} back-to-back pairs) | tokens/s | ratio |\n|---|---|---|")
        print(f"| HF BPE 8k: tokenizer's own encode_batch, all documents in memory (the limit) | {limit:,.0f} | 1.00x |")
        print(f"| HF BPE 8k: python -m maxtrain.prepare, whole command ({seconds:.1f} s) | {rate:,.0f} | "
              f"{ratio:.2f}x |")
        print(f"| byte: python -m maxtrain.prepare, whole command ({byte_seconds:.1f} s) | {byte_rate:,.0f} | |")

        step_c = train.load_config(CONFIG + ["dataset_type=text", f"train_files={TEXT}"])
        consumed = step_c.global_batch_size * step_c.max_target_length / measure(step_c, steps=3)["seconds"]
        base = CONFIG + ["max_target_length=1024", "per_device_batch_size=32"]
        rows = [("prepared (byte)", ["dataset_type=prepared", f"train_files={tmp / 'tok-byte'}"]),
                ("prepared (HF BPE 8k)", ["dataset_type=prepared", f"train_files={tmp / 'tok-hf0'}", *hf]),
                ("streamed jsonl (byte)", ["dataset_type=text", f"train_files={tmp}/corpus/*.jsonl"]),
                ("streamed jsonl (HF BPE 8k)", ["dataset_type=text", f"train_files={tmp}/corpus/*.jsonl", *hf])]
        rows += [(f"{name}, grain_worker_count={n}", [*keys, f"grain_worker_count={n}"])
                 for name, keys in rows[2:] for n in (1, 2)]
        import json
        prepared, streamed = {"files": str(tmp / "tok-byte")}, {"files": f"{tmp}/corpus/*.jsonl"}
        rows += [("mixture (data_sources): 2 prepared (byte) sources, 50/50",
                  ["data_sources=" + json.dumps({"a": {**prepared, "weight": 1}, "b": {**prepared, "weight": 1}})]),
                 ("mixture (data_sources): prepared + streamed jsonl (byte), 50/50",
                  ["data_sources=" + json.dumps({"a": {**prepared, "weight": 1}, "b": {**streamed, "weight": 1}})])]
        print(f"\ntrain step ({step_c.num_params / 1e6:.0f}M params, batch {step_c.global_batch_size} x "
              f"{step_c.max_target_length}, 1 CPU device) consumes {consumed:,.0f} tokens/s")
        print("| reader (batch 32 x 1024, one process, drained) | tokens/s per host | / step |\n|---|---|---|")
        for name, keys in rows:
            rate = drain(train.load_config(base + keys), args.seconds)
            print(f"| {name} | {rate:,.0f} | {rate / consumed:,.0f}x |")


if __name__ == "__main__":
    main()
