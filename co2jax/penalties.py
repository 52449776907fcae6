"""Staleness penalties for CO2: the multiplier ``Lambda_t`` on the stale averaged pseudo-gradient.

A penalty is a :class:`Penalty` (``init`` and ``update``) or any plain callable
``fn(anchor, previous_anchor, stale_delta) -> multiplier``, which :func:`stateless` wraps.
``update(anchor, previous_anchor, stale_delta, state) -> (multiplier, state)`` receives

- ``anchor``: ``theta^(t)``, the anchor the stale average is about to be applied to;
- ``previous_anchor``: ``theta^(t-1)``, the anchor the stale pseudo-gradients were computed
  from (CO2 derives it as ``theta^(t) + alpha * m_(t-1)``, so it costs no extra copy);
- ``stale_delta``: the stale averaged pseudo-gradient ``Delta-bar^(t-1)``;

and returns a multiplier: a scalar, or a pytree shaped like the parameters (element-wise).

Which is which:

- :func:`constant` is what the released CO2 code does: divide by a constant ``lam``
  (default 1, i.e. off). The CO2 paper's closed-form penalty could not be verified.
- :func:`gap_aware` is the element-wise gap penalty of Barkai et al. (arXiv 1909.10802).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax._checks import check_positive, check_unit_interval


class Penalty(NamedTuple):
    """A staleness penalty: ``init(params) -> state`` and
    ``update(anchor, previous_anchor, stale_delta, state) -> (multiplier, state)``.

    ``kind`` names the family (``"constant"``, ``"gap_aware"``, ``"custom"``); CO2's
    ``reference_code`` mode accepts only ``"constant"``. ``options`` records the family's
    hyper-parameters as ``(name, value)`` pairs, so the fused outer update can run it.
    """

    init: Callable[[Any], Any]
    update: Callable[[Any, Any, Any, Any], tuple[Any, Any]]
    kind: str = "custom"
    options: tuple[tuple[str, float], ...] = ()


class EmptyPenaltyState(NamedTuple):
    """State of a stateless penalty."""


def stateless(fn: Callable[[Any, Any, Any], Any]) -> Penalty:
    """Wraps ``fn(anchor, previous_anchor, stale_delta) -> multiplier`` as a :class:`Penalty`.

    Example:
      >>> import jax.numpy as jnp
      >>> p = stateless(lambda anchor, prev, delta: 0.5)
      >>> p.update(jnp.ones(2), jnp.ones(2), jnp.ones(2), p.init(jnp.ones(2)))
      (0.5, EmptyPenaltyState())
    """
    if not callable(fn):
        raise ValueError(f"penalty must be a Penalty or a callable, got penalty={fn!r}")

    def update(anchor, previous_anchor, stale_delta, state):
        return fn(anchor, previous_anchor, stale_delta), state

    return Penalty(lambda params: EmptyPenaltyState(), update, "custom")


def constant(lam: float = 1.0) -> Penalty:
    """The released CO2 code's penalty: ``Lambda = 1 / lam`` for every element.

    ``lam = 1`` (the released default) is no penalty at all.

    Example:
      >>> import jax.numpy as jnp
      >>> p = constant(2.0)
      >>> p.update(None, None, jnp.ones(3), p.init(jnp.ones(3)))[0]
      0.5
    """
    lam = check_positive("lam", lam)
    penalty = stateless(lambda anchor, previous_anchor, stale_delta: 1.0 / lam)
    return penalty._replace(kind="constant", options=(("lam", lam),))


class GapAwareState(NamedTuple):
    """State of :func:`gap_aware` (replica-invariant).

    Attributes:
      scale: the exponential moving average of ``|theta^(s) - theta^(s-1)|`` over past syncs,
        element-wise, shaped like the parameters (float32).
      count: 0-d int32, how many gaps the average has seen (for bias correction).
    """

    scale: Any
    count: jax.Array


def gap_aware(decay: float = 0.9, eps: float = 1e-12) -> Penalty:
    """The element-wise gap-aware penalty of Barkai et al. (arXiv 1909.10802).

    .. math::

        G = 1 + \\frac{|\\theta^{(t)} - \\theta^{(t-1)}|}{\\hat C_{t-1}}, \\qquad
        \\Lambda_t = 1 / G

    where ``C`` is an exponential moving average (``decay``) of the element-wise magnitude of
    past outer updates ``|theta^(s) - theta^(s-1)|``, bias-corrected as in Adam
    (``C-hat = C / (1 - decay**n)`` after n syncs), and taken *before* the current gap is
    added. Elements with no history (``C-hat <= eps``) get ``Lambda = 1``. A stale
    pseudo-gradient whose anchor moved by one typical step is halved; one that did not move
    is applied in full. The exact form used in the CO2 paper is unverified; this is the
    staleness-aware rule it cites.

    Args:
      decay: EMA decay of the update-magnitude average, in [0, 1).
      eps: magnitudes at or below this count as "no history".

    Example:
      >>> import jax.numpy as jnp
      >>> p = gap_aware(decay=0.5)
      >>> state = p.init(jnp.zeros(2))
      >>> lam, state = p.update(jnp.array([1.0, 1.0]), jnp.zeros(2), None, state)
      >>> lam  # no history yet
      Array([1., 1.], dtype=float32)
      >>> lam, state = p.update(jnp.array([2.0, 1.0]), jnp.array([1.0, 1.0]), None, state)
      >>> lam  # one typical step: 1 / (1 + 1/1); no step: 1
      Array([0.5, 1. ], dtype=float32)
    """
    decay = check_unit_interval("decay", decay)
    eps = check_positive("eps", eps)

    def init(params):
        scale = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
        return GapAwareState(scale, jnp.zeros([], jnp.int32))

    def update(anchor, previous_anchor, stale_delta, state):
        del stale_delta
        gap = jax.tree.map(
            lambda a, b: jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)),
            anchor,
            previous_anchor,
        )
        correction = 1.0 - decay ** state.count.astype(jnp.float32)
        safe = jnp.where(correction > 0, correction, 1.0)

        def multiplier(g, c):
            c_hat = jnp.where(correction > 0, c / safe, 0.0)
            return jnp.where(c_hat > eps, 1.0 / (1.0 + g / jnp.where(c_hat > eps, c_hat, 1.0)), 1.0)

        lam = jax.tree.map(multiplier, gap, state.scale)
        scale = jax.tree.map(lambda c, g: decay * c + (1.0 - decay) * g, state.scale, gap)
        return lam, GapAwareState(scale, state.count + 1)

    return Penalty(init, update, "gap_aware", (("decay", decay), ("eps", eps)))


def as_penalty(penalty: Penalty | Callable | None) -> Penalty | None:
    """Normalises CO2's ``penalty`` argument: ``None``, a :class:`Penalty`, or a callable."""
    if penalty is None or isinstance(penalty, Penalty):
        return penalty
    return stateless(penalty)
