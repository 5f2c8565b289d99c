"""The command line on a newcomer's first day: --help and --help-keys everywhere, run names derived from what
defines the run, Ctrl-C as a preemption, no libtpu noise on a CPU, the profiler saying where it wrote."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from maxtrain.config import help as cli_help, load as config, run_name
from maxtrain import compile as compile_lib, convert, generate, prepare, train
from conftest import TESTS, TINY, xla_flags
from helpers import Output, one_line, popen_as_from_a_terminal

BASE = TESTS.parent / "maxtrain" / "configs" / "base.yml"


# ---- --help and --help-keys ----------------------------------------------------------------------

@pytest.mark.parametrize("module, usage", [
    (train, "usage: python -m maxtrain.train CONFIG.yml"),
    (generate, "usage: python -m maxtrain.generate CONFIG.yml"),
    (compile_lib, "usage: python -m maxtrain.compile CONFIG.yml"),
    (prepare, "usage: python -m maxtrain.prepare CONFIG.yml"),
])
@pytest.mark.parametrize("argv", [["--help"], ["-h"], [TINY, "steps=3", "--help"]])
def test_help_prints_the_usage_and_where_the_keys_are(module, usage, argv, capsys):
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith(usage) and f"Every key, with its default and meaning, is in {config.BASE_YML};" in out
    assert "python -m maxtrain.train --help-keys [PATTERN]" in out


def test_convert_help_says_where_the_keys_are(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")  # narrow, as in CI: the commands must stay whole, not be rewrapped
    with pytest.raises(SystemExit) as done:
        convert.main(["--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: python -m maxtrain.convert")
    assert "python -m maxtrain.train --help-keys [PATTERN]" in out and "base.yml" in out


@pytest.mark.slow
def test_generate_help_as_a_user_runs_it():
    done = subprocess.run([sys.executable, "-m", "maxtrain.generate", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=TESTS.parent)
    assert done.returncode == 0 and done.stdout.startswith("usage: python -m maxtrain.generate"), done.stderr


def test_help_keys_prints_default_and_comment_from_base_yml(capsys):
    assert train.main(["--help-keys", "eval_*"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        'eval_files: str = ""              # comma-separated globs, or a prepared directory; empty = hold out '
        'eval_split_fraction of train',
        "eval_split_fraction: float = 0.0  # with no eval_files: hold out this fraction of train (prepared: its last "
        "rows; streamed: the documents a hash of their place picks)",
        "eval_sources: dict = {}           # eval sets evaluated each on its own (eval/<name>/loss), in place of "
        "eval_files: name: {files, dataset_type, text_field}; with data_sources and none given, eval_split_fraction "
        "holds out a part of each source and evaluates it so",
        "eval_interval: int = 0            # evaluate every this many steps (and at the end); 0 = never",
        "eval_steps: int = 10              # eval batches per evaluation (fewer if the eval set ends)",
    ]
    assert train.main(["--help-keys", "TOPK"]) == 0  # a part of the name, any case; comments aligned
    assert capsys.readouterr().out.splitlines() == [
        "norm_topk_prob: bool = false  # rescale each token's top-k scores to sum to 1 (Mixtral, Qwen3: true)",
        "topk_routing_group: int = -1  # the groups a token's experts come from (HF's topk_group); -1 = off"]
    # A comment over several lines is one; a key commented above it takes that comment.
    assert train.main(["--help-keys", "nan_policy"]) == 0
    assert capsys.readouterr().out.startswith('nan_policy: str = "skip"  # A step whose loss or gradient norm is '
                                              "not finite is never applied, and no checkpoint holds a non-finite "
                                              "state.")
    assert train.main(["--help-keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [x.split(":")[0] for x in lines] == list(config.defaults())  # every key, in base.yml's order
    assert all("  # " in x for x in lines)  # every key has its comment


def test_help_keys_without_a_match_is_one_line(capsys):
    assert train.main(["--help-keys", "learning_rte"]) == 2
    assert one_line(capsys.readouterr().err) == ("config error: --help-keys: no key matches 'learning_rte'; did you "
                                                 "mean learning_rate?")
    assert train.main(["--help-keys", "zzz*"]) == 2
    assert one_line(capsys.readouterr().err) == (f"config error: --help-keys: no key matches 'zzz*'; --help-keys with "
                                                 f"no pattern lists all {len(config.defaults())}")


def test_every_key_in_base_yml_is_documented():
    docs = cli_help.key_docs()
    assert list(docs) == list(config.defaults())
    assert [k for k, (_, comment) in docs.items() if not comment] == []


# ---- run names ---------------------------------------------------------------------------------------

@pytest.fixture
def my_config(tmp_path):
    """A config file of the user's own, without a run_name."""
    path = tmp_path / "my model.yml"
    path.write_text(f"base_config: {TINY}\nrun_name: \"\"\nenable_checkpointing: true\n")
    return str(path)


