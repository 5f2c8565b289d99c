"""Interleaved A/B runs of one row of benchmarks/compare.py: each variant in turn, --rounds times.

    python benchmarks/ab.py [--rounds 3] [--steps 4] ROW -- VARIANT [VARIANT ...]

ROW is a row name of compare.py ("small", "medium remat minimal", ...), or "startup": compare.py's
cold startup row (process start to the first step, an empty compilation cache each run; --steps does
not apply). A VARIANT is a space-separated mix of config overrides (`remat_policy=minimal`), XLA flags
(`--xla_cpu_...=...`) and `repo=PATH`, which runs the row on another checkout of maxtrain (e.g. the
commit before a change: `git worktree add /tmp/before HEAD~1`); "" is the row as compare.py runs it.
The `--` keeps a variant that starts with an XLA flag from being read as an option of this script. On
a shared, noisy machine only runs taken one right after the other compare fairly, hence the
interleaving: it prints each run, then each variant's median and range of s/step (or seconds to the
first step) and its ratio to the first variant's median.
"""

import argparse
import statistics
import tempfile

import compare


def parse_variant(text: str):
    overrides, flags, repo = [], [], compare.REPO
    for token in text.split():
        if token.startswith("--"):
            flags.append(token)
        elif token.startswith("repo="):
            repo = token.removeprefix("repo=")
        else:
            overrides.append(token)
    return overrides, " ".join(flags), repo


def main():
    rows = {row[0]: row for row in compare.ROWS}
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("row", choices=sorted(rows) + ["startup"])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if args.row == "startup":
        def measure(extra, flags, repo):
            with tempfile.TemporaryDirectory() as cache:  # empty: a cold start
                sec = compare.startup_seconds(extra, cache, xla_flags=flags, repo=repo)
            return sec, f"{sec:.2f} s to the first step"
        what, unit = "cold starts", "s to the first step"
    else:
        _, overrides, devices, batch = rows[args.row][:4]

        def measure(extra, flags, repo):
            result = compare.run_row(overrides, devices, batch, args.steps, extra, xla_flags=flags, repo=repo)
            return result["seconds"], f"{result['seconds']:.3f} s/step, loss {result['loss']:.4f}"
        what, unit = f"rounds of {args.steps} steps", "s/step"
    parsed = {v: parse_variant(v) for v in args.variants}
    seconds = {v: [] for v in args.variants}
    for i in range(args.rounds):
        for variant, (extra, flags, repo) in parsed.items():
            sec, line = measure(extra, flags, repo)
            seconds[variant].append(sec)
            print(f"round {i + 1} {variant!r}: {line}", flush=True)
    first = statistics.median(seconds[args.variants[0]])
    print(f"\n{args.row}, {args.rounds} interleaved {what}")
    print(f"| variant | median {unit} | range | first / this |\n|---|---|---|---|")
    for variant, runs in seconds.items():
        median = statistics.median(runs)
        print(f"| {variant or '(as compare.py)'} | {median:.3f} | {min(runs):.3f}-{max(runs):.3f} | {first / median:.2f}x |")


if __name__ == "__main__":
    main()
