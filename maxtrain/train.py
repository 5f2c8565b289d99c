"""Entry point: python -m maxtrain.train configs/x.yml key=value ...

argv -> config -> mesh -> sharded init -> loop (step N+1 queued before step N's metrics are read).
"""

# ruff: noqa: E402 (the re-exec below must come before jax and its allocator load)
from __future__ import annotations

import sys

if __name__ == "__main__":
    from maxtrain import interrupts
    interrupts.watch()  # first thing: Ctrl-C and SIGTERM end the start-up at once, in one line
    from maxtrain.hugepages import reexec_with_huge_pages
    reexec_with_huge_pages()
    from maxtrain.distributed import supervise
    supervise(sys.argv[1:])  # a multi-process run trains in a child: a lost peer is one line, not an abort

import concurrent.futures
import math
import os
import time

import jax

from maxtrain import config as config_lib, errors
from maxtrain import data, distributed, fit, mesh as mesh_lib, metrics as metrics_lib, platform_defaults, resolve
from maxtrain import cli_help, metric_writers, platform_env, profiler as profiler_lib, progress
from maxtrain import run_dir as run_dir_lib, run_name as run_name_lib, run_record
from maxtrain.interrupts import Preemption
from maxtrain import step as step_lib, summary


def say(*args) -> None:
    """Progress lines come from process 0 only; every process would print the same."""
    if jax.process_index() == 0:
        print(*args, flush=True)


def load_config(argv: list[str], devices=None) -> resolve.Resolved:
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
    return resolve.resolve(c, devices or jax.devices())


def dry_run(c: config_lib.Config, trainer: step_lib.Trainer) -> None:
    say(summary.param_table(trainer, c.num_active_params))
    with progress.heartbeat("compiling the train step"):
        compiled = trainer.compile_train_step()
    say("train step memory per device:", summary.format_memory(summary.memory_report(compiled)))


def initial_state(c: config_lib.Config, trainer: step_lib.Trainer, checkpointer, batches):
    """Resume this run; else load_full_state_path; else load_parameters_path; else fresh init."""
    if checkpointer is not None:
        with progress.heartbeat(f"reading the newest checkpoint in {checkpointer.directory}"):
            state = checkpointer.restore(trainer.abstract_state, batches)
        if state is not None:
            say(f"resumed from {checkpointer.directory}/{int(state.step)}")
            return state
    if c.load_full_state_path:
        from maxtrain import checkpoint as ckpt_lib  # orbax loads only where needed: see train()
        say(f"loading full state from {c.load_full_state_path}")
        return ckpt_lib.load_full_state(c, trainer.abstract_state)
    init = trainer.init.lower(jax.random.key(c.init_weights_seed)).compile()
    fit.check_compiled(init, trainer.mesh, "initializing the state")  # its temporaries can exceed the state's size
    state = init(jax.random.key(c.init_weights_seed))
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


class NonFiniteGuard:
    """What follows a step whose loss, gradient norm or new parameters were not finite. The step itself
    already dropped the update (step.py); this decides, one step late, between going on (skip), restoring
    the newest checkpoint (rollback) and stopping, and stops any policy after max_nonfinite_steps."""

    def __init__(self, c: config_lib.Config):
        self.policy, self.limit, self.count = c.nan_policy, c.max_nonfinite_steps, 0

    def on_bad_step(self, step: int, last_trusted: str) -> str:
        self.count += 1
        if self.policy == "stop":
            raise errors.RunError(f"step {step}: the loss or gradients are not finite (nan_policy=stop); the "
                                  f"update was not applied and nothing more is saved; {last_trusted}")
        if self.count > self.limit:
            raise errors.RunError(f"step {step}: {self.count} non-finite steps, more than max_nonfinite_steps="
                                  f"{self.limit} (nan_policy={self.policy}); the run diverges: lower the "
                                  f"learning_rate or set gradient_clipping_threshold; {last_trusted}")
        return self.policy


