"""MuLoCo (docs/algorithms/muloco.md): Muon against a port of the released step, the inner
split, error feedback carrying the outer learning rate, its special cases and settings, and
Muon on a weight matrix in the round engine's layouts against the numpy loop. The registry
row runs in every driver and layout in tests/test_matrix.py (its vectors take the run's SGD)."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
import textbook_muloco as tm
from jax.sharding import PartitionSpec as P

import co2jax
from co2jax import comm
from co2jax.algorithms import registry
from co2jax.algorithms.muloco import hidden_matrix

LR, H, ROUNDS = 0.1, 4, 3
TOL = harness.TOL[jnp.dtype(jnp.float32)]
NS_TOL = dict(rtol=2e-4, atol=2e-5)  # five quintic steps in float32 against float64


def _released_muon(shape_flax, steps, lr, **kw):
    """Our Muon with decoupled decay at ``lr`` and the port (torch layout: the transpose),
    on the same gradients: (ours, port) after ``steps`` steps."""
    rng = np.random.default_rng(len(shape_flax) + shape_flax[0])
    w = rng.normal(size=shape_flax).astype(np.float32)
    grads = [rng.normal(size=shape_flax).astype(np.float32) for _ in range(steps)]
    tx = optax.chain(
        co2jax.muon(
            kw.get("mu", 0.9), nesterov=kw.get("nesterov", False), scale=kw.get("scale", "spectral")
        ),
        optax.add_decayed_weights(kw.get("wd", 0.0)),
        optax.scale_by_learning_rate(lr),
    )
    ours, state = jnp.asarray(w), None
    state = tx.init(ours)
    for g in grads:
        u, state = tx.update(jnp.asarray(g), state, ours)
        ours = optax.apply_updates(ours, u)
    port, m = w.T.astype(np.float64), np.zeros(w.T.shape)
    for g in grads:
        port, m = tm.muon_step(port, g.T.astype(np.float64), m, lr, **kw)
    return np.asarray(ours), port.T


@pytest.mark.parametrize("shape", [(5, 8), (8, 5), (6, 6)])
@pytest.mark.parametrize(
    "kw",
    [{}, {"nesterov": True}, {"wd": 0.1, "scale": "rms"}, {"mu": 0.5}],
    ids=["default", "nesterov", "decay_rms", "momentum"],
)
def test_muon_is_the_released_step(shape, kw):
    ours, port = _released_muon(shape, 4, 0.05, **kw)
    np.testing.assert_allclose(ours, port, **NS_TOL)


def test_more_axes_fold_into_the_rows():
    rng = np.random.default_rng(0)
    g = jnp.asarray(rng.normal(size=(3, 4, 5)), jnp.float32)
    tx = co2jax.muon()
    folded, _ = tx.update(g.reshape(3, 20), tx.init(g.reshape(3, 20)))
    u, _ = tx.update(g, tx.init(g))
    np.testing.assert_allclose(np.asarray(u).reshape(3, 20), np.asarray(folded), rtol=1e-6)


def test_newton_schulz_approximately_orthogonalises():
    rng = np.random.default_rng(1)
    u = rng.normal(size=(16, 32))
    o = np.asarray(co2jax.algorithms.muloco.newton_schulz(jnp.asarray(u, jnp.float32)))
    s = np.linalg.svd(o, compute_uv=False)
    assert 0.6 < s.min() and s.max() < 1.25  # the quintic's band, not exactly 1


def test_the_inner_split_follows_the_released_classification():
    from experiments import model as model_lib

    _, params = model_lib.init_params(model_lib.preset("tiny"))
    labels = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        labels[jax.tree_util.keystr(path)] = hidden_matrix(path, leaf)
    assert not labels["['embed']['embedding'].value"]  # embeddings (tied head): AdamW
    assert not labels["['final_norm']['scale'].value"]  # vectors: AdamW
    assert labels["['blocks'][0]['attn']['q']['kernel'].value"]
    assert labels["['blocks'][0]['mlp']['down']['kernel'].value"]
    adamw = optax.adamw(1e-3)
    tx = co2jax.muloco_inner(adamw, 0.02)
    small = {"embed": jnp.ones((4, 3)), "w": jnp.eye(3), "b": jnp.ones(3)}
    updates, _ = tx.update(small, tx.init(small), small)
    alone, _ = adamw.update(small, adamw.init(small), small)
    np.testing.assert_array_equal(updates["embed"], alone["embed"])
    np.testing.assert_array_equal(updates["b"], alone["b"])
    assert np.abs(np.asarray(updates["w"]) - np.asarray(alone["w"])).max() > 1e-3


def test_without_compression_it_is_diloco():
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=2)
    outer, inner = harness.registered(
        "muloco", problem, LR, H, compression="none", collective="two_step", error_feedback=False
    )
    got = harness.run_adapter(outer, inner, problem, H, ROUNDS)
    np.testing.assert_allclose(got, tb.diloco_nesterov(problem, LR, H, ROUNDS, 0.9, 0.8), **TOL)


def test_lossless_feedback_as_released_is_diloco_at_the_squared_rate():
    """With a lossless codec the residual stays 0; the released scale puts eta in the
    payload, so the outer step is Nesterov at eta^2 (and at eta with feedback_scale one)."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=2)
    reduce = comm.all_gather_compressed(comm.make("none"))
    for scale, rate in ((0.9, 0.81), (1.0, 0.9)):
        outer = co2jax.error_feedback(
            co2jax.diloco(co2jax.outer_sgd(0.9, 0.8, nesterov=True), reduce=reduce), 0.9, scale
        )
        got, _ = harness.run_rounds(outer, problem, LR, H, ROUNDS)
        want = tb.diloco_nesterov(problem, LR, H, ROUNDS, rate, 0.8)
        np.testing.assert_allclose(got, want, **TOL)


