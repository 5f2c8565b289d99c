"""Text from a trained or imported model:

    python -m maxtrain.generate configs/x.yml load_parameters_path=DIR prompt="To be" max_new_tokens=32
    python -m maxtrain.generate configs/x.yml load_parameters_path=DIR prompt_ids=1,2,3 temperature=0.8 top_k=40

Greedy by default. There is no KV cache yet: each new token reruns the model over one fixed-length buffer
(prompt + max_new_tokens), so a single compiled program serves every position, and causal attention makes
the not-yet-written tail irrelevant. Correct and simple; quadratic in the output length. The buffer must
fit max_target_length (the context the model runs at) and, compiled, the device's memory: both are
checked before it runs.
"""

from __future__ import annotations

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np


from maxtrain.checkpoint import loading as ckpt_loading
from maxtrain.config import help as cli_help, load as config_lib
from maxtrain.config import keys as config_keys, validate as config_validate
from maxtrain.runtime import errors, platform_env
from maxtrain.observe import fit, summary
from maxtrain.parallel import mesh as mesh_lib, pipeline, rules as rules_lib
from maxtrain.training import step as step_lib
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.models.decoder import output_logits
from maxtrain.runtime.startup import load_config, say


def choose(logits_V, rng, temperature: float, top_k: int):
    """Greedy when temperature is 0; else a sample from softmax(logits / T), optionally top-k only."""
    if temperature == 0:
        return jnp.argmax(logits_V).astype(jnp.int32)
    logits_V = logits_V / temperature
    if top_k:
        kth = jax.lax.top_k(logits_V, top_k)[0][-1]
        logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V)
    return jax.random.categorical(rng, logits_V).astype(jnp.int32)