@pytest.mark.slow
def test_run_name_is_derived_from_the_config_file_and_the_defining_keys(my_config, tmp_path):
    def name(*overrides):
        c = train.load_config([my_config, *overrides])  # resolved on the 8 devices: the global batch known
        assert c.run_name_derived
        return c.run_name

    first = name()
    assert re.fullmatch(r"my_model-[0-9a-f]{8}", first) and name() == first  # stable
    # How long, how often, where and on which mesh: the same run.
    for same in ("steps=50", "log_period=7", "eval_interval=5", "checkpoint_period=3", "profiler=xplane",
                 f"base_output_directory={tmp_path}/other", "enable_checkpointing=false", "ici_fsdp_parallelism=4 ici_data_parallelism=2",
                 "remat_policy=none", "max_num_checkpoints_to_keep=5", "compilation_cache_dir="):
        assert name(*same.split()) == first, same
    # The model, the optimizer, the data: another run.
    others = [name(x) for x in ("base_emb_dim=32", "model_name=mixtral-tiny", "learning_rate=1e-2", "adam_b2=0.99",
                                "data_shuffle_seed=1", "init_weights_seed=1", "per_device_batch_size=2",
                                "dtype=bfloat16")]
    assert first not in others and len(set(others)) == len(others)
    # The global batch, known with the devices: another on more devices, the same one split finer.
    import jax
    one, eight = (train.load_config([my_config], jax.devices()[:n]).run_name for n in (1, 8))
    assert one != eight == first
    assert train.load_config([my_config, "per_device_batch_size=8"], jax.devices()[:1]).run_name == first
    # Given by the file or the command line, the name is the user's.
    c = config.load([my_config, "run_name=mine"])
    assert c.run_name == "mine" and not c.run_name_derived
    assert config.load([TINY]).run_name == "tiny"
    # The hash covers only values that differ from base.yml: the same values spelled out give the same name.
    assert name("learning_rate=3e-3") == first  # tiny.yml's own value, given again
    defaults = config.defaults()
    assert run_name.defining(defaults, defaults) == {}


