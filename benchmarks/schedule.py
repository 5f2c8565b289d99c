"""Warmup-stable-decay against cosine on Tiny Shakespeare (configs/shakespeare.yml), and a WSD run extended:
600 steps of each schedule, and a WSD run of 300 steps extended to 600 (the same command with steps=600: it
goes back to its last step at the peak, 240, and only the new end decays), all evaluated on the held-out
speeches.

    python benchmarks/schedule.py [--steps 600] [--decay 0.2] [--work /tmp/maxtrain-schedule]

Prints a table of eval losses and the extended run's ratio to the uninterrupted one (within 1% asked).
"""

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).parent.parent


def train(work: Path, name: str, *args) -> tuple[float, float]:
    """(the last eval loss, seconds) of `python -m maxtrain.train configs/shakespeare.yml ...`."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "maxtrain.train", "configs/shakespeare.yml", f"run_name={name}",
                           f"base_output_directory={work}", "sample_interval=0", "metrics_backends=jsonl",
                           "checkpoint_period=100000", *args], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stderr[-2000:])
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "eval/loss" in r][-1]["eval/loss"], time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--decay", type=float, default=0.2)
    ap.add_argument("--work", default="/tmp/maxtrain-schedule")
    a = ap.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    n, half = a.steps, a.steps // 2
    wsd = ("lr_schedule_type=wsd", f"wsd_decay_steps_fraction={a.decay}")
    every = f"eval_interval={half}"
    rows = [("cosine", *train(work, "cosine", f"steps={n}", every)),
            (f"wsd, {a.decay:g} decay", *train(work, "wsd", f"steps={n}", every, *wsd))]
    first, t1 = train(work, "extended", f"steps={half}", every, *wsd)
    extended, t2 = train(work, "extended", f"steps={n}", every, *wsd)
    rows.append((f"wsd, {half} steps ({first:.4f}) extended to {n}", extended, t1 + t2))
    print(f"| schedule ({n} steps, configs/shakespeare.yml) | eval loss | time |\n|---|---:|---:|")
    for name, loss, seconds in rows:
        print(f"| {name} | {loss:.4f} | {seconds:.0f} s |")
    print(f"\nextended / uninterrupted wsd: {rows[2][1] / rows[1][1]:.4f}; wsd / cosine: {rows[1][1] / rows[0][1]:.4f}")


if __name__ == "__main__":
    main()