def train(c: config_lib.Config, devices=None) -> dict:
    """Runs the config on `devices` (default: all). Returns per-step losses and the final state."""
    for warning in config_lib.no_effect_warnings(c):
        say(f"warning: {warning}")
    metric_writers.check_installed(c)
    mesh = mesh_lib.make_mesh(c, devices)
    fit.check_activations(c, mesh)  # from the shapes alone: tracing or compiling a step far too large takes minutes
    trainer = step_lib.build(c, mesh)
    active = f" ({c.num_active_params:,} active)" if c.num_active_params != c.num_params else ""
    say(f"maxtrain: {c.num_params:,} parameters{active} | mesh {c.mesh_shape} | global batch "
        f"{c.global_batch_size} x {c.max_target_length} tokens | remat {c.remat_policy} | "
        f"{platform_defaults.summary(c)}")
    for note in trainer.notes:
        say(note)
    if c.dry_run:
        dry_run(c, trainer)
        return {}
    fit.check_state(trainer)  # before init allocates it
    # Read data files and tokenizer before writing anything: bad input fails cleanly.
    batches, make_eval_iterator = data.make_iterators(c, trainer.batch_sharding)
    run_dir, created = run_dir_lib.make(c)
    say(run_record.start_lines(c, run_dir))
    # XLA compiles the step on a thread (the GIL is released) while the state is initialized or restored.
    t_compile, compiler = time.perf_counter(), concurrent.futures.ThreadPoolExecutor(1)
    say("compiling the train step (in the background while the state is made)")
    compiling = compiler.submit(progress.timed, trainer.compile_train_step)
    compiler.shutdown(wait=False)

    checkpointer, undo = None, []  # undo: what the loop set up that a failure must take down again
    try:
        if c.enable_checkpointing:
            # orbax takes ~0.4 s to import, so runs that neither save nor load do without it
            from maxtrain import checkpoint as ckpt_lib
            checkpointer = ckpt_lib.Checkpointer(c)
        return _loop(c, trainer, batches, make_eval_iterator, run_dir, checkpointer, compiling, t_compile, undo)
    except BaseException as e:
        for step_back in reversed(undo):  # signal handlers put back, metric files and the W&B run closed
            step_back()
        if not isinstance(e, errors.UserError):
            raise
        # Stopped for cause or by bad data: let the saves under way finish (they hold good states), then report.
        if checkpointer is not None and not isinstance(e, ckpt_lib.SaveError):
            try:
                checkpointer.close()
            except errors.RunError:
                pass
        if created:
            run_dir_lib.remove_if_unused(run_dir)
        raise


