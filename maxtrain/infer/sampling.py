"""The next token from a step's logits: greedy, or a sample at a temperature, among the top k and/or the
top-p nucleus. Each sequence draws from its own key (folded from the seed and its prompt's number in the
call), so a prompt file gives the same samples whatever generate_batch_size."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0            # > 0: among the k most likely tokens only
    top_p: float = 1.0        # < 1: among the fewest most likely tokens whose probability reaches p
    seed: int = 0

    @classmethod
    def from_config(cls, c) -> "Sampling":
        return cls(c.temperature, c.top_k, c.top_p, c.sampling_seed)

    def row_keys(self, prompt_numbers_B):
        """One PRNG key per sequence, from the seed and the number of its prompt."""
        return jax.vmap(lambda i: jax.random.fold_in(jax.random.key(self.seed), i))(prompt_numbers_B)

    def choose(self, logits_BxV, keys_B, step):
        """int32 [B]: each sequence's token at decode `step` (its key folded with the step)."""
        if self.temperature == 0:
            return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
        logits_BxV = logits_BxV.astype(jnp.float32)  # the best at 0 first: a small temperature cannot overflow
        logits_BxV = (logits_BxV - jnp.max(logits_BxV, axis=-1, keepdims=True)) / self.temperature
        if self.top_k:
            kth_Bx1 = jax.lax.top_k(logits_BxV, self.top_k)[0][:, -1:]
            logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
        if self.top_p < 1.0:
            sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
            probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
            # a token stays if the more likely ones before it have not reached p yet (the first always does)
            kept_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV < self.top_p
            least_Bx1 = jnp.min(jnp.where(kept_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
            logits_BxV = jnp.where(logits_BxV < least_Bx1, -jnp.inf, logits_BxV)
        draw = lambda key, logits_V: jax.random.categorical(jax.random.fold_in(key, step), logits_V)  # noqa: E731
        return jax.vmap(draw)(keys_B, logits_BxV).astype(jnp.int32)
