"""Muon against AdamW on Tiny Shakespeare (configs/shakespeare.yml, its learning rate 3e-3 for both), and Adam's
moments in bfloat16: eval loss on the held-out speeches after 300 and 600 steps, and each run's step time on
this machine (median of the logged steps after the first log; each Muon run right after its AdamW run).

    python benchmarks/optimizers.py [--steps 300,600] [--work /tmp/maxtrain-optimizers]
    python benchmarks/optimizers.py --timing 3     # step time only: AdamW and Muon in turn, 60 steps each, 3 rounds

Prints a table of eval losses and step times, and Muon's ratios to AdamW (with --timing: each round's ratio of
the median s/step, the runs of a round back to back, and their median).
"""

import argparse
import json
import shutil
import statistics
from pathlib import Path

import mixture  # same folder

RUNS = [("AdamW", ["opt_type=adamw"]), ("Muon", ["opt_type=muon"])]
# the first length only: Adam's moments narrowed (the state's bytes per parameter: dry_run's line)
NARROW = [("AdamW, nu bfloat16", ["nu_dtype=bfloat16"]),
          ("AdamW, mu and nu bfloat16", ["nu_dtype=bfloat16", "mu_dtype=bfloat16"])]


def run(work: Path, name: str, steps: int, overrides) -> tuple[float, float, float]:
    """(eval loss, median s/step, wall seconds)."""
    row, seconds = mixture.train(work, name, f"steps={steps}", f"eval_interval={steps}", "enable_checkpointing=false",
                                 *overrides)
    rows = [json.loads(x) for x in (work / name / "metrics.jsonl").read_text().splitlines()]
    times = [r["train/step_seconds"] for r in rows if "train/step_seconds" in r][1:]
    return row["eval/loss"], statistics.median(times), seconds


def timing(work: Path, rounds: int) -> None:
    ratios = []
    for r in range(rounds):
        adamw, muon = (run(work, f"time-{name}-{r}", 60, [f"opt_type={name}"])[1] for name in ("adamw", "muon"))
        ratios.append(muon / adamw)
        print(f"round {r + 1}: AdamW {adamw:.3f} s/step, Muon {muon:.3f} s/step, Muon / AdamW {muon / adamw:.2f}x")
    print(f"Muon / AdamW s/step, median of {rounds} rounds: {statistics.median(ratios):.2f}x "
          f"({min(ratios):.2f}-{max(ratios):.2f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", default="300,600")
    ap.add_argument("--timing", type=int, default=0, metavar="ROUNDS")
    ap.add_argument("--work", default="/tmp/maxtrain-optimizers")
    a = ap.parse_args()
    work = Path(a.work)
    shutil.rmtree(work, ignore_errors=True)
    if a.timing:
        return timing(work, a.timing)
    lengths = [int(s) for s in a.steps.split(",")]
    table = []
    for steps in lengths:
        for label, overrides in RUNS + (NARROW if steps == lengths[0] else []):
            table.append((label, steps, *run(work, f"{label.split(',')[0].lower()}-{len(table)}", steps, overrides)))
    print("| optimizer (configs/shakespeare.yml, lr 3e-3) | steps | eval loss | s/step | wall |")
    print("|---|---:|---:|---:|---:|")
    for label, steps, loss, step_s, wall in table:
        print(f"| {label} | {steps} | {loss:.4f} | {step_s:.3f} | {wall:.0f} s |")
    for steps in lengths:
        adamw, muon = (next(r for r in table if r[0] == name and r[1] == steps) for name in ("AdamW", "Muon"))
        print(f"\n{steps} steps: Muon / AdamW eval loss {muon[2] / adamw[2]:.4f}, s/step {muon[3] / adamw[3]:.2f}x")


if __name__ == "__main__":
    main()
