"""maxtrain against MaxText's figures for the same work (issue #7's table), on this machine, in one run.

    python benchmarks/compare.py [--steps 5] [--skip-aot] [--rows small,medium,...,startup] [--rounds 1]
                                 [--startup-runs 1] [--maxtext PYTHON]

Each CPU row runs in its own subprocess (fake device counts differ), one after another, with synthetic
data: s/step is the mean over `--steps` steps after two warm-up steps; MFU is model FLOPs per second
(remat recompute not counted) over the float32 matmul peak measured in the same subprocess; in
parentheses, the same for every FLOP the step executes (XLA's count, recompute included; for a pipelined
row the same model's without the pipeline, so the bubble shows in both). "1.2x needs"
is what 1.2x the issue's MaxText tokens/s would take of that peak, on both counts. With
`--rounds N` each row runs N times (alternating with MaxText's run, with --maxtext): s/step is the
median, with the range; tokens/s, MFU and the peaks come from the median run (the lower middle one
for an even N). The AOT
rows compile for v5p-128 through `maxtrain.compile` (needs the tpu extra); `--rows` naming some of them
runs only those. MaxText's figures from the
issue were measured on another machine of this kind (2 CPU cores, jax 0.10.2 then) and are quoted; with
--maxtext, MaxText's own train_compile also runs each AOT row, on maxtrain's libtpu ("here"; both
sides on another one with TPU_LIBRARY_PATH=.../libtpu.so).

`--maxtext PYTHON` also runs MaxText itself on each CPU row, right after maxtrain, on this machine:
PYTHON is an interpreter with MaxText installed. MaxText needs Python >= 3.12, so, for example:

    python3.12 -m venv /tmp/mt && /tmp/mt/bin/pip install "maxtext[tpu]==0.2.4"
    python benchmarks/compare.py --maxtext /tmp/mt/bin/python

MaxText's install resolves jax 0.12.0.1 and libtpu 0.0.52, as maxtrain's tpu extra pins them, so both sides'
AOT rows compile on one compiler (for another, set TPU_LIBRARY_PATH=.../libtpu/libtpu.so on both).

MaxText logs the wall time between step dispatches; its s/step is the mean of those after three steps
(compile, and a first step that only queued), over `--steps` steps. "ratio here" is MaxText's s/step
over maxtrain's in the same round (the two ran back to back, so they share that stretch of the machine's
speed): one figure for one round, the median and range over rounds for several.
"""

import argparse
import functools
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the tables: what is measured (benchmarks/ is on the path: compare.py runs as a script, or ab.py imports it)
from compare_rows import (AOT, AOT_COMMON, AOT_ISSUE_NOTE, MAXTEXT_AOT_EXTRA, MAXTEXT_ARGS, MAXTEXT_ROW_KEYS, ROWS,
                          SMALL)

REPO = Path(__file__).parent.parent
BASE = str(REPO / "configs" / "base.yml")

