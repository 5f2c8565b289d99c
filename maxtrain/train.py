"""Entry point: python -m maxtrain.train configs/x.yml key=value ...

argv -> config -> mesh -> sharded init -> loop (step N+1 queued before step N's metrics are read).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

import jax
import yaml

from maxtrain import checkpoint as ckpt_lib
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


def initial_state(c: config_lib.Config, trainer: step_lib.Trainer, checkpointer, batches):
    """Resume this run; else load_full_state_path; else load_parameters_path; else fresh init."""
    if checkpointer is not None:
        restored = checkpointer.restore(trainer.abstract_state)
        if restored is not None:
            state, data_state = restored
            batches.set_state(data_state)
            print(f"resumed from {checkpointer.directory}/{int(state.step)}")
            return state
    if c.load_full_state_path:
        print(f"loading full state from {c.load_full_state_path}")
        return ckpt_lib.load_full_state(c, trainer.abstract_state)
    state = trainer.init(jax.random.key(c.init_weights_seed))
    if c.load_parameters_path:
        print(f"loading parameters from {c.load_parameters_path}")
        state = state.replace(params=ckpt_lib.load_parameters(c, trainer.abstract_state.params))
    return state


class StopSignal:
    """Turns SIGTERM (what TPU, GKE and SLURM preemption send) into a flag the loop checks."""

    def __init__(self):
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)


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

    checkpointer = ckpt_lib.Checkpointer(c) if c.enable_checkpointing else None
    stop = StopSignal()
    preempted = False
    with mesh_lib.activate(mesh, trainer.rules):
        batches = data.make_iterator(c, trainer.batch_sharding)
        state = initial_state(c, trainer, checkpointer, batches)
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
            done = step + 1
            if checkpointer is not None:
                preempted = stop.received or checkpointer.reached_preemption(done)
                checkpointer.save(done, state, batches.get_state(), force=preempted or done == c.steps)
            if pending is not None:
                read(*pending)
            pending = (done, device_metrics)
            if preempted or (stop.received and checkpointer is None):
                break
        if pending is not None:
            read(*pending)
    stop.restore()
    if checkpointer is not None:
        checkpointer.close()  # waits until every pending save is durable
    writer.close()
    if stop.received:
        where = f"checkpoint saved at step {pending[0]}; rerun the same command to resume" if preempted else \
            "checkpointing is off, nothing saved"
        print(f"stopped by SIGTERM after step {pending[0]}: {where}", flush=True)
        return {"losses": history, "state": state, "preempted": True}
    elapsed = time.perf_counter() - t_start
    if not history:
        print(f"nothing to do: the run is already at step {int(state.step)} of {c.steps}")
        return {"losses": history, "state": state}
    print(f"done: {c.steps} steps in {elapsed:.1f} s, final loss {history[-1]:.4f}; outputs in {run_dir}")
    return {"losses": history, "state": state}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        c = load_config(argv)
    except config_lib.ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    try:
        train(c)
    except ckpt_lib.CheckpointError as e:
        print(f"checkpoint error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
