"""Every attention kernel with a family's variants (a sliding window, a query scale of its own, a soft
cap on the scores, sinks in the softmax's denominator, packed documents, GQA) against a plain dense
reference written here: outputs and gradients (q, k, v, sinks), float32. Then the same under context
parallelism, and a decode step against the KV cache."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtrain.infer.kv_cache import LayerCache
from maxtrain.ops import attention, window_attention
from maxtrain.ops.attention import Variant
from maxtrain.parallel import context, mesh as mesh_lib, rules as rules_lib

TOL = dict(rtol=2e-5, atol=2e-5)


def reference(q_BxLxHxK, k_BxLxNxK, v_BxLxNxK, segment_ids_BxL, positions_BxL=None, window=0, scale=None,
              softcap=0.0, sinks_H=None, chunk=0):
    """Dense softmax attention: all scores, the mask, and the sinks as one more column of the softmax.
    `chunk`: a query at p sees the keys from chunk x floor(p / chunk) on (Llama 4)."""
    b, length, h, d = q_BxLxHxK.shape
    g = h // k_BxLxNxK.shape[2]
    k_BxLxHxK, v_BxLxHxK = jnp.repeat(k_BxLxNxK, g, axis=2), jnp.repeat(v_BxLxNxK, g, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q_BxLxHxK, k_BxLxHxK) * (d ** -0.5 if scale is None else scale)
    if softcap:
        scores = softcap * jnp.tanh(scores / softcap)
    positions = jnp.arange(length)[None].repeat(b, 0) if positions_BxL is None else positions_BxL
    distance = positions[:, :, None] - positions[:, None, :]
    seen = (distance >= 0) & (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])
    if window:
        seen &= distance < window
    if chunk:
        seen &= positions[:, None, :] >= chunk * (positions[:, :, None] // chunk)
    scores = jnp.where(seen[:, None], scores, -jnp.inf)
    if sinks_H is not None:
        scores = jnp.concatenate([scores, jnp.broadcast_to(sinks_H[None, :, None, None], (b, h, length, 1))], -1)
    probs = jax.nn.softmax(scores, axis=-1)[..., :length]
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v_BxLxHxK)


def inputs(length, heads=4, kv_heads=2, head_dim=8, batch=2, documents=True, seed=0, spread=1.0):
    """q, k, v, segment ids (packed documents of uneven lengths: 3 in row 0, 1 in row 1), sinks, and a
    cotangent for the output."""
    ks = jax.random.split(jax.random.key(seed), 5)
    q = spread * jax.random.normal(ks[0], (batch, length, heads, head_dim))
    k = spread * jax.random.normal(ks[1], (batch, length, kv_heads, head_dim))
    v = jax.random.normal(ks[2], (batch, length, kv_heads, head_dim))
    segments = np.ones((batch, length), np.int32)
    if documents:
        segments[0, length // 3:] = 2
        segments[0, length // 3 + length // 5:] = 3
    sinks = jax.random.normal(ks[3], (heads,))
    cotangent = jax.random.normal(ks[4], (batch, length, heads, head_dim))
    return q, k, v, jnp.asarray(segments), sinks, cotangent


def value_and_grads(fn, q, k, v, sinks, cotangent):
    """fn's output and the gradients of <output, cotangent> over q, k, v (and sinks, if given)."""
    if sinks is None:
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None), q, k, v)
    else:
        out, vjp = jax.vjp(fn, q, k, v, sinks)
    return out, vjp(cotangent)


def assert_matches_reference(kernel, length, variant, with_sinks=True, positions=None, **shape):
    q, k, v, segments, sinks, cotangent = inputs(length, **shape)
    sinks = sinks if with_sinks else None
    ours = jax.jit(lambda *a: value_and_grads(lambda q, k, v, s: kernel(q, k, v, segments, variant, s), *a))(
        q, k, v, sinks, cotangent)
    theirs = value_and_grads(lambda q, k, v, s: reference(q, k, v, segments, positions, variant.window, variant.scale,
                                                          variant.softcap, s), q, k, v, sinks, cotangent)
    np.testing.assert_allclose(ours[0], theirs[0], **TOL)
    for name, a, b in zip("qkvs"[:len(theirs[1])], ours[1], theirs[1], strict=True):
        np.testing.assert_allclose(a, b, **TOL, err_msg=f"d{name}")