WORKER = r"""
import json, os, sys, time
import maxtrain
# benchmarks/ab.py repo=PATH may name a checkout from before the package layout (flat modules): import
# by what that checkout holds, never a mix (an editable install would fill in the missing modules)
if os.path.isdir(os.path.join(os.path.dirname(maxtrain.__file__), "runtime")):
    from maxtrain.runtime.hugepages import reexec_with_huge_pages
    reexec_with_huge_pages()  # what `python -m maxtrain.train` does first
    from maxtrain.data import pipeline as data
    from maxtrain.parallel import mesh as mesh_lib
    from maxtrain.observe import metrics
    from maxtrain.training import step as step_lib
else:
    from maxtrain.hugepages import reexec_with_huge_pages
    reexec_with_huge_pages()
    from maxtrain import data, mesh as mesh_lib, metrics, step as step_lib
import jax
from maxtrain import train
steps = int(sys.argv[1]); c = train.load_config(sys.argv[2:])
peak = metrics.measure_cpu_peak_tflops(size=2048) / jax.local_device_count()
peak_bf16 = metrics.measure_cpu_peak_tflops(size=2048, dtype=jax.numpy.bfloat16) / jax.local_device_count()
mesh = mesh_lib.make_mesh(c); t = step_lib.build(c, mesh)
with mesh_lib.activate(mesh, t.rules):
    state = t.init(jax.random.key(0)); batches = data.make_iterator(c, t.batch_sharding)
    for _ in range(2):
        state, m = t.train_step(state, next(batches))
    jax.block_until_ready(m); t0 = time.perf_counter()
    for _ in range(steps):
        state, m = t.train_step(state, next(batches))
    jax.block_until_ready(m); sec = (time.perf_counter() - t0) / steps
tflops = metrics.train_flops_per_step(c) / c.num_devices / sec / 1e12
# Every FLOP the step executes, remat recompute included: XLA's count for the same step unrolled (it
# counts a scanned body once), before partitioning (so the whole job's: divided by the devices).
# A pipeline runs only a scanned stack: its count is the same model's without the pipeline (the stages
# folded into fsdp), so the bubble's idle work is not in it.
flat = c
if c.get("ici_pipeline_parallelism", 1) > 1:
    flat = train.load_config(sys.argv[2:] + ["ici_pipeline_parallelism=1", "num_pipeline_microbatches=-1",
                                             "ici_fsdp_parallelism=-1"])
flat_mesh = mesh_lib.make_mesh(flat)
unrolled = step_lib.build(flat.replace(scan_layers=False), flat_mesh)
with mesh_lib.activate(flat_mesh, unrolled.rules):
    cost = unrolled.train_step.lower(unrolled.abstract_state, unrolled.abstract_batch()).cost_analysis()
executed = (cost[0] if isinstance(cost, list) else cost)["flops"] / c.num_devices
print(json.dumps({"seconds": sec, "tokens_per_second": c.global_batch_size * c.max_target_length / sec,
                  "mfu": tflops / peak, "executed_utilization": executed / sec / 1e12 / peak,
                  "loss": float(m["loss"]), "peak": peak, "peak_bf16": peak_bf16}))
"""


def cpu_env(devices, xla_flags="", **extra):
    """This process's environment with `devices` fake CPU devices (and any further XLA flags)."""
    flags = f"--xla_force_host_platform_device_count={devices} {xla_flags}".strip()
    return dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu", **extra)


