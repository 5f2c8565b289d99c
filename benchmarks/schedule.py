"""Warmup-stable-decay against cosine on Tiny Shakespeare (configs/shakespeare.yml), and a WSD run extended:
600 steps of each schedule, and a WSD run of 300 steps extended to 600 (the same command with steps=600: it
goes back to its last step at the peak, 240, and only the new end decays), all evaluated on the held-out
speeches.

    python benchmarks/schedule.py [--steps 600] [--decay 0.2] [--warmup 30] [--work /tmp/maxtrain-schedule]

Every run warms up for the same --warmup steps (warmup_steps: a fraction of the schedule would warm the 300-step
run up for half as long as the 600-step one, and the extension would not be the run it extends).

Prints a table of eval losses and the extended run's ratio to the uninterrupted one (within 1% asked).
"""

import argparse
import shutil
from pathlib import Path

import mixture  # same folder


def train(work: Path, name: str, *args) -> tuple[float, float]:
    """(the last eval loss, seconds): benchmarks/mixture.py's run of configs/shakespeare.yml, saving only at the end
    and at the wsd schedule's last stable step (an extension resumes there)."""
    row, seconds = mixture.train(work, name, "checkpoint_period=100000", *args)
    return row["eval/loss"], seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--decay", type=float, default=0.2)
    ap.add_argument("--warmup", type=int, default=30, help="warmup_steps of every run (shakespeare.yml's 5%% of 600)")
    ap.add_argument("--work", default="/tmp/maxtrain-schedule")
    a = ap.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    n, half = a.steps, a.steps // 2
    wsd = ("lr_schedule_type=wsd", f"wsd_decay_steps_fraction={a.decay}")
    every = (f"eval_interval={half}", f"warmup_steps={a.warmup}")
    rows = [("cosine", *train(work, "cosine", f"steps={n}", *every)),
            (f"wsd, {a.decay:g} decay", *train(work, "wsd", f"steps={n}", *every, *wsd))]
    first, t1 = train(work, "extended", f"steps={half}", *every, *wsd)
    extended, t2 = train(work, "extended", f"steps={n}", *every, *wsd)
    rows.append((f"wsd, {half} steps ({first:.4f}) extended to {n}", extended, t1 + t2))
    print(f"| schedule ({n} steps, configs/shakespeare.yml) | eval loss | time |\n|---|---:|---:|")
    for name, loss, seconds in rows:
        print(f"| {name} | {loss:.4f} | {seconds:.0f} s |")
    print(f"\nextended / uninterrupted wsd: {rows[2][1] / rows[1][1]:.4f}; wsd / cosine: {rows[1][1] / rows[0][1]:.4f}")


if __name__ == "__main__":
    main()
