"""NoLoCo: gossip outer steps (docs/algorithms/noloco.md). Every driver against the textbook
loop is in test_matrix.py (R = 4); here: R = 8, the all-reduce identity, the collectives in
the compiled program, the bytes per sync and the consensus distance."""

from __future__ import annotations

import collections

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb

import co2jax
from co2jax import hlo
from co2jax.comm import gossip

LR, H = 0.1, 4
TOL = harness.TOL[jnp.dtype(jnp.float32)]


def test_two_replicas_by_hand():
    """R = 2, one group. phi = 0, theta = (1, 3), eta = 0.5, mu = 0.5:
    g_bar = 2, phi_bar = 0: delta = 0.5 * 2 = 1, phi = 1 on both; round 2 with theta =
    (2, 4): g_bar = 2, delta = 0.5 * 1 + 0.5 * 2 = 1.5, phi = 2.5."""
    outer = co2jax.noloco(0.5, 0.5, sync_every=1)
    sync = jax.vmap(outer.sync, axis_name="replica")
    state = jax.vmap(outer.init)(jnp.zeros((2, 1)))
    params, state = sync(jnp.array([[1.0], [3.0]]), state)
    np.testing.assert_allclose(params, [[1.0], [1.0]])
    params, state = sync(params + jnp.array([[1.0], [3.0]]), state)
    np.testing.assert_allclose(params, [[2.5], [2.5]])
    np.testing.assert_allclose(state.momentum, [[1.5], [1.5]])


def test_the_groups_are_the_released_rule():
    """Round t of H steps: default_rng((t + 1) * H + 1).permutation(R), dealt round-robin."""
    perm = np.random.default_rng(3 * 5 + 1).permutation(8)
    want = tuple(tuple(int(v) for v in perm[g::4]) for g in range(4))
    assert gossip.gossip_groups(8, 2, gossip.round_seed(2, 5)) == want
    table, distinct = gossip.matchings(8, 2, 5, 16)
    assert {tuple(sorted(g)) for g in want} == set(distinct[table[2]])
    assert len(distinct) > 4  # the pairs change from round to round


@pytest.mark.parametrize("driver", ["vmap", "shard_map"])
def test_eight_replicas_match_the_released_rule(driver):
    problem = tb.make_problem(replicas=8, examples=2, dim=16, seed=3)
    want = tb.noloco(problem, LR, H, 5, 0.7, 0.5, 2)
    outer = co2jax.noloco(0.7, 0.5, 2, sync_every=H)
    if driver == "vmap":
        got, _ = harness.run_vmap(outer, problem, LR, H, 5)
    else:
        mesh = harness.make_mesh(replica=8, data=1)
        got, _ = harness.run_shard_map(outer, problem, LR, H, 5, mesh)
    np.testing.assert_allclose(got, want, **TOL)
    assert np.abs(want[-1] - want[-1].mean(0)).max() > 1e-3  # the replicas differ


def test_one_group_of_all_replicas_is_diloco_with_heavy_ball():
    """n = R: every group mean is the all-reduce mean, the anchors stay equal and the
    consensus term is zero: DiLoCo with optax.sgd(eta, momentum=mu) (no Nesterov)."""
    problem = tb.make_problem(replicas=4, examples=2, dim=16, seed=1)
    got, _ = harness.run_vmap(co2jax.noloco(0.7, 0.5, 4, sync_every=H), problem, LR, H, 4)
    diloco = co2jax.diloco(optax.sgd(0.7, momentum=0.5))
    want, _ = harness.run_vmap(diloco, problem, LR, H, 4)
    np.testing.assert_allclose(got, want, **TOL)
    np.testing.assert_allclose(got, tb.noloco(problem, LR, H, 4, 0.7, 0.5, 4), **TOL)