def splash(q, k, v, segments, variant, sinks):
    return context.splash(q, k, v, segments, variant=variant, sinks_H=sinks)


def tokamax_splash(q, k, v, segments, variant, sinks):
    return context.splash(q, k, v, segments, variant=variant, sinks_H=sinks, library="tokamax")


KERNELS = {**attention.KERNELS, "splash": splash, "tokamax_splash": tokamax_splash}
VARIANTS = {
    "window": Variant(window=32),
    "window+scale+softcap": Variant(window=32, scale=0.21, softcap=3.0),
    "full+scale+softcap": Variant(scale=0.21, softcap=3.0),
}


@pytest.mark.slow
# Every kernel with every variant; sinks on and off alternate, so each kernel and each variant meets both.
@pytest.mark.parametrize("kernel,variant,sinks", [(name, variant, (i + j) % 2 == 0) for i, name in enumerate(KERNELS)
                                                  for j, variant in enumerate(VARIANTS)])
def test_every_kernel_equals_the_dense_reference(kernel, sinks, variant):
    """Sequence 8W = 256 tokens, window W = 32 (blockwise: several blocks, each against its window's keys),
    packed documents, GQA (4 query heads on 2 kv heads); q and k spread so the soft cap bites."""
    assert_matches_reference(KERNELS[kernel], 256, VARIANTS[variant], with_sinks=sinks, spread=2.0)


def document_positions(segments):
    """Each token's position in its document (packed documents restart at 0)."""
    segments = np.asarray(segments)
    starts = np.maximum.accumulate(np.where(np.diff(segments, prepend=-1, axis=1) != 0, np.arange(
        segments.shape[1])[None], 0), axis=1)
    return jnp.asarray(np.arange(segments.shape[1])[None] - starts)


@pytest.mark.slow
@pytest.mark.parametrize("kernel,chunk,length", [(kernel, chunk, length) for kernel in KERNELS
                                                 for chunk, length in ((32, 256), (24, 200), (7, 64))
                                                 if "splash" not in kernel or length % 128 == 0])  # splash: 128s
