"""Shared test helpers: the JAX side of the textbook problem, runners and HLO inspection."""

from __future__ import annotations

import contextlib
import socket
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from textbook import Problem

import co2jax
from co2jax import hlo as co2jax_hlo
from co2jax.algorithms import registry

# One tolerance table for the whole suite (STYLE.md): float32 1e-6-ish, bf16 1e-2.
TOL = {
    jnp.dtype(jnp.float32): dict(rtol=1e-5, atol=1e-6),
    jnp.dtype(jnp.bfloat16): dict(rtol=1e-2, atol=1e-2),
}

SPLIT = 2  # params {"b": theta[:2], "w": theta[2:]}: two leaves of different shapes


def unflatten(theta: jax.Array) -> dict:
    return {"b": theta[..., :SPLIT], "w": theta[..., SPLIT:]}


def flatten(params: dict) -> jax.Array:
    return jnp.concatenate([params["b"], params["w"]], axis=-1)


def loss_fn(params: dict, d: jax.Array, c: jax.Array) -> jax.Array:
    """One replica's (or one data shard's) loss: mean_k 0.5 * sum(d * (theta - c_k)**2)."""
    theta = flatten(params)
    return jnp.mean(0.5 * jnp.sum(d * (theta - c) ** 2, axis=-1))


def initial_params(problem: Problem, dtype=jnp.float32) -> dict:
    theta = jnp.broadcast_to(
        jnp.asarray(problem.theta0, dtype), (problem.replicas, problem.d.shape[1])
    )
    return unflatten(theta)


def _inner_scan(inner, params, inner_state, grad_fn, H):
    def step(carry, _):
        p, s = carry
        u, s = inner.update(grad_fn(p), s, p)
        return (optax.apply_updates(p, u), s), None

    (params, inner_state), _ = jax.lax.scan(step, (params, inner_state), None, length=H)
    return params, inner_state


# An algorithm of the optimizer's moments gets Adam inside, with DiLoCo's inner betas (0.9,
# 0.95): at b2 = 0.999 float32's 1 - b2^k loses ~5 digits on the first steps (rtol 1e-5 fails)
INNER = {
    "desloc": lambda lr: optax.adam(lr, b1=0.9, b2=0.95),
    "ddp[gpa]": lambda lr: co2jax.gpa(lr, mu_y=0.7, mu_x=0.8, b1=0.9, b2=0.95),
}
"""The inner optimizer of the shared tests by algorithm or variant (``optax.sgd`` for the
others)."""


def registered(name: str, problem: Problem, lr: float, H: int, **overrides):
    """``(outer, inner)`` of the registry's algorithm ``name`` as the shared tests build it:
    the config of ``textbook.REGISTERED`` (plus ``overrides``), plain SGD inside (or
    :data:`INNER`'s)."""
    from textbook import REGISTERED, VARIANTS

    algorithm, fields = VARIANTS[name][:2] if name in VARIANTS else (name, REGISTERED[name][0])
    settings = registry.settings(algorithm, **{**fields, **overrides})
    settings.validate(registry.Bounds(sync_every=H))
    params = jax.tree.map(lambda x: x[0], initial_params(problem))
    context = registry.Context(H, params, lr, num_replicas=problem.replicas)
    transform = INNER.get(name, INNER.get(algorithm, optax.sgd))(lr)
    inner, outer = settings.optimizers(context, transform)
    return outer, inner


def syncs_per_round(outer) -> bool:
    """``outer.sync`` is its round-level form (no transfer applied during the round)."""
    return all(t.apply is None and t.send in (None, 0) for t in outer.schedule)


