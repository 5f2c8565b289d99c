"""What a checkpoint says it holds (its model description, its arrays' layout), checked against a config,
and the one-line text of a failed read or write: shared by this run's checkpoints (manager.py, both
tiers) and other runs' (loading.py, staging.py)."""

from __future__ import annotations

import os
import re
from typing import Any

from maxtrain.checkpoint.digest import leaf_signature
from maxtrain.config.keys import MODEL_TRAINING_KEYS, PRESET_KEYS
from maxtrain.config.load import Config, defaults
from maxtrain.runtime.errors import UserError


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be used as asked; the CLI prints it as one line and exits 2."""
    kind = "checkpoint"


def model_signature(c: Config) -> dict[str, Any]:
    """The model keys, and the training default an export hands on (router_aux_loss_coef)."""
    return {k: c[k] for k in PRESET_KEYS} | {"scan_layers": c.scan_layers}


def check_model(saved: dict[str, Any], c: Config, where: str, hint: str = "") -> None:
    ours = model_signature(c)
    saved = {**defaults(), **saved}  # keys added since the checkpoint was written had their default
    diff = [f"{k} (checkpoint {saved.get(k)!r}, config {ours[k]!r})" for k in ours
            if saved.get(k) != ours[k] and k not in MODEL_TRAINING_KEYS]
    if diff:
        raise CheckpointError(f"{where}: model shape differs: {'; '.join(diff)}{hint}")


def check_layout(saved: list[list], abstract, where: str, hint: str) -> None:
    """The saved arrays' paths, shapes and dtypes against this config's state (Orbax would cast)."""
    saved_by_path = {e[0]: e[1:3] for e in saved}
    ours = leaf_signature(abstract)
    for path, shape, dtype in ours:
        theirs = saved_by_path.get(path)
        if theirs != [shape, dtype]:
            got = "absent" if theirs is None else f"{theirs[1]}{theirs[0]}"
            raise CheckpointError(f"{where}: {path} is {got} in the checkpoint, {dtype}{shape} in this config "
                                  f"(an optimizer, dtype or shape change); {hint}")
    if len(saved_by_path) != len(ours):
        raise CheckpointError(f"{where}: the checkpoint holds {len(saved_by_path)} arrays, this config's "
                              f"train state {len(ours)}; {hint}")


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
