"""SPARTA and SPARTA-DiLoCo (docs/algorithms/sparta.md): the special cases, the released
step, what crosses the replica axis and the settings. Every driver and layout against the
numpy loop: tests/test_matrix.py (``sparta``, ``sparta_diloco``, ``sparta[bernoulli]``)."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb

import co2jax
from co2jax.algorithms import registry
from co2jax.algorithms.sparta import (
    sample_count,
    sparta_indices,
    sparta_mask,
    sparta_step_bytes,
)
from co2jax.comm.reducer import ring_bytes

LR, H, ROUNDS = 0.1, 4, 3
TOL = harness.TOL[jnp.dtype(jnp.float32)]


def _one_step(tx, params: jax.Array, grads: jax.Array):
    """One update of every replica (the leading axis) under vmap: the new parameters."""
    state = jax.vmap(tx.init)(params)
    updates, _ = jax.vmap(tx.update, axis_name="replica")(grads, state, params)
    return np.asarray(params + updates)


def _released_step(x: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """A port of the released SparseCommunicator.communicate (exo-explore/gym@9fa323c):
    ``sparse = param[mask]; all_reduce(sparse, SUM); sparse /= num_nodes;
    param.masked_scatter_(mask, sparse)``, on every replica's tensor (leading axis)."""
    x = x.copy()
    summed = np.sum([xr[mask] for xr in x], axis=0)
    for xr in x:
        xr[mask] = summed / len(x)
    return x


def test_at_p_one_with_sgd_it_is_ddp():
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=3)
    tx = co2jax.sparta(optax.sgd(LR), fraction=1.0)
    got, *_ = harness.run_vmap_steps(tx, problem, H * ROUNDS, H)
    np.testing.assert_allclose(got, tb.data_parallel_sgd(problem, LR, H, ROUNDS), **TOL)


def test_sparta_diloco_at_p_zero_is_diloco():
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=3)
    outer, inner = harness.registered("sparta_diloco", problem, LR, H, fraction=0.0)
    got = harness.run_adapter(outer, inner, problem, H, ROUNDS)
    np.testing.assert_allclose(got, tb.diloco_nesterov(problem, LR, H, ROUNDS, 0.7, 0.9), **TOL)


def test_sparta_averages_less_than_ddp_and_more_than_local_steps():
    """The loop is neither of its limits: a fraction of 0.25 leaves the replicas apart, yet
    closer than independent local SGD (so the matrix's comparisons can fail)."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=3)
    tx = co2jax.sparta(optax.sgd(LR), fraction=0.25)
    got, *_ = harness.run_vmap_steps(tx, problem, H * ROUNDS, H)
    spread = lambda x: np.sqrt(np.mean((x - x.mean(axis=0)) ** 2))  # RMS over replicas
    local = co2jax.sparta(optax.sgd(LR), fraction=0.0)
    alone, *_ = harness.run_vmap_steps(local, problem, H * ROUNDS, H)
    assert 0.1 * spread(alone[-1]) < spread(got[-1]) < 0.7 * spread(alone[-1])


@pytest.mark.parametrize("shape", [(7, 5), (13,), (2, 3, 4)])
def test_the_bernoulli_selector_is_the_released_step(shape):
    """Our update with the released law equals the released communicate() with the same
    mask, on tensors that split into no even chunks."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, *shape)).astype(np.float32)
    tx = co2jax.sparta(optax.sgd(0.0), fraction=0.3, selector="bernoulli", seed=7)
    got = _one_step(tx, jnp.asarray(x), jnp.zeros_like(x))
    mask = np.asarray(sparta_mask(7, 0, 0, shape, 0.3))
    assert 0 < mask.sum() < mask.size
    np.testing.assert_allclose(got, _released_step(x, mask), **TOL)


def test_indices_average_the_chosen_entries_and_leave_the_rest_bit_for_bit():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 9, 7)).astype(np.float32)
    g = rng.normal(size=x.shape).astype(np.float32)
    tx = co2jax.sparta(optax.sgd(0.5), fraction=0.1, seed=3)
    got = _one_step(tx, jnp.asarray(x), jnp.asarray(g)).reshape(4, -1)
    local = np.asarray(jnp.asarray(x) - 0.5 * jnp.asarray(g)).reshape(4, -1)
    idx = np.unique(np.asarray(sparta_indices(3, 0, 0, 63, 0.1)))
    assert len(idx) == sample_count(63, 0.1) == 6
    rest = np.setdiff1d(np.arange(63), idx)
    np.testing.assert_array_equal(got[:, rest], local[:, rest])  # untouched: the local step
    # the chosen entries: the replicas' mean on every replica (up to the rounding of
    # x_r + (mean - x_r): the driver adds the update back)
    want = np.broadcast_to(local[:, idx].mean(axis=0), (4, len(idx)))
    np.testing.assert_allclose(got[:, idx], want, **TOL)
    assert np.abs(got[:, idx] - local[:, idx]).max() > 0.1  # they did move
    np.testing.assert_allclose(got.mean(axis=0), local.mean(axis=0), **TOL)  # mean kept


