"""End to end through the CLI, as a user runs it, plus the golden loss curve."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxtrain.config import load as config

from conftest import TINY, TESTS
from helpers import run_cli

REPO = TESTS.parent
# Same machine type in CI: the curve reproduces to ~1e-6; 2e-3 absolute allows other CPU kernels.
GOLDEN_ATOL = 2e-3


def test_golden_loss_curve():
    sys.path.insert(0, str(TESTS / "golden"))
    from regenerate import golden_losses
    golden = json.loads((TESTS / "golden" / "tiny_losses.json").read_text())["losses"]
    losses = golden_losses()
    assert len(losses) == len(golden) == 20
    np.testing.assert_allclose(losses, golden, atol=GOLDEN_ATOL)


@pytest.mark.slow
def test_cli_trains_and_writes_metrics(tmp_path):
    proc = run_cli(TINY, "run_name=cli", f"base_output_directory={tmp_path}", "steps=12", "log_period=4",
                   "metrics_backends=jsonl,tensorboard", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
    assert proc.code == 0, proc.err[-2000:]
    assert "MFU" in proc.out and "done: 12 steps" in proc.out
    run = tmp_path / "cli"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["start"]["config"]["steps"] == 12  # the start's record, then the steps
    rows = rows[1:]
    assert [r["step"] for r in rows] == [1, 4, 8, 12]  # step 1 (with compile time), then every 4
    assert {"train/loss", "train/mfu", "train/tokens_per_second", "train/grad_norm"} <= set(rows[0])
    assert rows[-1]["train/loss"] < rows[0]["train/loss"]
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert "ici_fsdp_parallelism: 4" in (run / "config.yml").read_text()
    # The saved config is a config again: it loads and reproduces the run's settings.
    again = config.load([str(run / "config.yml")])
    assert (again.ici_fsdp_parallelism, again.steps, again.base_emb_dim) == (4, 12, 64)


@pytest.mark.slow
def test_the_loop_reads_each_step_metrics_after_queueing_the_next(train_tiny, monkeypatch):
    # No host sync in the loop: step N's metrics are fetched only once step N+1 is queued, so the
    # device never waits on the host (nanodo's loop). Logged: D<n> = step n dispatched, R<n> = read.
    import jax
    from maxtrain.training import step as step_lib
    events, step_of = [], {}
    compile_step, device_get = step_lib.Trainer.compile_train_step, jax.device_get

    def logged_compile(self, lowered=None):
        compiled = compile_step(self, lowered)

        def dispatch(state, batch):
            state, metrics = compiled(state, batch)
            step_of[id(metrics)] = sum(e.startswith("D") for e in events) + 1  # (a dead dict's id may recur)
            events.append(f"D{step_of[id(metrics)]}")
            return state, metrics
        dispatch.memory_analysis = compiled.memory_analysis  # for the loop's will-it-fit check
        return dispatch

    def logged_get(x):
        if id(x) in step_of:
            events.append(f"R{step_of[id(x)]}")
        return device_get(x)
    monkeypatch.setattr(step_lib.Trainer, "compile_train_step", logged_compile)
    monkeypatch.setattr(jax, "device_get", logged_get)
    assert len(train_tiny("steps=4", "log_period=2", n_devices=2)["losses"]) == 4
    assert events == ["D1", "D2", "R1", "D3", "R2", "D4", "R3", "R4"]


def test_the_cpu_peak_probe_runs_after_the_compile(train_tiny, monkeypatch):
    # MFU's denominator on CPU is a matmul probe; run beside the step's compile (on a thread) it
    # shares the cores, reads a fraction of their rate and puts MFU over 100%.
    from maxtrain.observe import metrics
    from maxtrain.training import step as step_lib
    compiled, probe_saw_compiled = [], []
    compile_step, probe = step_lib.Trainer.compile_train_step, metrics.measure_cpu_peak_tflops

    def tracked_compile(self, lowered=None):
        result = compile_step(self, lowered)
        compiled.append(True)
        return result

    def tracked_probe(*args, **kwargs):
        probe_saw_compiled.append(bool(compiled))
        return probe(*args, **kwargs)
    monkeypatch.setattr(step_lib.Trainer, "compile_train_step", tracked_compile)
    monkeypatch.setattr(metrics, "measure_cpu_peak_tflops", tracked_probe)
    train_tiny("peak_tflops_per_device=0", "steps=2", n_devices=1)
    assert probe_saw_compiled == [True]


@pytest.mark.slow
def test_the_step_is_traced_on_the_main_thread_and_compiled_beside_the_init(train_tiny, monkeypatch):
    # Flax builds its lifted classes (nn.scan, nn.remat) while tracing; the init traced on the main
    # thread beside a step traced on the compile thread raced on them (KeyError: 'name', seen in CI).
    import threading
    from maxtrain.training import step as step_lib
    threads = {}
    lower, compile_step = step_lib.Trainer.lower_train_step, step_lib.Trainer.compile_train_step

    def tracked_lower(self):
        threads["traced"] = threading.current_thread()
        return lower(self)

    def tracked_compile(self, lowered=None):
        threads["compiled"], threads["given"] = threading.current_thread(), lowered is not None
        return compile_step(self, lowered)
    monkeypatch.setattr(step_lib.Trainer, "lower_train_step", tracked_lower)
    monkeypatch.setattr(step_lib.Trainer, "compile_train_step", tracked_compile)
    train_tiny("steps=1", n_devices=1)
    assert threads["traced"] is threading.main_thread() and threads["given"]
    assert threads["compiled"] is not threading.main_thread()


@pytest.mark.slow
def test_dry_run_prints_parameter_table_and_memory(tmp_path):
    proc = run_cli(TINY, f"base_output_directory={tmp_path}", "dry_run=true", "ici_tensor_parallelism=2")
    assert proc.code == 0, proc.err[-2000:]
    assert "layers/mlp/wi_gate" in proc.out and "('layers', 'embed', 'mlp')" in proc.out
    assert "total parameters:" in proc.out and "temporaries" in proc.out
    assert not (tmp_path / "tiny").exists()  # a dry run trains nothing and writes nothing


@pytest.mark.slow
def test_compilation_cache_is_filled_and_gives_the_same_losses(tmp_path):
    cache = tmp_path / "xla_cache"

    def losses(run, *extra):
        proc = run_cli(TINY, f"run_name={run}", f"base_output_directory={tmp_path}", "steps=3", *extra, devices=2)
        assert proc.code == 0, proc.err[-2000:]
        return [line.split("| loss ")[1].split()[0] for line in proc.out.splitlines() if "| loss " in line]

    cold = losses("cold", f"compilation_cache_dir={cache}")
    entries = sorted(p.name for p in cache.iterdir())
    assert any(name.startswith("jit_step-") for name in entries), entries  # the train step's executable
    warm = losses("warm", f"compilation_cache_dir={cache}")  # loads the step instead of compiling it
    plain = losses("plain", "compilation_cache_dir=")
    assert cold == warm == plain and len(cold) == 3


def test_entry_point_reexecs_with_huge_pages_unless_opted_out():
    code = ("import os, sys; from maxtrain.runtime.hugepages import reexec_with_huge_pages; reexec_with_huge_pages(); "
            "print(repr(os.environ.get('GLIBC_TUNABLES')), sys.argv[1:])")
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", code, "a=1", "b c"], capture_output=True, text=True, env=env,
                         cwd=REPO, check=True).stdout.strip()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    madvise = sys.platform.startswith("linux") and thp.exists() and "[madvise]" in thp.read_text()
    assert out == f"{'glibc.malloc.hugetlb=1' if madvise else None!r} ['a=1', 'b c']"
    opted_out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                               env={**env, "GLIBC_TUNABLES": ""}, cwd=REPO, check=True).stdout.strip()
    assert opted_out == "'' []"
