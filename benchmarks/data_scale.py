"""Host memory and start-up against the corpus's size: the tiny model trained for 3 steps on streamed jsonl
corpora of 10 MB, 1 GB and 8 GB (scripts/make_corpus.py: shuffled Tiny Shakespeare paragraphs, files of
64 MB), each run's peak RSS (the kernel's count for the process, os.wait4) and the time from launch to its
data's first batch (made before the run's record line) and to its first step's line (which adds the compile,
the same for every corpus); the median of --repeat runs, interleaved.

    python benchmarks/data_scale.py [--sizes 10,1000,8000] [--repeat 3] [--work DIR] [--prepared]

--prepared also tokenizes each corpus (python -m maxtrain.prepare) and trains on the shards.
The corpora stay in --work (default: a temporary folder) for a rerun.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).parent.parent


def run(args: list[str]) -> tuple[float, float, float, str]:
    """(peak RSS in MB, seconds from launch to the data's first batch made (the `run ...` line after it), and to the
    first step's line, output) of one training command."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", JAX_PLATFORMS="cpu")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "maxtrain.train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    ready = first = None
    out = []
    for line in proc.stdout:
        out.append(line)
        if ready is None and line.startswith("run "):
            ready = time.perf_counter() - t0
        if first is None and line.startswith("step 1/"):
            first = time.perf_counter() - t0
    _, status, usage = os.wait4(proc.pid, 0)
    if status or first is None:
        raise SystemExit("".join(out[-20:]))
    return usage.ru_maxrss / 1024, ready, first, "".join(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10,1000,8000", help="corpus sizes in MB")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--prepared", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="maxtrain-scale-"))
    commands = []
    for mb in map(int, args.sizes.split(",")):
        folder = work / f"corpus-{mb}mb"
        if not folder.exists():
            subprocess.run([sys.executable, str(REPO / "scripts" / "make_corpus.py"), str(folder),
                            f"--megabytes={mb}"], check=True)
        common = [str(REPO / "tests" / "configs" / "tiny.yml"), "vocab_size=384", "steps=3", "log_period=1",
                  "per_device_batch_size=8", "enable_checkpointing=false", f"base_output_directory={work / 'runs'}"]
        commands.append((f"streamed jsonl, {mb:,} MB", [*common, f"run_name=s{mb}", "dataset_type=text",
                                                        f"train_files={folder}/*.jsonl"]))
        if args.prepared:
            out = work / f"tok-{mb}mb"
            if not (out / "manifest.json").exists():
                subprocess.run([sys.executable, "-m", "maxtrain.prepare", str(REPO / "configs" / "base.yml"),
                                f"train_files={folder}/*.jsonl", f"prepared_dir={out}"], check=True, cwd=REPO)
            commands.append((f"prepared, {mb:,} MB", [*common, f"run_name=p{mb}", "dataset_type=prepared",
                                                      f"train_files={out}"]))
    results = {name: [] for name, _ in commands}
    for _ in range(args.repeat):  # interleaved: the machine's drift falls on every row alike
        for name, command in commands:
            results[name].append(run(command)[:3])
    rows = [(name, *(statistics.median(r[i] for r in runs) for i in range(3))) for name, runs in results.items()]
    print("| corpus | peak RSS MB | launch to the data's first batch s | launch to first step s |\n|---|---|---|---|")
    for name, rss, ready, first in rows:
        print(f"| {name} | {rss:,.0f} | {ready:.2f} | {first:.2f} |")


if __name__ == "__main__":
    main()
