"""Every test sees 8 fake CPU devices, so each sharding path runs without accelerators."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import contextlib  # noqa: E402
import subprocess  # noqa: E402
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


FIRST = ("tests/test_readme.py::test_the_readmes_commands_give_what_it_shows",)  # the longest test, by far


def pytest_collection_modifyitems(items):
    """The longest test first, so that under `-n 2` it runs beside the rest instead of after it."""
    items.sort(key=lambda item: item.nodeid not in FIRST)  # stable: the others keep their order