def test_the_draws_have_the_stated_law():
    """Indices: k draws with replacement, each entry chosen with 1 - (1 - 1/n)^k; Bernoulli:
    about p n entries; both drawn anew every step and per tensor."""
    n, p, steps = 400, 0.05, 200
    k = sample_count(n, p)
    distinct = [len(np.unique(np.asarray(sparta_indices(0, t, 1, n, p)))) for t in range(steps)]
    expected = n * (1 - (1 - 1 / n) ** k)
    assert abs(np.mean(distinct) - expected) < 0.5
    counts = [int(np.asarray(sparta_mask(0, t, 1, (n,), p)).sum()) for t in range(steps)]
    assert abs(np.mean(counts) - p * n) < 1.0
    a, b = (np.asarray(sparta_indices(0, t, 1, n, p)) for t in (0, 1))
    c = np.asarray(sparta_indices(0, 0, 2, n, p))
    assert not np.array_equal(a, b) and not np.array_equal(a, c)


def test_only_the_chosen_values_cross_the_replica_axis():
    """Per step: one all-reduce of k values per tensor over the replica axis (1 of b's 2,
    4 of w's 14), no mask broadcast; DDP reduces all 16."""
    mesh = harness.make_mesh(4, 2)
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=1)

    def reduced(tx):
        args = harness.shard_step_args(tx, problem, mesh)
        hlo = harness.shard_step(tx, mesh).lower(*args).compile().as_text()
        return harness.replica_reduced_elements(hlo, mesh, "all-reduce")

    assert reduced(co2jax.sparta(optax.sgd(LR), fraction=0.25)) == 1 + 4
    assert reduced(co2jax.data_parallel(optax.sgd(LR))) == 16


def test_step_bytes():
    params = {"b": jnp.zeros(2), "w": jnp.zeros((2, 7))}
    assert sparta_step_bytes(params, 4, 0.25, "indices") == ring_bytes(4 * (1 + 4), 4)
    assert sparta_step_bytes(params, 4, 0.25, "bernoulli") == ring_bytes(4 * 16, 4)
    assert sparta_step_bytes(params, 4, 0.25, "indices", every=5) == ring_bytes(20, 4) / 5
    s = registry.settings("sparta", fraction=0.25)
    assert s.step_bytes(params, 4, 8) == ring_bytes(20, 4)


@pytest.mark.parametrize(
    "algorithm,fields,match",
    [
        ("sparta", {"fraction": 0.0}, r"outer.fraction=0.0: must be > 0 for sparta"),
        ("sparta", {"fraction": 1.5}, r"outer.fraction=1.5: must be in \[0, 1\]"),
        ("sparta_diloco", {"fraction": -0.1}, r"outer.fraction=-0.1: must be in \[0, 1\]"),
        ("sparta", {"every": 0}, r"outer.every=0: must be >= 1"),
        ("sparta", {"seed": -1}, r"outer.seed=-1: must be >= 0"),
        ("sparta", {"selector": "topk"}, r"outer.selector='topk': must be one of"),
        ("sparta", {"learning_rate": 0.7}, r"outer.learning_rate=0.7: sparta has no such"),
    ],
)
def test_bad_settings_are_refused_in_one_line(algorithm, fields, match):
    with pytest.raises(ValueError, match=match) as info:
        registry.settings(algorithm, **fields).validate()
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"fraction": 2.0}, r"fraction must be in \[0, 1\], got fraction=2.0"),
        ({"every": 0}, r"every"),
        ({"selector": "mask"}, r"selector must be one of"),
    ],
)
def test_the_library_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        co2jax.sparta(optax.sgd(0.1), **kwargs)


def test_update_without_params_is_refused():
    tx = co2jax.sparta(optax.sgd(0.1), fraction=0.5)
    state = jax.vmap(tx.init)(jnp.zeros((2, 3)))
    with pytest.raises(ValueError, match="needs params"):
        jax.vmap(tx.update, axis_name="replica")(jnp.zeros((2, 3)), state)
