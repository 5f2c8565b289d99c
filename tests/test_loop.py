"""The training loop's clean-up: however a run ends, what it set up is taken down again."""

import contextlib
import os
import signal

import jax
import pytest

from maxtrain.checkpoint import manager as ckpt_lib
from maxtrain.runtime import interrupts
from maxtrain.observe import writers as metric_writers
from conftest import TINY


class Boom(RuntimeError):
    """An error no part of the run expects (a bug): it must still leave the process as it found it."""


def open_files_under(path) -> list[str]:
    """The files under `path` this process holds open."""
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own descriptor, closed by now
            continue
        if target == str(path) or target.startswith(str(path) + os.sep):
            held.append(target)
    return held


def tracing() -> bool:
    """Whether a jax.profiler trace is running in this process (only one may run at a time)."""
    try:
        jax.profiler.start_trace("/tmp/maxtrain-test-loop-probe")
    except RuntimeError:
        return True
    jax.profiler.stop_trace()
    return False


@pytest.mark.slow
@pytest.mark.parametrize("fails", ["metrics write", "checkpoint save"])
def test_an_error_inside_the_loop_puts_back_what_the_run_set_up(fails, tmp_path, monkeypatch):
    """An error raised mid-run, inside the profiled steps, leaves the caller's SIGINT and SIGTERM handlers,
    the metric files closed, the preemption state out of the loop and no trace running."""
    from maxtrain import train

    def boom(*args, **kwargs):
        raise Boom(fails)
    if fails == "metrics write":
        monkeypatch.setattr(metric_writers.MetricsWriter, "write", boom)
    else:
        monkeypatch.setattr(ckpt_lib.Checkpointer, "save", boom)
    mine = {signal.SIGINT: lambda *_: None, signal.SIGTERM: lambda *_: None}
    before = {s: signal.signal(s, handler) for s, handler in mine.items()}
    devices = jax.devices()[:1]
    c = train.load_config([TINY, f"base_output_directory={tmp_path}", "run_name=failing", "steps=4",
                           "checkpoint_period=1", "enable_checkpointing=true", "metrics_backends=jsonl,tensorboard",
                           "profiler=xplane", "profiler_start_step=1", "profiler_steps=3"], devices)
    try:
        with pytest.raises(Boom, match=fails):
            train.train(c, devices)
        assert {s: signal.getsignal(s) for s in mine} == mine
        assert not interrupts.STATE.in_loop
        run = tmp_path / "failing"
        assert (run / "metrics.jsonl").exists() and list((run / "tensorboard").iterdir())
        assert open_files_under(run / "metrics.jsonl") + open_files_under(run / "tensorboard") == []
        assert not tracing()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        with contextlib.suppress(RuntimeError):  # a trace left running would fail every later profiled test
            jax.profiler.stop_trace()
