"""Every test sees 8 fake CPU devices, so each sharding path runs without accelerators; every test of one run
(each xdist worker, each process a test starts) shares one HOME made for the run, so its `~/.cache/maxtrain/xla`
(base.yml's compilation_cache_dir) is the run's compilation cache, never the user's: a step compiled once is
read, not compiled, by the next test with the same shapes."""

import os
import tempfile

# One Eigen thread per process: each of the `-n 2` workers (and each process a test starts) has a core's share,
# and the spinning of a second Eigen pool per process only takes it from the other (about 15% of the suite).
# No LLVM optimization of the compiled code: the tests' shapes are tiny, so compiling is most of a test's time
# and running it little (the same HLO, so the same numerics checks hold). training/step.py's CPU default (level 1)
# gives way to a level set here: 22% off the slow tests of test_context.py.
CPU_FLAGS = "--xla_cpu_multi_thread_eigen=false --xla_backend_optimization_level=0"


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for a test process (or one a test starts) with `devices` fake CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {CPU_FLAGS}"


os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(8)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "MAXTRAIN_TEST_HOME" not in os.environ:  # the first process of the run (xdist's workers inherit it)
    os.environ["MAXTRAIN_TEST_HOME"] = tempfile.mkdtemp(prefix="maxtrain-tests-home-")
    os.environ["MAXTRAIN_TEST_HOME_OWNER"] = str(os.getpid())
os.environ["HOME"] = os.environ["MAXTRAIN_TEST_HOME"]

import contextlib  # noqa: E402
import resource  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

TESTS = Path(__file__).parent
TINY = str(TESTS / "configs" / "tiny.yml")
SHAKESPEARE = TESTS.parent / "data" / "tinyshakespeare.txt"


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A tmpfs mounted at `path` for the block (a full or read-only disk); skips where this machine does not
    let the tests mount one (needs root or CAP_SYS_ADMIN)."""
    path.mkdir(exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root or CAP_SYS_ADMIN)")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def tiny_config():
    """tiny_config(*overrides, devices=None) -> Config resolved for those devices."""
    from maxtrain import train

    def make(*overrides, devices=None):
        return train.load_config([TINY, *overrides], devices)
    return make


@pytest.fixture
def train_tiny(tmp_path):
    """train_tiny(*overrides, n_devices=8) trains the tiny config in-process on the first n_devices
    devices, writing under tmp_path; returns train()'s result (per-step losses, final state)."""
    from maxtrain import train

    def run(*overrides, n_devices=8):
        devices = jax.devices()[:n_devices]
        c = train.load_config([TINY, f"base_output_directory={tmp_path}", *overrides], devices)
        return train.train(c, devices)
    return run


@pytest.fixture(scope="session")
def reference_losses(tmp_path_factory):
    """reference_losses(*overrides, n_devices=1) -> the tiny config's losses on the first n_devices, trained once
    per test run (whichever xdist worker asks first) for every mesh's test that compares with them."""
    import hashlib
    from helpers import once
    from maxtrain import train

    def get(*overrides, n_devices=1):
        def compute():
            devices = jax.devices()[:n_devices]
            out = tmp_path_factory.mktemp("reference")
            c = train.load_config([TINY, f"base_output_directory={out}", *overrides], devices)
            return [float(x) for x in train.train(c, devices)["losses"]]
        key = hashlib.sha256(repr((overrides, n_devices)).encode()).hexdigest()[:16]
        return once(f"losses-{key}", compute)
    return get


@pytest.fixture(scope="session")
def hf_tokenizer_json(tmp_path_factory):
    """A real tokenizer.json: a byte-level BPE trained with HF tokenizers on Tiny Shakespeare."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(SHAKESPEARE)], trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


def decode(c, trainer, params, prompts, max_new_tokens, sampling=None, eos_id=None, batch_size=8):
    """Each prompt's new ids, decoded with the KV cache (maxtrain.infer.decode) on the trainer's mesh
    from params in the model's layer order."""
    from maxtrain.infer.decode import Engine
    from maxtrain.infer.sampling import Sampling
    from maxtrain.parallel import mesh as mesh_lib
    engine = Engine(c, trainer.mesh)
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        return engine.generate(engine.weights(params), prompts, max_new_tokens, sampling or Sampling(), eos_id,
                               batch_size).ids


