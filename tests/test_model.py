"""Tests for the flax.nnx decoder-only transformer in experiments/model.py."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from experiments import model

# XLA:CPU compiles dominate this file's runtime: every test that compiles shares the tiny preset
# (whose init program the module doctest reuses) and one jitted value_and_grad.
SMALL = model.preset("tiny")
SEQ = 16


@pytest.fixture(scope="module")
def small():
    graphdef, params = model.init_params(SMALL, seed=0)
    return graphdef, params


@pytest.fixture(scope="module")
def value_and_grad(small):
    graphdef, _ = small
    return jax.jit(jax.value_and_grad(model.make_loss_fn(graphdef)))


def _batch(key, shape, vocab=SMALL.vocab_size):
    return jax.random.randint(jax.random.key(key), shape, 0, vocab, dtype=jnp.int32)


@pytest.mark.parametrize(
    "name, low, high", [("tiny", 0.5e6, 2e6), ("150m", 120e6, 180e6), ("1b", 0.8e9, 1.4e9)]
)
def test_preset_param_counts(name, low, high):
    assert low <= model.param_count(model.preset(name)) <= high


def test_param_count_matches_initialized_params(small):
    _, params = small
    assert model.param_count(SMALL) == sum(x.size for x in jax.tree.leaves(params))


def test_split_gives_only_params_with_configured_dtypes():
    cfg = model.preset("tiny", dtype="bfloat16", tie_embeddings=False)
    abstract = nnx.eval_shape(lambda: model.Transformer(cfg, nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)  # raises if other state existed
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
    tokens = jax.ShapeDtypeStruct((2, 8), jnp.int32)
    logits = jax.eval_shape(lambda p, t: nnx.merge(graphdef, p)(t), params, tokens)
    assert logits.shape == (2, 8, cfg.vocab_size) and logits.dtype == jnp.float32


def test_causal_changing_token_t_leaves_earlier_logits_unchanged(small):
    graphdef, params = small
    apply = jax.jit(lambda p, t: nnx.merge(graphdef, p)(t))
    tokens_BxL = _batch(1, (2, SEQ))
    t = 7
    changed_BxL = tokens_BxL.at[:, t].set((tokens_BxL[:, t] + 1) % SMALL.vocab_size)
    logits, logits_changed = apply(params, tokens_BxL), apply(params, changed_BxL)
    np.testing.assert_allclose(logits[:, :t], logits_changed[:, :t], rtol=0, atol=1e-6)
    assert not np.allclose(logits[:, t:], logits_changed[:, t:], atol=1e-4)


def test_rope_scores_depend_only_on_relative_position():
    B, L, H, K = 1, 12, 2, 32
    rng = np.random.default_rng(0)
    q_BxLxHxK = jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32)
    k_BxLxHxK = jnp.asarray(rng.normal(size=(B, L, H, K)), jnp.float32)

    @jax.jit
    def scores(shift):
        positions_L = jnp.arange(L) + shift
        q, k = model.rope(q_BxLxHxK, positions_L), model.rope(k_BxLxHxK, positions_L)
        return jnp.einsum("blhk,bmhk->bhlm", q, k)

    np.testing.assert_allclose(scores(0), scores(37), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(scores(0), scores(1000), rtol=1e-3, atol=1e-3)
    # Not the identity: rotation changes the scores, but keeps the norms.
    raw = jnp.einsum("blhk,bmhk->bhlm", q_BxLxHxK, k_BxLxHxK)
    assert not np.allclose(scores(0), raw, atol=1e-2)
    rotated = np.asarray(jax.jit(model.rope)(q_BxLxHxK, jnp.arange(L)))
    np.testing.assert_allclose(
        np.linalg.norm(rotated, axis=-1), np.linalg.norm(q_BxLxHxK, axis=-1), rtol=1e-5
    )


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_loss_at_init_near_log_vocab_and_decreases_under_adam(small, value_and_grad):
    _, params = small
    batch_BxLp1 = _batch(2, (4, SEQ + 1))
    opt = optax.adam(3e-3)

    @jax.jit
    def apply_adam(grads, opt_state, params):
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    opt_state, losses = opt.init(params), []
    for _ in range(6):
        loss, grads = value_and_grad(params, batch_BxLp1)
        params, opt_state = apply_adam(grads, opt_state, params)
        losses.append(float(loss))
    log_v = math.log(SMALL.vocab_size)
    assert abs(losses[0] - log_v) < 0.1 * log_v
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert losses[-1] < losses[0] - 0.5, losses


def test_layer_of_maps_block_params_to_their_index(small):
    _, params = small
    for tree in (params, nnx.to_pure_dict(params)):
        leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
        layers = [model.layer_of(path) for path, _ in leaves]
        for (path, _), layer in zip(leaves, layers, strict=True):
            top = path[0].key
            if top == "blocks":
                assert layer == path[1].key
            else:
                assert top in ("embed", "final_norm", "head") and layer is None
        assert sorted({i for i in layers if i is not None}) == list(range(SMALL.n_layers))
    flat_paths = [path for path, _ in nnx.to_flat_state(params)]
    assert {model.layer_of(p) for p in flat_paths} == {None, *range(SMALL.n_layers)}
    assert model.layer_of(("blocks", 3, "attn", "q", "kernel")) == 3


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_loss_fn_under_vmap_over_stacked_replica_params(small, value_and_grad):
    graphdef, params = small
    loss_fn = model.make_loss_fn(graphdef)
    R = 2
    # Host-side numpy for the bookkeeping: eager jnp ops would each compile per leaf shape.
    stacked = jax.tree.map(lambda x: np.stack([x, x + np.float32(0.01)]), params)
    batch_RxBxLp1 = np.asarray(_batch(3, (R, 4, SEQ + 1)))
    losses_R, grads = jax.jit(jax.vmap(jax.value_and_grad(loss_fn)))(stacked, batch_RxBxLp1)
    grads = jax.tree.map(np.asarray, grads)
    assert losses_R.shape == (R,)
    assert jax.tree.structure(grads) == jax.tree.structure(stacked)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    # The replicas stay independent: replica 0 sees the unperturbed params and its own batch.
    loss_0, grads_0 = value_and_grad(params, batch_RxBxLp1[0])
    np.testing.assert_allclose(losses_R[0], loss_0, rtol=1e-5)
    for g, g0 in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_0), strict=True):
        np.testing.assert_allclose(g[0], g0, rtol=1e-4, atol=1e-6)
    assert not np.isclose(losses_R[0], losses_R[1])


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"vocab_size": 0}, "vocab_size"),
        ({"d_model": -128}, "d_model"),
        ({"n_layers": 0}, "n_layers"),
        ({"d_ff": 0}, "d_ff"),
        ({"max_seq_len": 0}, "max_seq_len"),
        ({"n_heads": 3}, "n_heads"),
        ({"d_model": 12, "n_heads": 4}, "head_dim"),
        ({"dtype": "float8"}, "dtype"),
        ({"param_dtype": "int8"}, "param_dtype"),
        ({"rope_base": 0.0}, "rope_base"),
    ],
)
def test_bad_config_raises_naming_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        model.preset("tiny", **overrides)


def test_unknown_preset_and_too_long_sequence_raise():
    with pytest.raises(ValueError, match="name"):
        model.preset("7b")
    abstract = nnx.eval_shape(lambda: model.Transformer(SMALL, nnx.Rngs(0)))
    with pytest.raises(ValueError, match="max_seq_len"):
        abstract(jnp.zeros((1, SMALL.max_seq_len + 1), jnp.int32))
