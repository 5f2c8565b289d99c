"""Entry point: python -m maxtrain.train configs/x.yml key=value ...

argv -> config -> mesh -> trainer -> data -> training.loop.TrainLoop (step N+1 queued before step N's metrics
are read). Only the wiring lives here: no module imports an entry point.
"""

# ruff: noqa: E402 (the re-exec below must come before jax and its allocator load)
from __future__ import annotations

import sys

if __name__ == "__main__":
    from maxtrain.runtime import interrupts
    interrupts.watch()  # first thing: Ctrl-C and SIGTERM end the start-up at once, in one line
    from maxtrain.runtime.hugepages import reexec_with_huge_pages
    reexec_with_huge_pages()
    from maxtrain.launch.distributed import supervise
    supervise(sys.argv[1:])  # a multi-process run trains in a child: a lost peer is one line, not an abort

import concurrent.futures
import os
import time

import jax

from maxtrain.config import load as config_lib, help as cli_help, run_name as run_name_lib

from maxtrain.config import schema as config_schema
from maxtrain.launch import distributed, run_dir as run_dir_lib
from maxtrain.runtime import errors, platform_env, storage
from maxtrain.data import pipeline as data
from maxtrain.observe import cloud_goodput, fit, goodput, writers as metric_writers, progress, run_record
from maxtrain.observe import settings, summary
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import optimizer, step as step_lib
from maxtrain.launch.startup import load_config
from maxtrain.runtime.console import say
from maxtrain.training.loop import TrainLoop
from maxtrain.training.samples import Samples


def dry_run(c: config_lib.Config, trainer: step_lib.Trainer) -> None:
    say(summary.param_table(trainer, c.num_active_params))
    with progress.heartbeat("compiling the train step"):
        compiled = trainer.compile_train_step()
    report = summary.memory_report(compiled)
    say("train step memory per device:", summary.format_memory(report))
    say(summary.state_placement(trainer, report["total"]))


def train(c: config_lib.Config, devices=None) -> dict:
    """Runs the config on `devices` (default: all). Returns per-step losses and the final state."""
    for warning in config_schema.no_effect_warnings(c):
        say(f"warning: {warning}")
    metric_writers.check_installed(c)
    cloud_goodput.check_installed(c)
    mesh = mesh_lib.make_mesh(c, devices)
    fit.check_activations(c, mesh)  # from the shapes alone: tracing or compiling a step far too large takes minutes
    trainer = step_lib.build(c, mesh)
    active = f" ({c.num_active_params:,} active)" if c.num_active_params != c.num_params else ""
    say(f"maxtrain: {c.num_params:,} parameters{active} | {c.model_family} | mesh {c.mesh_shape} | global batch "
        f"{c.global_batch_size} x {c.max_target_length} tokens | {optimizer.describe_schedule(c)} | remat {c.remat_policy} | "
        f"{settings.summary(c)}")
    for note in trainer.notes:
        say(note)
    if c.dry_run:
        dry_run(c, trainer)
        return {}
    from maxtrain.checkpoint.finished import finished_step
    if (done := finished_step(c)) is not None:  # before the data, the restore and the compile
        run_dir = storage.path(c.base_output_directory, "base_output_directory") / c.run_name
        say(f"nothing to do: run {c.run_name} is finished (at step {done} of steps={c.steps}); its outputs are in "
            f"{run_dir} (raise steps to train on)")
        return {"losses": [], "state": None, "finished": done}
    fit.check_state(trainer)  # before init allocates it
    # Read data files and tokenizer before writing anything: bad input fails cleanly.
    batches, evals = data.make_iterators(c, trainer.batch_sharding, say)
    samples = Samples(c, trainer) if c.sample_interval else None
    run_dir, created = run_dir_lib.make(c)
    first = jax.process_index() == 0  # this start's time, by cause; a copy to Cloud Logging where asked
    ledger = goodput.Ledger(run_dir, write=first, mirror=cloud_goodput.recorder(c, say) if first else None)
    say(run_record.start_lines(c, run_dir))
    if advice := goodput.start_advice(ledger, c):  # once the job has failed: how often to save
        say(advice)
    # XLA compiles the step on a thread (the GIL is released) while the state is initialized or restored;
    # the tracing before it stays on this thread (Trainer.lower_train_step says why).
    t_compile, compiler = time.perf_counter(), concurrent.futures.ThreadPoolExecutor(1)
    with progress.heartbeat("tracing the train step"), ledger.phase("compile"):
        lowered = trainer.lower_train_step()
    say("compiling the train step (in the background while the state is made)")
    compiling = compiler.submit(progress.timed, trainer.compile_train_step, lowered)
    compiler.shutdown(wait=False)
    return TrainLoop(c, trainer, batches, evals, run_dir, created, compiling, t_compile, ledger, samples).run()


PRINT_CONFIG = "--print-config"
USAGE = """usage: python -m maxtrain.train CONFIG.yml [key=value ...] [--print-config]
       python -m maxtrain.train --help-keys [PATTERN]
       python -m maxtrain.train --list-presets

Trains the decoder CONFIG.yml describes; key=value pairs override the files. Outputs go to
base_output_directory/run_name/ (without a run_name: one derived from the config file's name and the keys
that define the model, optimizer and data, so the same command resumes the same run). Ctrl-C or SIGTERM
saves the current step and stops (a rerun resumes); a third Ctrl-C quits without that save. --print-config
prints the config as the run would resolve it (platform defaults, mesh, derived values) and runs nothing;
--list-presets lists the model_name presets."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if (code := cli_help.handle(argv, USAGE)) is not None:
        return code
    platform_env.quiet_without_accelerators()

    print_config = PRINT_CONFIG in argv

    def run():
        c = load_config([a for a in argv if a != PRINT_CONFIG])
        if print_config:  # the config as this run would resolve it on these devices; nothing runs
            import yaml
            from maxtrain.config import load as config_load, resolve
            derived = {k: c[k] for k in (*config_load.DERIVED_AT_LOAD, *resolve.DERIVED)}
            say(f"# {argv[0]} {' '.join(a for a in argv[1:] if a != PRINT_CONFIG)}, resolved for "
                f"{c.num_devices} x {jax.devices()[0].platform}: every key (it loads again as a config)\n"
                + c.to_yaml() + "# derived from it, not keys:\n"
                + "".join(f"# {line}\n" for line in yaml.safe_dump(derived, sort_keys=False,
                                                                    default_flow_style=None).splitlines()))
            return {}
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