@pytest.mark.slow
def test_the_same_command_resumes_and_another_model_starts_a_new_run(my_config, tmp_path, capsys):
    out_dir = f"base_output_directory={tmp_path}"
    name = train.load_config([my_config]).run_name  # (on this process's 8 devices: their global batch)
    note = (f"run_name: {name} (derived from my model.yml and the keys that define the model, optimizer and data; "
            "the same command resumes it; set run_name=... to choose one)")
    assert train.main([my_config, out_dir, "steps=2"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == note and f"outputs in {tmp_path}/{name}" in out
    assert train.main([my_config, out_dir, "steps=3"]) == 0  # more steps: the same run, resumed
    assert f"resumed from {tmp_path}/{name}/checkpoints/2" in capsys.readouterr().out
    assert train.main([my_config, out_dir, "steps=3"]) == 0  # finished: says so and where its outputs are
    out = capsys.readouterr().out
    assert "compiling" not in out and "resumed from" not in out  # decided from the files, before any of that
    assert out.splitlines()[-1] == (
        f"nothing to do: run {name} is finished (at step 3 of steps=3); its outputs are in {tmp_path}/{name} "
        "(raise steps to train on)")
    # Another model: a new run, not a refusal.
    other = train.load_config([my_config, "base_emb_dim=32"]).run_name
    assert train.main([my_config, out_dir, "steps=2", "base_emb_dim=32"]) == 0
    assert f"outputs in {tmp_path}/{other}" in capsys.readouterr().out and other != name
    # Another model under a name given on purpose: refused in one line that names run_name.
    code = train.main([my_config, out_dir, "steps=4", f"run_name={name}", "base_emb_dim=32"])
    line = one_line(capsys.readouterr().err)
    assert code == 2 and line == (
        f"checkpoint error: {tmp_path}/{name}/checkpoints/3: model shape differs: base_emb_dim (checkpoint 64, "
        f"config 32); run_name={name} is another model's run: choose another run_name, or leave it unset for one "
        "derived from the model")


# ---- the profiler says where it wrote ------------------------------------------------------------------

@pytest.mark.slow
def test_the_profiler_says_where_it_wrote_the_trace(train_tiny, tmp_path, capsys):
    train_tiny("run_name=profiled", "steps=4", "profiler=xplane", "profiler_start_step=2", "profiler_steps=2")
    profile = tmp_path / "profiled" / "profile"
    written = [p for p in (profile / "plugins" / "profile").iterdir()]
    assert len(written) == 1
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("profiler:")]
    assert lines == [f"profiler: trace of steps 2-3 written to {written[0]} (view it with xprof "
                     f"--logdir={profile} --port=8791; pip install -e \".[profile]\" installs it)"]
    assert list(written[0].glob("*.xplane.pb"))
    import tomllib  # the extra it names installs the viewer it names (no TensorBoard is installed)
    extras = tomllib.loads((TESTS.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert [d.split("==")[0] for d in extras["profile"]] == ["xprof"]


# ---- as a user runs it: no libtpu noise, Ctrl-C -------------------------------------------------------

def cli(*args, out, env=None):
    env = {**os.environ, "XLA_FLAGS": xla_flags(8), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "maxtrain.train", TINY, f"base_output_directory={out}",
                             "compilation_cache_dir=", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=TESTS.parent)


def saved_steps(directory):
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


@pytest.mark.slow
def test_no_libtpu_noise_on_a_cpu_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    done = subprocess.run([sys.executable, "-m", "maxtrain.train", TINY, f"base_output_directory={tmp_path}",
                           "steps=1"], capture_output=True, text=True, timeout=300, cwd=TESTS.parent,
                          env={**env, "XLA_FLAGS": xla_flags(8)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "E0000" not in done.stderr and "unexpected worker hostname" not in done.stderr, done.stderr[-3000:]
    assert "TPU" not in done.stderr, done.stderr[-3000:]


@pytest.mark.slow
def test_ctrl_c_saves_the_step_exits_zero_and_the_run_resumes(tmp_path):
    proc = cli("enable_checkpointing=true", "steps=100000", "checkpoint_period=100000", "log_period=1", out=tmp_path)
    output = Output(proc)
    output.wait_for(r"\bstep\s+3\b")
    proc.send_signal(signal.SIGINT)
    t0 = time.perf_counter()
    output.wait_for(r"^Ctrl-C \(SIGINT\): stopping after step \d+: saving it \(Ctrl-C twice more to quit without "
                    r"saving\)$", timeout=2)  # at once, whatever the step's length
    assert time.perf_counter() - t0 < 2
    code, lines, err = output.finish()
    assert code == 0 and "Traceback" not in err, err[-3000:]
    stopped = [x for x in lines if x.startswith("stopped by")]
    step = int(stopped[0].split("after step ")[1].split(":")[0]) if stopped else -1
    assert stopped == [f"stopped by Ctrl-C (SIGINT) after step {step}: checkpoint saved at step {step}; rerun the "
                       "same command to resume"], lines[-5:]
    assert f"Ctrl-C (SIGINT): stopping after step {step}: saving it (Ctrl-C twice more to quit without saving)" in lines
    assert not any("still saving" in x for x in lines)
    checkpoints = tmp_path / "tiny" / "checkpoints"
    assert saved_steps(checkpoints) == [step]
    code, lines, err = Output(cli("enable_checkpointing=true", f"steps={step + 2}", out=tmp_path)).finish()
    assert code == 0, err[-3000:]
    assert f"resumed from {checkpoints}/{step}" in lines and any(x.startswith(f"done: {step + 2} steps") for x in lines)


@pytest.mark.slow
def test_a_third_ctrl_c_quits_at_once_and_keeps_the_last_complete_checkpoint(tmp_path):
    # Steps long enough that the three presses all come before the step they stop at is saved; saves every step,
    # so one is usually being written when the process quits.
    args = ("enable_checkpointing=true", "checkpoint_period=1", "max_num_checkpoints_to_keep=0", "log_period=1",
            "per_device_batch_size=16", "max_target_length=128")
    proc = cli(*args, "steps=100000", out=tmp_path)
    output = Output(proc)
    output.wait_for(r"\bstep\s+3\b")
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)  # signals that arrive together count once
    code, lines, err = output.finish()
    assert code == 130, (lines[-5:], err[-3000:])
    assert one_line(err) == ("interrupted by a third Ctrl-C: quit before the save finished; the last complete "
                             "checkpoint is kept")
    assert [x for x in lines if "still saving" in x] == [
        "still saving before stopping: press Ctrl-C again to quit now without that save (the last complete "
        "checkpoint is kept)"]
    assert not any(x.startswith("stopped by") for x in lines)
    checkpoints = tmp_path / "tiny" / "checkpoints"
    last = saved_steps(checkpoints)[-1]
    code, lines, err = Output(cli(*args, f"steps={last + 1}", out=tmp_path)).finish()
    assert code == 0 and "Traceback" not in err, err[-3000:]
    assert f"resumed from {checkpoints}/{last}" in lines and any(x.startswith(f"done: {last + 1} steps") for x in lines)


def test_ctrl_c_during_start_up_ends_at_once_in_one_line(tmp_path):
    proc = cli("enable_checkpointing=true", out=tmp_path)
    time.sleep(1.0)  # importing: long before the first step
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and not re.search(r"^step ", out, re.M), (out, err)
    assert one_line(err) == "interrupted by Ctrl-C during start-up, before the first step: nothing saved"


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_stops_every_process_at_one_saved_step(tmp_path):
    """A terminal's Ctrl-C goes to its whole foreground process group: the launcher and each process's
    supervisor, which hands it to its training child; JAX's preemption service agrees on one step."""
    env = dict(os.environ, MAXTRAIN_LOG_DIR=str(tmp_path / "logs"), MAXTRAIN_DEVICES_PER_PROCESS="4",
               PYTHON=sys.executable)
    args = [str(TESTS.parent / "scripts" / "launch_local.sh"), "2", TINY, f"base_output_directory={tmp_path}",
            "log_period=1", "enable_checkpointing=true", "checkpoint_period=100000", "compilation_cache_dir=",
            "ici_fsdp_parallelism=4", "dcn_data_parallelism=1", "dcn_fsdp_parallelism=2"]
    proc = subprocess.Popen([*args, "steps=100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=TESTS.parent, start_new_session=True)
    output = Output(proc)
    try:
        output.wait_for(r"\bstep\s+3\b")
        os.killpg(proc.pid, signal.SIGINT)  # as the terminal does
        code, lines, err = output.finish(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 0 and "Traceback" not in err, err[-3000:]
    stopped = [x for x in lines if x.startswith("stopped by")]
    step = int(stopped[0].split("after step ")[1].split(":")[0]) if stopped else -1
    assert stopped == [f"stopped by Ctrl-C (SIGINT) after step {step}: checkpoint saved at step {step}; rerun the "
                       "same command to resume"], lines[-5:]
    # the rerun that resumes there: test_multiprocess's SIGTERM to one process (the same save, the same job)
    assert saved_steps(tmp_path / "tiny" / "checkpoints") == [step]


@pytest.mark.slow
def test_ctrl_c_in_the_other_entry_points_is_one_line(tmp_path):
    """compile (and generate, convert) end on Ctrl-C with one line and exit 130, not a KeyboardInterrupt trace."""
    # Ctrl-C as from a terminal: a test run started in the background inherits SIGINT ignored, which
    # Python keeps (and so would a user's `nohup ... &`)
    proc = popen_as_from_a_terminal([sys.executable, "-m", "maxtrain.compile", str(BASE), "model_name=llama3-8b",
                                     "compile_topology=v5p-128", "per_device_batch_size=4", "max_target_length=8192"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    output = Output(proc)
    output.wait_for(r"^lowering the train step", timeout=240)  # tracing: Python runs, so Ctrl-C lands at once
    proc.send_signal(signal.SIGINT)
    code, lines, err = output.finish(timeout=120)
    assert code == 130, err[-3000:]
    # nor libtpu's start-up errors about a host without chips
    assert one_line(err) == "interrupted by Ctrl-C during the compile: nothing written"


def test_list_presets_names_each_with_its_family_and_size(capsys):
    assert train.main(["--list-presets"]) == 0
    lines = capsys.readouterr().out.splitlines()
    presets = sorted(p.stem for p in (config.CONFIG_DIR / "models").glob("*.yml"))
    assert [x.split()[0] for x in lines[:len(presets)]] == presets
    llama = next(x for x in lines if x.startswith("llama3-8b "))
    assert llama.split()[1:3] == ["llama", "8.03B"] and "32 layers x 4096, vocab 128256" in llama
    mixtral = next(x for x in lines if x.startswith("mixtral-8x7b "))
    assert "(12.9B active)" in mixtral and "8 experts (2 active)" in mixtral


@pytest.mark.slow
def test_print_config_prints_the_resolved_config_and_runs_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "maxtrain.train", TINY, "steps=7", "ici_fsdp_parallelism=2", "ici_data_parallelism=-1",
                           f"base_output_directory={tmp_path}", "--print-config"], capture_output=True, text=True,
                          timeout=300, cwd=TESTS.parent,
                          env=dict(os.environ, XLA_FLAGS=xla_flags(4)))
    assert proc.returncode == 0, proc.stderr[-2000:]
    printed = tmp_path / "printed.yml"
    printed.write_text(proc.stdout)
    again = config.load([str(printed)])  # it loads again as a config, with the same values
    assert again.steps == 7 and again.ici_fsdp_parallelism == 2 and again.attention == "blockwise"  # auto resolved
    assert "# global_batch_size: 4" in proc.stdout and "# mesh_shape: {stage: 1, data: 2, fsdp: 2" in proc.stdout
    assert not any(tmp_path.iterdir()) or list(tmp_path.iterdir()) == [printed]  # no run directory


@pytest.mark.slow
def test_the_shakespeare_quickstart_runs_from_any_folder(tmp_path, monkeypatch):
    """The shipped config finds its shipped data from an empty folder (relative input paths that match nothing
    there are read beside the config file that names them), and so do the mixture's sources: the mixture
    trains there (its base, shakespeare.yml, is read beside it too)."""
    monkeypatch.chdir(tmp_path)
    train_files = config.load(["configs/shakespeare.yml"]).train_files
    assert os.path.isfile(train_files) and train_files.endswith("data/tinyshakespeare.txt"), train_files
    done = subprocess.run([sys.executable, "-m", "maxtrain.train", "configs/shakespeare_mix.yml", "steps=2",
                           "eval_interval=2", "eval_steps=1", "sample_interval=0", "log_period=1"], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path,
                          env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "done: 2 steps" in done.stdout and "eval step 2/2" in done.stdout
    assert [p.name.split("-")[0] for p in (tmp_path / "outputs").iterdir()] == ["shakespeare_mix"]
