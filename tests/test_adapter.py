"""The per-step adapter: equal to round-level syncs, compiles once, works in nnx.Optimizer."""

from __future__ import annotations

import harness
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import textbook as tb
from flax import nnx
from test_algorithms import CASES, IDS

import co2jax
from co2jax.comm import chunks

LR, H, ROUNDS = 0.05, 3, 4
TOL = harness.TOL[jnp.dtype(jnp.float32)]


@pytest.fixture(scope="module")
def problem():
    return tb.make_problem(replicas=4, examples=2, seed=4)


def _adapter_run(tx, problem, steps):
    return harness.run_vmap_steps(tx, problem, steps, every=H)[:2]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.cases("first", 3)
def test_adapter_equals_round_sync(case, problem):
    """Adam inner state persists across syncs in both; the trajectories must agree."""
    round_level, _ = harness.run_vmap(case.make(), problem, LR, H, ROUNDS, inner=optax.adam(LR))
    tx = co2jax.local_updates(optax.adam(LR), case.make(), sync_every=H)
    per_step, step = _adapter_run(tx, problem, ROUNDS * H)
    np.testing.assert_allclose(per_step, round_level, **TOL)
    assert step._cache_size() == 1  # sync and non-sync steps share one compiled program


def test_adapter_sgd_matches_textbook(problem):
    tx = co2jax.local_updates(optax.sgd(LR), co2jax.co2(1.0, 0.5, clip_threshold=0.1), H)
    got, _ = _adapter_run(tx, problem, ROUNDS * H)
    expected = tb.co2_paper(problem, LR, H, ROUNDS, alpha=1.0, beta=0.5, phi=0.1)
    np.testing.assert_allclose(got, expected, **TOL)


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_state_types_identical_on_sync_and_non_sync_steps(problem):
    tx = co2jax.local_updates(optax.adam(LR), co2jax.co2(1.0, 0.5), sync_every=2)
    params = harness.initial_params(problem)
    state = jax.vmap(tx.init)(params)
    step = jax.vmap(tx.update, axis_name="replica")
    grads = jax.tree.map(jnp.ones_like, params)
    types = lambda s: jax.tree.map(lambda x: (x.shape, x.dtype), s)
    _, s1 = step(grads, state, params)  # non-sync
    _, s2 = step(grads, s1, params)  # sync
    assert jax.tree.structure(s1) == jax.tree.structure(s2) == jax.tree.structure(state)
    assert types(s1) == types(s2) == types(state)


def test_adapter_under_shard_map_syncs_only_in_the_taken_branch(problem):
    """Under shard_map the sync's collective sits inside the conditional's branch."""
    mesh = harness.make_mesh(replica=4, data=2)
    tx = co2jax.local_updates(optax.sgd(LR), co2jax.diloco(optax.sgd(0.7, momentum=0.9)), H)
    params, state, d, c = harness.shard_step_args(tx, problem, mesh)
    step = harness.shard_step(tx, mesh)
    got = []
    for i in range(ROUNDS * H):
        params, state = step(params, state, d, c)
        if (i + 1) % H == 0:
            got.append(np.asarray(harness.flatten(params)))
    expected, _ = harness.run_vmap(
        co2jax.diloco(optax.sgd(0.7, momentum=0.9)), problem, LR, H, ROUNDS
    )
    np.testing.assert_allclose(np.stack(got), expected, **TOL)

    hlo = step.lower(params, state, d, c).compile().as_text()
    entry = hlo[hlo.index("ENTRY") :]
    assert "conditional(" in entry
    assert harness.count_replica_collectives(entry.split("\n}\n")[0], mesh) == 0
    assert harness.count_replica_collectives(hlo, mesh) >= 1


