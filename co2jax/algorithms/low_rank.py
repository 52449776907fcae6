"""Low-rank pseudo-gradients with a warm start and error feedback around any outer optimizer.

Per replica, per transfer of the schedule and per matrix leaf (``co2jax.comm.lowrank``), at
the transfer's send step:

.. math::

    T = \\Delta + \\beta e, \\qquad (P, Q') = (\\operatorname{orth}(T Q), T^\\top P), \\qquad
    e \\leftarrow T - D(C(P))\\, D(C(Q'))^\\top, \\qquad Q \\leftarrow Q'

and the encoded ``(P, Q')`` cross the wire; the reducer averages ``P_r Q_r'^T`` over the
replicas (dense leaves: their values). ``C``/``D`` is the ``factors`` number format (float32
is exact), ``beta`` the residual's ``decay`` (1: classic error feedback; 0: none). ``Q`` and
``e`` are per replica, which is why this is a wrapper and not a reducer: the reducer alone
(:func:`co2jax.comm.all_gather_low_rank`) restarts from the fixed ``Q`` every round.

``Q`` starts as a fixed-seed Gaussian (:func:`co2jax.comm.lowrank.initial_factors`), the same
on every replica. Nothing in the mean needs it shared (each replica sends its own ``P`` and
``Q'``), but ``init`` is a function of the parameters only, as the protocol calls it (the
round engine vmaps it over replicas, a separate job calls it with no replica axis at all):
a per-replica key would have no index to come from, and with one seed every driver starts
from the same factors, so the SPMD engine and separate jobs give the same run.

A payload that is not finite leaves the replica's ``Q`` and residual as they were (its
encoding still decodes to NaN, so :func:`co2jax.skip_nonfinite` inside this wrapper skips the
step and the run recovers).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax._checks import check_int, check_unit_interval
from co2jax.axes import REPLICA
from co2jax.comm.lowrank import all_gather_low_rank, encode_factors, initial_factors
from co2jax.comm.reducer import Encoded
from co2jax.protocol import OuterOptimizer, Params, StateRoles, checked_roles, payload_shapes
from co2jax.tree import tree_all_finite, tree_select


@checked_roles
class LowRankState(NamedTuple):
    """State of :func:`low_rank`.

    Attributes:
      inner_state: the wrapped algorithm's state.
      factors: per transfer of the schedule, per factored leaf of its payload (in leaf
        order), the warm-start ``Q [n, r]`` (float32). Replica-varying.
      residuals: per transfer, what the factors have left out so far, shaped like that
        transfer's payload (float32). Replica-varying.
    """

    inner_state: Any
    factors: tuple[tuple[jax.Array, ...], ...]
    residuals: tuple[Any, ...]

    ROLES = StateRoles(replica_varying=("factors", "residuals"), wraps="inner_state")


def low_rank(
    outer: OuterOptimizer,
    rank: int,
    *,
    factors: str = "float32",
    decay: float = 1.0,
    block: int = 128,
    seed: int = 0,
    axis_name: str = REPLICA,
) -> OuterOptimizer:
    """``outer`` with its payloads sent as rank-``rank`` factors, warm-started, with error
    feedback (see the module docstring).

    ``outer``'s payload must be a pseudo-gradient pytree (DiLoCo and its delayed variants,
    Streaming DiLoCo, ...) and its reducer an exact mean: the wrapper puts
    :func:`co2jax.comm.all_gather_low_rank` in its place. The encoding cannot be cut into
    chunks: run it with ``spread=False`` (:class:`co2jax.RoundTrainer` spreads overlapped
    transfers by default on TPU, :func:`co2jax.local_updates` everywhere).

    Args:
      outer: the algorithm to wrap.
      rank: r (>= 1); a leaf for which r saves no elements is sent dense.
      factors: the factors' (and dense leaves') number format: ``"float32"``, ``"bf16"`` or
        ``"int4"``.
      decay: beta, the residual's decay, in [0, 1] (0: no error feedback).
      block: int4's elements per scale (even).
      seed: the seed of the first ``Q``.
      axis_name: the replica axis.

    Returns:
      An :class:`~co2jax.OuterOptimizer` with :class:`LowRankState`, ``outer``'s schedule and
      the all-gather of factors as its reducer.

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> outer = co2jax.low_rank(co2jax.diloco(optax.sgd(1.0)), rank=1)
      >>> params = {"w": jnp.zeros((2, 3, 4))}  # two replicas, one 3x4 matrix
      >>> state = jax.vmap(outer.init)(params)
      >>> delta = jnp.stack([jnp.eye(3, 4), 2 * jnp.eye(3, 4)])  # rank 3 each
      >>> params, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))({"w": -delta}, state)
      >>> int(jnp.linalg.matrix_rank(state.residuals[0]["w"][0]))  # rank 1 sent, 2 kept
      2

    References:
      PowerSGD, arXiv 1905.13133 (the warm-started power step and its error feedback).
    """
    if not isinstance(outer, OuterOptimizer):
        raise ValueError(f"outer must be a co2jax.OuterOptimizer, got outer={outer!r}")
    if not outer.reducer.exact:
        raise ValueError(
            "low_rank puts its own all-gather of factors in place of outer's reducer, which "
            f"must be an exact mean (the default); got outer.reducer={outer.reducer.name!r}"
        )
    reducer = all_gather_low_rank(rank, factors, block=block, seed=seed, axis_name=axis_name)
    decay = check_unit_interval("decay", decay, closed_right=True)
    seed = check_int("seed", seed, 0)

    def init(params: Params) -> LowRankState:
        inner = outer.init(params)
        qs, residuals = [], []
        for i in range(len(outer.schedule)):
            shapes = payload_shapes(outer, params, inner, i)
            qs.append(initial_factors(shapes, rank, seed))
            residuals.append(jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes))
        return LowRankState(inner, tuple(qs), tuple(residuals))

    def send(params: Params, state: LowRankState, i: int):
        payload, inner = outer.send(params, state.inner_state, i)
        old_e, old_q = state.residuals[i], state.factors[i]
        target = jax.tree.map(lambda x, e: x.astype(jnp.float32) + decay * e, payload, old_e)
        encoded, qs = encode_factors(target, old_q, rank, factors, block, axis_name)
        residual = jax.tree.map(lambda t, c: t - c, target, encoded.decode())
        finite = tree_all_finite(target)
        residual, qs = tree_select(finite, (residual, qs), (old_e, old_q))
        dtypes = tuple(str(jnp.dtype(x.dtype)) for x in jax.tree.leaves(payload))
        sent = Encoded(encoded.data, dataclasses.replace(encoded.form, dtypes=dtypes))
        new = LowRankState(
            inner,
            (*state.factors[:i], qs, *state.factors[i + 1 :]),
            (*state.residuals[:i], residual, *state.residuals[i + 1 :]),
        )
        return sent, new

    def apply(params: Params, state: LowRankState, i: int, reduced: Any):
        new_params, inner = outer.apply(params, state.inner_state, i, reduced)
        return new_params, state._replace(inner_state=inner)

    return outer._replace(init=init, send=send, apply=apply, reducer=reducer)


def carry_over(fresh: LowRankState, old: LowRankState) -> LowRankState:
    """The state of a rebuilt :func:`low_rank` optimizer (``fresh``, its ``init``) that
    continues ``old``'s run: ``old``'s wrapped state (anchor, outer momentum, pending
    pseudo-gradients) and residuals, and ``old``'s ``Q`` where its shapes still fit (the
    same rank), else ``fresh``'s (a changed rank restarts ``Q`` from its seed). The residual
    does not depend on the rank: what the old rank left out is sent by the new one.
    Works on one replica's state or on states with a leading replica axis alike.
    """
    layout = lambda t: (jax.tree.structure(t), [x.shape for x in jax.tree.leaves(t)])
    for name in ("inner_state", "residuals"):
        if layout(getattr(fresh, name)) != layout(getattr(old, name)):
            raise ValueError(
                f"carry_over: the rebuilt optimizer's {name} does not match the old state's "
                "(another algorithm or other parameters)"
            )
    shape = lambda qs: [q.shape for q in qs]
    qs = tuple(
        q_old if shape(q_old) == shape(q_new) else q_new
        for q_new, q_old in zip(fresh.factors, old.factors, strict=True)
    )
    return LowRankState(old.inner_state, qs, old.residuals)
