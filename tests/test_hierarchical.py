"""Hierarchical DiLoCo (docs/algorithms/hierarchical_diloco.md). Every driver and layout
against the textbook loop is in test_matrix.py (R = 4, two regions); here: R = 8, the two
reductions to DiLoCo, the collectives in the compiled round (region means inside regions,
the global all-reduce inside the cond), the bytes by level and the settings."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb

import co2jax
from co2jax import hlo
from co2jax.algorithms import registry
from co2jax.comm import regions as rg

LR, H = 0.1, 4
TOL = harness.TOL[jnp.dtype(jnp.float32)]


def nesterov(lr, mu):
    return optax.sgd(lr, momentum=mu, nesterov=True)


@pytest.mark.parametrize("driver", ["vmap", "shard_map"])
def test_eight_replicas_in_four_regions_match_the_loop(driver):
    """R = 8, G = 4 regions of 2, a global step every 3 rounds over 7 rounds (two of them),
    alpha 0.3: the regions' parameters differ at the end."""
    problem = tb.make_problem(replicas=8, examples=2, dim=16, seed=3)
    want = tb.hierarchical(problem, LR, H, 7, 4, 3, 0.3, (0.7, 0.6), (0.8, 0.4))
    outer = co2jax.hierarchical_diloco(
        nesterov(0.7, 0.6), nesterov(0.8, 0.4), regions=4, global_every=3, alpha=0.3
    )
    if driver == "vmap":
        got, _ = harness.run_vmap(outer, problem, LR, H, 7)
    else:
        got, _ = harness.run_shard_map(outer, problem, LR, H, 7, harness.make_mesh(8, 1))
    np.testing.assert_allclose(got, want, **TOL)
    assert np.abs(want[-1] - want[-1].mean(0)).max() > 1e-3  # the regions differ