def _loop(c, trainer, batches, make_eval_iterator, run_dir, checkpointer, compiling, t_compile, undo) -> dict:
    mesh = trainer.mesh
    tokens_per_step = c.global_batch_size * c.max_target_length
    flops_per_device = metrics_lib.train_flops_per_step(c) / c.num_devices
    guard = NonFiniteGuard(c)
    start_data = batches.get_state()  # where a rollback with no checkpoint restarts the data
    with mesh_lib.activate(mesh, trainer.rules):
        with progress.heartbeat("initializing the state and compiling the train step", since=t_compile) as beat:
            state = initial_state(c, trainer, checkpointer, batches)
            t_state = time.perf_counter() - t_compile
            record = run_record.record(c, run_dir, int(state.step))
            run_dir_lib.write_config(c, run_dir, record)
            writer = metric_writers.MetricsWriter(run_dir, metric_writers.backends(c), int(state.step), record)
            undo.append(lambda: writer.abandon())  # the writer of the moment: a rollback makes another
            beat.what = "compiling the train step"
            train_step, compile_seconds = compiling.result()
        fit.check_compiled(train_step, mesh)  # before the first batch is made
        jax.block_until_ready(state)
        say(f"train step compiled in {compile_seconds:.1f} s; state ready in {t_state:.1f} s")
        # Only now: on CPU the MFU denominator is a matmul probe, which beside the compile read a
        # third of the machine's rate.
        peak = metrics_lib.peak_tflops_per_device(c) if int(state.step) < c.steps else None  # a finished run: no probe
        if peak is not None:
            say(peak.describe())
        stop = Preemption()  # from here a SIGTERM is a step to save at
        undo.append(stop.restore)
        profiler = profiler_lib.StepProfiler(c, run_dir)
        preempted = exhausted = False
        t_start = time.perf_counter()
        first_step = int(state.step)
        last_time, last_step = t_start, first_step  # the current step-time window
        recent_seconds = None  # the last window's time per step, for the ETA
        saved_step = checkpointer.latest_step() if checkpointer is not None else None
        evaluated_step = None
        pending, history, eval_history, rolled_back = None, [], [], False

        def eta(step_done: int) -> float | None:
            return recent_seconds * (c.steps - step_done) if recent_seconds is not None else None

        def last_trusted() -> str:
            return checkpointer.last_trusted() if checkpointer is not None else "checkpointing is off"

        def read(step_done, device_metrics) -> str | None:
            """Blocks until step `step_done` finished (the next one is already queued); logs it. Returns
            None, or the non-finite policy's action for it ("skip" / "rollback"; "stop" raises)."""
            nonlocal last_time, last_step, recent_seconds
            m = {k: v.tolist() if v.ndim else float(v) for k, v in jax.device_get(device_metrics).items()}
            bad = m["nonfinite"] > 0
            m["nonfinite_steps"] = guard.count + bad
            history.append(m["loss"])
            if checkpointer is not None:
                checkpointer.observe(step_done, m["loss"], not bad)
            now = time.perf_counter()
            first = len(history) == 1 and not rolled_back  # warm-up is kept out of later step-time windows
            if first:
                say(f"first step took {now - t_start:.1f} s")
            if not bad and step_done % c.log_period and step_done != c.steps and not first:
                return None
            seconds = (now - last_time) / max(step_done - last_step, 1)
            last_time, last_step = now, step_done
            if not first:  # the first step's time is mostly compiling and warm-up: no base for an ETA
                recent_seconds = seconds
            tflops = flops_per_device / seconds / 1e12
            mfu, note = peak.mfu(tflops)
            if note:
                say(note)
            m.update(step_seconds=seconds, tokens_per_second=tokens_per_step / seconds, tflops_per_device=tflops,
                     **({"mfu": mfu} if mfu is not None else {}))
            say(metrics_lib.format_line(step_done, c.steps, m, eta(step_done)))
            writer.write(step_done, m)
            return guard.on_bad_step(step_done, last_trusted()) if bad else None

        def save(step_done) -> str | None:
            """None, or (the state is not finite: an update overflowed it; nothing saved) the policy's action."""
            nonlocal saved_step, last_time
            t0 = time.perf_counter()
            try:
                with progress.heartbeat(f"saving checkpoint {step_done}"):
                    checkpointer.save(step_done, state, batches.get_state())  # the data state is gathered only here
            except errors.NonFiniteState as e:
                say(f"{e}: not saved")
                return guard.on_bad_step(step_done, last_trusted())
            finally:
                last_time += time.perf_counter() - t0  # keep the save out of the step-time window
            saved_step = step_done
            return None

        def run_eval(step_done):
            nonlocal last_time, evaluated_step
            t0 = time.perf_counter()
            with progress.heartbeat(f"evaluating at {metrics_lib.step_of(step_done, c.steps)}"):
                e = evaluate(c, trainer, state.params, make_eval_iterator)
            last_time += time.perf_counter() - t0  # keep eval out of the step-time window
            evaluated_step = step_done
            eval_history.append(e["loss"])
            say(metrics_lib.format_eval_line(step_done, c.steps, e, time.perf_counter() - t0, eta(step_done)))
            writer.write(step_done, e, prefix="eval")

        def rollback(bad_step: int):
            """The newest checkpoint (or the start), then past the batches from it up to `bad_step`."""
            nonlocal state, last_time, last_step, rolled_back
            state = None  # free it before the restore allocates another
            with progress.heartbeat(f"restoring the newest checkpoint for the rollback from step {bad_step}"):
                restored = checkpointer.restore(trainer.abstract_state, batches) if checkpointer is not None else None
            if restored is None:
                batches.set_state(start_data)
                restored = initial_state(c, trainer, None, batches)
            good = int(restored.step)
            batches.skip(bad_step - good)
            del history[max(good - first_step, 0):]  # a rollback can reach before this run's start
            writer.rewind(good)
            say(f"rollback: step {bad_step} was not finite ({guard.count} of max_nonfinite_steps="
                f"{guard.limit}); back at step {good}, skipping the {bad_step - good} batches after it")
            last_time, last_step, rolled_back = time.perf_counter(), good, True
            return restored, good

        step = first_step
        while step < c.steps:
            if checkpointer is not None:
                checkpointer.poll()  # a failed background save stops the run now
            try:
                batch = next(batches)
            except StopIteration:
                say(f"data exhausted after num_epochs={c.num_epochs} at step {step}")
                exhausted = True
                break
            profiler.before_step(step + 1)
            state, device_metrics = train_step(state, batch)
            step += 1
            profiler.after_step(step, state)
            preempted = stop.reached(step)
            must_save = checkpointer is not None and (preempted or step == c.steps or checkpointer.due(step))
            must_eval = bool(make_eval_iterator and c.eval_interval and (step % c.eval_interval == 0 or step == c.steps))
            to_read = [pending] if pending is not None else []
            pending = (step, device_metrics)
            if must_save or must_eval or preempted or step == c.steps:  # these wait for it anyway: check it first
                to_read.append(pending)
                pending = None
            bad_step = next((item[0] for item in to_read if read(*item) == "rollback"), None)
            if bad_step is None and must_save and save(step) == "rollback":
                bad_step = step
            if bad_step is not None:
                state, step = rollback(bad_step)
                pending = None
                if preempted:
                    break  # the checkpoint just restored is where a rerun resumes
                continue
            if must_eval:
                run_eval(step)
            if preempted:
                break
        if pending is not None and read(*pending) == "rollback":
            state, step = rollback(pending[0])  # the last step was bad: end at the good state before it
        profiler.stop(state)  # the run ended inside the traced steps
        last = int(state.step)
        if exhausted and last == first_step == 0:
            raise data.DataError(f"{c.train_files}: the data ends before the first batch of {c.global_batch_size} x "
                                 f"{c.max_target_length} tokens (num_epochs={c.num_epochs}): add data or use "
                                 f"num_epochs=-1")
        if exhausted and last > first_step:  # the data's end is this run's end: save and evaluate it
            if checkpointer is not None and saved_step != last:
                save(last)  # a non-finite state is not saved; the run ends on the data either way
            if make_eval_iterator and c.eval_interval and evaluated_step != last:
                run_eval(last)
    if checkpointer is not None:
        with progress.heartbeat("waiting for the last checkpoint to be written"):
            checkpointer.close()  # waits until every pending save is durable
    stop.restore()  # only now: a second SIGTERM during the final save must not cut it short
    writer.close()
    skipped = f" ({guard.count} non-finite steps skipped)" if guard.count and c.nan_policy == "skip" else ""
    if preempted:
        where = f"checkpoint saved at step {last}; rerun the same command to resume" if checkpointer is not None else \
            "checkpointing is off, nothing saved"
        say(f"stopped by {stop.name} after step {last}: {where}")
        return {"losses": history, "state": state, "preempted": True, "eval_losses": eval_history}
    elapsed = time.perf_counter() - t_start
    if not history:
        say(f"nothing to do: run {c.run_name} is finished (at step {int(state.step)} of steps={c.steps}); its outputs "
            f"are in {run_dir} (raise steps to train on)")
        return {"losses": history, "state": state}
    say(f"done: {int(state.step)} steps in {elapsed:.1f} s, final loss {history[-1]:.4f}{skipped}; outputs in {run_dir}")
    return {"losses": history, "state": state, "eval_losses": eval_history, "nonfinite_steps": guard.count}


USAGE = """usage: python -m maxtrain.train CONFIG.yml [key=value ...]
       python -m maxtrain.train --help-keys [PATTERN]

Trains the decoder CONFIG.yml describes; key=value pairs override the files. Outputs go to
base_output_directory/run_name/ (without a run_name: one derived from the config file's name and the keys
that define the model, optimizer and data, so the same command resumes the same run). Ctrl-C or SIGTERM
saves the current step and stops (a rerun resumes); a third Ctrl-C quits without that save."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if (code := cli_help.handle(argv, USAGE)) is not None:
        return code
    platform_env.quiet_without_accelerators()

    def run():
        c = load_config(argv)
        if c.run_name_derived:
            say(run_name_lib.note(argv[0], c.run_name))
        return train(c)
    return errors.exit_code(run)


if __name__ == "__main__":
    code = main()
    if code:  # a failed run ends now: no waiting on threads (Orbax's, the compile) that may never finish
        distributed.leave_on_error(code)  # peers that failed alike leave together, none aborted by another's exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
