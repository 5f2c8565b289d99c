"""The run's keys (group `run`): how long, how often, where: outputs, checkpoints and their tiers, non-finite
steps, metrics, the processes of a job. None of them changes what is trained (the derived run name leaves
them out)."""

from __future__ import annotations

from maxtrain.runtime.declaration import Key, declare
from maxtrain.config.keys import RUN_NAME
from maxtrain.runtime.errors import ConfigError

METRICS_BACKENDS = ("tensorboard", "jsonl", "wandb")


def _run_name(c) -> None:
    if not RUN_NAME.fullmatch(c["run_name"]):
        raise ConfigError("run_name", f"{c['run_name']!r} is not a plain name (letters, digits, '.', '_', '-'; "
                          "not starting with '.')")


def _metrics_backends(c) -> None:
    """A comma-separated list of known backends, each named once (kept without blanks)."""
    backends = [b.strip() for b in c["metrics_backends"].split(",") if b.strip()]
    for b in backends:
        if b not in METRICS_BACKENDS:
            raise ConfigError("metrics_backends", f"{b!r} is not one of {', '.join(METRICS_BACKENDS)}")
        if backends.count(b) > 1:
            raise ConfigError("metrics_backends", f"{b!r} is named twice")
    c["metrics_backends"] = ",".join(backends)


def _local_tier(c) -> None:
    local, period = c["local_checkpoint_directory"], c["local_checkpoint_period"]
    if not local:
        if period:
            raise ConfigError("local_checkpoint_period", "needs local_checkpoint_directory (a RAM disk or local "
                              "SSD on every host, e.g. /mnt/ramdisk/ckpt)")
        return
    if "://" in local:
        raise ConfigError("local_checkpoint_directory", f"{local}: must be a path on each host's own disk (the "
                          "persistent tier, base_output_directory, is the one for gs://)")
    if not period:
        raise ConfigError("local_checkpoint_directory", "needs local_checkpoint_period (save locally every this "
                          "many steps, fewer than checkpoint_period)")
    if not c["enable_checkpointing"]:
        raise ConfigError("local_checkpoint_directory", "needs enable_checkpointing=true (the local tier is the "
                          "second of two)")


def _every_local_step_persistent(c) -> str | None:
    local = c["local_checkpoint_period"]
    if c["local_checkpoint_directory"] and local and local % c["checkpoint_period"] == 0:
        return (f"local_checkpoint_period: {local} has no effect: every local step is a persistent one "
                f"(checkpoint_period={c['checkpoint_period']}); save locally more often")
    return None


def _loss_spike_factor(c) -> None:
    if c["loss_spike_factor"] != 0 and c["loss_spike_factor"] <= 1:
        raise ConfigError("loss_spike_factor", "must be 0 (no spike test) or > 1")


def _profile_after_end(c) -> str | None:
    if c["profiler"] and c["profiler_start_step"] > c["steps"]:
        return (f"profiler_start_step: {c['profiler_start_step']} is after the last step (steps={c['steps']}): "
                f"profiler={c['profiler']} traces nothing")
    return None


def run(name: str, **kw) -> Key:
    return Key(name, "run", **kw)


POSITIVE = dict(at_least=1)
declare(
    run("run_name", check=_run_name),
    run("base_output_directory", path="output"),
    run("steps", **POSITIVE),
    run("log_period", **POSITIVE),
    run("dry_run"),
    run("compilation_cache_dir"),
    run("model_name", in_run_name=True),  # a preset's model keys say the model; its name stays as it always was
    run("learning_rate_schedule_steps", **POSITIVE, auto=-1, why="= steps"),
    run("prepared_dir", path="output"),
    run("distributed_init", choices=("auto", "true", "false")),
    run("coordinator_address"),
    run("num_processes"),
    run("process_id"),
    run("distributed_heartbeat_timeout_seconds", **POSITIVE),
    run("enable_checkpointing"),
    run("async_checkpointing"),
    run("checkpoint_period", **POSITIVE),
    run("max_num_checkpoints_to_keep", at_least=0),
    run("local_checkpoint_directory", check=_local_tier),
    run("local_checkpoint_period", at_least=0, no_effect=_every_local_step_persistent),
    run("failure_interval_hours", at_least=0, why="0: 50,000 chip-hours / chips"),
    run("nan_policy", choices=("skip", "stop", "rollback")),
    run("max_nonfinite_steps", at_least=0),
    run("loss_spike_factor", check=_loss_spike_factor),
    run("metrics_backends", check=_metrics_backends),
    run("enable_goodput_recording"),
    run("peak_tflops_per_device", at_least=0),
    run("profiler", choices=("", "xplane")),
    run("profiler_start_step", **POSITIVE, no_effect=_profile_after_end),
    run("profiler_steps", **POSITIVE),
)