@pytest.mark.parametrize(("every", "alpha"), [(1, 1.0), (3, 0.4)])
def test_one_region_is_diloco_with_the_region_optimizer(every, alpha):
    """G = 1: the region mean is the all-replica mean and the global step (SGD(1)) moves theta
    onto phi; any K and alpha then leave phi where the region step put it."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=1)
    outer = co2jax.hierarchical_diloco(
        nesterov(0.7, 0.9), optax.sgd(1.0), regions=1, global_every=every, alpha=alpha
    )
    got, _ = harness.run_vmap(outer, problem, LR, H, 6)
    np.testing.assert_allclose(got, tb.diloco_nesterov(problem, LR, H, 6, 0.7, 0.9), **TOL)


def test_one_replica_per_region_is_diloco_over_the_regions():
    """m = 1, region step SGD(1) (phi_g is the replica's own parameters), alpha 1: each
    replica runs K H local steps, then the global Nesterov step on the mean: DiLoCo at K H."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=2)
    outer = co2jax.hierarchical_diloco(
        optax.sgd(1.0), nesterov(0.7, 0.9), regions=4, global_every=3
    )
    got, _ = harness.run_vmap(outer, problem, LR, H, 9)
    want = tb.diloco_nesterov(problem, LR, 3 * H, 3, 0.7, 0.9)
    np.testing.assert_allclose(got[2::3], want, **TOL)


def test_region_optimizer_is_any_optax_transform():
    """Adam at the region level, in the same loop with its own state per region (the loop's
    Nesterov steps replaced by the region's Adam: checked against the region means by hand)."""
    problem = tb.make_problem(replicas=4, examples=2, dim=8, seed=5)
    outer = co2jax.hierarchical_diloco(
        optax.adam(0.05), optax.sgd(1.0), regions=2, global_every=2, alpha=0.5
    )
    got, _ = harness.run_vmap(outer, problem, LR, H, 2)
    adam = optax.adam(0.05)
    phi = [problem.theta0.copy() for _ in range(2)]
    opt = [adam.init(jnp.asarray(problem.theta0)) for _ in range(2)]
    for t in range(2):
        for g in range(2):
            delta = np.mean(
                [phi[g] - tb.inner_sgd(problem, r, phi[g], LR, H) for r in (2 * g, 2 * g + 1)], 0
            )
            u, opt[g] = adam.update(jnp.asarray(delta, jnp.float32), opt[g])
            phi[g] = phi[g] + np.asarray(u, np.float64)
        if t == 1:
            theta = problem.theta0 - np.mean([problem.theta0 - p for p in phi], 0)
            phi = [0.5 * p + 0.5 * theta for p in phi]
    np.testing.assert_allclose(got[-1], np.stack([phi[0], phi[0], phi[1], phi[1]]), **TOL)


def _compiled_round(replicas: int, regions: int, every: int):
    problem = tb.make_problem(replicas=replicas, examples=8, dim=16, seed=0)
    mesh = harness.make_mesh(replica=replicas, data=8 // replicas)
    outer = co2jax.hierarchical_diloco(
        nesterov(0.7, 0.9), nesterov(0.7, 0.5), regions=regions, global_every=every
    )
    inner = optax.sgd(LR)
    params = harness.initial_params(problem)
    spec = jax.sharding.PartitionSpec("replica")
    args = [
        harness.place(x, mesh, spec)
        for x in (params, jax.vmap(inner.init)(params), jax.vmap(outer.init)(params))
    ]
    d = harness.place(jnp.asarray(problem.d), mesh, spec)
    c = harness.place(jnp.asarray(problem.c), mesh, jax.sharding.PartitionSpec("replica", "data"))
    fn = harness.shard_round(outer, inner, mesh, H)
    return fn.lower(*args, d, c).compile().as_text(), mesh


def test_region_means_stay_inside_regions_and_the_global_mean_is_conditional():
    """R = 4 replicas x 2 data shards, 2 regions: the compiled round's collective-permutes pair
    devices of one region and one data shard (nothing crosses a region's border); the one
    replica-axis all-reduce (the global mean, 16 float32) sits in a conditional's branch,
    not in the round's main computation."""
    text, mesh = _compiled_round(4, 2, 2)
    found = hlo.collectives(text)
    ids = np.arange(8).reshape(mesh.devices.shape)
    where = {int(ids[r, d]): (r // 2, d) for r in range(4) for d in range(2)}
    permutes = [c for c in found if c.op == "collective-permute"]
    assert permutes
    for c in permutes:
        assert all(where[a] == where[b] and a != b for a, b in c.groups), c.groups
    over = [c for c in hlo.over_axis(found, mesh, "replica") if c.op != "collective-permute"]
    assert [c.op for c in over] == ["all-reduce"], over
    assert over[0].bytes == 16 * 4
    main = [c for c in found if c.computation.startswith("main")]
    assert over[0] not in main, "the global all-reduce must run inside the cond only"


def test_wire_bytes_by_level():
    """Region payload: (m - 1) copies on the fast links; global: 2 (R - 1) / R copies every K
    rounds on the slow ones (rg.slow_link_bytes)."""
    reducer = rg.two_level_mean(regions=2, every=4)
    values = {"w": jnp.zeros(100)}
    region = jax.eval_shape(lambda v: rg.region_payload(v), values)
    glob = jax.eval_shape(lambda v: rg.global_payload(v, jnp.int32(0)), values)
    assert reducer.wire_bytes(region, 8) == 3 * 400.0
    assert reducer.wire_bytes(glob, 8) == 2 * 7 / 8 * 400.0 / 4
    assert rg.slow_link_bytes(400.0, 8, 4) == reducer.wire_bytes(glob, 8)


def test_round_engine_counts_both_levels():
    """The round engine's bytes per round: the region level's (m - 1) P plus the global
    level's amortized 2 (R - 1) / R P / K, with P the 5 float32 parameters; and its rounds
    equal the loop's."""
    from test_engine import run_engine

    problem = tb.make_problem(replicas=4, examples=2)
    mesh = co2jax.make_mesh(replica=4, data=2, devices=jax.devices("cpu")[:8])
    outer = co2jax.hierarchical_diloco(
        nesterov(0.7, 0.9), nesterov(0.5, 0.5), regions=2, global_every=2, alpha=0.6
    )
    got, _, metrics, _ = run_engine(outer, problem, mesh, rounds=4)
    want = tb.hierarchical(problem, 0.1, 3, 4, 2, 2, 0.6, (0.7, 0.9), (0.5, 0.5))
    np.testing.assert_allclose(got, want, **TOL)
    payload = 5 * 4
    np.testing.assert_allclose(metrics[0].bytes_communicated, payload + 2 * 3 / 4 * payload / 2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(regions=0, global_every=2), "regions"),
        (dict(regions=2, global_every=0), "global_every"),
        (dict(regions=2, global_every=2, alpha=0.0), r"alpha must be a number in \(0, 1\]"),
        (dict(regions=2, global_every=2, alpha=1.5), "alpha"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        co2jax.hierarchical_diloco(optax.sgd(1.0), optax.sgd(1.0), **kwargs)


def test_regions_must_divide_the_replicas():
    outer = co2jax.hierarchical_diloco(optax.sgd(1.0), optax.sgd(1.0), regions=3, global_every=1)
    state = jax.vmap(outer.init)(jnp.zeros((4, 1)))
    with pytest.raises(ValueError, match=r"regions=3 must divide .* R=4"):
        jax.vmap(outer.sync, axis_name="replica")(jnp.ones((4, 1)), state)


def test_settings_refuse_before_compute():
    s = registry.settings("hierarchical_diloco", regions=3)
    with pytest.raises(ValueError, match=r"outer.regions=3: must divide mesh.replica=4"):
        s.validate(registry.Bounds(replicas=4))
    with pytest.raises(ValueError, match=r"outer.alpha=0.0"):
        registry.settings("hierarchical_diloco", alpha=0.0).validate()
    with pytest.raises(ValueError, match=r"outer.global_momentum=1.0"):
        registry.settings("hierarchical_diloco", global_momentum=1.0).validate()


def test_separate_jobs_refuse_clearly():
    """Separate jobs exchange by all-gather: a region mean has no such form."""
    outer = co2jax.hierarchical_diloco(optax.sgd(1.0), optax.sgd(1.0), regions=2, global_every=2)
    peers = co2jax.Peers(("127.0.0.1:1", "127.0.0.1:2"), rank=0)
    with pytest.raises(ValueError, match=r"no gather form.*group of replicas only"):
        co2jax.JobTrainer(harness.loss_fn, optax.sgd(0.1), outer, peers, 4)