def _round_hlo(replicas: int, group_size: int = 2) -> tuple[str, object]:
    problem = tb.make_problem(replicas=replicas, examples=8, dim=16, seed=0)
    mesh = harness.make_mesh(replica=replicas, data=8 // replicas)
    outer, inner = co2jax.noloco(0.7, 0.5, group_size, sync_every=H), optax.sgd(LR)
    params = harness.initial_params(problem)
    args = [
        harness.place(x, mesh, jax.sharding.PartitionSpec("replica"))
        for x in (params, jax.vmap(inner.init)(params), jax.vmap(outer.init)(params))
    ]
    d = harness.place(jnp.asarray(problem.d), mesh, jax.sharding.PartitionSpec("replica"))
    c = harness.place(jnp.asarray(problem.c), mesh, jax.sharding.PartitionSpec("replica", "data"))
    fn = harness.shard_round(outer, inner, mesh, H)
    return fn.lower(*args, d, c).compile().as_text(), mesh


@pytest.mark.parametrize("replicas", [2, 4, 8])
def test_only_permutes_cross_replicas_and_the_bytes_do_not_grow_with_r(replicas):
    """The compiled round: no all-reduce or all-gather over the replica axis, only
    collective-permutes, each pairing devices of the same data shard; per matching (one
    branch of the round's switch) they move two model copies, 2 x 16 float32, for every R."""
    text, mesh = _round_hlo(replicas)
    found = hlo.collectives(text)
    assert not [c for c in hlo.over_axis(found, mesh, "replica") if c.op != "collective-permute"]
    permutes = [c for c in found if c.op == "collective-permute"]
    assert permutes
    ids = np.arange(8).reshape(mesh.devices.shape)
    data_of = {int(ids[r, d]): d for r in range(ids.shape[0]) for d in range(ids.shape[1])}
    for c in permutes:
        assert all(data_of[a] == data_of[b] and a != b for a, b in c.groups), c.groups
    per_branch = collections.Counter()
    for c in permutes:
        per_branch[c.computation] += c.bytes
    assert set(per_branch.values()) == {2 * 16 * 4}, per_branch
    _, distinct = gossip.matchings(replicas, 2, H, 32)
    assert len(per_branch) == len(distinct)


def test_wire_bytes_do_not_grow_with_r():
    reducer = co2jax.noloco(sync_every=H).reducer
    shapes = {"drift": jnp.zeros(100), "anchor": jnp.zeros(100)}
    assert {reducer.wire_bytes(shapes, r) for r in (2, 4, 8, 64)} == {800.0}


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_consensus_distance_grows_then_contracts():
    """Heterogeneous replicas in groups of 2 drift apart (the distance is > 0 after one
    round); with the inner steps switched off (lr 0) the gossip contracts it toward 0."""
    problem = tb.make_problem(replicas=8, examples=2, dim=16, seed=4)
    outer = co2jax.noloco(0.7, 0.5, 2, sync_every=H)
    params = harness.initial_params(problem)
    state = jax.vmap(outer.init)(params)
    sync = jax.jit(jax.vmap(outer.sync, axis_name="replica"))
    d, c = jnp.asarray(problem.d), jnp.asarray(problem.c)
    grad = jax.vmap(jax.grad(harness.loss_fn))
    distances = []
    for t in range(30):
        lr = LR if t < 6 else 0.0
        for _ in range(H):
            params = jax.tree.map(lambda p, g, lr=lr: p - lr * g, params, grad(params, d, c))
        params, state = sync(params, state)
        distances.append(float(co2jax.consensus_distance(params)))
    assert distances[0] > 1e-3
    assert distances[-1] < 1e-2 * max(distances[:6]), distances
    assert distances[-1] < distances[-6] < distances[-12], distances


def test_consensus_distance_of_equal_replicas_is_zero():
    x = {"a": jnp.ones((4, 3)), "b": jnp.arange(8.0).reshape(4, 2) * 0 + 2}
    assert float(co2jax.consensus_distance(x)) == 0.0
    y = {"a": jnp.array([[1.0], [3.0]])}  # mean 2, deviations +-1: sqrt(1) / 2
    np.testing.assert_allclose(co2jax.consensus_distance(y), 0.5)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(learning_rate=0.0, sync_every=4), "learning_rate"),
        (dict(momentum=1.0, sync_every=4), "momentum"),
        (dict(group_size=0, sync_every=4), "group_size"),
        (dict(sync_every=0), "sync_every"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        co2jax.noloco(**kwargs)


def test_group_size_must_divide_the_replicas():
    outer = co2jax.noloco(group_size=3, sync_every=1)
    state = jax.vmap(outer.init)(jnp.zeros((4, 1)))
    with pytest.raises(ValueError, match=r"group_size=3 must divide .* R=4"):
        jax.vmap(outer.sync, axis_name="replica")(jnp.ones((4, 1)), state)


def test_the_period_is_checked():
    outer = co2jax.noloco(sync_every=4)
    with pytest.raises(ValueError, match="sync_every=8 differs"):
        co2jax.local_updates(optax.sgd(0.1), outer, 8)


def test_separate_jobs_refuse_gossip_clearly():
    """The transfer service's exchange is an all-gather: gossip has no such form."""
    outer = co2jax.noloco(sync_every=4)
    peers = co2jax.Peers(("127.0.0.1:1", "127.0.0.1:2"), rank=0)
    with pytest.raises(ValueError, match=r"no gather form.*gossip"):
        co2jax.JobTrainer(harness.loss_fn, optax.sgd(0.1), outer, peers, 4)
