"""Entry point: python -m maxtrain.train configs/x.yml key=value ...

argv -> config -> mesh -> sharded init -> loop (step N+1 queued before step N's metrics are read).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import jax
import yaml

from maxtrain import config as config_lib
from maxtrain import data, mesh as mesh_lib, metrics as metrics_lib, step as step_lib, summary


def load_config(argv: list[str], devices=None) -> config_lib.Config:
    devices = devices or jax.devices()
    c = config_lib.load(argv)
    return config_lib.with_devices(c, len(devices), mesh_lib.num_slices(devices))


def dry_run(c: config_lib.Config, trainer: step_lib.Trainer) -> None:
    print(summary.param_table(trainer))
    batch = {k: jax.ShapeDtypeStruct((c.global_batch_size, c.max_target_length),
                                     "float32" if k == "weights" else "int32", sharding=trainer.batch_sharding)
             for k in step_lib.BATCH_KEYS}
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        compiled = trainer.train_step.lower(trainer.abstract_state, batch).compile()
    print("train step memory per device:", summary.format_memory(summary.memory_report(compiled)))


def train(c: config_lib.Config, devices=None) -> dict:
    """Runs the config on `devices` (default: all). Returns per-step losses and the final state."""
    mesh = mesh_lib.make_mesh(c, devices)
    trainer = step_lib.build(c, mesh)
    print(f"maxtrain: {c.num_params:,} parameters | mesh {c.mesh_shape} | global batch "
          f"{c.global_batch_size} x {c.max_target_length} tokens | remat {c.remat_policy} | {c.dtype}")
    if c.dry_run:
        dry_run(c, trainer)
        return {}

    run_dir = Path(c.base_output_directory) / c.run_name
    writer = metrics_lib.MetricsWriter(run_dir, c.enable_tensorboard)
    if writer.active:
        (run_dir / "config.yml").write_text(yaml.safe_dump(c.to_dict(), sort_keys=False))
    tokens_per_step = c.global_batch_size * c.max_target_length
    flops_per_device = metrics_lib.train_flops_per_step(c) / c.num_devices
    peak = metrics_lib.peak_tflops_per_device(c)

    with mesh_lib.activate(mesh, trainer.rules):
        state = trainer.init(jax.random.key(c.init_weights_seed))
        batches = data.make_iterator(c, trainer.batch_sharding)
        t_start = time.perf_counter()
        last_time, last_step, pending, history = t_start, 0, None, []

        def read(step_done, device_metrics):
            # Blocks until step `step_done` finished; by then the next step is already queued.
            nonlocal last_time, last_step
            m = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
            history.append(m["loss"])
            if step_done == first_step + 1:  # compile time kept out of the step-time windows
                last_time, last_step = time.perf_counter(), step_done
                print(f"first step (includes compile) took {last_time - t_start:.1f} s", flush=True)
            if step_done % c.log_period and step_done != c.steps or step_done == last_step:
                return
            now = time.perf_counter()
            seconds = (now - last_time) / (step_done - last_step)
            last_time, last_step = now, step_done
            tflops = flops_per_device / seconds / 1e12
            m.update(step_seconds=seconds, tokens_per_second=tokens_per_step / seconds,
                     tflops_per_device=tflops, mfu=tflops / peak)
            print(metrics_lib.format_line(step_done, m), flush=True)
            writer.write(step_done, m)

        first_step = int(state.step)
        for step in range(first_step, c.steps):
            state, device_metrics = trainer.train_step(state, next(batches))
            if pending is not None:
                read(*pending)
            pending = (step + 1, device_metrics)
        if pending is not None:
            read(*pending)
    writer.close()
    elapsed = time.perf_counter() - t_start
    print(f"done: {c.steps} steps in {elapsed:.1f} s, final loss {history[-1]:.4f}; outputs in {run_dir}")
    return {"losses": history, "state": state}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        c = load_config(argv)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    train(c)
    return 0


if __name__ == "__main__":
    sys.exit(main())