# The longest tests (seconds on a 2-core machine, measured with --durations): under `-n N` each worker's first
# share of the queue (xdist's worksteal hands worker k the k-th of N equal slices, then idle workers steal from
# the ends of the others') starts with its part of these, so that they run side by side, not one after another.
LONG = {
    "tests/test_readme.py::test_each_pages_commands_give_what_it_shows[models.md#6]": 635,
    "tests/test_readme.py::test_each_pages_commands_give_what_it_shows[README.md]": 290,
    "tests/test_readme.py::test_each_pages_commands_give_what_it_shows[parallelism.md#1]": 400,
    "tests/test_readme.py::test_each_pages_commands_give_what_it_shows[data.md#2]": 285,
    "tests/test_readme.py::test_each_pages_commands_give_what_it_shows": 200,  # each other section
    "tests/test_faults.py::test_two_processes_roll_back_together": 45,
    "tests/test_launch.py::test_the_tpu_worker_script_makes_its_environment_and_runs_the_job_detached": 105,
    "tests/test_deepseek.py::test_the_same_losses_on_every_mesh_with_mtp": 75,
    "tests/test_multiprocess.py::test_the_data_position_moves_between_process_counts": 65,
    "tests/test_moe.py::test_metrics_resume_and_accumulation": 40,
    "tests/test_multiprocess.py::test_checkpoints_move_between_two_processes_and_one": 68,
    "tests/test_goodput.py::test_a_job_killed_again_and_again_restarts_itself_and_ends_as_if_never_killed": 60,
    "tests/test_checkpoint.py::test_kill_9_at_random_moments_resumes_to_the_same_params": 50,
    "tests/test_local_tier.py::test_a_replaced_host_gets_its_local_shards_from_a_peer": 50,
    "tests/test_cli.py::test_ctrl_c_in_a_terminal_stops_every_process_at_one_saved_step": 40,
    "tests/test_multiprocess.py::test_sigterm_to_one_process_stops_both_at_one_saved_step": 55,
    "tests/test_multiprocess.py::test_two_processes_match_one": 45,
    "tests/test_multiprocess.py::test_eval_rows_that_end_at_different_batches": 51,
    "tests/test_moe.py::test_two_processes_with_experts_across_them_match_one": 50,
    "tests/test_checkpoint.py::test_bad_checkpoints_give_one_line_and_exit_2": 40,
    "tests/test_gpt_oss.py::test_the_same_losses_on_every_mesh": 45,
    "tests/test_cli.py::test_the_shakespeare_quickstart_runs_from_any_folder": 30,
    "tests/test_storage.py::test_train_sigterm_resume_on_gcs_matches_a_local_run_bitwise": 48,
    "tests/test_faults.py::test_a_file_only_one_process_reads_damaged_falls_back_on_both": 45,
    "tests/test_package.py::test_the_wheel_ships_its_configs_and_trains_from_anywhere": 43,
}


def pytest_collection_modifyitems(config, items):
    workers = getattr(config, "workerinput", {}).get("workercount")  # in an xdist worker, which does the collecting
    if not isinstance(workers, int) or workers < 2:
        return
    seconds = {item.nodeid: next((s for prefix, s in LONG.items() if item.nodeid.startswith(prefix)), 0)
               for item in items}
    long = sorted((i for i in items if seconds[i.nodeid]), key=lambda i: -seconds[i.nodeid])
    short = [i for i in items if not seconds[i.nodeid]]
    shares: list[list] = [[] for _ in range(workers)]
    for item in long:  # the longest to the share with the least so far
        min(shares, key=lambda share: sum(seconds[i.nodeid] for i in share)).append(item)
    ordered, left = [], len(items)
    for k, share in enumerate(shares):
        size = left // (workers - k)  # the slice xdist hands worker k
        fill = max(0, size - len(share))
        ordered += share + short[:fill]
        short, left = short[fill:], left - size
    items[:] = ordered + short


SLOW_TO_NAME = 60  # seconds: a test at least this long is named as it ends (in CI's log, even one cut short)
_started = time.monotonic()


def _cpu_seconds() -> float:
    """CPU time of this process and of the children it has waited for (a test's subprocesses)."""
    return sum(r.ru_utime + r.ru_stime for r in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """Each test's CPU seconds (its own and its subprocesses'), beside its wall time in the report: a test far
    under its wall time mostly waits (a timeout, a sleep), one far over it runs threads on both cores."""
    start = _cpu_seconds()
    yield
    item.user_properties.append(("cpu_seconds", round(_cpu_seconds() - start, 1)))


def pytest_runtest_logreport(report):
    """Name each long test when it ends, with the run's time so far, so that a run stopped from outside (CI's
    limit) still shows where its time went; --durations tells only at the end."""
    if report.when == "call" and report.duration >= SLOW_TO_NAME and "PYTEST_XDIST_WORKER" not in os.environ:
        cpu = dict(report.user_properties).get("cpu_seconds", "?")
        sys.stdout.write(f"\n[{time.monotonic() - _started:5.0f} s] {report.duration:4.0f} s (CPU {cpu} s) "
                         f"{report.nodeid}\n")
        sys.stdout.flush()


def pytest_unconfigure(config):
    """The run's HOME (its compilation cache) goes with the process that made it."""
    if os.environ.get("MAXTRAIN_TEST_HOME_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["MAXTRAIN_TEST_HOME"], ignore_errors=True)