def generate(c: config_lib.Config, trainer: step_lib.Trainer, params, prompt_ids: list[int],
             max_new_tokens: int, temperature: float = 0.0, top_k: int = 0, seed: int = 0,
             eos_id: int | None = None) -> list[int]:
    """New token ids after `prompt_ids` (up to max_new_tokens; stops after eos_id). Call under the mesh."""
    start, total = len(prompt_ids), len(prompt_ids) + max_new_tokens
    # The buffer splits over the context axis, each device's share in splash's blocks of 128 (the tail is
    # never attended); it stays in sequence order, without training's load-balanced layout.
    multiple = c.mesh_shape["context"] * (128 if c.attention == "splash" else 1)
    total = -(-total // multiple) * multiple
    args = trainer.model.args
    # Decoding runs the layers in order on every device: the pipeline is a training schedule (its checkpoints
    # hold the model's order). The stack stays sharded over stage as trained: XLA gathers it whole.
    model = trainer.model.clone(args=dataclasses.replace(args, plan=dataclasses.replace(
        args.plan, context_load_balance=False, schedule=pipeline.Schedule())))
    # The batch axis is sharded over data x fsdp: give every batch shard a (identical) row.
    rows = rules_lib.shards(c.logical_axis_rules, "batch", c.mesh_shape)
    buffer_RxT = np.zeros((rows, total), np.int32)
    buffer_RxT[:, :start] = prompt_ids
    buffer_RxT = jax.device_put(buffer_RxT, trainer.batch_sharding)

    def step(params, buffer_RxT, position, rng):
        hidden_RxTxD, out_DxV = model.apply({"params": params}, buffer_RxT, return_hidden=True)
        hidden_1x1xD = jax.lax.dynamic_slice_in_dim(hidden_RxTxD[:1], position - 1, 1, axis=1)
        logits_V = output_logits(hidden_1x1xD, out_DxV, c.logits_dot_in_fp32)[0, 0, :c.vocab_size]  # not the padding
        token = choose(logits_V, rng, temperature, top_k)
        return buffer_RxT.at[:, position].set(token), token

    step = jax.jit(step, out_shardings=(trainer.batch_sharding, rules_lib.replicated(trainer.mesh)),
                   donate_argnums=1)
    rng, new = jax.random.key(seed), []
    step = step.lower(params, buffer_RxT, start, rng).compile()
    check_memory(step, trainer.mesh, total, max_new_tokens)
    for position in range(start, start + max_new_tokens):
        buffer_RxT, token = step(params, buffer_RxT, position, jax.random.fold_in(rng, position))
        new.append(int(token))
        if new[-1] == eos_id:
            break
    return new


def check_length(c: config_lib.Config, prompt_ids: list[int]) -> None:
    """The prompt and the new tokens share one buffer, which must fit the context the model runs at:
    RoPE would go on past it, but into positions the model never saw (raise max_target_length to allow
    that). Checked before anything is built or compiled."""
    room = c.max_target_length - len(prompt_ids)
    key = "prompt_ids" if c.prompt_ids else "prompt"
    if room <= 0:
        raise config_keys.ConfigError(key, f"{len(prompt_ids)} tokens leave no room for new ones in "
                                     f"max_target_length={c.max_target_length}")
    if c.max_new_tokens > room:
        raise config_keys.ConfigError("max_new_tokens", f"{c.max_new_tokens} after a {len(prompt_ids)}-token prompt "
                                     f"exceeds max_target_length={c.max_target_length}, the context the model "
                                     f"runs at: at most {room} (raise max_target_length to go further)")


def check_memory(compiled, mesh, total: int, max_new_tokens: int) -> None:
    """The compiled step (the model over the whole buffer) against a device's memory, before it runs."""
    need = summary.memory_report(compiled)["total"] * fit.GiB
    have, source = fit.device_memory(mesh.devices.flat[0])
    if need > have:
        raise fit.FitError(f"max_new_tokens: {max_new_tokens} makes a {total}-token buffer, and running the model "
                           f"over it needs {need / fit.GiB:.2f} GiB per device, more than the {have / fit.GiB:.2f} "
                           f"GiB a device has ({source}); lower max_new_tokens")


def run(c: config_lib.Config) -> list[int]:
    if not c.load_parameters_path:
        raise config_keys.ConfigError("load_parameters_path", "required: the checkpoint to generate from "
                                     "(<run>/checkpoints/<step>, or a directory written by maxtrain.convert)")
    if bool(c.prompt) == bool(c.prompt_ids):
        raise config_keys.ConfigError("prompt", 'set exactly one of prompt="text" or prompt_ids=1,2,3')
    if c.prompt_ids:  # the tokenizer is optional here: it only turns the output into text
        prompt_ids = config_validate.prompt_token_ids(c.prompt_ids)
        try:
            tokenizer = tokenizer_lib.make_tokenizer(c)
        except config_keys.ConfigError as e:
            say(f"printing ids only, no text: {e}")
            tokenizer = None
    else:
        tokenizer = tokenizer_lib.make_tokenizer(c)
        tokenizer.add_eos = False  # a prompt is an unfinished document
        prompt_ids = tokenizer.encode(c.prompt).tolist()
    if not prompt_ids:
        raise config_keys.ConfigError("prompt_ids" if c.prompt_ids else "prompt", "gives no tokens to start from")
    check_length(c, prompt_ids)

    mesh = mesh_lib.make_mesh(c)
    trainer = step_lib.build(c, mesh)
    with mesh_lib.activate(mesh, trainer.rules):
        params = ckpt_loading.load_parameters(c, trainer.abstract_state.params)
        new = generate(c, trainer, params, prompt_ids, c.max_new_tokens, c.temperature, c.top_k,
                       c.sampling_seed, tokenizer.eos_id if tokenizer else None)
    say(f"prompt ids: {prompt_ids}")
    say(f"generated ids: {new}")
    if tokenizer:
        say(f"text: {tokenizer.decode(new)!r}")
    return new


USAGE = """usage: python -m maxtrain.generate CONFIG.yml load_parameters_path=DIR prompt="text" [key=value ...]

Continues a prompt (prompt="text", or prompt_ids=1,2,3) with max_new_tokens tokens from the parameters
in load_parameters_path (a checkpoint step, or a directory maxtrain.convert wrote); greedy unless
temperature > 0 (top_k, sampling_seed). The prompt and the new tokens together fit max_target_length."""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if (code := cli_help.handle(argv, USAGE)) is not None:
        return code
    platform_env.quiet_without_accelerators()
    return errors.exit_code(lambda: run(load_config(argv)))


if __name__ == "__main__":
    sys.exit(main())
