"""Text from a trained or imported model, decoded with a KV cache (maxtrain.infer):

    python -m maxtrain.generate ckpt/mymodel/maxtrain.yml prompt="ROMEO:" max_new_tokens=256
    python -m maxtrain.generate configs/x.yml load_parameters_path=DIR prompt_file=prompts.txt \\
        max_new_tokens=128 temperature=0.8 top_p=0.95 generate_batch_size=8

Greedy by default. Prints each prompt's new ids (and text, with a tokenizer) and the prefill's and the
decode's tokens/s. A prompt and its new tokens fit max_target_length, the context the model runs at;
the cache and the programs fit a device's memory: both are checked before anything runs.
"""

from __future__ import annotations

import sys
import time

from maxtrain.checkpoint import loading as ckpt_loading
from maxtrain.config import help as cli_help, load as config_lib
from maxtrain.config import keys as config_keys
from maxtrain.config.groups import generate as generate_keys
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.infer.decode import Engine
from maxtrain.infer.sampling import Sampling
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.observe import progress
from maxtrain.runtime import errors, platform_env, storage
from maxtrain.launch.startup import load_config
from maxtrain.runtime.console import say
from maxtrain.training import step as step_lib

PROMPT_KEYS = ("prompt", "prompt_ids", "prompt_file")


def check_length(c: config_lib.Config, prompts: list[list[int]], key: str) -> None:
    """Each prompt and its new tokens fit the context the model runs at (the longer of max_target_length, the
    run's, and max_position_embeddings, the model's own): RoPE would go on past it, but into positions the model
    never saw. Checked before anything is built or compiled."""
    longest = max(len(p) for p in prompts)
    context, name = max((c.max_target_length, "max_target_length"), (c.max_position_embeddings,
                                                                      "max_position_embeddings"))
    room = context - longest
    if room <= 0:
        raise config_keys.ConfigError(key, f"{longest} tokens leave no room for new ones in {name}={context}")
    if c.max_new_tokens > room:
        raise config_keys.ConfigError("max_new_tokens", f"{c.max_new_tokens} after a {longest}-token prompt "
                                      f"exceeds {name}={context}, the context the model runs at: at most {room} "
                                      f"(raise {name} to go further)")


def read_prompt_file(value: str) -> list[str]:
    """The non-blank lines of the prompt file, or a ConfigError naming it."""
    try:
        text = storage.path(value, "prompt_file").read_bytes().decode("utf-8")
    except OSError as e:
        raise config_keys.ConfigError("prompt_file", f"cannot read {value}: {storage.error_text(e)}") from None
    except UnicodeDecodeError:
        raise config_keys.ConfigError("prompt_file", f"{value} is not UTF-8 text") from None
    lines = [line.removesuffix("\r") for line in text.split("\n")]  # lines end at \n only (or \r\n)
    lines = [line for line in lines if line.strip()]
    if not lines:
        raise config_keys.ConfigError("prompt_file", f"{value} has no prompts (one per line)")
    return lines


def prompts_and_tokenizer(c: config_lib.Config):
    """(each prompt's ids, the key they came from, the tokenizer or None)."""
    given = [k for k in PROMPT_KEYS if c[k]]
    if len(given) != 1:
        raise config_keys.ConfigError("prompt", 'set exactly one of prompt="text", prompt_ids=1,2,3 or '
                                      "prompt_file=FILE" + (f" (got {' and '.join(given)})" if given else ""))
    key = given[0]
    if key == "prompt_ids":  # the tokenizer is optional here: it only turns the output into text
        prompts = [generate_keys.prompt_token_ids(c.prompt_ids)]
        try:
            tokenizer = tokenizer_lib.make_tokenizer(c)
        except config_keys.ConfigError as e:
            say(f"printing ids only, no text: {e}")
            tokenizer = None
    else:
        texts = [c.prompt] if key == "prompt" else read_prompt_file(c.prompt_file)
        tokenizer = tokenizer_lib.make_tokenizer(c)
        tokenizer.add_eos = False  # a prompt is an unfinished document
        prompts = [tokenizer.encode(text).tolist() for text in texts]
    for number, ids in enumerate(prompts):
        if not ids:
            where = f" (line {number + 1} of the non-blank lines)" if key == "prompt_file" else ""
            raise config_keys.ConfigError(key, f"gives no tokens to start from{where}")
    return prompts, key, tokenizer


def run(c: config_lib.Config) -> list[list[int]]:
    if not c.load_parameters_path:
        raise config_keys.ConfigError("load_parameters_path", "required: the checkpoint to generate from "
                                      "(<run>/checkpoints/<step>, or a directory written by maxtrain.convert)")
    prompts, key, tokenizer = prompts_and_tokenizer(c)
    check_length(c, prompts, key)

    mesh = mesh_lib.make_mesh(c)
    trainer = step_lib.build(c, mesh)
    engine = Engine(c, mesh)
    sampling, eos_id = Sampling.from_config(c), tokenizer.eos_id if tokenizer else None
    with mesh_lib.activate(mesh, trainer.rules):
        params = ckpt_loading.load_parameters(c, trainer.abstract_state.params)
        weights = engine.weights(params, own=True)
        t0, shape = time.perf_counter(), engine.shape(prompts, c.max_new_tokens, c.generate_batch_size)
        with progress.heartbeat("compiling the prefill and the decode"):
            engine.compile(shape, sampling, -1 if eos_id is None else eos_id)
        say(f"prefill and decode compiled in {time.perf_counter() - t0:.1f} s: {len(prompts)} prompt(s), "
            f"{min(c.generate_batch_size, len(prompts))} at a time, a KV cache of {shape.slots} slots ({engine.cache_gib(shape):.3f} GiB per device)")
        with progress.heartbeat("decoding"):
            out = engine.generate(weights, prompts, c.max_new_tokens, sampling, eos_id, c.generate_batch_size)
    for ids, new in zip(prompts, out.ids):
        say(f"prompt ids: {ids}")
        say(f"generated ids: {new}")
        if tokenizer:
            say(f"text: {tokenizer.decode(new)!r}")
    say(out.speed())
    return out.ids


USAGE = """usage: python -m maxtrain.generate CONFIG.yml load_parameters_path=DIR prompt="text" [key=value ...]

Continues a prompt (prompt="text", prompt_ids=1,2,3, or prompt_file=FILE with one prompt per line,
generate_batch_size at a time) with max_new_tokens tokens from the parameters in load_parameters_path
(a checkpoint step, or a directory maxtrain.convert wrote), decoding with a KV cache; greedy unless
temperature > 0 (top_k, top_p, sampling_seed). A prompt and its new tokens fit max_target_length."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if (code := cli_help.handle(argv, USAGE)) is not None:
        return code
    platform_env.quiet_without_accelerators()
    return errors.exit_code(lambda: run(load_config(argv)))


if __name__ == "__main__":
    sys.exit(main())
