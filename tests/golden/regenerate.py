"""Rewrites tests/golden/tiny_losses.json: the first 20 losses of tests/configs/tiny.yml on 1 device.

Run only on purpose (a deliberate change to the model, init, data or optimizer), and say why in the
commit message:  python tests/golden/regenerate.py
"""

import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
HERE = Path(__file__).parent
ARGS = [str(HERE.parent / "configs" / "tiny.yml"), "steps=20", "log_period=5"]


def golden_losses(extra=()) -> list[float]:
    import jax
    from maxtrain import train
    devices = jax.devices()[:1]
    with tempfile.TemporaryDirectory() as out:
        c = train.load_config([*ARGS, f"base_output_directory={out}", *extra], devices)
        return train.train(c, devices)["losses"]


if __name__ == "__main__":
    losses = golden_losses()
    (HERE / "tiny_losses.json").write_text(json.dumps({"args": ARGS[1:], "losses": losses}, indent=1) + "\n")
    print(f"wrote {len(losses)} losses", file=sys.stderr)