def _matrix_problem():
    """The textbook problem with ``w`` a 2 x 7 matrix (Muon's) beside the vector ``b``."""
    return tb.make_problem(replicas=4, examples=2, dim=16, seed=6)


def _loop_with_muon(problem, rounds):
    """The numpy loop: b takes SGD at LR, w (flax (2, 7), torch (7, 2)) the released Muon at
    LR, momentum kept per replica across rounds; int8 error feedback carrying eta."""
    momenta = [np.zeros((7, 2)) for _ in range(problem.replicas)]

    def inner(r, theta, steps):
        theta = theta.copy()
        for _ in range(steps):
            g = problem.grad(r, theta)
            w_t = theta[2:].reshape(2, 7).T
            w_t, momenta[r] = tm.muon_step(w_t, g[2:].reshape(2, 7).T, momenta[r], LR)
            theta = np.concatenate([theta[:2] - LR * g[:2], w_t.T.reshape(-1)])
        return theta

    return tm.diloco_feedback(problem, LR, H, rounds, 0.9, 0.8, 0.9, 128, inner=inner)


@pytest.mark.parametrize("layout", ["replicated", "fsdp", "tp"])
def test_muon_on_a_matrix_in_the_round_engine(layout, monkeypatch):
    from test_engine import engine_loss, textbook_batch

    monkeypatch.setattr(
        harness,
        "unflatten",
        lambda t: {"b": t[..., :2], "w": t[..., 2:].reshape(*t.shape[:-1], 2, 7)},
    )
    monkeypatch.setattr(
        harness,
        "flatten",
        lambda p: jnp.concatenate([p["b"], p["w"].reshape(*p["w"].shape[:-2], 14)], -1),
    )
    problem = _matrix_problem()
    shape = {"replicated": (4, 2, 1), "fsdp": (4, 2, 1), "tp": (4, 1, 2)}[layout]
    mesh = co2jax.make_mesh(*shape, devices=jax.devices("cpu")[:8])
    specs = {"b": P(), "w": P("model", None)} if layout == "tp" else None  # 2 rows: 1 each
    outer, inner = harness.registered(
        "muloco", problem, LR, H, compression="int8", collective="all_gather"
    )
    trainer = co2jax.RoundTrainer(
        engine_loss, inner, outer, mesh, H, fsdp=layout == "fsdp", param_specs=specs
    )
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    got = []
    for _ in range(ROUNDS):
        state, _ = trainer.round(state, textbook_batch(problem, H))
        got.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
    np.testing.assert_allclose(np.stack(got), _loop_with_muon(problem, ROUNDS), **NS_TOL)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"lr_schedule": "cosine"}, r"outer.feedback_scale='outer_lr': scales the feedback"),
        ({"error_feedback": False, "error_decay": 0.5}, r"outer.error_decay=0.5: ignored unless"),
        ({"muon_momentum": 1.0}, r"outer.muon_momentum=1.0: must be in \[0, 1\)"),
        ({"muon_weight_decay": -1.0}, r"outer.muon_weight_decay=-1.0: must be >= 0"),
        ({"muon_scale": "frob"}, r"outer.muon_scale='frob': must be one of"),
        ({"error_decay": 1.5}, r"outer.error_decay=1.5: must be in \[0, 1\]"),
    ],
)
def test_bad_settings_are_refused_in_one_line(fields, match):
    with pytest.raises(ValueError, match=match) as info:
        registry.settings("muloco", **fields).validate(registry.Bounds(rounds=10))
    assert "\n" not in str(info.value)


def test_the_registry_needs_the_inner_learning_rate():
    with pytest.raises(ValueError, match="needs the inner learning rate"):
        registry.settings("muloco").inner(optax.adamw(1e-3), registry.Context(4))


def test_muon_takes_its_own_multiple_of_the_inner_learning_rate():
    params = {"w": jnp.eye(3) + 0.1, "b": jnp.ones(3)}

    def updates(scale):
        s = registry.settings("muloco", muon_lr_scale=scale).validate()
        tx = s.inner(optax.sgd(0.01), registry.Context(4, inner_learning_rate=0.01))
        return tx.update(params, tx.init(params), params)[0]

    one, four = updates(1.0), updates(4.0)
    np.testing.assert_allclose(four["w"], 4 * one["w"], rtol=1e-6)  # Muon's part
    np.testing.assert_array_equal(four["b"], one["b"])  # the run's transform: unchanged
    with pytest.raises(ValueError, match=r"outer.muon_lr_scale=0.0: must be > 0"):
        registry.settings("muloco", muon_lr_scale=0.0).validate()
