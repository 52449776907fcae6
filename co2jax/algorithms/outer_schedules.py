"""Outer optimizers by name, with learning-rate and momentum schedules over outer steps, and SNOO.

An outer optax transform is stepped once per sync, so its ``count`` is the outer step ``s``
and an optax schedule of ``s`` is a schedule *by outer step*:

- learning rate: a linear warm-up from 0 over ``warmup`` outer steps, then ``"constant"``,
  ``"cosine"`` or ``"linear"`` decay from the peak ``eta`` to ``final * eta`` at outer step
  ``rounds``;
- momentum: a linear ramp from 0 to ``mu`` over ``warmup`` outer steps, then constant;
- ``"adam"``: ``optax.adam(eta, b1=mu, b2)`` as the outer optimizer (outer Adam).

:func:`outer_transform` returns the fusable :func:`co2jax.outer_sgd` when nothing is
scheduled (the fused kernel takes constants), else an ``optax.inject_hyperparams`` transform.
"""

from __future__ import annotations

from collections.abc import Callable

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


def momentum_schedule(momentum: float, warmup: int = 0) -> float | Callable:
    """The outer momentum by outer step: a linear ramp from 0 to ``momentum`` over ``warmup``
    outer steps, then constant (``momentum`` itself when ``warmup == 0``)."""
    momentum = check_unit_interval("momentum", momentum)
    warmup = check_int("momentum_warmup", warmup, 0)
    return optax.linear_schedule(0.0, momentum, warmup) if warmup else momentum


def outer_transform(
    optimizer: str = "sgd",
    learning_rate: float | Callable = 0.7,
    momentum: float | Callable = 0.9,
    *,
    nesterov: bool = True,
    b2: float = 0.99,
    eps: float = 1e-8,
    in_state: bool = False,
) -> optax.GradientTransformation:
    """The outer optax transform ``optimizer`` names, with constant or scheduled
    hyper-parameters (functions of the outer step).

    ``"sgd"``: ``optax.sgd(learning_rate, momentum, nesterov)`` (momentum 0: plain SGD);
    with constants this is :func:`co2jax.outer_sgd`, runnable by the fused kernel, unless
    ``in_state``: then the constants are values in the optimizer state
    (``optax.inject_hyperparams``), inputs of a compiled round rather than constants in it,
    so runs that differ only in them share one compiled program (the step is not fused).
    ``"adam"``: ``optax.adam(learning_rate, b1=momentum, b2=b2, eps=eps)``, its
    hyper-parameters always in its state.

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
    scheduled = callable(learning_rate) or callable(momentum)
    if optimizer == "adam":
        b2 = check_unit_interval("b2", b2)
        return optax.inject_hyperparams(optax.adam)(learning_rate, b1=momentum, b2=b2, eps=eps)
    if not scheduled and not in_state:
        m = momentum or None  # 0: plain SGD (Nesterov then means nothing)
        return outer_sgd(learning_rate, m, nesterov=nesterov and m is not None)

    def sgd(learning_rate, momentum):  # a trace even at momentum 0: a ramp starts there
        return optax.sgd(learning_rate, momentum=momentum, nesterov=nesterov)

    return optax.inject_hyperparams(sgd)(learning_rate, momentum)
