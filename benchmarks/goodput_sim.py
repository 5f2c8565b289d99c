"""What a second, local checkpoint tier buys a job that fails: the two tiers' save and restore times measured
here, then a job simulated with failures at random (exponential) times, one tier against two.

    python benchmarks/goodput_sim.py [--steps-per-failure 3000] [--persistent-period 500] [--local-period 10 100]
                                     [--restart-seconds 120] [--jobs 200] [key=value ...]

Measures on this machine, in one process (the 125m preset, as benchmarks/checkpoint.py): the step, the time
the loop is blocked by a local save and by an async persistent save, each until written, and a restore from
each tier. Then simulates `--jobs` jobs of 100,000 steps with those costs, a failure every
`--steps-per-failure` steps on average (a pod's rate: a few hours), each failure costing `--restart-seconds`
(rescheduling, start-up, compile) plus the restore plus the steps since the newest checkpoint of either tier
(the local copy always restores: a lost host's shards come from its peers).
Prints both tables and the Young-Daly interval (sqrt(2 x save cost x mean time between failures)) per tier.
"""

import argparse
import math
import random
import shutil
import tempfile
import time
from pathlib import Path

import jax

from maxtrain import train
from maxtrain.checkpoint import manager as ckpt_lib
from maxtrain.data import pipeline as data
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib

CONFIG = [str(Path(__file__).parent.parent / "configs" / "base.yml"), "model_name=125m",
          "max_target_length=128", "per_device_batch_size=1", "remat_policy=full"]
STEPS = 100_000


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
        for tier, step in (("local", 7), ("persistent", 1000)):
            t0 = time.perf_counter()
            ckpt.save(step, state, batches.get_state())
            m[f"{tier} blocked"] = time.perf_counter() - t0
            if tier == "local":
                ckpt.local.wait()
            else:
                ckpt.wait()
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


def simulate(m: dict, persistent_period: int, local_period: int | None, steps_per_failure: float,
             restart: float, jobs: int, seed: int = 0) -> dict:
    """Mean wall time and goodput of jobs of STEPS steps: a step costs m['step'], a save its blocked time, a
    failure the restart, the restore of the newest checkpoint's tier and the steps since it."""
    rng = random.Random(seed)
    step_s = m["step"]
    walls = []
    for _ in range(jobs):
        wall, done, saved, saved_tier = 0.0, 0, 0, "persistent"
        next_failure = rng.expovariate(1 / (steps_per_failure * step_s))
        while done < STEPS:
            cost = step_s
            step = done + 1
            if local_period and step % local_period == 0:
                cost += m["local blocked"]
            if step % persistent_period == 0 or step == STEPS:
                cost += m["persistent blocked"]
            if wall + cost > next_failure:  # fails in this step: back to the newest checkpoint
                wall = next_failure + restart + (m[f"{saved_tier} restore"] if saved else 0.0)
                done = saved
                next_failure = wall + rng.expovariate(1 / (steps_per_failure * step_s))
                continue
            wall += cost
            done = step
            if step % persistent_period == 0:
                saved, saved_tier = step, "persistent"
            elif local_period and step % local_period == 0:
                saved, saved_tier = step, "local"
        walls.append(wall)
    mean = sum(walls) / len(walls)
    return {"wall_h": mean / 3600, "goodput": STEPS * step_s / mean}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps-per-failure", type=float, default=3000)
    parser.add_argument("--persistent-period", type=int, default=500)
    parser.add_argument("--local-period", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--restart-seconds", type=float, default=120)
    parser.add_argument("--jobs", type=int, default=200)
    args, overrides = parser.parse_known_args()
    m = measure(overrides)
    print(f"{m['params'] / 1e6:.0f}M params, checkpointed state {m['state_gib']:.2f} GiB, "
          f"{jax.device_count()} {jax.devices()[0].platform} device(s); step {m['step']:.3f} s")
    print("| tier | loop blocked by a save (s) | save until written (s) | restore (s) |\n|---|---|---|---|")
    for tier in ("local", "persistent"):
        print(f"| {tier} | {m[f'{tier} blocked']:.3f} | {m[f'{tier} written']:.3f} | {m[f'{tier} restore']:.3f} |")
    mtbf = args.steps_per_failure * m["step"]
    print(f"\n{STEPS:,} steps, a failure every {args.steps_per_failure:,.0f} steps on average ({mtbf / 3600:.2f} h), "
          f"restart {args.restart_seconds:.0f} s, {args.jobs} jobs")
    print("| checkpoints | wall (h) | goodput |\n|---|---|---|")
    one = simulate(m, args.persistent_period, None, args.steps_per_failure, args.restart_seconds, args.jobs)
    print(f"| persistent every {args.persistent_period} | {one['wall_h']:.2f} | {100 * one['goodput']:.1f}% |")
    for local in args.local_period:
        two = simulate(m, args.persistent_period, local, args.steps_per_failure, args.restart_seconds, args.jobs)
        print(f"| + local every {local} | {two['wall_h']:.2f} | {100 * two['goodput']:.1f}% | "
              f"{two['wall_h'] / one['wall_h']:.3f}x the wall of one tier |")
    for tier in ("local", "persistent"):
        period = math.sqrt(2 * m[f"{tier} blocked"] * mtbf) / m["step"]
        print(f"Young-Daly interval for the {tier} tier: {period:.0f} steps")


if __name__ == "__main__":
    main()
