"""Decode tokens/s with the KV cache (maxtrain.infer) against the old full rerun and transformers' generate.

    python benchmarks/decode.py [--rounds 3] [--new-tokens 64,256,1024] [--batches 1,8] [--rerun-steps 3]

(the hf extra: torch, transformers)
One random-weight 125m-shaped Llama (the 125m preset's shape: 12 layers, width 768, 12 heads, MLP 2560,
vocab 32000, tied embeddings), built with transformers and converted with maxtrain.convert, so both
sides run the same weights, in float32, on this machine's CPU (torch with as many threads as XLA:CPU's
cores). Prompts of 64 random tokens, greedy, no eos: every sequence gets all its new tokens.

- maxtrain: Engine.generate, compiled ahead; its own split of prefill and decode time. Decode tokens/s
  = batch x (new - 1) / decode seconds (the first new token comes from the prefill).
- transformers: model.generate with its default (dynamic) KV cache; decode seconds = the call for
  `new` tokens minus a call for 1 token (its prefill and first token), run right after it.
- full rerun: reference.full_rerun's step (the whole model over one prompt + `new` buffer, then the
  next token), timed over --rerun-steps steps after a warm-up: its time per token is the same at every
  position, so tokens/s = 1 / (seconds per step) without running all `new` steps (1024 would take an hour).

Each round runs every variant once, maxtrain, then transformers, then the rerun, back to back; figures
are medians over rounds, ratios the median of each round's paired ratio. "leading equal": how many
new ids maxtrain and transformers agree on before the first difference (the fewest over a batch's rows;
random weights in float32 can flip a near-tie).
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from maxtrain import convert, train
from maxtrain.checkpoint import loading as ckpt_loading
from maxtrain.infer.decode import Engine
from maxtrain.infer.sampling import Sampling
from maxtrain.infer import reference
from maxtrain.parallel import mesh as mesh_lib
from maxtrain.training import step as step_lib

PROMPT = 64
SHAPE = dict(vocab_size=32000, hidden_size=768, intermediate_size=2560, num_hidden_layers=12, num_attention_heads=12,
             num_key_value_heads=12, head_dim=64, tie_word_embeddings=True, max_position_embeddings=2048,
             rms_norm_eps=1e-5)


def hf_model(directory: Path, init_std: float) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, initializer_range=init_std)).eval()
    model.generation_config.eos_token_id = None  # eos disabled: every sequence runs to max_new_tokens
    model.save_pretrained(directory)
    return model


def load(config_path: Path):
    """(config, trainer, params) on one device, float32."""
    c = train.load_config([str(config_path), "dtype=float32", "max_target_length=2048", "per_device_batch_size=1"])
    mesh = mesh_lib.make_mesh(c)
    trainer = step_lib.build(c, mesh)
    with mesh_lib.activate(mesh, trainer.rules):
        params = ckpt_loading.load_parameters(c, trainer.abstract_state.params)
    return c, trainer, params


def hf_generate(model, prompts, new_tokens: int) -> tuple[list[list[int]], float]:
    ids = torch.tensor(prompts, dtype=torch.long)
    t0 = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    return out[:, ids.shape[1]:].tolist(), time.perf_counter() - t0


def rerun_seconds(step, trainer, params, prompt, new_tokens: int, steps: int) -> float:
    """Seconds per new token of the full rerun: the mean of `steps` steps after one warm-up step."""
    buffer = np.zeros((1, PROMPT + new_tokens), np.int32)
    buffer[0, :PROMPT] = prompt
    buffer = jax.device_put(buffer, trainer.batch_sharding)
    buffer, token = step(params, buffer, PROMPT)
    int(token)
    t0 = time.perf_counter()
    for position in range(PROMPT + 1, PROMPT + 1 + steps):
        buffer, token = step(params, buffer, position)
        int(token)  # as full_rerun does: each token comes back to the host
    return (time.perf_counter() - t0) / steps


def leading_equal(a: list[list[int]], b: list[list[int]]) -> int:
    same = lambda x, y: next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))  # noqa: E731
    return min(same(x, y) for x, y in zip(a, b))


def spread(values, digits=1, unit=""):
    """'12.3' for one value; the median and the range, '12.3 (11.0-13.1)', for several."""
    f = lambda v: f"{v:,.{digits}f}{unit}"  # noqa: E731
    return f(values[0]) if len(values) == 1 else f"{f(statistics.median(values))} ({f(min(values))}-{f(max(values))})"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", default="64,256,1024")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rerun-steps", type=int, default=3, help="timed steps of the full rerun (0: skip it)")
    parser.add_argument("--init-std", type=float, default=0.02, help="the random weights' std (LlamaConfig's "
                        "initializer_range; norms 1)")
    args = parser.parse_args()
    new_tokens = [int(n) for n in args.new_tokens.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(os.cpu_count())
    rng = np.random.RandomState(0)
    prompts = rng.randint(0, SHAPE["vocab_size"], (max(batches), PROMPT)).tolist()

    with tempfile.TemporaryDirectory() as tmp:
        model = hf_model(Path(tmp) / "hf", args.init_std)
        c, trainer, params = load(convert.hf_to_maxtrain(str(Path(tmp) / "hf"), str(Path(tmp) / "mt")) / "maxtrain.yml")
    print(f"{time.strftime('%Y-%m-%d')} | {os.cpu_count()} CPU cores, load {os.getloadavg()[0]:.2f} | "
          f"{c.num_params / 1e6:.0f}M params, float32 | jax {jax.__version__} ({jax.device_count()} device), "
          f"torch {torch.__version__} ({torch.get_num_threads()} threads) | prompts of {PROMPT}, greedy | "
          f"{args.rounds} rounds")

    variants = [(b, n) for b in batches for n in new_tokens]
    mesh = trainer.mesh
    with mesh_lib.activate(mesh, trainer.rules):
        engine = Engine(c, mesh)
        weights = engine.weights(params)
        t0 = time.perf_counter()
        for b, n in variants:
            engine.compile(engine.shape(prompts[:b], n, b), Sampling(), -1)
        steps = {n: reference.rerun_step(c, trainer) for n in new_tokens} if args.rerun_steps else {}
        print(f"compiled maxtrain's {len(variants)} shapes in {time.perf_counter() - t0:.0f} s (not timed below)")
        hf_generate(model, prompts[:1], 4)  # warm-up
        ours, theirs, rerun, paired, equal, prefill = ({v: [] for v in variants} for _ in range(6))
        for _ in range(args.rounds):
            for b, n in variants:
                g = engine.generate(weights, prompts[:b], n, Sampling(), eos_id=None, batch_size=b)
                ours[b, n].append(g.decode_tokens / g.decode_seconds)
                hf_ids, seconds = hf_generate(model, prompts[:b], n)
                _, first = hf_generate(model, prompts[:b], 1)
                theirs[b, n].append(b * (n - 1) / (seconds - first))
                paired[b, n].append(ours[b, n][-1] / theirs[b, n][-1])
                prefill[b, n].append((b * PROMPT / g.prefill_seconds, b * PROMPT / first))
                equal[b, n].append(leading_equal(g.ids, hf_ids))
                if b == 1 and args.rerun_steps:
                    rerun[b, n].append(1 / rerun_seconds(steps[n], trainer, params, prompts[0], n, args.rerun_steps))
                tail = f", full rerun {rerun[b, n][-1]:,.2f}" if rerun[b, n] else ""
                print(f"  batch {b}, {n} new: maxtrain {ours[b, n][-1]:,.1f} tokens/s, transformers "
                      f"{theirs[b, n][-1]:,.1f}{tail}", flush=True)

    print("\ndecode tokens/s (median over rounds, range); full rerun: 1 / (s per step), timed over "
          f"{args.rerun_steps} steps at the buffer length 64 + new")
    print("| batch | new tokens | maxtrain (KV cache) | full rerun | cache / rerun | transformers generate "
          "| maxtrain / transformers | prefill tokens/s maxtrain / transformers | leading equal ids |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b, n in variants:
        speedup = [o / r for o, r in zip(ours[b, n], rerun[b, n])]
        rerun_cells = f"{spread(rerun[b, n], 2)} | {spread(speedup, 1, 'x')}" if rerun[b, n] else "- | -"
        ours_prefill, their_prefill = (statistics.median(p[i] for p in prefill[b, n]) for i in (0, 1))
        print(f"| {b} | {n} | {spread(ours[b, n])} | {rerun_cells} | {spread(theirs[b, n])} | "
              f"{spread(paired[b, n], 2, 'x')} | {ours_prefill:,.0f} / {their_prefill:,.0f} | "
              f"{min(equal[b, n])} of {n} |")
    ratios = [statistics.median(p) for p in paired.values()]
    print(f"maxtrain / transformers decode: {min(ratios):.2f}x to {max(ratios):.2f}x over the rows")
    for b in batches:
        if all(rerun[b, n] for n in new_tokens):
            print(f"cache / full rerun, batch {b}: " + ", ".join(
                f"{statistics.median(o / r for o, r in zip(ours[b, n], rerun[b, n])):.1f}x at {n}" for n in new_tokens))


if __name__ == "__main__":
    main()
