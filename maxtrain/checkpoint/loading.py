"""Checkpoints of other runs and parameter-only checkpoints: a step directory named by a config key
(load_full_state_path, load_parameters_path) or by maxtrain.convert, read only once its digest and
model description check out; and the parameter-only checkpoint that conversion writes."""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp

from maxtrain.config.load import Config
from maxtrain.checkpoint.describe import CheckpointError, check_layout, check_model, first_line, model_signature
from maxtrain.checkpoint.digest import Corrupt, verify
from maxtrain.checkpoint.trust import Trust
from maxtrain.runtime import storage



def step_directory(path: str, key: str) -> Path:
    p = storage.absolute(path, key)
    storage.check_bucket(p, key)  # an unreachable store would answer "no such directory" below
    if not (p / "state").is_dir():
        raise CheckpointError(f"{key}: {p} is not a maxtrain checkpoint step directory "
                              f"(expected {p}/state; e.g. <run>/checkpoints/<step>)")
    if (p / "model").is_dir():
        why = untrusted_reason(p)
        if why is not None and jax.process_index() == 0:
            print(f"warning: {p} is not trusted ({why}): loading it anyway, as {key} asks", flush=True)
        return p
    raise CheckpointError(f"{key}: {p} has no model description (expected {p}/model)")


def untrusted_reason(p: Path) -> str | None:
    """Why the run that saved step directory `p` rejected it, or None (trusted, not yet judged, or not a run's)."""
    if not p.name.isdigit():
        return None
    return Trust(p.parent, 0.0).rejected.get(int(p.name))


def restore_failed(key: str, p: Path, e: Exception) -> CheckpointError:
    return CheckpointError(f"{key}: cannot restore {p}/state: {type(e).__name__}: {first_line(e)}")


def _read_json_item(p: Path, item: str, key: str):
    try:
        return ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(p / item)
    except Exception as e:
        raise CheckpointError(f"{key}: cannot read {p}/{item}: {type(e).__name__}") from None


def read_model(p: Path, key: str) -> dict:
    """A step directory's model description (describe.model_signature: the model keys and what a preset carries)."""
    saved = _read_json_item(p, "model", key)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{key}: {p}/model is not a model description: the checkpoint is damaged")
    return saved


def read_digest(p: Path, key: str) -> dict | None:
    """The step's digest record, or None where it has none (converted parameters)."""
    if not (p / "digest").is_dir():
        return None
    record = _read_json_item(p, "digest", key)
    if not isinstance(record, dict) or not isinstance(record.get("leaves"), list):
        raise CheckpointError(f"{key}: {p}/digest is not what maxtrain writes: the checkpoint is damaged")
    return record


def _verify_loaded(tree, record: dict | None, p: Path, key: str, prefix: str = "") -> None:
    if record is None:
        return
    try:
        verify(tree, record, prefix, partial=bool(prefix))
    except (Corrupt, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{key}: {p} does not match its digest ({e}): the checkpoint is damaged") from None


def load_full_state(c: Config, abstract_state):
    """State (params, optimizer, step) from another run's checkpoint step directory."""
    p = step_directory(c.load_full_state_path, "load_full_state_path")
    check_model(read_model(p, "load_full_state_path"), c, str(p))
    record = read_digest(p, "load_full_state_path")
    if record is not None:
        check_layout(record["leaves"], abstract_state, f"load_full_state_path: {p}",
                     "load only the parameters (load_parameters_path) to change the optimizer state")
    try:
        state = ocp.StandardCheckpointer().restore(p / "state", abstract_state)
    except Exception as e:  # Orbax raises many types for unreadable data
        raise restore_failed("load_full_state_path", p, e) from None
    _verify_loaded(state, record, p, "load_full_state_path")
    return state


def load_data_position(c: Config, batches) -> None:
    """load_full_state_path's data position, where it fits this config's data: the run goes on with the
    batches that run would have seen next; data of another kind starts from its beginning, said once."""
    p = step_directory(c.load_full_state_path, "load_full_state_path")
    if not (p / "data").is_dir():
        return
    position = _read_json_item(p, "data", "load_full_state_path")
    try:
        batches.set_state(position)
    except (ValueError, KeyError, TypeError) as e:
        if jax.process_index() == 0:
            print(f"note: {p}'s data position does not fit this config's data ({e}): the data starts from its "
                  "beginning", flush=True)


def load_parameters(c: Config, abstract_params):
    """Parameters only (from a full-state or a parameters-only checkpoint); optimizer starts fresh."""
    p = step_directory(c.load_parameters_path, "load_parameters_path")
    check_model(read_model(p, "load_parameters_path"), c, str(p))
    target = {"params": abstract_params}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, global_shape=x.shape,
                                                               dtype=x.dtype), target)
    try:
        restored = ocp.PyTreeCheckpointer().restore(
            p / "state", args=ocp.args.PyTreeRestore(item=target, restore_args=restore_args,
                                                     partial_restore=True))
    except Exception as e:
        raise restore_failed("load_parameters_path", p, e) from None
    _verify_loaded(restored["params"], read_digest(p, "load_parameters_path"), p, "load_parameters_path",
                   prefix=".params")
    return restored["params"]


def save_parameters(path: str | Path, params, c: Config) -> None:
    """A parameters-only checkpoint step directory that load_parameters_path accepts."""
    p = storage.absolute(path)
    # Synchronous, at most 1 GB of encoded data in flight: converting a model needs little more than it.
    saver = ocp.Checkpointer(ocp.StandardCheckpointHandler(save_concurrent_gb=1))
    saver.save(p / "state", args=ocp.args.StandardSave({"params": params}))
    ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(p / "model", model_signature(c))
