"""Does mixing damage the data? Tiny Shakespeare alone for N steps, against Tiny Shakespeare mixed 50/50 with
Python source code for 2N steps (the same Shakespeare tokens), both evaluated on the same held-out tenth of
Shakespeare's speeches (configs/shakespeare.yml's eval_split_fraction; the mixture evaluates each source's
held-out part on its own: eval/shakespeare/loss).

    python benchmarks/mixture.py [--steps 300] [--work /tmp/mixture]

The code corpus: the standard library's .py files of the Python running this (paragraphs split at blank
lines, as text). The ratio is the mixture's Shakespeare eval loss over the alone run's: 1.05 or less asked.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).parent.parent


def code_corpus(folder: Path, megabytes: float = 8.0) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    out, size = folder / "stdlib.txt", 0
    if not out.exists():
        with open(out, "w") as f:
            for path in sorted(Path(os.__file__).parent.glob("*.py")):
                text = path.read_text(errors="replace")
                f.write(text + "\n\n")
                size += len(text)
                if size > megabytes * 1e6:
                    break
    return str(out)


def train(work: Path, name: str, *args) -> tuple[dict, float]:
    """(the last eval row of metrics.jsonl, seconds) of `python -m maxtrain.train configs/shakespeare.yml ...`
    under `work`/`name` (benchmarks/schedule.py runs its schedules through this too)."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "maxtrain.train", "configs/shakespeare.yml", f"run_name={name}",
                           f"base_output_directory={work}", "sample_interval=0", "metrics_backends=jsonl", *args],
                          cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-2000:])
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/loss" in r][-1], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--work", default="/tmp/maxtrain-mixture")
    a = ap.parse_args()
    work = Path(a.work)
    if work.exists():
        import shutil
        shutil.rmtree(work)
    code = code_corpus(work / "code")
    off = "enable_checkpointing=false"
    alone, t_alone = train(work, "alone", f"steps={a.steps}", f"eval_interval={a.steps}", off)
    mix = {"shakespeare": {"files": "data/tinyshakespeare.txt", "weight": 0.5}, "code": {"files": code, "weight": 0.5}}
    mixed, t_mixed = train(work, "mixed", f"steps={2 * a.steps}", f"eval_interval={2 * a.steps}", off, 'train_files=',
                           "data_sources=" + json.dumps(mix))
    ratio = mixed["eval/shakespeare/loss"] / alone["eval/loss"]
    print("| run | steps | Shakespeare tokens | Shakespeare eval loss | code eval loss | time |")
    print("|---|---:|---:|---:|---:|---:|")
    print(f"| Shakespeare alone | {a.steps} | {a.steps * 8 * 256:,} | {alone['eval/loss']:.4f} | | {t_alone:.0f} s |")
    print(f"| 50/50 with Python code | {2 * a.steps} | {a.steps * 8 * 256:,} | {mixed['eval/shakespeare/loss']:.4f} | "
          f"{mixed['eval/code/loss']:.4f} | {t_mixed:.0f} s |")
    print(f"\nratio (mixed / alone, Shakespeare eval loss): {ratio:.3f}")


if __name__ == "__main__":
    main()
