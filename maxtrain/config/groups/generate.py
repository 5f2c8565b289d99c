"""The generation keys (group `generate`): python -m maxtrain.generate's, and the samples a run prints."""

from __future__ import annotations

from maxtrain.runtime.declaration import Key, declare
from maxtrain.runtime.errors import ConfigError


def prompt_token_ids(text: str) -> list[int]:
    return [int(t) for t in text.replace(" ", "").split(",") if t]


def _prompt_ids(c) -> None:
    try:
        ids = prompt_token_ids(c["prompt_ids"])
    except ValueError:
        raise ConfigError("prompt_ids",
                          f"expected comma-separated token ids like 1,2,3, got {c['prompt_ids']!r}") from None
    bad = [i for i in ids if not 0 <= i < c["vocab_size"]]
    if bad:
        raise ConfigError("prompt_ids", f"token id {bad[0]} is outside the vocabulary [0, {c['vocab_size']})")


def _temperature(c) -> None:
    if 0 < c["temperature"] < 1e-6:  # logits / temperature in float32: below this, greedy with extra steps
        raise ConfigError("temperature", f"must be 0 (greedy) or at least 1e-6, got {c['temperature']}")


def _top_k(c) -> None:
    if c["top_k"] > c["vocab_size"]:
        raise ConfigError("top_k", f"{c['top_k']} exceeds vocab_size={c['vocab_size']}")


def _sample_prompts(c) -> None:
    prompts = c["sample_prompts"]
    if not all(isinstance(p, str) and p for p in prompts):
        raise ConfigError("sample_prompts",
                          f"must be a list of non-empty strings, e.g. '[\"ROMEO:\"]', got {prompts!r}")
    if c["sample_interval"] and not prompts:
        raise ConfigError("sample_prompts", "sample_interval needs prompts to continue, e.g. "
                          "sample_prompts='[\"ROMEO:\"]'")


def generate(name: str, **kw) -> Key:
    return Key(name, "generate", **kw)


declare(
    generate("sample_interval", at_least=0, why="0 = never"),
    generate("sample_prompts", check=_sample_prompts),
    generate("prompt"),
    generate("prompt_ids", check=_prompt_ids),
    generate("prompt_file", path="input"),
    generate("generate_batch_size", at_least=1),
    generate("max_new_tokens", at_least=1),
    generate("temperature", at_least=0, check=_temperature),
    generate("top_k", at_least=0, check=_top_k),
    generate("top_p", above=0, at_most=1, why="1 = off"),
    generate("sampling_seed"),
)
