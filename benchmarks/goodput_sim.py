"""What a second, local checkpoint tier buys a job that fails: the two tiers' save and restore times measured
here, jobs of 256 to 16,384 chips simulated with those costs, and a real job killed three times, measured.

    python benchmarks/goodput_sim.py [--persistent-period 500] [--local-period 100] [--restart-seconds 120]
                                     [--jobs 200] [--no-chaos] [key=value ...]

1. Measures on this machine, in one process (the 125m preset, as benchmarks/checkpoint.py): the step, what a
   save to each tier holds the loop (the local tier: this machine's disk; the persistent one: Orbax, async),
   and a restore from each.
2. Simulates `--jobs` jobs of 100,000 such steps per chip count, with failures at maxtrain's default rate
   (failure_interval_hours: 50,000 chip-hours / chips, from Llama 3's 16,384-GPU run), exponential; a failure
   costs `--restart-seconds` (rescheduling, start-up, compile), the restore of the newest checkpoint's tier
   and the steps since it (the local copy always restores: a lost host's shards come from its peers). One
   tier (persistent every `--persistent-period`) against two (and local every `--local-period`).
3. Runs one real job twice (2 processes through scripts/launch_local.sh --max-restarts, the 3.4M default
   model, 60 steps), killing a process with SIGKILL when the job first reaches steps 14, 31 and 47: with
   persistent checkpoints every 20 steps only, and with local copies every 4 as well; prints each job's
   goodput ledger (python -m maxtrain.goodput).
"""

import argparse
import bisect
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax

from maxtrain import train
from maxtrain.checkpoint import manager as ckpt_lib
from maxtrain.data import pipeline as data
from maxtrain.observe import goodput
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib

REPO = Path(__file__).parent.parent
CONFIG = [str(REPO / "configs" / "base.yml"), "model_name=125m", "max_target_length=128", "per_device_batch_size=1",
          "remat_policy=full"]
STEPS = 100_000
CHIPS = (256, 1024, 4096, 16384)
KILL_AT = (14, 31, 47)  # the chaos job's steps at which a process is killed (the first time the job reaches them)


def measure(overrides) -> dict:
    out = tempfile.mkdtemp(prefix="maxtrain_goodput_sim_")
    c = train.load_config(CONFIG + [f"base_output_directory={out}", "checkpoint_period=1000",
                                    f"local_checkpoint_directory={out}/local", "local_checkpoint_period=1"] + overrides)
    mesh = mesh_lib.make_mesh(c)
    trainer = step_lib.build(c, mesh)
    m = {"params": c.num_params, "state_gib": sum(x.size * x.dtype.itemsize
                                                  for x in jax.tree.leaves(trainer.abstract_state)) / 2**30}
    with mesh_lib.activate(mesh, trainer.rules):
        state = trainer.init(jax.random.key(0))
        batches = data.make_iterator(c, trainer.batch_sharding)
        for _ in range(2):  # compile and warm up
            state, _ = trainer.train_step(state, next(batches))
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        for _ in range(5):
            state, _ = trainer.train_step(state, next(batches))
        jax.block_until_ready(state)
        m["step"] = (time.perf_counter() - t0) / 5
        ckpt = ckpt_lib.Checkpointer(c)
        ckpt.save(5, state, batches.get_state())  # the first save compiles the checksums
        ckpt.local.wait()
        for tier, step in (("local", 7), ("persistent", 1000)):
            t0 = time.perf_counter()
            ckpt.save(step, state, batches.get_state())
            m[f"{tier} blocked"] = time.perf_counter() - t0
            ckpt.local.wait() if tier == "local" else ckpt.wait()
            m[f"{tier} written"] = time.perf_counter() - t0
        ckpt.close()
        for tier in ("local", "persistent"):
            if tier == "persistent":
                shutil.rmtree(f"{out}/local")
            t0 = time.perf_counter()
            reader = ckpt_lib.Checkpointer(c)
            jax.block_until_ready(reader.restore(trainer.abstract_state, batches))
            m[f"{tier} restore"] = time.perf_counter() - t0
            reader.close()
    shutil.rmtree(out, ignore_errors=True)
    return m


def simulate(m: dict, mtbf_s: float, persistent: int, local: int | None, restart: float, jobs: int,
             seed: int = 0) -> float:
    """Mean goodput of `jobs` jobs of STEPS steps: a step costs m['step'], a save what it holds the loop; a
    failure at a random time throws away the steps since the newest checkpoint and costs the restart and
    that checkpoint's restore. Event by event: the wall time to each step is a running sum."""
    cost = [0.0]
    for step in range(1, STEPS + 1):  # wall time to reach each step from step 0, saves included
        held = m["local blocked"] if local and step % local == 0 and step % persistent else 0.0
        held += m["persistent blocked"] if step % persistent == 0 else 0.0
        cost.append(cost[-1] + m["step"] + held)
    rng, total = random.Random(seed), 0.0
    for _ in range(jobs):
        wall, at = 0.0, 0
        while True:
            failure = rng.expovariate(1 / mtbf_s)
            if cost[STEPS] - cost[at] <= failure:
                wall += cost[STEPS] - cost[at]
                break
            reached = bisect.bisect_right(cost, cost[at] + failure) - 1
            back = max(reached - reached % persistent, reached - reached % local if local else 0, at)
            tier = "persistent" if back % persistent == 0 or not local else "local"
            wall += failure + restart + (m[f"{tier} restore"] if back else 0.0)
            at = back
        total += wall
    return STEPS * m["step"] * jobs / total