def run_vmap(
    outer, problem: Problem, lr: float, H: int, rounds: int, dtype=jnp.float32, inner=None
):
    """Simulates R replicas with jax.vmap(axis_name="replica"): [rounds, R, dim] anchors.

    ``inner`` defaults to ``optax.sgd(lr)``.
    """
    inner = optax.sgd(lr) if inner is None else inner
    params = initial_params(problem, dtype)
    state = jax.vmap(outer.init)(params)
    inner_state = jax.vmap(inner.init)(params)
    d, c = jnp.asarray(problem.d, dtype), jnp.asarray(problem.c, dtype)

    def replica(params, inner_state, state, d, c):
        params, inner_state = _inner_scan(
            inner, params, inner_state, lambda p: jax.grad(loss_fn)(p, d, c), H
        )
        params, state = outer.sync(params, state)
        return params, inner_state, state

    round_fn = jax.jit(jax.vmap(replica, axis_name="replica"))
    out = []
    for _ in range(rounds):
        params, inner_state, state = round_fn(params, inner_state, state, d, c)
        out.append(np.asarray(flatten(params), np.float64))
    return np.stack(out), state


def make_mesh(replica=4, data=2, axis_type=AxisType.Explicit):
    if len(jax.devices("cpu")) < replica * data:
        import pytest

        pytest.skip(f"needs {replica * data} CPU devices")
    return jax.make_mesh(
        (replica, data),
        ("replica", "data"),
        axis_types=(axis_type,) * 2,
        devices=jax.devices("cpu")[: replica * data],
    )


def shard_round(outer, inner, mesh, H, check_vma=True):
    """A jitted round mapped by hand over "replica" only (``co2jax.mesh.replica_map``): H
    inner steps on the replica's whole batch (the compiler averages the gradients over
    "data"), then the sync.

    Per-replica state carries a leading replica axis sharded over "replica" (STYLE.md: params
    that enter replica-invariant would silently become data-parallel).
    """

    def body_once(params, inner_state, state, d, c):
        grad_fn = lambda p: jax.grad(loss_fn)(p, d, c)
        params, inner_state = _inner_scan(inner, params, inner_state, grad_fn, H)
        params, state = outer.sync(params, state)
        return params, inner_state, state

    return jax.jit(co2jax.mesh.replica_map(body_once, mesh, check_vma=check_vma))


def place(tree, mesh, spec):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), tree)


def place_mapped(tree, mesh, spec):
    """``tree`` on ``mesh`` as ``replica_map``'s results lie (its data and model axes Auto:
    ``co2jax.mesh.compiler_sharded``), so a second call of a mapped step or round runs the
    program the first one compiled."""
    return place(tree, co2jax.mesh.compiler_sharded(mesh), spec)


def run_shard_map(
    outer, problem, lr, H, rounds, mesh, dtype=jnp.float32, check_vma=True, inner=None
):
    inner = optax.sgd(lr) if inner is None else inner
    params = initial_params(problem, dtype)
    state = jax.vmap(outer.init)(params)
    inner_state = jax.vmap(inner.init)(params)
    rep = P("replica")
    params, state, inner_state = (place_mapped(x, mesh, rep) for x in (params, state, inner_state))
    d = place_mapped(jnp.asarray(problem.d, dtype), mesh, rep)
    c = place_mapped(jnp.asarray(problem.c, dtype), mesh, P("replica", "data"))
    round_fn = shard_round(outer, inner, mesh, H, check_vma)
    out = []
    for _ in range(rounds):
        params, inner_state, state = round_fn(params, inner_state, state, d, c)
        out.append(np.asarray(flatten(params), np.float64))
    return np.stack(out), state


# ---------------------------------------------------------------------------------------------
# HLO inspection, through co2jax.hlo


def count_replica_collectives(hlo: str, mesh, op: str = "all-reduce") -> int:
    """How many ``op`` instructions in ``hlo`` run over the replica axis."""
    return sum(
        c.op == op for c in co2jax_hlo.over_axis(co2jax_hlo.collectives(hlo), mesh, "replica")
    )


def replica_reduced_elements(hlo: str, mesh, op: str = "all-reduce") -> int:
    """Total number of elements that ``op`` instructions reduce over the replica axis."""
    found = co2jax_hlo.over_axis(co2jax_hlo.collectives(hlo), mesh, "replica")
    return sum(c.elements for c in found if c.op == op)


