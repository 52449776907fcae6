"""A flax.nnx model as users write it (dropout, BatchNorm, auxiliary metrics) trained by the round
engine (co2jax.NnxModel + RoundTrainer) and by a loop of one's own over co2jax.local_updates,
the two compared; its state per replica; an orbax save and restore."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import co2jax

R, D, H, B, ROUNDS = 4, 2, 3, 8, 3


class Net(nnx.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout -> Linear: running statistics and an RNG
    stream, the state that is not parameters."""

    def __init__(self, rngs: nnx.Rngs):
        # no bias before the BatchNorm: it would cancel it, leaving a gradient of rounding
        # noise that Adam scales up to full steps (different at each layout)
        self.inp = nnx.Linear(5, 16, use_bias=False, rngs=rngs)
        self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.25, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.norm(self.inp(x)))))


def loss(net: Net, batch):
    pred = net(batch["x"])[:, 0]
    err = pred - batch["y"]
    return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err)), "pred": jnp.mean(pred)}


def _net():
    return Net(nnx.Rngs(params=0, dropout=1))


def _batches(same_for_all=False):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROUNDS, R, H, B, 5)).astype(np.float32)
    if same_for_all:
        x[:] = x[:, :1]
    y = np.tanh(x @ np.linspace(-1, 1, 5)).astype(np.float32)
    return [{"x": x[k], "y": y[k]} for k in range(ROUNDS)]


def _outer():
    return co2jax.diloco(optax.sgd(0.7, momentum=0.9, nesterov=True))


def _engine(batches, **options):
    model = co2jax.NnxModel(_net(), loss, has_aux=True)
    mesh = co2jax.make_mesh(replica=R, data=D, devices=jax.devices()[: R * D])
    trainer = model.trainer(optax.adam(1e-2), _outer(), mesh, H, **options)
    state, aux = model.init(trainer), []
    for batch in batches:
        state, metrics = trainer.round(state, batch)
        aux.append(jax.device_get(metrics.aux))
    return model, trainer, state, aux


def _own_loop(batches):
    """The twin: nnx as written, split by hand, in a loop over jax.vmap with
    co2jax.local_updates (no NnxModel), replica r's RNG key folded with r."""
    graphdef, params, rest = nnx.split(_net(), nnx.Param, ...)
    stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * R), t)
    params, rest = stack(params), stack(rest)
    rest = jax.tree.map(
        lambda x: (
            jax.vmap(jax.random.fold_in)(x, jnp.arange(R, dtype=jnp.uint32))
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
            else x
        ),
        rest,
    )
    tx = co2jax.local_updates(optax.adam(1e-2), _outer(), H)
    opt = jax.vmap(tx.init)(params)

    def step(params, rest, opt, batch):
        def f(p):
            net = nnx.merge(graphdef, p, rest, copy=True)
            value, aux = loss(net, batch)
            return value, (aux, nnx.split(net, nnx.Param, ...)[2])

        (_, (aux, rest_)), grads = jax.value_and_grad(f, has_aux=True)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), rest_, opt, aux

    step = jax.jit(jax.vmap(step, axis_name="replica"))
    aux = []
    for batch in batches:
        per_step = []
        for h in range(H):
            b = jax.tree.map(lambda x, h=h: x[:, h], batch)
            params, rest, opt, a = step(params, rest, opt, b)
            per_step.append(a)
        aux.append(jax.tree.map(lambda *a: np.stack(a, axis=1), *per_step))
    return params, rest, aux


def _close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def test_the_round_engine_equals_a_loop_of_ones_own_over_local_updates():
    """Every step's auxiliary outputs (which see the parameters after each outer step) and
    the model state after the rounds agree. (The parameters themselves are not compared at
    the end: local_updates applies a round's outer step in the next round's first call.)"""
    batches = _batches()
    _, _, state, aux = _engine(batches)
    _, rest, own_aux = _own_loop(batches)
    _close(state.model_state, rest)  # statistics, keys and counts, replica by replica
    _close(aux, own_aux)
    assert aux[0]["mae"].shape == (R, H) and len(aux) == ROUNDS