def chaos(local: bool, out: Path) -> dict:
    """The real job, killed at KILL_AT; its ledger's summary."""
    args = [str(REPO / "configs" / "base.yml"), f"base_output_directory={out}", "steps=60", "log_period=1",
            "checkpoint_period=20", "dcn_data_parallelism=2", "run_name=chaos"]
    if local:
        args += [f"local_checkpoint_directory={out}/local", "local_checkpoint_period=4"]
    env = dict(os.environ, MAXTRAIN_LOG_DIR=str(out / "logs"), PYTHON=sys.executable)
    proc = subprocess.Popen([str(REPO / "scripts" / "launch_local.sh"), "--max-restarts", "5", "2", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    kills = list(KILL_AT)
    for line in proc.stdout:
        m = re.match(r"step\s+(\d+)/", line)
        if m and kills and int(m.group(1)) >= kills[0]:
            kills.pop(0)
            pids = subprocess.run(["pgrep", "-f", f"maxtrain.train .*base_output_directory={out} .*process_id=1"],
                                  capture_output=True, text=True).stdout.split()
            for pid in pids:
                os.kill(int(pid), signal.SIGKILL)
    if proc.wait() != 0:
        raise SystemExit(f"the chaos job failed (exit {proc.returncode})")
    return goodput.summarize(goodput.read(out / "chaos" / goodput.FILE))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--persistent-period", type=int, default=500)
    parser.add_argument("--local-period", type=int, default=100)
    parser.add_argument("--restart-seconds", type=float, default=120)
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--no-chaos", action="store_true", help="skip the real job")
    args, overrides = parser.parse_known_args()
    m = measure(overrides)
    print(f"{m['params'] / 1e6:.0f}M params, checkpointed state {m['state_gib']:.2f} GiB, "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s); step {m['step']:.3f} s")
    print("| tier | loop blocked by a save (s) | save until written (s) | restore (s) |\n|---|---|---|---|")
    for tier in ("local", "persistent"):
        print(f"| {tier} | {m[f'{tier} blocked']:.3f} | {m[f'{tier} written']:.3f} | {m[f'{tier} restore']:.3f} |")

    p, lp = args.persistent_period, args.local_period
    print(f"\n{STEPS:,} steps of {m['step']:.3f} s, restart {args.restart_seconds:.0f} s, {args.jobs} jobs per row; "
          f"a failure per {goodput.CHIP_HOURS_PER_FAILURE:,} chip-hours")
    print(f"| chips | hours between failures | persistent every {p} | + local every {lp} | wall, two tiers / one | "
          "Young-Daly: local, persistent (steps) |\n|---|---|---|---|---|---|")
    for chips in CHIPS:
        mtbf = 3600 * goodput.CHIP_HOURS_PER_FAILURE / chips
        one = simulate(m, mtbf, p, None, args.restart_seconds, args.jobs)
        two = simulate(m, mtbf, p, lp, args.restart_seconds, args.jobs)
        best = [round(goodput.young_daly(m[f"{t} blocked"], mtbf) / m["step"]) for t in ("local", "persistent")]
        print(f"| {chips:,} | {mtbf / 3600:.1f} | {100 * one:.1f}% | {100 * two:.1f}% | {one / two:.3f}x | "
              f"{best[0]:,}, {best[1]:,} |")
    if args.no_chaos:
        return
    print(f"\nthe chaos job: 60 steps, 2 processes, process 1 killed at steps {', '.join(map(str, KILL_AT))}")
    print("| checkpoints | goodput | wall (s) | steps lost | lost steps (s) | restore (s) | down (s) |\n"
          "|---|---|---|---|---|---|---|")
    for local in (False, True):
        out = Path(tempfile.mkdtemp(prefix="maxtrain_chaos_"))
        s = chaos(local, out)
        shutil.rmtree(out, ignore_errors=True)
        name = "persistent every 20, local every 4" if local else "persistent every 20"
        b = s["badput"]
        print(f"| {name} | {100 * s['goodput']:.1f}% | {s['wall_s']:.1f} | {s['steps_lost']} | {b['lost']:.1f} | "
              f"{b['restore']:.1f} | {b['down']:.1f} |")


if __name__ == "__main__":
    main()
