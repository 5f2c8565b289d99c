"""What a checkpoint says it holds (its model description, its arrays' layout), checked against a config,
and the one-line text of a failed read or write: shared by this run's checkpoints (manager.py, both
tiers) and other runs' (loading.py, staging.py)."""

from __future__ import annotations

import os
import re
from typing import Any

from maxtrain.checkpoint.digest import leaf_signature
from maxtrain.config.load import Config, defaults
from maxtrain.config.schema import in_group, preset_keys
from maxtrain.runtime.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used as asked; the CLI prints it as one line and exits 2."""
    kind = "checkpoint"


def model_signature(c: Config) -> dict[str, Any]:
    """The model keys, and the settings an export hands on (router_aux_loss_coef): what a preset may set."""
    return {k: c[k] for k in preset_keys()}


def as_written_now(saved: dict[str, Any]) -> dict[str, Any]:
    """A model description as this maxtrain writes one: keys added since it was written had their default, and
    model_family, if it predates the key, is the family its keys describe."""
    from maxtrain.models import registry
    values = {**defaults(), **saved}
    if "model_family" not in saved:
        values["model_family"] = registry.family_of_keys(values).name
    return values


def check_model(saved: dict[str, Any], c: Config, where: str, hint: str = "") -> None:
    ours, saved, carried = model_signature(c), as_written_now(saved), in_group("model_training")
    diff = [f"{k} (checkpoint {saved.get(k)!r}, config {ours[k]!r})" for k in ours
            if saved.get(k) != ours[k] and k not in carried]
    if diff:
        raise CheckpointError(f"{where}: model shape differs: {'; '.join(diff)}{hint}")


def check_layout(saved: list[list], abstract, where: str, hint: str) -> None:
    """The saved arrays' paths, shapes and dtypes against this config's state (Orbax would cast)."""
    saved_by_path = {e[0]: e[1:3] for e in saved}
    ours = leaf_signature(abstract)
    theirs_opt, ours_opt = optimizer_of(saved_by_path), optimizer_of(path for path, _, _ in ours)
    if theirs_opt != ours_opt:
        raise CheckpointError(f"{where}: the checkpoint holds {theirs_opt}'s optimizer state, this config has "
                              f"opt_type={ours_opt}; {hint}")
    for path, shape, dtype in ours:
        theirs = saved_by_path.get(path)
        if theirs != [shape, dtype]:
            got = "absent" if theirs is None else f"{theirs[1]}{theirs[0]}"
            raise CheckpointError(f"{where}: {path} is {got} in the checkpoint, {dtype}{shape} in this config "
                                  f"(an optimizer, dtype or shape change); {hint}")
    if len(saved_by_path) != len(ours):
        raise CheckpointError(f"{where}: the checkpoint holds {len(saved_by_path)} arrays, this config's "
                              f"train state {len(ours)}; {hint}")


def optimizer_of(paths) -> str:
    """The opt_type whose state has these array paths: Muon's state is optax's partition of a 'muon' side."""
    return "muon" if any(".inner_states['muon']" in path for path in paths) else "adamw"


RESUME_HINT = "cannot resume this run with this config: a config that changes the train state needs a new run_name"


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0][:300] if str(e) else type(e).__name__


def read_error_text(e: BaseException | None) -> str:
    """What failed in a read: Orbax wraps TensorStore's error ('OUT_OF_RANGE: Error reading "params..." in
    OCDBT database ...') in one that names only an index range, so the innermost cause says it."""
    while e is not None and e.__cause__ is not None:
        e = e.__cause__
    return f"{type(e).__name__}: {first_line(e)[:200]}"


def os_error_text(e: BaseException) -> str:
    """'No space left on device [errno 28]' from an OSError or from tensorstore's error text."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror} [errno {e.errno}]"
    m = re.search(r"\[os_error_code='?(\d+)", str(e))  # the text before it varies with what failed
    return f"{os.strerror(int(m.group(1)))} [errno {m.group(1)}]" if m else f"{type(e).__name__}: {first_line(e)}"
