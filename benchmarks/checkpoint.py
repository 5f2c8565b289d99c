"""Cost of checkpointing a ~125M-parameter model (state = params + Adam moments, ~1.5 GB) on this machine.

    python benchmarks/checkpoint.py [--steps 6] [key=value ...]

Measures, in one process: step time without checkpoints; step time saving every 5 steps (async);
how long the loop is blocked by an async save vs how long the save takes to become durable; a
synchronous save; and restore time.
"""

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import jax

from maxtrain.checkpoint import manager as ckpt_lib
from maxtrain.data import pipeline as data
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib
from maxtrain import train

CONFIG = [str(Path(__file__).parent.parent / "configs" / "base.yml"), "model_name=125m",
          "max_target_length=128", "per_device_batch_size=1", "remat_policy=full"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    args, overrides = parser.parse_known_args()
    out = tempfile.mkdtemp(prefix="maxtrain_ckpt_bench_")
    c = train.load_config(CONFIG + [f"base_output_directory={out}", "checkpoint_period=5"] + overrides)
    mesh = mesh_lib.make_mesh(c)
    trainer = step_lib.build(c, mesh)
    state_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(trainer.abstract_state))
    rows = []
    with mesh_lib.activate(mesh, trainer.rules):
        state = trainer.init(jax.random.key(0))
        batches = data.make_iterator(c, trainer.batch_sharding)

        def run(steps, checkpointer=None):
            nonlocal state
            blocked = []
            t0 = time.perf_counter()
            for _ in range(steps):
                state, m = trainer.train_step(state, next(batches))
                step = int(state.step)
                if checkpointer is not None and checkpointer.due(step):
                    jax.block_until_ready(state)  # time the save itself, not the step it waits for
                    s0 = time.perf_counter()
                    checkpointer.save(step, state, batches.get_state())
                    blocked.append(time.perf_counter() - s0)
            jax.block_until_ready(m)
            return (time.perf_counter() - t0) / steps, blocked

        run(2)  # compile and warm up
        plain, _ = run(args.steps)
        async_ckpt = ckpt_lib.Checkpointer(c)
        with_ckpt, blocked = run(args.steps, async_ckpt)
        async_ckpt.wait()

        # One async save timed to durability, and one synchronous save.
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        async_ckpt.save(int(state.step) + 1000, state, batches.get_state())
        async_blocked = time.perf_counter() - t0
        async_ckpt.wait()
        async_total = time.perf_counter() - t0
        async_ckpt.close()
        sync_c = c.replace(async_checkpointing=False, run_name="sync")
        sync_ckpt = ckpt_lib.Checkpointer(sync_c)
        t0 = time.perf_counter()
        sync_ckpt.save(1, state, batches.get_state())
        sync_ckpt.wait()
        sync_total = time.perf_counter() - t0
        sync_ckpt.close()

        t0 = time.perf_counter()
        restored = ckpt_lib.Checkpointer(c).restore(trainer.abstract_state, batches)
        jax.block_until_ready(restored)
        restore = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)

    print(f"{c.num_params / 1e6:.0f}M params, checkpointed state {state_bytes / 2**30:.2f} GiB, "
          f"{c.num_devices} {jax.devices()[0].platform} device(s)")
    rows = [("step, no checkpointing", plain),
            ("step, async save every 5 steps (mean)", with_ckpt),
            ("loop blocked by one async save (mean over the loop's saves)", sum(blocked) / max(len(blocked), 1)),
            ("loop blocked by one async save (idle device)", async_blocked),
            ("async save until durable", async_total),
            ("synchronous save", sync_total),
            ("restore", restore)]
    print("| measurement | seconds |\n|---|---|")
    for name, sec in rows:
        print(f"| {name} | {sec:.3f} |")
    print(f"blocked / step time: {async_blocked / plain:.2f} ; blocked / durable save: {async_blocked / async_total:.2f} ; "
          f"step overhead with saves every 5 steps: {with_ckpt / plain:.2f}x")


if __name__ == "__main__":
    main()
