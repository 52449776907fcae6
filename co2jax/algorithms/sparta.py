"""SPARTA: sparse parameter averaging every inner step, and SPARTA-DiLoCo.

After every inner step, each replica replaces a random fraction ``p`` of every parameter
tensor's entries by their mean over the replicas; everything else (the other entries, the
optimizer state) stays local. The entries are drawn from a key every replica derives from
the same seed, the step count and the tensor's index, so no mask is broadcast and only the
chosen values cross the replica axis. SPARTA-DiLoCo adds DiLoCo's outer step every round.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._checks import check_axis_name, check_choice, check_int, check_transform
from co2jax.algorithms.data_parallel import no_sync
from co2jax.algorithms.diloco import diloco
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import (
    Fused,
    Guard,
    OuterStep,
    Settings,
    fail,
    setting,
)
from co2jax.axes import REPLICA, axis_size
from co2jax.comm.reducer import ring_bytes
from co2jax.protocol import OuterOptimizer

SELECTORS = ("indices", "bernoulli")


class SpartaState(NamedTuple):
    """State of :func:`sparta` (one per replica).

    Attributes:
      inner: the wrapped transform's state. Replica-varying (never averaged).
      count: 0-d int32, the inner steps taken (the mask's step). Replica-invariant.
    """

    inner: optax.OptState
    count: jax.Array


def sample_count(size: int, fraction: float) -> int:
    """``k``, the entries a tensor of ``size`` entries averages per step: ``round(p n)``, at
    least 1 for ``p > 0``, 0 for ``p = 0`` (``k = n``: every entry, no draw)."""
    if fraction == 0 or size == 0:
        return 0
    return min(size, max(1, round(fraction * size)))


def leaf_key(seed: int, step: jax.Array, leaf: int) -> jax.Array:
    """The key of tensor ``leaf``'s draw at ``step``: the same on every replica."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), leaf)


def sparta_indices(seed: int, step: jax.Array, leaf: int, size: int, fraction: float):
    """The flat indices tensor ``leaf`` (of ``size`` entries) averages at ``step`` with the
    ``"indices"`` selector: ``k = sample_count(size, fraction)`` uniform draws with
    replacement (``None`` when ``k = size``: every entry)."""
    k = sample_count(size, fraction)
    if k == size:
        return None
    return jax.random.randint(leaf_key(seed, step, leaf), (k,), 0, size)


def sparta_mask(seed: int, step: jax.Array, leaf: int, shape, fraction: float) -> jax.Array:
    """The ``"bernoulli"`` selector's mask of tensor ``leaf`` at ``step``: every entry
    independently with probability ``fraction`` (the released code's law)."""
    return jax.random.bernoulli(leaf_key(seed, step, leaf), fraction, shape)


def sparta(
    inner: optax.GradientTransformation,
    fraction: float = 0.005,
    *,
    every: int = 1,
    seed: int = 0,
    selector: str = "indices",
    axis_name: str = REPLICA,
) -> optax.GradientTransformationExtraArgs:
    """``inner``, then a random fraction of every parameter tensor averaged over the replicas.

    At inner step ``t`` (0-based, steps taken before this one), on every replica ``r``:

    .. math::

        x_r \\leftarrow x_r + \\mathrm{inner}(g_r), \\qquad
        x_r[M_t] \\leftarrow \\operatorname{mean}_{r'} x_{r'}[M_t]
        \\quad \\text{if } t \\bmod \\mathrm{every} = 0

    per tensor, with ``M_t`` drawn from ``fold_in(fold_in(key(seed), t), tensor index)``:
    every replica draws the same set, nothing but the chosen values is sent. The entries
    outside ``M_t`` and the inner state stay local; the replicas' mean is unchanged.

    Selectors (per tensor of ``n`` entries):

    - ``"indices"`` (default): ``k = round(p n)`` (at least 1) flat indices drawn uniformly
      with replacement; ``k`` values cross the replica axis, ``p n`` per step. An entry is
      chosen with probability ``1 - (1 - 1/n)^k ~ p`` (a repeat averages the same value
      twice). ``k = n`` (``p = 1``) averages the whole tensor.
    - ``"bernoulli"``: every entry independently with probability ``p``, as the released
      code draws it (``torch.bernoulli``); the masked mean is taken over the whole tensor,
      so ``n`` values cross the axis (the released code broadcasts a dense mask instead).

    Args:
      inner: the local optimizer (its update must not need more than gradients, state and
        params).
      fraction: ``p`` in [0, 1] (0: nothing averaged: local steps).
      every: average on steps ``t`` with ``t % every == 0`` (the released code's
        ``sparta_interval``; its current release averages every step).
      seed: the replicas' shared seed.
      selector: ``"indices"`` or ``"bernoulli"``.
      axis_name: the replica axis.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`SpartaState`; ``update``
      needs ``params``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> tx = co2jax.sparta(optax.sgd(0.0), fraction=1.0)   # p = 1: every entry
      >>> params = jnp.array([[1.0, 2.0], [3.0, 6.0]])       # two replicas
      >>> state = jax.vmap(tx.init)(params)
      >>> updates, state = jax.jit(jax.vmap(tx.update, axis_name="replica"))(
      ...     jnp.zeros_like(params), state, params)
      >>> params + updates
      Array([[2., 4.],
             [2., 4.]], dtype=float32)

    References:
      Beton et al., "Improving the Efficiency of Distributed Training using Sparse Parameter
      Averaging" (SPARTA).
    """
    check_transform("inner", inner)
    if not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be in [0, 1], got fraction={fraction!r}")
    every = check_int("every", every, 1)
    seed = check_int("seed", seed, 0)
    selector = check_choice("selector", selector, SELECTORS)
    check_axis_name("axis_name", axis_name)
    inner = optax.with_extra_args_support(inner)

    def mix_leaf(i: int, u: jax.Array, p: jax.Array, step) -> jax.Array:
        """Leaf ``i``'s update ``u`` (at parameters ``p``), its chosen entries replaced by
        what lands them on the replicas' mean of ``p + u`` (``u`` itself elsewhere)."""
        new = optax.apply_updates(p, u)
        mean = lambda v: jax.lax.pmean(v.astype(jnp.float32), axis_name)
        if selector == "bernoulli":
            mask = sparta_mask(seed, step, i, new.shape, fraction)
            return jnp.where(mask, (mean(new) - p).astype(u.dtype), u)
        idx = sparta_indices(seed, step, i, new.size, fraction)
        if idx is None:
            return (mean(new) - p).astype(u.dtype)
        chosen = mean(new.reshape(-1)[idx]) - p.reshape(-1)[idx]
        return u.reshape(-1).at[idx].set(chosen.astype(u.dtype)).reshape(u.shape)

    def update(grads, state: SpartaState, params=None, **extra_args):
        if params is None:
            raise ValueError("sparta needs params in update (it averages parameter entries)")
        axis_size(axis_name)
        updates, inner_state = inner.update(grads, state.inner, params, **extra_args)
        if fraction > 0:
            leaves_u, treedef = jax.tree.flatten(updates)
            leaves_p = treedef.flatten_up_to(params)

            def mixed(leaves_u):
                pairs = enumerate(zip(leaves_u, leaves_p, strict=True))
                return [mix_leaf(i, u, p, state.count) for i, (u, p) in pairs]

            if every == 1:
                leaves_u = mixed(leaves_u)
            else:
                due = state.count % every == 0
                leaves_u = jax.lax.cond(due, mixed, lambda leaves: list(leaves), leaves_u)
            updates = treedef.unflatten(leaves_u)
        return updates, SpartaState(inner_state, optax.safe_increment(state.count))

    def init(params) -> SpartaState:
        return SpartaState(inner.init(params), jnp.zeros([], jnp.int32))

    return optax.GradientTransformationExtraArgs(init, update)


def sparta_step_bytes(params, replicas: int, fraction: float, selector: str, every: int = 1):
    """Bytes one replica sends per inner step (averaged over ``every``): a ring all-reduce
    of ``k`` float32 values per tensor (``"indices"``), of the whole tensor
    (``"bernoulli"``)."""
    total = 0
    for x in jax.tree.leaves(params):
        n = math.prod(x.shape)
        k = n if selector == "bernoulli" and fraction > 0 else sample_count(n, fraction)
        total += 4 * k
    return ring_bytes(total, replicas) / every


@dataclasses.dataclass(frozen=True)
class SparseAveraging:
    """SPARTA's every-step sparse averaging of parameter entries (:func:`co2jax.sparta`)."""

    fraction: float = setting(0.005, "p, the fraction of each tensor averaged per step")
    every: int = setting(1, "average on every this many inner steps")
    seed: int = setting(0, "the replicas' shared seed for the entries drawn")
    selector: str = setting("indices", "how entries are drawn", SELECTORS)

    def check(self, bounds) -> None:
        if not 0 <= self.fraction <= 1:
            fail("fraction", self.fraction, "must be in [0, 1]")
        if self.every < 1:
            fail("every", self.every, "must be >= 1 (inner steps)")
        if self.seed < 0:
            fail("seed", self.seed, "must be >= 0")

    def wrap(self, transform: optax.GradientTransformation):
        """``transform`` with this sparse averaging after each of its steps."""
        return sparta(
            transform, self.fraction, every=self.every, seed=self.seed, selector=self.selector
        )

    def averaging_bytes(self, params, replicas: int) -> float:
        """Bytes one replica sends per inner step for this averaging
        (:func:`sparta_step_bytes`)."""
        return sparta_step_bytes(params, replicas, self.fraction, self.selector, self.every)


@register("SPARTA: a random fraction of every tensor averaged every step")
@dataclasses.dataclass(frozen=True)
class SpartaSettings(Settings, SparseAveraging):
    """SPARTA's settings: the sparse averaging (nothing is exchanged per round)."""

    algorithm: str = setting("sparta", "the algorithm")

    def check(self, bounds) -> None:
        if self.fraction == 0:
            fail("fraction", self.fraction, "must be > 0 for sparta (0 averages nothing)")

    def inner(self, transform, context):
        return self.wrap(transform)

    def step_bytes(self, params, replicas: int, sync_every: int) -> float:
        return self.averaging_bytes(params, replicas)

    def build(self, context, reduce) -> OuterOptimizer:
        return no_sync()


@register("SPARTA-DiLoCo: SPARTA's sparse averaging every step, DiLoCo's outer step every round")
@dataclasses.dataclass(frozen=True)
class SpartaDiLoCoSettings(Settings, OuterStep, Fused, Guard, SparseAveraging):
    """SPARTA-DiLoCo's settings: DiLoCo's outer step and guard, SPARTA's averaging."""

    algorithm: str = setting("sparta_diloco", "the algorithm")

    def build(self, context, reduce) -> OuterOptimizer:
        return diloco(self.transform(context), implementation=self.implementation)

    def inner(self, transform, context):
        return self.wrap(transform)

    def step_bytes(self, params, replicas: int, sync_every: int) -> float:
        return self.averaging_bytes(params, replicas)


__all__ = ["SELECTORS", "SpartaState", "sample_count", "sparta", "sparta_indices", "sparta_mask"]