def test_every_kernel_chunks_as_the_reference(kernel, chunk, length):
    """Chunked attention (Llama 4) as every kernel runs it through the plan: the window = the chunk, and each
    chunk of each packed document a segment of its own (chunks count from the document's start)."""
    q, k, v, segments, sinks, cotangent = inputs(length, spread=2.0)
    positions = document_positions(segments)
    chunked = attention.chunk_segments(segments, positions, chunk)
    variant = Variant(window=chunk, chunked=True, scale=0.21, softcap=3.0)
    fn = KERNELS[kernel]
    ours = jax.jit(lambda *a: value_and_grads(lambda q, k, v, s: fn(q, k, v, chunked, variant, s), *a))(
        q, k, v, sinks, cotangent)
    theirs = value_and_grads(lambda q, k, v, s: reference(q, k, v, segments, positions, 0, 0.21, 3.0, s, chunk),
                             q, k, v, sinks, cotangent)
    np.testing.assert_allclose(ours[0], theirs[0], **TOL)
    for name, a, b in zip("qkvs", ours[1], theirs[1], strict=True):
        np.testing.assert_allclose(a, b, **TOL, err_msg=f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("window,block,length,form", [  # the hardest shapes in both forms, the others in one
    (32, 64, 256, "stacked"),     # block bigger than the window
    (48, 20, 200, "stacked"),     # window not a multiple of the block, nor the block of the length
    (48, 20, 200, "banded"),
    (100, 64, 330, "stacked"),    # the window spans blocks; the last block short
    (100, 64, 330, "banded"),
    (7, 16, 64, "banded"),
    (1, 16, 48, "stacked"),       # each token sees only itself
    (500, 64, 256, "banded"),     # a window longer than the sequence: full causal
])
def test_blockwise_window_at_any_block(window, block, length, form):
    """Both windowed forms (stacked keys: float32's; banded: bfloat16's), with sinks and a soft cap."""
    variant = Variant(window=window, scale=0.3, softcap=4.0)
    windowed = attention.window_blocks if form == "stacked" else window_attention.banded_blocks
    assert_matches_reference(lambda *a: windowed(*a[:4], block, *a[4:]), length, variant)


def test_bfloat16_takes_the_banded_form_and_matches_float32():
    q, k, v, segments, sinks, _ = inputs(256)
    variant = Variant(window=32)
    as_bf16 = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    ours = attention.blockwise(*as_bf16, segments, variant, sinks)
    banded = window_attention.banded_blocks(*as_bf16, segments, attention.window_block(32, jnp.bfloat16), variant, sinks)
    np.testing.assert_array_equal(np.asarray(ours, np.float32), np.asarray(banded, np.float32))
    np.testing.assert_allclose(np.asarray(ours, np.float32), attention.blockwise(q, k, v, segments, variant, sinks),
                               atol=3e-2)


@pytest.mark.slow
def test_blockwise_window_8w_default_block():
    """The issue's test: blockwise with window W at sequence 8W equals the dense masked reference, at a W
    that is not a multiple of blockwise's own block for it."""
    w = 100
    assert w % attention.window_block(w)
    assert_matches_reference(attention.blockwise, 8 * w, Variant(window=w), heads=2, kv_heads=1, batch=1)


def _flops(length, window):
    q, k, v, segments, *_ = inputs(length, heads=2, kv_heads=2, batch=1)
    fn = jax.jit(jax.grad(lambda q, k, v: attention.blockwise(q, k, v, segments, Variant(window=window)).sum(),
                          argnums=(0, 1, 2)))
    return fn.lower(q, k, v).compile().cost_analysis()["flops"]


@pytest.mark.slow
def test_blockwise_cost_grows_with_the_window_not_the_sequence():
    """Forward + backward flops of windowed blockwise double with the sequence (each query's work is
    bounded by the window), where full causal's quadruple."""
    w = 128
    windowed = _flops(16 * w, w) / _flops(8 * w, w)
    full = _flops(16 * w, 0) / _flops(8 * w, 0)
    assert 1.9 < windowed < 2.2, windowed
    assert full > 3.5, full


# ---- context parallelism


@pytest.fixture(scope="module")
def context_mesh():
    from maxtrain import train
    from conftest import TINY
    c = train.load_config([TINY, "ici_context_parallelism=4", "ici_fsdp_parallelism=2"], jax.devices())
    return mesh_lib.make_mesh(c, jax.devices()), rules_lib.axis_rules(c)


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize("window", [9, 40, *(pytest.param(w, marks=pytest.mark.slow) for w in (1, 17, 24, 0))])
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "unbalanced"])
def test_context_parallel_with_a_window_and_sinks(context_mesh, balanced, window, strategy):
    """Context 4 x fsdp 2, each device 32 of 128 positions (in zigzag order two runs of 16): outputs and
    gradients equal the reference in sequence order. A window of at most a run + 1 takes the keys before
    each run from the neighbouring device (ppermute, no all-gather); a longer one gathers them all, or
    under the ring strategy passes each device's block round the ring (ppermutes, no all-gather)."""
    length, shards = 128, 4
    q, k, v, segments, sinks, cotangent = inputs(length)
    variant = Variant(window=window, scale=0.3, softcap=4.0)
    order = attention.zigzag_order(length, shards) if balanced else np.arange(length)
    positions = jnp.asarray(order)[None].repeat(2, 0)
    mesh, rules = context_mesh

    def ours(q, k, v, s):
        return context.context_parallel(q, k, v, segments[:, order], positions, variant, s, balanced, strategy)
    args = (q[:, order], k[:, order], v[:, order], sinks, cotangent[:, order])
    with mesh_lib.activate(mesh, rules):
        program = str(jax.make_jaxpr(lambda *a: value_and_grads(ours, *a))(*args))
        out, grads = jax.jit(lambda *a: value_and_grads(ours, *a))(*args)
    halo = window and window - 1 <= (16 if balanced else 32)
    gathers = not halo and strategy == "all_gather"
    assert ("all_gather" in program, "ppermute" in program) == (gathers, not gathers and window != 1)
    back = np.argsort(order)
    grads = [g[:, back] for g in grads[:3]] + [grads[3]]
    out_r, grads_r = value_and_grads(lambda q, k, v, s: reference(q, k, v, segments, None, window, 0.3, 4.0, s),
                                     q, k, v, sinks, cotangent)
    np.testing.assert_allclose(out[:, back], out_r, **TOL)
    for name, a, b in zip("qkv", grads[:3], grads_r[:3]):
        np.testing.assert_allclose(a, b, **TOL, err_msg=f"d{name}")
    np.testing.assert_allclose(grads[3], grads_r[3], **TOL, err_msg="dsinks")


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [9, 40])
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced", "unbalanced"])
def test_context_parallel_chunks_as_the_reference(context_mesh, balanced, chunk):
    """The same mesh with chunks, through the plan's entry (as a Llama 4 layer calls it): a chunk of at most a
    run + 1 takes its keys from the neighbour, a longer one gathers them all."""
    from maxtrain.parallel.plan import Plan
    length, shards = 128, 4
    q, k, v, segments, sinks, cotangent = inputs(length)
    positions = document_positions(segments)
    variant = Variant(window=chunk, chunked=True, scale=0.3)
    order = attention.zigzag_order(length, shards) if balanced else np.arange(length)
    plan = Plan(attention="dot_product", mlp_chunk=0, moe_chunk=0, moe_grouped_matmul="blocked", remat_policy="none",
                scan_unroll=1, context_load_balance=balanced)
    mesh, rules = context_mesh

    def ours(q, k, v, s):
        return plan.attend(q, k, v, segments[:, order], positions[:, order], variant, s)
    with mesh_lib.activate(mesh, rules):
        out, grads = jax.jit(lambda *a: value_and_grads(ours, *a))(q[:, order], k[:, order], v[:, order], sinks,
                                                                   cotangent[:, order])
    back = np.argsort(order)
    out_r, grads_r = value_and_grads(lambda q, k, v, s: reference(q, k, v, segments, positions, 0, 0.3, 0.0, s, chunk),
                                     q, k, v, sinks, cotangent)
    np.testing.assert_allclose(out[:, back], out_r, **TOL)
    for name, a, b in zip("qkv", grads[:3], grads_r[:3]):
        np.testing.assert_allclose(a[:, back], b, **TOL, err_msg=f"d{name}")


