"""Samples during training: every sample_interval steps (and at the last), the model continues each of
sample_prompts with the generation keys (max_new_tokens, temperature, top_k, top_p, sampling_seed); the
continuations are printed and written to the metrics, so a user watches the model learn.

They decode with the KV cache (maxtrain.infer.decode) from a copy of the parameters with each layer
its own arrays, made for the sampling and freed after it: for the while, the parameters take twice
their memory.
"""

from __future__ import annotations

from maxtrain.config import keys as config_keys
from maxtrain.data import tokenizer as tokenizer_lib
from maxtrain.infer.decode import Engine
from maxtrain.infer.sampling import Sampling
from maxtrain.runtime.console import say


class Samples:
    def __init__(self, c, trainer):
        self.c, self.trainer = c, trainer
        self.tokenizer = tokenizer_lib.make_tokenizer(c)
        self.tokenizer.add_eos = False  # a prompt is an unfinished document
        self.prompts = [self.tokenizer.encode(text).tolist() for text in c.sample_prompts]
        for text, ids in zip(c.sample_prompts, self.prompts):
            if not ids:
                raise config_keys.ConfigError("sample_prompts", f"{text!r} gives no tokens to start from")
            if len(ids) >= c.max_target_length:
                raise config_keys.ConfigError("sample_prompts", f"{text!r} is {len(ids)} tokens: no room for a new "
                                              f"one in max_target_length={c.max_target_length}, the context the "
                                              f"model runs at")
        # A sample is a glimpse, not the run's purpose: a context shortened below a config's max_new_tokens
        # (configs/shakespeare.yml's 64 at max_target_length=64) stops the samples early instead of the run.
        longest = max(self.prompts, key=len)
        self.new_tokens = min(c.max_new_tokens, c.max_target_length - len(longest))
        if self.new_tokens < c.max_new_tokens:
            say(f"warning: max_new_tokens: {c.max_new_tokens} after the {len(longest)}-token sample prompt "
                f"{c.sample_prompts[self.prompts.index(longest)]!r} exceeds max_target_length={c.max_target_length}: "
                f"samples stop at {self.new_tokens} new tokens")
        self.engine = Engine(c, trainer.mesh)

    def due(self, step: int) -> bool:
        return step % self.c.sample_interval == 0 or step == self.c.steps

    def sample(self, params) -> list[dict[str, str]]:
        """Each prompt and its continuation under `params` (the run's layout). Call under the mesh."""
        in_model_order = self.trainer.to_saved(params)  # a copy under the circular pipeline: ours to free
        weights = self.engine.weights(in_model_order, own=in_model_order is not params)
        out = self.engine.generate(weights, self.prompts, self.new_tokens, Sampling.from_config(self.c),
                                   self.tokenizer.eos_id, self.c.generate_batch_size)
        del weights
        return [{"prompt": text, "text": self.tokenizer.decode(ids)} for text, ids in zip(self.c.sample_prompts, out.ids)]
