"""Entry point: python -m maxtrain.train configs/x.yml key=value ...

argv -> config -> mesh -> sharded init -> loop (step N+1 queued before step N's metrics are read).
"""

# ruff: noqa: E402 (the re-exec below must come before jax and its allocator load)
from __future__ import annotations

import sys

if __name__ == "__main__":
    from maxtrain.hugepages import reexec_with_huge_pages
    reexec_with_huge_pages()

import concurrent.futures
import math
import os
import signal
import time
from pathlib import Path

import jax

from maxtrain import config as config_lib, errors
from maxtrain import data, distributed, mesh as mesh_lib, metrics as metrics_lib, step as step_lib, summary


def say(*args) -> None:
    """Progress lines come from process 0 only; every process would print the same."""
    if jax.process_index() == 0:
        print(*args, flush=True)


def load_config(argv: list[str], devices=None) -> config_lib.Config:
    """Parse and validate, start jax.distributed if the run is multi-process, then fit the mesh."""
    c = config_lib.load(argv)
    distributed.initialize(c)  # before anything touches devices
    if jax.process_count() > 1 and c.num_epochs != -1 and c.dataset_type != "synthetic":
        # Each process reads its own share of the documents and the shares end at different steps:
        # the processes that ran out would stop while the others wait for them in the step.
        raise config_lib.ConfigError("num_epochs", f"{c.num_epochs}: with several processes use -1 (repeat) "
                                     "and end the run with steps")
    if c.compilation_cache_dir:  # a rerun of the same program loads its executables instead of compiling
        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(c.compilation_cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    devices = devices or jax.devices()
    return config_lib.with_devices(c, len(devices), mesh_lib.num_slices(devices))


def dry_run(c: config_lib.Config, trainer: step_lib.Trainer) -> None:
    say(summary.param_table(trainer))
    compiled = trainer.compile_train_step()
    say("train step memory per device:", summary.format_memory(summary.memory_report(compiled)))


def initial_state(c: config_lib.Config, trainer: step_lib.Trainer, checkpointer, batches):
    """Resume this run; else load_full_state_path; else load_parameters_path; else fresh init."""
    if checkpointer is not None:
        state = checkpointer.restore(trainer.abstract_state, batches)
        if state is not None:
            say(f"resumed from {checkpointer.directory}/{int(state.step)}")
            return state
    if c.load_full_state_path:
        from maxtrain import checkpoint as ckpt_lib  # orbax loads only where needed: see train()
        say(f"loading full state from {c.load_full_state_path}")
        return ckpt_lib.load_full_state(c, trainer.abstract_state)
    state = trainer.init(jax.random.key(c.init_weights_seed))
    if c.load_parameters_path:
        from maxtrain import checkpoint as ckpt_lib
        say(f"loading parameters from {c.load_parameters_path}")
        state = state.replace(params=ckpt_lib.load_parameters(c, trainer.abstract_state.params))
    return state


def evaluate(c: config_lib.Config, trainer: step_lib.Trainer, params, make_eval_iterator) -> dict:
    """Loss over (up to) eval_steps batches of a fresh pass over the eval documents."""
    loss_sum, tokens, batches = 0.0, 0.0, make_eval_iterator()
    for _ in range(c.eval_steps):
        try:
            batch = next(batches)
        except StopIteration:
            break
        out = jax.device_get(trainer.eval_step(params, batch))
        if out["tokens"] == 0:  # every process's share is used up (several processes pad; see data.py)
            break
        loss_sum, tokens = loss_sum + float(out["loss_sum"]), tokens + float(out["tokens"])
    loss = loss_sum / max(tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}


class Preemption:
    """SIGTERM (what TPU, GKE and SLURM preemption send) as a step at which to save and stop.

    One process: a handler sets a flag that the next step sees. Several processes: the signal may
    reach each at a different step, so JAX's preemption service (started by jax.distributed.initialize,
    with its own SIGTERM handler, which a Python handler would replace) agrees on one step for all.
    """

    def __init__(self):
        self.multiprocess = jax.process_count() > 1
        self.received = False
        if self.multiprocess:
            from jax.experimental import multihost_utils
            self._sync_point = multihost_utils.reached_preemption_sync_point
        else:
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.received = True

    def reached(self, step: int) -> bool:
        """Call after every step (all processes, every step): True at the step to stop after."""
        if self.multiprocess and not self.received:
            self.received = self._sync_point(step)
        return self.received

    def restore(self):
        if not self.multiprocess:
            signal.signal(signal.SIGTERM, self._previous)


def train(c: config_lib.Config, devices=None) -> dict:
    """Runs the config on `devices` (default: all). Returns per-step losses and the final state."""
    mesh = mesh_lib.make_mesh(c, devices)
    trainer = step_lib.build(c, mesh)
    say(f"maxtrain: {c.num_params:,} parameters | mesh {c.mesh_shape} | global batch "
        f"{c.global_batch_size} x {c.max_target_length} tokens | remat {c.remat_policy} | {c.dtype}")
    if c.dry_run:
        dry_run(c, trainer)
        return {}
    # Read data files and tokenizer before writing anything: bad input fails cleanly.
    batches, make_eval_iterator = data.make_iterators(c, trainer.batch_sharding)
    # XLA compiles the step on a thread (the GIL is released) while the state is initialized or restored.
    t_compile, compiler = time.perf_counter(), concurrent.futures.ThreadPoolExecutor(1)
    compiling = compiler.submit(trainer.compile_train_step)
    compiler.shutdown(wait=False)

    run_dir = Path(c.base_output_directory) / c.run_name
    if jax.process_index() == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yml").write_text(c.to_yaml())
    tokens_per_step = c.global_batch_size * c.max_target_length
    flops_per_device = metrics_lib.train_flops_per_step(c) / c.num_devices

    checkpointer = None
    if c.enable_checkpointing:
        # orbax takes ~0.4 s to import, so runs that neither save nor load do without it
        from maxtrain import checkpoint as ckpt_lib
        checkpointer = ckpt_lib.Checkpointer(c)
    stop = Preemption()
    preempted = exhausted = False
    with mesh_lib.activate(mesh, trainer.rules):
        state = initial_state(c, trainer, checkpointer, batches)
        writer = metrics_lib.MetricsWriter(run_dir, c.enable_tensorboard, start_step=int(state.step))
        train_step = compiling.result()
        jax.block_until_ready(state)
        say(f"state ready and train step compiled in {time.perf_counter() - t_compile:.1f} s")
        # Only now: on CPU the MFU denominator is a matmul probe, which beside the compile read a
        # third of the machine's rate.
        peak = metrics_lib.peak_tflops_per_device(c)
        t_start = time.perf_counter()
        first_step = int(state.step)
        last_time, last_step = t_start, first_step  # the current step-time window
        saved_step = evaluated_step = None
        pending, history, eval_history = None, [], []

        def read(step_done, device_metrics):
            # Blocks until step `step_done` finished; by then the next step is already queued.
            nonlocal last_time, last_step
            m = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
            history.append(m["loss"])
            now = time.perf_counter()
            if step_done == first_step + 1:  # warm-up is kept out of later step-time windows
                say(f"first step took {now - t_start:.1f} s")
            if step_done % c.log_period and step_done != c.steps and step_done != first_step + 1:
                return
            seconds = (now - last_time) / max(step_done - last_step, 1)
            last_time, last_step = now, step_done
            tflops = flops_per_device / seconds / 1e12
            m.update(step_seconds=seconds, tokens_per_second=tokens_per_step / seconds,
                     tflops_per_device=tflops, mfu=tflops / peak)
            say(metrics_lib.format_line(step_done, m))
            writer.write(step_done, m)

        def save(step_done):
            nonlocal saved_step
            checkpointer.save(step_done, state, batches.get_state())  # the data state is gathered only here
            saved_step = step_done

        def run_eval(step_done):
            nonlocal last_time, evaluated_step
            t0 = time.perf_counter()
            e = evaluate(c, trainer, state.params, make_eval_iterator)
            last_time += time.perf_counter() - t0  # keep eval out of the step-time window
            evaluated_step = step_done
            eval_history.append(e["loss"])
            say(f"eval   {step_done:>6d} | loss {e['loss']:.4f} | perplexity {e['perplexity']:.3f} | "
                f"{e['tokens']:,.0f} tokens")
            writer.write(step_done, e, prefix="eval")

        for step in range(first_step, c.steps):
            try:
                batch = next(batches)
            except StopIteration:
                say(f"data exhausted after num_epochs={c.num_epochs} at step {step}")
                exhausted = True
                break
            state, device_metrics = train_step(state, batch)
            done = step + 1
            preempted = stop.reached(done)
            if checkpointer is not None and (preempted or done == c.steps or checkpointer.due(done)):
                save(done)
            if pending is not None:
                read(*pending)
            pending = (done, device_metrics)
            if make_eval_iterator and c.eval_interval and (done % c.eval_interval == 0 or done == c.steps):
                read(*pending)
                pending = None
                run_eval(done)
            if preempted:
                break
        if pending is not None:
            read(*pending)
        last = int(state.step)
        if exhausted and last > first_step:  # the data's end is this run's end: save and evaluate it
            if checkpointer is not None and saved_step != last:
                save(last)
            if make_eval_iterator and c.eval_interval and evaluated_step != last:
                run_eval(last)
    if checkpointer is not None:
        checkpointer.close()  # waits until every pending save is durable
    stop.restore()  # only now: a second SIGTERM during the final save must not cut it short
    writer.close()
    if preempted:
        where = f"checkpoint saved at step {last}; rerun the same command to resume" if checkpointer is not None else \
            "checkpointing is off, nothing saved"
        say(f"stopped by SIGTERM after step {last}: {where}")
        return {"losses": history, "state": state, "preempted": True, "eval_losses": eval_history}
    elapsed = time.perf_counter() - t_start
    if not history:
        say(f"nothing to do: the run is already at step {int(state.step)} of {c.steps}")
        return {"losses": history, "state": state}
    say(f"done: {int(state.step)} steps in {elapsed:.1f} s, final loss {history[-1]:.4f}; outputs in {run_dir}")
    return {"losses": history, "state": state, "eval_losses": eval_history}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return errors.exit_code(lambda: train(load_config(argv)))


if __name__ == "__main__":
    sys.exit(main())