def shard_step(tx, mesh, check_vma=True):
    """A jitted optax step on the textbook problem, mapped by hand over "replica" only: each
    replica's whole batch (the compiler averages the gradients over "data")."""

    def body(params, state, d, c):
        updates, state = tx.update(jax.grad(loss_fn)(params, d, c), state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(co2jax.mesh.replica_map(body, mesh, check_vma=check_vma))


def shard_step_args(tx, problem: Problem, mesh):
    """Placed (params, state, d, c) for :func:`shard_step`, every replica at theta0."""
    rep = P("replica")
    params = initial_params(problem)
    state = place_mapped(jax.vmap(tx.init)(params), mesh, rep)
    return (
        place_mapped(params, mesh, rep),
        state,
        place_mapped(jnp.asarray(problem.d), mesh, rep),
        place_mapped(jnp.asarray(problem.c), mesh, P("replica", "data")),
    )


def vmap_step(tx):
    """A jitted, vmap-simulated optax step of every replica on the textbook problem."""

    def step(params, state, d, c):
        updates, state = tx.update(jax.grad(loss_fn)(params, d, c), state, params)
        return optax.apply_updates(params, updates), state

    return jax.jit(jax.vmap(step, axis_name="replica"))


def run_vmap_steps(tx, problem: Problem, steps: int, every: int, dtype=jnp.float32):
    """``steps`` per-step updates from theta0; the parameters after every ``every``-th step
    ([steps // every, R, dim]), the jitted step (to inspect its compilations) and the last
    state."""
    params = initial_params(problem, dtype)
    state = jax.vmap(tx.init)(params)
    d, c = jnp.asarray(problem.d, dtype), jnp.asarray(problem.c, dtype)
    step = vmap_step(tx)
    out = []
    for i in range(steps):
        params, state = step(params, state, d, c)
        if (i + 1) % every == 0:
            out.append(np.asarray(flatten(params), np.float64))
    return np.stack(out), step, state


def run_rounds(outer, problem, lr, H, rounds, dtype=jnp.float32, inner=None):
    """Under vmap: round-level syncs where the schedule allows, else the per-step adapter.
    Returns the trajectory [rounds, R, dim] and the outer state."""
    inner = optax.sgd(lr) if inner is None else inner
    if syncs_per_round(outer):
        return run_vmap(outer, problem, lr, H, rounds, dtype, inner)
    tx = co2jax.local_updates(inner, outer, H)
    got, _, state = run_vmap_steps(tx, problem, rounds * H, H, dtype)
    return got, state.outer_state


def run_adapter(outer, inner, problem: Problem, H: int, rounds: int, mesh=None) -> np.ndarray:
    """``local_updates(inner, outer, H)`` for ``rounds`` rounds under vmap, or on ``mesh``
    (a (replica, data) mesh): every replica's parameters at the end of each round."""
    tx = co2jax.local_updates(inner, outer, H)
    if mesh is None:
        return run_vmap_steps(tx, problem, rounds * H, H)[0]
    args = shard_step_args(tx, problem, mesh)
    step = shard_step(tx, mesh)
    out = []
    for i in range(rounds * H):
        args = (*step(*args), *args[2:])
        if (i + 1) % H == 0:
            out.append(np.asarray(flatten(args[0]), np.float64))
    return np.stack(out)


def ephemeral_low() -> int:
    """The first port the kernel hands out for outgoing connections (32768 if unknown)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_blocks(count: int, width: int, seed: int | None = None) -> list[int]:
    """``count`` ports p with p .. p + width - 1 all free (a block per job, e.g. one port for
    each algorithm a worker runs), below the ephemeral range: a worker binds a port some time
    after it was found free, and meanwhile an outgoing connection's port is drawn from the
    ephemeral range (a block inside it was taken that way in CI: "bind: Address already in
    use")."""
    rng = np.random.default_rng(seed)
    high = ephemeral_low() - width
    found: list[int] = []
    taken: set[int] = set()
    for _ in range(10_000):
        if len(found) == count:
            return found
        port = int(rng.integers(10_000, high))
        block = set(range(port, port + width))
        if block & taken:
            continue
        try:
            with contextlib.ExitStack() as stack:
                for q in block:
                    sock = stack.enter_context(socket.socket())
                    sock.bind(("127.0.0.1", q))
        except OSError:
            continue
        found.append(port)
        taken |= block
    raise RuntimeError(f"no {count} free blocks of {width} ports below {high + width}")
