"""What the training driver reads off a round's state for its records: CO2's clipped
fraction and penalty scale, the outer guard's skipped rounds, and the consensus distance."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

import co2jax


def clip_fraction(state, threshold: float | None) -> float | None:
    """Fraction of CO2 momentum elements at the clip bound."""
    if threshold is None:
        return None

    inner = getattr(state.outer_state, "inner_state", state.outer_state)
    momentum = getattr(getattr(inner, "outer_state", None), "momentum", None)
    if momentum is None:
        return None
    return float(_at_bound()(momentum, threshold * (1 - 1e-6)))


@functools.cache
def consensus():
    """The jitted consensus distance (one program per state shapes, kept between runs)."""
    return jax.jit(co2jax.consensus_distance)


@functools.cache
def _at_bound():
    """A jitted fraction of elements with |m| >= bound, computed on device: the momentum is
    parameter-sized and stays where it is."""

    def fraction(momentum, bound):
        leaves = jax.tree.leaves(momentum)
        at = sum(jnp.sum(jnp.abs(x) >= bound) for x in leaves)
        return at / max(1, sum(x.size for x in leaves))

    return jax.jit(fraction, static_argnums=1)


def penalty_scale(state) -> float | None:
    inner = getattr(state.outer_state, "inner_state", state.outer_state)
    scale = getattr(getattr(inner, "outer_state", None), "penalty_scale", None)
    return None if scale is None else float(np.asarray(scale).mean())


def skipped(state) -> int | None:
    n = getattr(state.outer_state, "num_skipped", None)
    return None if n is None else int(np.asarray(n).max())