class _MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(3, 8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.tanh(self.hidden(x)))


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_works_inside_nnx_optimizer():
    """Two replicas of a flax model, each with an nnx.Optimizer, vmapped over "replica"."""
    R, sync_every, steps = 2, 2, 6
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(R, 16, 3)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(R, 16, 1)), jnp.float32)
    make_tx = lambda: co2jax.local_updates(optax.adam(1e-2), co2jax.local_sgd(), sync_every)

    model = _MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, make_tx(), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    states = jax.tree.map(lambda a: jnp.stack([a] * R), state)

    def loss(model, x, y):
        return jnp.mean((model(x) - y) ** 2)

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        grads = nnx.grad(loss)(model, x, y)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer))

    step = jax.jit(jax.vmap(step, axis_name="replica"))
    for _ in range(steps):
        states = step(states, x, y)
    nnx_params = nnx.state(nnx.merge(graphdef, states)[0], nnx.Param)

    # The same run on the plain pytree of parameters.
    params = jax.tree.map(lambda a: jnp.stack([a] * R), nnx.state(_MLP(nnx.Rngs(0)), nnx.Param))
    tx = make_tx()
    opt_state = jax.vmap(tx.init)(params)

    def plain_step(params, opt_state, x, y):
        def f(p):
            return loss(nnx.merge(nnx.graphdef(_MLP(nnx.Rngs(0))), p), x, y)

        updates, opt_state = tx.update(jax.grad(f)(params), opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    plain_step = jax.jit(jax.vmap(plain_step, axis_name="replica"))
    for _ in range(steps):
        params, opt_state = plain_step(params, opt_state, x, y)

    for a, b in zip(jax.tree.leaves(nnx_params), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(a, b, **TOL)
    # after the last sync (step 6) the replicas agree
    for a in jax.tree.leaves(nnx_params):
        np.testing.assert_allclose(a[0], a[1], **TOL)


# ---------------------------------------------------------------------------------------------
# spreading a delayed reduction over the round's steps

DELAYED = [c for c in CASES if c.make().overlapped]
DELAYED_IDS = [c.name for c in DELAYED]


@pytest.mark.parametrize("sync_every", [3, 4])
@pytest.mark.parametrize("case", DELAYED, ids=DELAYED_IDS)
@pytest.mark.cases("each")
def test_spread_equals_unspread(case, sync_every, problem):
    """H=4 > the leaf sizes, so chunks are zero-padded (leaf "b" has 2 elements in 4
    chunks of 1)."""
    runs, reduced, expected = [], None, None
    for spread in (True, False):
        outer = case.make()
        tx = co2jax.local_updates(optax.adam(LR), outer, sync_every, spread=spread)
        params = harness.initial_params(problem)
        state = jax.vmap(tx.init)(params)
        d, c = jnp.asarray(problem.d), jnp.asarray(problem.c)

        step = harness.vmap_step(tx)
        for i in range(ROUNDS * sync_every):
            if spread and i == 2 * sync_every:  # the start of round 2: the payload is known
                send = jax.vmap(lambda p, s, o=outer: o.send(p, s, 0)[0])
                payload = send(params, state.outer_state)
                expected = jax.vmap(outer.reduce, axis_name="replica")(payload)
            params, state = step(params, state, d, c)
            if spread and i == 3 * sync_every - 1:  # what the sync of round 2 applied
                plan = chunks.plan(jax.tree.map(lambda x: x[0], payload), outer.reducer, sync_every)
                reduced = jax.vmap(lambda w, p=plan: chunks.finish(p, w))(state.inflight[0].wire)
        runs.append(np.asarray(harness.flatten(params)))
    # the assembled reduction is exactly the unchunked one
    for a, b in zip(jax.tree.leaves(reduced), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)
    # the trajectories are two different compiled programs: XLA may contract the outer
    # update's arithmetic differently (FMA), so allow one float32 ulp
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-6, atol=1e-7)


def _run_shard_step(tx, problem, mesh, steps):
    args = harness.shard_step_args(tx, problem, mesh)
    step = harness.shard_step(tx, mesh)
    for _ in range(steps):
        args = (*step(*args), *args[2:])
    return np.asarray(harness.flatten(args[0])), step, args


@pytest.mark.parametrize("kind", ["pmean", "all_gather", "ring"])
@pytest.mark.cases("first", 2)
def test_spread_under_shard_map(kind, problem):
    mesh = harness.make_mesh(replica=4, data=2)
    reduce = co2jax.comm.exact_mean(kind)
    outer = lambda: co2jax.co2(1.0, 0.5, clip_threshold=0.1)
    spread = co2jax.local_updates(optax.sgd(LR), outer(), H, spread=True, reduce=reduce)
    plain = co2jax.local_updates(optax.sgd(LR), outer(), H, spread=False)
    got, step, args = _run_shard_step(spread, problem, mesh, ROUNDS * H)
    want, *_ = _run_shard_step(plain, problem, mesh, ROUNDS * H)
    if kind == "ring":  # the ring sums each chunk in its own order
        np.testing.assert_allclose(got, want, **TOL)
    else:
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(
        got, tb.co2_paper(problem, LR, H, ROUNDS, alpha=1.0, beta=0.5, phi=0.1)[-1], **TOL
    )

    # every step reduces 1/H of the payload, outside the sync branch, before the gradients
    n, k = co2jax.overlap.collectives_depending_on(step, *args, argnums=(0, 2, 3))
    assert n >= 1 and k == 0, (n, k)
    if kind == "pmean":
        text = step.lower(*args).compile().as_text()
        found = co2jax.hlo.over_axis(co2jax.hlo.collectives(text), mesh, "replica")
        branches = co2jax.hlo.conditional_computations(text)
        assert found and all(c.computation not in branches for c in found)
        assert sum(c.elements for c in found) == 1 + 1  # ceil(2/3) + ceil(3/3)


def test_unspread_sync_waits_for_the_gradients(problem):
    """The checker can fail: without spreading, the sync's reduction needs this step's params."""
    mesh = harness.make_mesh(replica=4, data=2)
    tx = co2jax.local_updates(optax.sgd(LR), co2jax.diloco(optax.sgd(0.7)), H)
    _, step, args = _run_shard_step(tx, problem, mesh, 1)
    n, k = co2jax.overlap.collectives_depending_on(step, *args, argnums=(0, 2, 3))
    assert n >= 1 and k == n


def test_spread_needs_a_delayed_algorithm():
    with pytest.raises(ValueError, match="spread=True needs a transfer sent before"):
        co2jax.local_updates(optax.sgd(LR), co2jax.local_sgd(), H, spread=True)


@pytest.mark.parametrize("name", co2jax.registry.NAMES)
@pytest.mark.cases("algorithms", 6)
def test_a_step_that_donates_params_and_state_runs(name):
    """``jax.jit(step, donate_argnums=(0, 1))``, optax's usual pattern: the adapter's state
    holds no buffer of the parameters (an anchor is its own copy), so nothing is donated
    twice (XLA refuses that on every backend)."""
    problem = tb.make_problem(replicas=2, examples=2, dim=5, seed=1)
    outer, inner = harness.registered(name, problem, LR, tb.REGISTERED_H)
    tx = co2jax.local_updates(inner, outer, sync_every=tb.REGISTERED_H)
    params = harness.initial_params(problem)  # two replicas, stacked
    state = jax.vmap(tx.init, axis_name=co2jax.REPLICA)(params)
    mine = {x.unsafe_buffer_pointer() for x in jax.tree.leaves(params)}
    assert not mine & {x.unsafe_buffer_pointer() for x in jax.tree.leaves(state)}

    def one(params, state):
        updates, state = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
        return optax.apply_updates(params, updates), state

    donated = jax.jit(jax.vmap(one, axis_name=co2jax.REPLICA), donate_argnums=(0, 1))
    for _ in range(tb.REGISTERED_H + 1):  # through a sync
        params, state = donated(params, state)
    assert np.isfinite(harness.flatten(params)).all()