# ---- decoding against the KV cache


@pytest.mark.slow
@pytest.mark.parametrize("window,chunked", [(5, False), (0, False), (5, True)])
def test_a_decode_step_against_the_cache(window, chunked):
    """Single queries at several slots of a left-padded cache (row 1's sequence starts at slot 3), each
    against the cache's slots: as the reference's output at that position (chunks count from the sequence's
    first slot)."""
    slots, starts = 24, np.array([0, 3])
    q, k, v, _, sinks, _ = inputs(slots, documents=False)
    segments = jnp.asarray((np.arange(slots)[None] >= starts[:, None]).astype(np.int32))  # padding: its own
    positions = jnp.asarray(np.arange(slots)[None] - starts[:, None])
    variant = Variant(window=window, chunked=chunked, scale=0.3, softcap=4.0)
    rows = lambda x: x.transpose(0, 2, 1, 3).reshape(-1, slots, x.shape[-1])  # noqa: E731
    expected = reference(q, k, v, segments, positions, 0 if chunked else window, 0.3, 4.0, sinks,
                         window if chunked else 0)
    for t in (3, 4, 9, 17, 23):
        cache = LayerCache(rows(k), rows(v), jnp.asarray(starts), jnp.asarray(t), prefill=False)
        out, _ = cache.attend(q[:, t:t + 1], k[:, t:t + 1], v[:, t:t + 1], None, None, None, variant, sinks)
        np.testing.assert_allclose(out[:, 0], expected[:, t], **TOL, err_msg=f"slot {t}")


