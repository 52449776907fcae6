"""Shared test helpers: the JAX side of the textbook problem, runners and HLO inspection."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from textbook import Problem

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


def _squeeze(tree):
    return jax.tree.map(lambda x: x[0], tree)


def _unsqueeze(tree):
    return jax.tree.map(lambda x: x[None], tree)


def shard_round(outer, inner, mesh, H):
    """A jitted shard_map'd round: H inner steps (grads averaged over "data"), then the sync.

    Per-replica state carries a leading replica axis sharded over "replica" (STYLE.md: params
    that enter replica-invariant would silently become data-parallel).
    """

    def body(params, inner_state, state, d, c):
        params, inner_state, state, d = map(_squeeze, (params, inner_state, state, d))
        c = c[0]  # [K/data, dim]

        def grad_fn(p):
            # Mark the data-invariant params varying over "data" so that grad gives this
            # shard's gradient; then average over the data shards explicitly.
            p = jax.lax.pcast(p, "data", to="varying")
            return jax.lax.pmean(jax.grad(loss_fn)(p, d, c), "data")

        params, inner_state = _inner_scan(inner, params, inner_state, grad_fn, H)
        params, state = outer.sync(params, state)
        return _unsqueeze(params), _unsqueeze(inner_state), _unsqueeze(state)

    rep = P("replica")
    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(rep, rep, rep, rep, P("replica", "data")),
            out_specs=(rep, rep, rep),
        )
    )


def place(tree, mesh, spec):
    return jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec)), tree)


def run_shard_map(outer, problem, lr, H, rounds, mesh, dtype=jnp.float32):
    inner = optax.sgd(lr)
    params = initial_params(problem, dtype)
    state = jax.vmap(outer.init)(params)
    inner_state = jax.vmap(inner.init)(params)
    rep = P("replica")
    params, state, inner_state = (place(x, mesh, rep) for x in (params, state, inner_state))
    d = place(jnp.asarray(problem.d, dtype), mesh, rep)
    c = place(jnp.asarray(problem.c, dtype), mesh, P("replica", "data"))
    round_fn = shard_round(outer, inner, mesh, H)
    out = []
    for _ in range(rounds):
        params, inner_state, state = round_fn(params, inner_state, state, d, c)
        out.append(np.asarray(flatten(params), np.float64))
    return np.stack(out), state


# ---------------------------------------------------------------------------------------------
# HLO inspection


def _groups(attr: str) -> list[tuple[int, ...]]:
    """Parses an HLO replica_groups attribute, explicit ({{0,2},{1,3}}) or iota ([2,2]<=[4])."""
    attr = attr.strip()
    if attr.startswith("{"):
        return [tuple(int(v) for v in g.split(",") if v) for g in re.findall(r"\{([\d,]*)\}", attr)]
    m = re.match(r"\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", attr)
    shape = [int(v) for v in m.group(1).split(",")]
    dims = [int(v) for v in m.group(2).split(",")]
    ids = np.arange(int(np.prod(dims))).reshape(dims)
    if m.group(3):
        ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    return [tuple(int(v) for v in row) for row in ids.reshape(shape)]


def collectives(hlo: str, op: str = "all-reduce") -> list[list[tuple[int, ...]]]:
    """The replica groups of every ``op`` instruction (start ops for async forms) in ``hlo``."""
    out = []
    pattern = re.compile(rf"^\s*(ROOT )?%\S+ = .*? {op}(-start)?\(")
    for line in hlo.splitlines():
        if pattern.search(line):
            m = re.search(
                r"replica_groups=(\{\{[\d,{}]*\}\}|\[[\d,]+\]<=\[[\d,]+\](T\([\d,]+\))?|\{\})", line
            )
            out.append(_groups(m.group(1)) if m and m.group(1) != "{}" else [])
    return out


def replica_axis_groups(mesh) -> set[tuple[int, ...]]:
    """Device-id groups that span the "replica" axis (one group per data index)."""
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    axis = mesh.axis_names.index("replica")
    moved = np.moveaxis(ids, axis, -1).reshape(-1, ids.shape[axis])
    return {tuple(sorted(int(v) for v in row)) for row in moved}


def count_replica_collectives(hlo: str, mesh, op: str = "all-reduce") -> int:
    """How many ``op`` instructions in ``hlo`` reduce over the replica axis."""
    want = replica_axis_groups(mesh)
    n = 0
    for groups in collectives(hlo, op):
        if {tuple(sorted(g)) for g in groups} == want:
            n += 1
    return n


def replica_reduced_elements(hlo: str, mesh, op: str = "all-reduce") -> int:
    """Total number of elements that ``op`` instructions reduce over the replica axis."""
    want = replica_axis_groups(mesh)
    pattern = re.compile(rf"^\s*(?:ROOT )?%\S+ = (.*?) {op}(?:-start)?\(")
    total = 0
    for line, groups in zip(
        [ln for ln in hlo.splitlines() if pattern.search(ln)], collectives(hlo, op), strict=True
    ):
        if {tuple(sorted(g)) for g in groups} != want:
            continue
        shape_text = pattern.search(line).group(1)
        for dims in re.findall(r"[a-z]+\d*\[([\d,]*)\]", shape_text):
            total += int(np.prod([int(v) for v in dims.split(",") if v] or [1]))
    return total
