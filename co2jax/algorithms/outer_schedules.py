"""Outer optimizers by name, with learning-rate and momentum schedules over outer steps, and SNOO.

An outer optax transform is stepped once per sync, so its ``count`` is the outer step ``s``
and an optax schedule of ``s`` is a schedule *by outer step*:

- learning rate: a linear warm-up from 0 over ``warmup`` outer steps, then ``"constant"``,
  ``"cosine"`` or ``"linear"`` decay from the peak ``eta`` to ``final * eta`` at outer step
  ``rounds``;
- momentum: a linear ramp from 0 to ``mu`` over ``warmup`` outer steps, then constant, and
  optionally a linear decay to ``final`` over the last ``decay`` outer steps before outer
  step ``rounds`` (momentum warm-up and decay);
- momentum restarts: the momentum buffer zeroed before every ``every``-th outer step
  (:func:`restart_momentum`);
- ``"adam"``: ``optax.adam(eta, b1=mu, b2)`` as the outer optimizer (outer Adam).

:func:`outer_transform` returns the fusable :func:`co2jax.outer_sgd` when nothing is
scheduled (the fused kernel takes constants), else an ``optax.inject_hyperparams`` transform.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._checks import check_choice, check_int, check_positive, check_unit_interval
from co2jax.algorithms.fused import outer_sgd

OPTIMIZERS = ("sgd", "adam")
LR_SCHEDULES = ("constant", "cosine", "linear")


def learning_rate_schedule(
    peak: float,
    kind: str = "constant",
    *,
    warmup: int = 0,
    rounds: int | None = None,
    final: float = 0.0,
) -> float | Callable:
    """The outer learning rate by outer step: ``peak`` itself when constant with no warm-up,
    else an optax schedule (warm-up from 0 over ``warmup`` steps, then the decay ``kind``
    reaching ``final * peak`` at outer step ``rounds``).

    Example:
      >>> lr = learning_rate_schedule(0.8, "cosine", warmup=2, rounds=6, final=0.25)
      >>> [round(float(lr(s)), 3) for s in range(7)]
      [0.0, 0.4, 0.8, 0.71, 0.5, 0.29, 0.2]
    """
    peak = check_positive("learning_rate", peak)
    check_choice("lr_schedule", kind, LR_SCHEDULES)
    warmup = check_int("lr_warmup", warmup, 0)
    final = check_unit_interval("lr_final", final, closed_right=True)
    if kind == "constant":
        if not warmup:
            return peak
        return optax.join_schedules(
            [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup]
        )
    if rounds is None:
        raise ValueError(f"lr_schedule={kind!r} decays to outer step `rounds`: give rounds")
    rounds = check_int("rounds", rounds, 1)
    if warmup >= rounds:
        raise ValueError(f"lr_warmup={warmup} must be < rounds={rounds}")
    decay = (
        optax.cosine_decay_schedule(peak, rounds - warmup, alpha=final)
        if kind == "cosine"
        else optax.linear_schedule(peak, final * peak, rounds - warmup)
    )
    if not warmup:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def momentum_schedule(
    momentum: float,
    warmup: int = 0,
    *,
    decay: int = 0,
    final: float = 0.0,
    rounds: int | None = None,
) -> float | Callable:
    """The outer momentum by outer step s: a linear ramp from 0 to ``momentum`` over
    ``warmup`` outer steps, then ``momentum``, then (``decay`` > 0) linear from
    ``momentum`` at outer step ``rounds - decay`` to ``final`` at outer step ``rounds`` (the
    learning-rate decay's convention); ``momentum`` itself when nothing is scheduled.

    .. math::

        \\mu_s = \\mu \\min(s / W, 1) \\;(s < R - D), \\qquad
        \\mu_s = \\mu + (\\mu_{final} - \\mu) \\frac{s - (R - D)}{D} \\;(s \\ge R - D)

    Momentum warm-up and decay are Pier's (arXiv 2511.17849); its formulas are not public,
    so the linear shapes and the lengths are parameters here, not the paper's values.

    Example:
      >>> mu = momentum_schedule(0.9, warmup=2, decay=2, final=0.5, rounds=6)
      >>> [round(float(mu(s)), 3) for s in range(7)]
      [0.0, 0.45, 0.9, 0.9, 0.9, 0.7, 0.5]
    """
    momentum = check_unit_interval("momentum", momentum)
    warmup = check_int("momentum_warmup", warmup, 0)
    decay = check_int("momentum_decay", decay, 0)
    final = check_unit_interval("momentum_final", final)
    if not decay:
        return optax.linear_schedule(0.0, momentum, warmup) if warmup else momentum
    if rounds is None:
        raise ValueError(f"momentum_decay={decay} ends at outer step `rounds`: give rounds")
    rounds = check_int("rounds", rounds, 1)
    if warmup + decay > rounds:
        raise ValueError(
            f"momentum_warmup={warmup} + momentum_decay={decay} must be <= rounds={rounds}"
        )
    pieces = [optax.constant_schedule(momentum), optax.linear_schedule(momentum, final, decay)]
    boundaries = [rounds - decay]
    if warmup:
        pieces.insert(0, optax.linear_schedule(0.0, momentum, warmup))
        boundaries.insert(0, warmup)
    return optax.join_schedules(pieces, boundaries)


def keep_state_dtypes(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` whose state keeps the dtypes ``init`` gave it. A hyper-parameter held in the
    state is a float32 value, and ``mu * b + g`` with it promotes a bfloat16 momentum buffer
    to float32: a round's carry would then change type (and a bf16 run hold float32 state).

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = keep_state_dtypes(optax.inject_hyperparams(optax.sgd)(0.1, momentum=0.9))
      >>> p = jnp.zeros(2, jnp.bfloat16)
      >>> _, state = tx.update(jnp.ones(2, jnp.bfloat16), tx.init(p), p)
      >>> state.inner_state[0].trace.dtype
      dtype(bfloat16)
    """

    def update(updates, state, params=None):
        updates, new = tx.update(updates, state, params)
        return updates, jax.tree.map(lambda n, o: n.astype(o.dtype), new, state)

    return optax.GradientTransformation(tx.init, update)


class RestartState(NamedTuple):
    """State of :func:`restart_momentum`: the wrapped transform's state and the outer step
    (0-d int32)."""

    inner_state: optax.OptState
    count: jax.Array


def restart_momentum(tx: optax.GradientTransformation, every: int) -> optax.GradientTransformation:
    """``tx`` whose momentum buffers (every ``optax.TraceState`` in its state: optax's SGD
    momentum, Nesterov included) are zeroed before outer step s whenever s > 0 and
    s % ``every`` == 0: momentum restarts (arXiv 2605.28585). Restarting every step is SGD
    at ``(1 + mu)`` times the learning rate for Nesterov momentum.

    .. math::

        b \\leftarrow 0 \\text{ if } s > 0 \\text{ and } s \\bmod S = 0; \\qquad
        b \\leftarrow \\mu b + g; \\qquad \\theta \\leftarrow \\theta - \\eta (g + \\mu b)

    Example:
      >>> import jax.numpy as jnp, optax
      >>> tx = restart_momentum(optax.sgd(1.0, momentum=0.5, nesterov=True), every=1)
      >>> state = tx.init(jnp.zeros(1))
      >>> u0, state = tx.update(jnp.ones(1), state)
      >>> u1, state = tx.update(jnp.ones(1), state)
      >>> float(u0[0]), float(u1[0])  # (1 + mu) g at every step (without: -1.5, -1.75)
      (-1.5, -1.5)
    """
    every = check_int("momentum_restart", every, 1)

    def init(params):
        return RestartState(tx.init(params), jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        restart = (state.count > 0) & (state.count % every == 0)

        def zeroed(x):
            if isinstance(x, optax.TraceState):
                trace = jax.tree.map(lambda t: jnp.where(restart, jnp.zeros_like(t), t), x.trace)
                return optax.TraceState(trace=trace)
            return x

        is_trace = lambda x: isinstance(x, optax.TraceState)
        inner = jax.tree.map(zeroed, state.inner_state, is_leaf=is_trace)
        updates, inner = tx.update(updates, inner, params)
        return updates, RestartState(inner, state.count + 1)

    return optax.GradientTransformation(init, update)


def outer_transform(
    optimizer: str = "sgd",
    learning_rate: float | Callable = 0.7,
    momentum: float | Callable = 0.9,
    *,
    nesterov: bool = True,
    b2: float = 0.99,
    eps: float = 1e-8,
    in_state: bool = False,
    restart_every: int = 0,
) -> optax.GradientTransformation:
    """The outer optax transform ``optimizer`` names, with constant or scheduled
    hyper-parameters (functions of the outer step).

    ``"sgd"``: ``optax.sgd(learning_rate, momentum, nesterov)`` (momentum 0: plain SGD);
    with constants this is :func:`co2jax.outer_sgd`, runnable by the fused kernel, unless
    ``in_state``: then the constants are values in the optimizer state
    (``optax.inject_hyperparams``), inputs of a compiled round rather than constants in it,
    so runs that differ only in them share one compiled program (the step is not fused).
    ``"adam"``: ``optax.adam(learning_rate, b1=momentum, b2=b2, eps=eps)``, its
    hyper-parameters always in its state. ``restart_every`` (``"sgd"`` with momentum):
    :func:`restart_momentum` around it (not fused).

    Example:
      >>> import jax.numpy as jnp
      >>> tx = outer_transform("sgd", learning_rate_schedule(1.0, warmup=2), 0.0)
      >>> state = tx.init(jnp.zeros(1))
      >>> u0, state = tx.update(jnp.ones(1), state)
      >>> u1, state = tx.update(jnp.ones(1), state)
      >>> float(u0[0]), float(u1[0])  # lr 0 then 0.5 during the warm-up
      (-0.0, -0.5)
    """
    check_choice("optimizer", optimizer, OPTIMIZERS)
    restart_every = check_int("momentum_restart", restart_every, 0)
    scheduled = callable(learning_rate) or callable(momentum) or bool(restart_every)
    if restart_every and (optimizer != "sgd" or momentum == 0):
        raise ValueError(
            f"momentum_restart={restart_every} restarts SGD's momentum: needs optimizer 'sgd' "
            f"with momentum > 0, got optimizer={optimizer!r}, momentum={momentum!r}"
        )
    if optimizer == "adam":
        b2 = check_unit_interval("b2", b2)
        adam = optax.inject_hyperparams(optax.adam)(learning_rate, b1=momentum, b2=b2, eps=eps)
        return keep_state_dtypes(adam)
    if not scheduled and not in_state:
        m = momentum or None  # 0: plain SGD (Nesterov then means nothing)
        return outer_sgd(learning_rate, m, nesterov=nesterov and m is not None)

    def sgd(learning_rate, momentum):  # a trace even at momentum 0: a ramp starts there
        return optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)

    tx = keep_state_dtypes(optax.inject_hyperparams(sgd)(learning_rate, momentum))
    return restart_momentum(tx, restart_every) if restart_every else tx
