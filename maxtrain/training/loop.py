"""The training loop: step N+1 is queued before step N's metrics are read, so the host's work (logging,
the data's next batch, checkpoint bookkeeping) overlaps the device's.

One method per duty: read a step's metrics, save, evaluate, roll back, and the end (the data's end, a
SIGTERM or Ctrl-C, the last step); what the run set up is taken down again in `run`'s finally, however it
ends.
"""

from __future__ import annotations

import sys
import time

import jax

from maxtrain.config import load as config_lib
from maxtrain.data import pipeline as data
from maxtrain.launch import run_dir as run_dir_lib
from maxtrain.runtime import errors
from maxtrain.observe import fit, metrics as metrics_lib, writers as metric_writers, profiler as profiler_lib
from maxtrain.observe import goodput, progress, run_record
from maxtrain.observe.data_watch import DataWatch, MixtureWatch
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib
from maxtrain.runtime.interrupts import Preemption
from maxtrain.runtime.console import say
from maxtrain.training import evaluation, optimizer
from maxtrain.training.guards import NonFiniteGuard
from maxtrain.training.state import initial_state


class TrainLoop:
    """One run of `c` with `trainer` from its newest checkpoint (or its start) to steps, the data's end or a
    stop request. `created`: the run directory is this start's, and is removed if a failure leaves it unused.
    `compiling`: the train step being compiled (a future of (executable, seconds)) since `t_compile`.
    `ledger`: this start's goodput.Ledger, told where the time goes.
    `samples`: continuations to print and log every sample_interval steps (maxtrain.training.samples), or None."""

    def __init__(self, c: config_lib.Config, trainer: step_lib.Trainer, batches, evals, run_dir,
                 created: bool, compiling, t_compile: float, ledger: goodput.Ledger, samples=None):
        self.c, self.trainer, self.batches, self.evals = c, trainer, batches, evals
        self.samples = samples
        self.run_dir, self.created, self.compiling, self.t_compile = run_dir, created, compiling, t_compile
        self.ledger, self.goodput = ledger, None  # goodput: the job's summary once this start ends
        self.tokens_per_step = c.global_batch_size * c.max_target_length
        self.flops_per_device = metrics_lib.train_flops_per_step(c) / c.num_devices
        self.guard = NonFiniteGuard(c)
        # What run() sets up, in order; its finally takes down whichever exist.
        self.checkpointer = self.writer = self.preemption = self.profiler = None
        self.state = self.train_step = self.peak = self.start_data = None
        self.first_step = 0
        self.t_start = self.last_time = 0.0  # last_time, last_step: where the current step-time window began
        self.last_step = 0
        self.recent_seconds = None  # the last window's time per step, for the ETA
        self.evaluated_step = None
        self.preempted = self.exhausted = self.rolled_back = False
        self.restart_s, self.advised = 0.0, False  # what this start took to its first step; intervals said
        self.history, self.eval_history = [], []
        self.data_watch, self.mixture_watch = DataWatch(batches, c), MixtureWatch(batches, c)

    def run(self) -> dict:
        """Trains; returns per-step losses and the final state."""
        finished = False
        try:
            if self.c.enable_checkpointing:
                # orbax is slow to import, so runs that neither save nor load do without it
                from maxtrain.checkpoint import manager as ckpt_lib
                self.checkpointer = ckpt_lib.Checkpointer(self.c, also_at=optimizer.stable_end(self.c))
            self.start_data = self.batches.get_state()  # where a rollback with no checkpoint restarts the data
            with mesh_lib.activate(self.trainer.mesh, self.trainer.rules):
                self.start()
                self.loop()
                self.end_of_data()
                self.persist_last()
            if self.checkpointer is not None:
                with progress.heartbeat("waiting for the last checkpoint to be written"), \
                        self.ledger.phase("checkpoint"):
                    self.checkpointer.close()  # waits until every pending save is durable
            self.goodput = self.ledger.end("preempted" if self.preempted else "done")
            if self.goodput is not None:
                # goodput.jsonl holds them for tools: metrics.jsonl's rows stay the steps' and evals'
                self.writer.write(int(self.state.step), goodput.metrics(self.goodput), prefix="goodput", jsonl=False)
            finished = True
        finally:
            # The exception under way, if any (held in no local: it would keep this frame and the run's
            # arrays alive until the garbage collector runs).
            self.clean_up(None if finished else sys.exc_info()[1])
        return self.report()

    def start(self) -> None:
        """The state (restored, loaded or new) while the step compiles; the metrics writer; the step."""
        c = self.c
        with progress.heartbeat("initializing the state and compiling the train step", since=self.t_compile) as beat:
            previous = run_dir_lib.last_start_config(self.run_dir)
            stable = optimizer.extend_from(c, previous)
            if stable is not None and self.checkpointer is not None:  # the decayed steps are the old end's
                self.checkpointer.set_aside_after(stable, "decayed", "a wsd run extended (learning_rate_schedule_steps "
                                                  f"{previous['learning_rate_schedule_steps']} -> "
                                                  f"{c.learning_rate_schedule_steps})")
            t0 = time.perf_counter()
            self.state = initial_state(c, self.trainer, self.checkpointer, self.batches)
            t_state = time.perf_counter() - self.t_compile
            if int(self.state.step):  # a restore; a new state's making is start-up
                self.ledger.add("restore", time.perf_counter() - t0)
            note = optimizer.extension_note(c, previous, int(self.state.step))
            if note:
                say(note)
            record = run_record.record(c, self.run_dir, int(self.state.step))
            run_dir_lib.write_config(c, self.run_dir, record)
            self.writer = metric_writers.MetricsWriter(self.run_dir, metric_writers.backends(c), int(self.state.step),
                                                       record)
            beat.what = "compiling the train step"
            with self.ledger.phase("compile"):  # what is left of it once the state is ready
                self.train_step, compile_seconds = self.compiling.result()
        fit.check_compiled(self.train_step, self.trainer.mesh)  # before the first batch is made
        jax.block_until_ready(self.state)
        say(f"train step compiled in {compile_seconds:.1f} s; state ready in {t_state:.1f} s")
        # Only now: on CPU the MFU denominator is a matmul probe, which beside the compile read a
        # third of the machine's rate. A finished run: no probe.
        self.peak = metrics_lib.peak_tflops_per_device(c) if int(self.state.step) < c.steps else None
        if self.peak is not None:
            say(self.peak.describe())
        self.preemption = Preemption(int(self.state.step))  # from here a SIGTERM is a step to save at
        self.profiler = profiler_lib.StepProfiler(c, self.run_dir)
        self.t_start = time.perf_counter()
        self.first_step = int(self.state.step)
        self.last_time, self.last_step = self.t_start, self.first_step
        self.ledger.loop(self.first_step)
        self.restart_s = time.time() - goodput.process_start()

    def loop(self) -> None:
        """Dispatches step after step; a step's metrics are read once the next is queued, unless a save, an
        eval or the end waits for the step anyway."""
        c, step, pending = self.c, self.first_step, None
        while step < c.steps:
            if self.checkpointer is not None:
                self.checkpointer.poll()  # a failed background save stops the run now
            t0 = time.perf_counter()
            try:
                batch = next(self.batches)
            except StopIteration:
                say(f"data exhausted at step {step}: " + ("every source of data_sources is used up" if c.data_sources
                                                          else f"num_epochs={c.num_epochs}"))
                self.exhausted = True
                break
            self.ledger.waited(time.perf_counter() - t0)
            self.profiler.before_step(step + 1)
            self.state, device_metrics = self.train_step(self.state, batch)
            step += 1
            self.profiler.after_step(step, self.state)
            self.preempted = self.preemption.reached(step)
            must_save = self.checkpointer is not None and (self.preempted or step == c.steps or
                                                           self.checkpointer.due(step))
            must_eval = bool(self.evals and c.eval_interval and
                             (step % c.eval_interval == 0 or step == c.steps))
            must_sample = self.samples is not None and self.samples.due(step)
            to_read = [pending] if pending is not None else []
            pending = (step, device_metrics)
            if must_save or must_eval or must_sample or self.preempted or step == c.steps:
                # these wait for the step anyway: check it first (a sample of a state rolled back is never shown)
                to_read.append(pending)
                pending = None
            bad_step = next((item[0] for item in to_read if self.read(*item) == "rollback"), None)
            if bad_step is None and must_save and self.save(step) == "rollback":
                bad_step = step
            if bad_step is not None:
                step = self.roll_back(bad_step)
                pending = None
                if self.preempted:
                    break  # the checkpoint just restored is where a rerun resumes
                continue
            if must_eval:
                self.evaluate(step)
            if must_sample:
                self.sample(step)
            if self.preempted:
                break
        if pending is not None and self.read(*pending) == "rollback":
            self.roll_back(pending[0])  # the last step was bad: end at the good state before it
        self.profiler.stop(self.state)  # the run ended inside the traced steps

    def eta(self, step_done: int) -> float | None:
        return self.recent_seconds * (self.c.steps - step_done) if self.recent_seconds is not None else None

    def last_trusted(self) -> str:
        return self.checkpointer.last_trusted() if self.checkpointer is not None else "checkpointing is off"

    def read(self, step_done: int, device_metrics) -> str | None:
        """Blocks until step `step_done` finished (the next one is already queued); logs it. Returns
        None, or the non-finite policy's action for it ("skip" / "rollback"; "stop" raises)."""
        c = self.c
        m = {k: v.tolist() if v.ndim else float(v) for k, v in jax.device_get(device_metrics).items()}
        self.ledger.step(step_done)
        bad = m["nonfinite"] > 0
        self.mixture_watch.add(m)
        m["nonfinite_steps"] = self.guard.count + bad
        self.history.append(m["loss"])
        if self.checkpointer is not None:
            self.checkpointer.observe(step_done, m["loss"], not bad)
        now = time.perf_counter()
        first = len(self.history) == 1 and not self.rolled_back  # warm-up is kept out of later step-time windows
        if first:
            say(f"first step took {now - self.t_start:.1f} s")
        if not bad and step_done % c.log_period and step_done != c.steps and not first:
            return None
        seconds = (now - self.last_time) / max(step_done - self.last_step, 1)
        self.last_time, self.last_step = now, step_done
        if not first:  # the first step's time is mostly compiling and warm-up: no base for an ETA
            self.recent_seconds = seconds
        tflops = self.flops_per_device / seconds / 1e12
        mfu, note = self.peak.mfu(tflops)
        if note:
            say(note)
        m.update(step_seconds=seconds, tokens_per_second=self.tokens_per_step / seconds, tflops_per_device=tflops,
                 **({"mfu": mfu} if mfu is not None else {}), **self.data_watch.read(now, first, seconds))
        say(metrics_lib.format_line(step_done, c.steps, m, self.eta(step_done)))
        self.writer.write(step_done, m)
        if mixture := self.mixture_watch.read(step_done):
            self.writer.write(step_done, mixture, prefix="data")
        return self.guard.on_bad_step(step_done, self.last_trusted()) if bad else None

    def save(self, step_done: int) -> str | None:
        """None, or (the state is not finite: an update overflowed it; nothing saved) the policy's action."""
        t0 = time.perf_counter()
        try:
            with progress.heartbeat(f"saving checkpoint {step_done}"), self.ledger.phase("checkpoint"):
                # the data state is gathered only here
                self.checkpointer.save(step_done, self.trainer.to_saved(self.state), self.batches.get_state(),
                                       final=self.preempted or step_done == self.c.steps or self.exhausted)
        except errors.NonFiniteState as e:
            say(f"{e}: not saved")
            return self.guard.on_bad_step(step_done, self.last_trusted())
        finally:
            self.last_time += time.perf_counter() - t0  # keep the save out of the step-time window
        self.advise()
        return None

    def advise(self) -> None:
        """Once every tier's save is measured (on an accelerator, or with failure_interval_hours set): how often
        to save, from the expected time between failures (goodput.interval_lines)."""
        c, ck = self.c, self.checkpointer
        tiers = {"persistent"} | ({"local"} if ck.local is not None else set())
        if self.advised or not self.recent_seconds or not tiers <= set(ck.blocked) or not (
                c.failure_interval_hours or jax.devices()[0].platform != "cpu"):
            return
        self.advised = True
        for line in goodput.interval_lines(c, ck.blocked, self.restart_s, self.recent_seconds):
            say(line)

    def evaluate(self, step_done: int) -> None:
        c, t0 = self.c, time.perf_counter()
        with progress.heartbeat(f"evaluating at {metrics_lib.step_of(step_done, c.steps)}"), \
                self.ledger.phase("eval"):
            e = evaluation.evaluate(c, self.trainer, self.state.params, self.evals)
        self.last_time += time.perf_counter() - t0  # keep eval out of the step-time window
        self.evaluated_step = step_done
        self.eval_history.append(e["loss"])
        say(metrics_lib.format_eval_line(step_done, c.steps, e, time.perf_counter() - t0, self.eta(step_done)))
        self.writer.write(step_done, {k: v for k, v in e.items() if k != "sources"} | {
            f"{name}/{k}": v for name, x in e.get("sources", {}).items() for k, v in x.items()}, prefix="eval")

    def sample(self, step_done: int) -> None:
        t0 = time.perf_counter()
        with progress.heartbeat(f"sampling at {metrics_lib.step_of(step_done, self.c.steps)}"), \
                self.ledger.phase("eval"):
            samples = self.samples.sample(self.state.params)
        self.last_time += time.perf_counter() - t0  # keep sampling out of the step-time window
        for x in samples:
            say(f"sample at step {step_done}: {x['prompt']!r} -> {x['text']!r}")
        self.writer.write_samples(step_done, samples)

    def roll_back(self, bad_step: int) -> int:
        """The newest checkpoint (or the start), then past the batches from it up to `bad_step`. Returns the
        step it is back at."""
        self.state = None  # free it before the restore allocates another
        with progress.heartbeat(f"restoring the newest checkpoint for the rollback from step {bad_step}"), \
                self.ledger.phase("restore"):
            restored = self.checkpointer.restore(self.trainer.abstract_state, self.batches) \
                if self.checkpointer is not None else None
        restored = restored if restored is None else self.trainer.to_run(restored)
        if restored is None:
            self.batches.set_state(self.start_data)
            restored = initial_state(self.c, self.trainer, None, self.batches)
        good = int(restored.step)
        self.batches.skip(bad_step - good)
        del self.history[max(good - self.first_step, 0):]  # a rollback can reach before this run's start
        self.writer.rewind(good)
        say(f"rollback: step {bad_step} was not finite ({self.guard.count} of max_nonfinite_steps="
            f"{self.guard.limit}); back at step {good}, skipping the {bad_step - good} batches after it")
        self.last_time, self.last_step, self.rolled_back = time.perf_counter(), good, True
        self.ledger.loop(good)  # the steps after it were trained for nothing
        self.state = restored
        return good

    def end_of_data(self) -> None:
        """The data's end is this run's end: save and evaluate it (no data at all is an error)."""
        c, last = self.c, int(self.state.step)
        if self.exhausted and last == self.first_step == 0:
            raise data.DataError(f"{c.train_files}: the data ends before the first batch of {c.global_batch_size} x "
                                 f"{c.max_target_length} tokens (num_epochs={c.num_epochs}): add data or use "
                                 f"num_epochs=-1")
        if self.exhausted and last > self.first_step:
            if self.checkpointer is not None and not self.checkpointer.persisted(last):
                self.save(last)  # a non-finite state is not saved; the run ends on the data either way
            if self.evals and c.eval_interval and self.evaluated_step != last:
                self.evaluate(last)

    def persist_last(self) -> None:
        """A start that resumed at its last step from a local copy (the job died before its last save): the
        persistent tier gets that step too."""
        last = int(self.state.step)
        if self.checkpointer is not None and last == self.c.steps and not self.checkpointer.persisted(last):
            self.save(last)

    def clean_up(self, failure: BaseException | None) -> None:
        """Every way out: the trace stopped, the signal handlers put back (only now: a second SIGTERM during
        the final save must not cut it short), the metric files closed (after a failure quietly, the W&B run
        marked failed). A run stopped for cause or by bad data lets the saves under way finish (they hold
        good states) and leaves no run directory it made and did not use."""
        getattr(self.batches, "close", lambda: None)()  # its reading thread
        if failure is not None:
            try:
                self.ledger.end("failed")
            except errors.RunError:  # the ledger cannot be written either: the failure under way says enough
                pass
        if self.profiler is not None:
            self.profiler.abandon()  # a failure inside the traced steps
        if self.preemption is not None:
            self.preemption.restore()
        if self.writer is not None and failure is None:
            self.writer.close()
        elif self.writer is not None:
            self.writer.abandon()
        if not isinstance(failure, errors.UserError):
            return
        if self.checkpointer is not None:
            from maxtrain.checkpoint import manager as ckpt_lib
            if not isinstance(failure, ckpt_lib.SaveError):
                try:
                    self.checkpointer.close()
                except errors.RunError:
                    pass
        if self.created:
            run_dir_lib.remove_if_unused(self.run_dir)

    def report(self) -> dict:
        """The last line, and train()'s result."""
        c, state, history, last = self.c, self.state, self.history, int(self.state.step)
        count = self.guard.count
        skipped = f" ({count} non-finite steps skipped)" if count and c.nan_policy == "skip" else ""
        if self.preempted:
            where = f"checkpoint saved at step {last}; rerun the same command to resume" \
                if self.checkpointer is not None else "checkpointing is off, nothing saved"
            say(f"stopped by {self.preemption.name} after step {last}: {where}")
            if self.goodput is not None:
                say(goodput.line(self.goodput))
            return {"losses": history, "state": state, "preempted": True, "eval_losses": self.eval_history}
        elapsed = time.perf_counter() - self.t_start
        if not history:
            say(f"nothing to do: run {c.run_name} is finished (at step {last} of steps={c.steps}); its outputs "
                f"are in {self.run_dir} (raise steps to train on)")
            return {"losses": history, "state": state}
        say(f"done: {last} steps in {elapsed:.1f} s, final loss {history[-1]:.4f}{skipped}; outputs in {self.run_dir}")
        if self.goodput is not None:
            say(goodput.line(self.goodput))
        return {"losses": history, "state": state, "eval_losses": self.eval_history, "nonfinite_steps": count}