WINDOWED = ("sliding_window_size=6", "attention_sinks=true", "attn_logit_softcapping=20.0",
            "max_target_length=64")


def step_logits_against_full_forward(c, trainer, params, prompts, steps):
    """test_decode's check through the engine's own cache shape (a ring where every layer slides): the
    largest |logit difference| between each decode step and the full forward at the same position; and
    the cache's shape."""
    from maxtrain.infer.decode import Engine
    engine = Engine(c, trainer.mesh)
    shape = engine.shape(prompts, steps + 1, len(prompts))
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        weights = engine.weights(params)
        tokens, start, _, _ = engine._batch(prompts, 0, shape)
        logits, cache = jax.jit(engine.prefill, static_argnums=(3, 4))(weights, tokens, start, shape.slots, shape.ring)
        step, each_step = jax.jit(engine.step), []
        for _ in range(steps + 1):
            each_step.append(np.asarray(logits)[:len(prompts)])
            logits, cache = step(weights, jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None], cache)
        chosen_SxB = np.argmax(np.stack(each_step), axis=-1)
        final = np.zeros((len(prompts), max(map(len, prompts)) + steps + 1), np.int32)
        for b, p in enumerate(prompts):
            final[b, :len(p) + steps + 1] = p + chosen_SxB[:, b].tolist()
        full = np.asarray(jax.jit(trainer.model.apply)({"params": params}, final))
    worst = max(float(np.abs(each_step[t][b] - full[b, len(p) - 1 + t]).max())
                for t in range(steps + 1) for b, p in enumerate(prompts))
    return worst, shape


@pytest.mark.slow
@pytest.mark.parametrize("pattern,ring", [(("global_layer_interval=2",), 0), (("global_layer_interval=0",), 16)],
                         ids=["sliding_and_global", "every_layer_slides"])
def test_a_windowed_model_decodes_as_without_the_cache(tiny_config, pattern, ring):
    """Prompts and 40 new tokens, both longer than the 6-token window, with sinks and a soft cap: each
    decode step's logits are the full forward's, and generate's greedy ids the full rerun's (no cache).
    Where every layer slides the cache is the prompts' 16 slots and a ring of 16 (the window, padded),
    not the 64 of the prompts and every new token: the ring wraps twice."""
    from maxtrain.infer import reference
    from maxtrain.training import step as step_lib
    from conftest import decode
    devices = jax.devices()[:1]
    c = tiny_config(*WINDOWED, *pattern, devices=devices)
    trainer = step_lib.build(c, mesh_lib.make_mesh(c, devices))
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        params = trainer.init(jax.random.key(0)).params
    assert any("sinks" in str(path) for path, _ in jax.tree_util.tree_leaves_with_path(params))
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7]]
    worst, shape = step_logits_against_full_forward(c, trainer, params, prompts, 40)
    assert worst <= 1e-4
    assert (shape.prompt_slots, shape.ring, shape.slots) == (16, ring, 32 if ring else 64)
    ids = decode(c, trainer, params, prompts, 40, batch_size=2)
    with mesh_lib.activate(trainer.mesh, trainer.rules):
        assert ids == [reference.full_rerun(c, trainer, params, p, 40) for p in prompts]