def run_row(overrides, devices, batch, steps, extra, xla_flags="", repo=REPO):
    """One row's run in a subprocess; `repo`: the maxtrain checkout it imports (benchmarks/ab.py)."""
    env = cpu_env(devices, xla_flags, PYTHONPATH=str(repo))  # that checkout's maxtrain, not the installed one
    args = [str(Path(repo) / "configs" / "base.yml"), *overrides, f"per_device_batch_size={batch / devices}",
            "ici_fsdp_parallelism=-1", *extra]
    proc = subprocess.run([sys.executable, "-c", WORKER, str(steps), *args], capture_output=True, text=True,
                          env=env, cwd=repo)
    if proc.returncode:
        raise SystemExit(f"row failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def maxtext_base_yml(python):
    """MaxText's base.yml in the installation PYTHON imports, or None where it has no maxtext."""
    find = "import maxtext, os; print(os.path.dirname(maxtext.__file__))"
    try:
        where = subprocess.run([python, "-c", find], capture_output=True, text=True)
    except OSError:
        return None
    return None if where.returncode else str(Path(where.stdout.strip()) / "configs" / "base.yml")


def merge_keys(*groups):
    """key=value lists merged in order, a later key replacing an earlier one in place; a bare key drops it."""
    merged = {}
    for item in (item for group in groups for item in group):
        key, eq, _ = item.partition("=")
        if eq:
            merged[key] = item
        else:
            merged.pop(key, None)
    return list(merged.values())


def maxtext_command(python, overrides, devices, batch, steps, out, extra=(), row_keys=()):
    """(argv, env) that run MaxText's trainer on a row, or None where PYTHON has no maxtext. `row_keys`: the
    row's MAXTEXT_ROW_KEYS."""
    base_yml = maxtext_base_yml(python)
    if base_yml is None:
        return None
    args = [base_yml, *merge_keys(overrides, MAXTEXT_ARGS, row_keys, [
        f"per_device_batch_size={batch / devices:g}", f"steps={steps}", f"base_output_directory={out}",
        "run_name=compare"], extra)]
    return [python, "-u", "-m", "maxtext.trainers.pre_train.train", *args], cpu_env(devices, TF_CPP_MIN_LOG_LEVEL="2")


def run_maxtext_row(python, overrides, devices, batch, steps, row_keys=()):
    """MaxText's s/step on the same row, or a short reason it did not run."""
    with tempfile.TemporaryDirectory() as out:
        command = maxtext_command(python, overrides, devices, batch, steps + 3, out, row_keys=row_keys)
        if command is None:
            return f"no maxtext in {python}"
        proc = subprocess.run(command[0], capture_output=True, text=True, env=command[1], cwd=out)
    seconds = [float(s) for n, s in re.findall(r"completed step: (\d+), seconds: ([0-9.]+)", proc.stdout + proc.stderr)
               if int(n) >= 3]
    return sum(seconds) / len(seconds) if seconds else f"MaxText failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"


def seconds_to_line(command, env, cwd, text):
    """Wall time from process start to its first output line that contains `text`."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
    seconds = float("nan")
    for line in proc.stdout:
        if text in line:
            seconds = time.perf_counter() - t0
            break
    proc.kill()
    proc.wait()
    return seconds


def startup_seconds(extra, cache_dir, xla_flags="", repo=REPO):
    """Process start to the first completed step of the small config, as a user runs it."""
    command = [sys.executable, "-m", "maxtrain.train", str(Path(repo) / "configs" / "base.yml"), *SMALL,
               "per_device_batch_size=4", "steps=1", "enable_checkpointing=false",
               "base_output_directory=/tmp/maxtrain_compare", "peak_tflops_per_device=1",
               f"compilation_cache_dir={cache_dir}", *extra]
    return seconds_to_line(command, cpu_env(1, xla_flags, PYTHONPATH=str(repo)), repo, "first step")


def maxtext_startup_seconds(python, cache_dir):
    """The same for MaxText: process start to its log line for step 0 (logged once step 0 is done)."""
    with tempfile.TemporaryDirectory() as out:
        command = maxtext_command(python, SMALL, 1, 4, 2, out, [f"jax_cache_dir={cache_dir}"])
        return seconds_to_line(*command, out, "completed step: 0") if command else float("nan")


def cpu_model() -> str:
    """The CPU's name from /proc/cpuinfo (Linux), since the machine behind a table changes over time."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown CPU")
    except OSError:
        return "unknown CPU"


def spread(seconds, digits=1, unit=" s"):
    """'9.8 s' for one run; the median and the range, '9.8 s (8.0-10.8)', for several."""
    if len(seconds) == 1:
        return f"{seconds[0]:.{digits}f}{unit}"
    return f"{statistics.median(seconds):.{digits}f}{unit} ({min(seconds):.{digits}f}-{max(seconds):.{digits}f})"


def aot_gib(overrides, extra):
    proc = subprocess.run([sys.executable, "-m", "maxtrain.compile", BASE, *merge_keys(AOT_COMMON, overrides, extra)],
                          capture_output=True, text=True, cwd=REPO)
    m = re.search(r"total ([0-9.]+) GiB", proc.stdout)
    if not m:
        return float("nan"), (proc.stderr.strip().splitlines() or ["failed"])[-1]
    args = re.search(r"arguments ([0-9.]+) GiB \| temporaries ([0-9.]+) GiB", proc.stdout)
    return float(m.group(1)), f"arguments {args.group(1)} + temporaries {args.group(2)} GiB"


def maxtext_aot_gib(python, overrides):
    """MaxText's own ahead-of-time compile of a row (its train_compile, remat full like maxtrain's plain
    command), on the libtpu this interpreter loads, so both sides use one compiler: (GiB, detail)."""
    import libtpu  # the tpu extra's
    base_yml = maxtext_base_yml(python)
    if base_yml is None:
        return float("nan"), f"no maxtext in {python}"
    library = os.environ.get("TPU_LIBRARY_PATH") or os.path.join(os.path.dirname(libtpu.__file__), "libtpu.so")
    # as maxtrain.compile: a compile holds no chips, so it need not take libtpu's lockfile (and fail beside another)
    env = {**os.environ, "TPU_LIBRARY_PATH": library, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    proc = subprocess.run([python, "-m", "maxtext.trainers.pre_train.train_compile", base_yml, *merge_keys(
        AOT_COMMON, ["override_model_config=true", "compile_topology_num_slices=1", "remat_policy=full"], overrides)],
        capture_output=True, text=True, cwd=REPO, env=env)
    stats = {k: int(v) for k, v in re.findall(r"(\w+_size_in_bytes)=(\d+)", proc.stdout + proc.stderr)}
    if "temp_size_in_bytes" not in stats:
        return float("nan"), (proc.stderr.strip().splitlines() or ["failed"])[-1]
    args, temps = stats["argument_size_in_bytes"] / 2**30, stats["temp_size_in_bytes"] / 2**30
    total = args + temps + stats["output_size_in_bytes"] / 2**30 - stats["alias_size_in_bytes"] / 2**30
    return total, f"arguments {args:.3f} + temporaries {temps:.3f} GiB"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skip-aot", action="store_true")
    parser.add_argument("--rows", default="", help="comma-separated row names (default: all; the AOT rows "
                        "all unless some are named)")
    parser.add_argument("--rounds", type=int, default=1, help="run each CPU row N times; print median (range)")
    parser.add_argument("--startup-runs", type=int, default=1, help="repeat the startup rows; print median (range)")
    parser.add_argument("--maxtext", metavar="PYTHON", help="also run MaxText on each CPU row, with this interpreter")
    args, extra = parser.parse_known_args()  # extra key=value overrides apply to every row
    wanted = set(args.rows.split(",")) if args.rows else None
    if args.startup_runs < 1 or args.rounds < 1:
        parser.error("--rounds and --startup-runs: at least 1")
    if args.maxtext and maxtext_base_yml(args.maxtext) is None:
        parser.error(f"--maxtext: {args.maxtext} cannot import maxtext")
    print(f"{time.strftime('%Y-%m-%d')} | {os.cpu_count()} CPU cores, {cpu_model()} | overrides: {' '.join(extra) or '(none)'}")
    print("| workload | maxtrain s/step | tokens/s | MFU (all FLOPs) | MaxText s/step (issue) | MaxText tokens/s | ratio "
          "| 1.2x needs: MFU (all FLOPs) | matmul peak f32 / bf16 GFLOP/s | MaxText s/step here | ratio here |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, overrides, devices, batch, mt_sec, mt_tps in ROWS:
        if wanted and name not in wanted:
            continue
        runs, mt_runs = [], []
        for _ in range(args.rounds):  # alternating, so both see the same stretch of this machine's speed
            runs.append(run_row(overrides, devices, batch, args.steps, extra))
            if args.maxtext:
                mt_runs.append(run_maxtext_row(args.maxtext, overrides, devices, batch, args.steps,
                                               MAXTEXT_ROW_KEYS.get(name, ())))
        seconds = [run["seconds"] for run in runs]
        r = sorted(runs, key=lambda run: run["seconds"])[(len(runs) - 1) // 2]  # the median run (lower middle)
        here = ""
        if mt_runs:
            failed = [m for m in mt_runs if not isinstance(m, float)]
            paired = [mt / ours for mt, ours in zip(mt_runs, seconds)]  # each pair ran back to back
            here = f"{failed[0]} |" if failed else f"{spread(mt_runs, 3, '')} | {spread(paired, 2, 'x')}"
        used = f"{100 * r['mfu']:.0f}% ({100 * r['executed_utilization']:.0f}%)"
        if mt_tps is None:  # no figures from the issue: only the MaxText run here compares
            quoted = "- | - | - | -"
        else:
            # The share of the float32 peak that 1.2x MaxText's tokens/s would take on this machine: over
            # 100% (all FLOPs) the work cannot run that fast here.
            ratio = r["tokens_per_second"] / mt_tps
            needs = f"{120 * r['mfu'] / ratio:.0f}% ({120 * r['executed_utilization'] / ratio:.0f}%)"
            quoted = f"{mt_sec:.2f} | {mt_tps:,} | {ratio:.2f}x | {needs}"
        print(f"| {name} | {spread(seconds, 3, '')} | {r['tokens_per_second']:,.0f} | {used} | {quoted} | "
              f"{1e3 * r['peak']:.0f} / {1e3 * r['peak_bf16']:.0f} | {here or ' |'} |", flush=True)
    if not wanted or "startup" in wanted:
        # an empty compilation cache, then the same one again; --startup-runs pairs, median (range)
        runs = {"cold: empty compilation cache": [], "warm: the compilation cache of the run before": []}
        runs_mt = {name: [] for name in runs}
        for _ in range(args.startup_runs):
            with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as mt_cache:
                for name in runs:
                    runs[name].append(startup_seconds(extra, cache))
                    if args.maxtext:
                        runs_mt[name].append(maxtext_startup_seconds(args.maxtext, mt_cache))
        for name, seconds in runs.items():
            s = statistics.median(seconds)
            here = ""
            if args.maxtext:
                paired = [mt / ours for mt, ours in zip(runs_mt[name], seconds)]
                here = f"{spread(runs_mt[name])} | {spread(paired, 2, 'x')}"
            print(f"| startup to first step (small), {name} | {spread(seconds)} | | | 15-20 s | | {17.5 / s:.2f}x | | | "
                  f"{here or ' |'} |", flush=True)
    if args.skip_aot:
        return
    print(f"\nahead-of-time compile, the plain command: {' '.join(AOT_COMMON)}")
    here = " MaxText GiB here | detail | ratio here |" if args.maxtext else ""
    print(f"| per chip | maxtrain GiB | detail | MaxText GiB (issue) | ratio |{here}\n|---|---|---|---|---|"
          + "---|---|---|" * bool(args.maxtext))
    named = [row for row in AOT if wanted and row[0] in wanted]  # --rows naming AOT rows: only those
    for name, overrides, mt_gib in named or AOT:
        gib, detail = aot_gib(overrides, extra)
        issue = "- | -" if math.isnan(mt_gib) else f"{mt_gib:.2f} | {less(gib, mt_gib)}"  # no issue figure
        if name in AOT_ISSUE_NOTE:
            issue = f"{AOT_ISSUE_NOTE[name]} | " + (f"at least {less(gib, mt_gib)}" if gib <= mt_gib else "-")
        row = f"| {name} | {gib:.2f} | {detail} | {issue} |"
        if args.maxtext:
            mt_here, mt_detail = maxtext_aot_gib(args.maxtext, overrides + MAXTEXT_AOT_EXTRA.get(name, []))
            row += f" {mt_here:.2f} | {mt_detail} | {less(gib, mt_here)} |"
        print(row, flush=True)


def less(gib, other):
    return f"{other / gib:.2f}x less" if gib <= other else f"{gib / other:.3f}x more"


if __name__ == "__main__":
    main()
