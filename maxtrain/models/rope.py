"""Rotary position embeddings: the frequencies of each kind of scaling and their application.

Half-split layout, as HF's Llama (and every family here): a head's dimensions rotate in (x[:K/2], x[K/2:])
pairs. Scaling stretches long wavelengths for long contexts: llama3 (Llama 3.1: a blend between kept and
slowed wavelengths), linear (every frequency divided by the factor: Gemma 3's global layers), yarn (gpt-oss,
DeepSeek: NTK-by-parts, and cos/sin scaled by 0.1 ln(factor) + 1, or as HF's mscale keys say).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

KINDS = ("llama3", "linear", "yarn")


@dataclasses.dataclass(frozen=True)
class Rope:
    theta: float
    kind: str = "llama3"       # how `factor` scales: one of KINDS
    factor: float = 1.0        # 1 = no scaling
    low_freq_factor: float = 1.0    # llama3
    high_freq_factor: float = 4.0   # llama3
    original_length: int = 8192     # llama3, yarn: the context the model was first trained for
    beta_fast: float = 32.0         # yarn
    beta_slow: float = 1.0          # yarn
    truncate: bool = True           # yarn: the correction range rounded outwards to whole dimensions
    mscale: float = 0.0             # yarn: HF's mscale and mscale_all_dim (0 = not set; see magnitude)
    mscale_all_dim: float = 0.0

    @classmethod
    def from_config(cls, c, theta: float | None = None) -> "Rope":
        """The config's RoPE; with `theta`, that base and no scaling (Gemma 3's sliding layers)."""
        if theta is not None:
            return cls(theta=theta)
        return cls(theta=c["rope_theta"], kind=c["rope_type"], factor=c["rope_scaling_factor"],
                   low_freq_factor=c["rope_low_freq_factor"], high_freq_factor=c["rope_high_freq_factor"],
                   original_length=c["rope_original_max_position_embeddings"], beta_fast=c["rope_yarn_beta_fast"],
                   beta_slow=c["rope_yarn_beta_slow"], truncate=c["rope_yarn_truncate"], mscale=c["rope_yarn_mscale"],
                   mscale_all_dim=c["rope_yarn_mscale_all_dim"])

    def frequencies(self, half: int):
        """[half] float32 angular frequencies."""
        freq_K2 = self.theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
        if self.factor == 1.0:
            return freq_K2
        if self.kind == "linear":
            return freq_K2 / self.factor
        if self.kind == "yarn":
            return self._yarn(freq_K2, half)
        cycles_K2 = self.original_length * freq_K2 / (2 * jnp.pi)  # turns over the original context
        if self.high_freq_factor == self.low_freq_factor:  # no band between the two (Llama 4 Scout: 1 and 1)
            blend = (cycles_K2 > self.high_freq_factor).astype(jnp.float32)
        else:
            blend = jnp.clip((cycles_K2 - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor),
                             0.0, 1.0)
        return (1 - blend) * freq_K2 / self.factor + blend * freq_K2

    def _yarn(self, freq_K2, half: int):
        dim = 2 * half

        def correction_dim(rotations):  # the dimension whose wavelength fits `rotations` times in the original
            return dim * math.log(self.original_length / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))
        low, high = correction_dim(self.beta_fast), correction_dim(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        high = high + 0.001 if low == high else high
        interpolated_K2 = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
        return freq_K2 / self.factor * interpolated_K2 + freq_K2 * (1 - interpolated_K2)

    def yarn_scale(self, mscale: float = 1.0) -> float:
        """yarn's m(s) = 0.1 s ln(factor) + 1 (1 without yarn scaling)."""
        if self.kind != "yarn" or self.factor <= 1:
            return 1.0
        return 0.1 * mscale * math.log(self.factor) + 1.0

    @property
    def magnitude(self) -> float:
        """What cos and sin are multiplied by: yarn's attention temperature, m(1), or with both of HF's
        mscale and mscale_all_dim m(mscale) / m(mscale_all_dim) (DeepSeek's: 1); 1 elsewhere."""
        if self.mscale and self.mscale_all_dim:
            return self.yarn_scale(self.mscale) / self.yarn_scale(self.mscale_all_dim)
        return self.yarn_scale()


def rope(x_BxLxHxK, positions_BxL, r: Rope):
    """x rotated by each position's angles, in x's dtype (the rotation itself in float32)."""
    half = x_BxLxHxK.shape[-1] // 2
    angle_BxLx1xK2 = (positions_BxL[:, :, None, None] * r.frequencies(half)).astype(jnp.float32)
    sin, cos = jnp.sin(angle_BxLx1xK2) * r.magnitude, jnp.cos(angle_BxLx1xK2) * r.magnitude
    x1, x2 = jnp.split(x_BxLxHxK.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BxLxHxK.dtype)