def test_each_replica_keeps_its_own_statistics_and_dropout():
    model, _, state, aux = _engine(_batches(same_for_all=True))
    mean = np.asarray(state.model_state["norm"]["mean"].get_value())
    assert mean.shape == (R, 16)
    # every replica saw the same inputs: only dropout (its own mask) sets them apart, and the
    # statistics are never averaged
    assert all(not np.allclose(mean[0], mean[r]) for r in range(1, R))
    first = aux[0]["pred"][:, 0]  # step 0: equal parameters, equal inputs, own masks
    assert len(set(np.round(first, 6).tolist())) == R
    counts = np.asarray(state.model_state["drop"]["rngs"]["count"].get_value())
    np.testing.assert_array_equal(counts, np.full(R, ROUNDS * H))  # one draw per step
    one = model.module(state, replica=2)
    np.testing.assert_array_equal(np.asarray(one.norm.mean.get_value()), mean[2])
    avg = co2jax.NnxModel.averaged_statistics(state)
    got = np.asarray(avg.model_state["norm"]["mean"].get_value())
    np.testing.assert_allclose(got, np.broadcast_to(mean.mean(0), mean.shape), rtol=1e-6)
    keys = avg.model_state["drop"]["rngs"]["key"].get_value()
    np.testing.assert_array_equal(
        jax.random.key_data(keys),
        jax.random.key_data(state.model_state["drop"]["rngs"]["key"].get_value()),
    )


def test_an_orbax_checkpoint_restores_the_trainer_state(tmp_path):
    batches = _batches()
    model, trainer, state, _ = _engine(batches[:1])
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "round1", state)
    checkpointer.wait_until_finished()
    target = trainer.abstract_state(model.params, model.model_state)
    restored = checkpointer.restore(tmp_path / "round1", target)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert a.sharding == b.sharding
    after, metrics = trainer.round(restored, batches[1])
    _, _, straight, aux = _engine(batches[:2])
    for a, b in zip(jax.tree.leaves(straight), jax.tree.leaves(after), strict=True):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(aux[1]["mae"], np.asarray(metrics.aux["mae"]))


def test_aux_without_model_state_and_its_data_slices():
    """A plain loss with auxiliary outputs (no model state): each data device's slice, the
    aux averaged like the loss; equal to the one-device whole-batch values."""

    def plain(p, b):
        err = b["x"] @ p["w"] - b["y"]
        return jnp.mean(err**2), {"mae": jnp.mean(jnp.abs(err))}

    batches = _batches()
    out = []
    for data in (1, D):
        mesh = co2jax.make_mesh(replica=R, data=data, devices=jax.devices()[: R * data])
        trainer = co2jax.RoundTrainer(plain, optax.sgd(0.1), _outer(), mesh, H, has_aux=True)
        state = trainer.init({"w": jnp.zeros(5)})
        state, metrics = trainer.round(state, batches[0])
        out.append((np.asarray(state.params["w"]), np.asarray(metrics.aux["mae"])))
    _close(out[0], out[1])


@pytest.mark.parametrize(
    "returned, has_aux, message",
    [
        (lambda v: v, True, r"^loss_fn must return \(loss, aux\), got an array of shape \(\)"),
        (lambda v: (v, {}), False, "loss_fn must return a scalar"),
    ],
)
def test_a_loss_that_does_not_return_what_has_aux_says_is_one_line(returned, has_aux, message):
    mesh = co2jax.make_mesh(replica=R, data=D, devices=jax.devices()[: R * D])
    trainer = co2jax.RoundTrainer(
        lambda p, b: returned(jnp.mean(b["x"] * p)),
        optax.sgd(0.1),
        _outer(),
        mesh,
        H,
        has_aux=has_aux,
    )
    state = trainer.init(jnp.ones(()))
    with pytest.raises(ValueError, match=message):
        trainer.round(state, {"x": jnp.ones((R, H, B))})


def test_a_module_with_state_needs_its_state():
    model = co2jax.NnxModel(_net(), loss, has_aux=True)
    with pytest.raises(ValueError, match=r"^model_state=\(\): this module has state"):
        model.loss_fn(model.params, {"x": jnp.ones((2, 5)), "y": jnp.ones(2)})
    with pytest.raises(ValueError, match=r"^module must be an nnx.Module"):
        co2jax.NnxModel(lambda x: x, loss)
