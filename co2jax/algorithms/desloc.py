"""DES-LOC: local Adam whose parameters, first and second moments are averaged on separate
periods (K_x <= K_u <= K_v), as an inner optax wrapper and Local SGD's round.

The parameters are averaged every round (K_x = H, :func:`co2jax.local_sgd`); the wrapper
averages the inner transform's moments over the replica axis after every K_u-th (first
moments: Adam's ``mu``, a momentum ``trace``) and K_v-th (Adam's ``nu``) inner step, each
under a ``lax.cond`` on the step count (replica-invariant: every replica takes the same
branch; no collective on the other steps). Adam's step count and everything else stays
local.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._checks import check_axis_name, check_int, check_transform
from co2jax.algorithms.local_sgd import local_sgd
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import Guard, Settings, fail, setting
from co2jax.axes import REPLICA, axis_size
from co2jax.comm.reducer import ring_bytes
from co2jax.protocol import OuterOptimizer
from co2jax.tree import varying_like

FIRST = {optax.ScaleByAdamState: "mu", optax.TraceState: "trace"}
SECOND = {optax.ScaleByAdamState: "nu"}


class DESLocState(NamedTuple):
    """State of :func:`desloc` (one per replica).

    Attributes:
      inner: the wrapped transform's state; its moments equal across replicas right after
        their averaging, replica-varying otherwise.
      count: 0-d int32, the inner steps taken. Replica-invariant.
    """

    inner: optax.OptState
    count: jax.Array


def _is_moments(node: Any) -> bool:
    return type(node) in FIRST or type(node) in SECOND


def moment_fields(state: Any) -> tuple[list[str], list[str]]:
    """The first- and second-moment fields ``state`` holds (``"mu"``, ``"trace"``;
    ``"nu"``), one entry per optax state that has them."""
    nodes = [n for n in jax.tree.leaves(state, is_leaf=_is_moments) if _is_moments(n)]
    first = [FIRST[type(n)] for n in nodes if type(n) in FIRST]
    second = [SECOND[type(n)] for n in nodes if type(n) in SECOND]
    return first, second


def average_moments(state: Any, table: dict, axis_name: str) -> Any:
    """``state`` with the moment fields ``table`` names replaced by their replica mean."""

    def mean(node):
        if not _is_moments(node) or type(node) not in table:
            return node
        name = table[type(node)]
        field = getattr(node, name)
        averaged = jax.tree.map(
            lambda x: jax.lax.pmean(x.astype(jnp.float32), axis_name).astype(x.dtype), field
        )  # typed as varying as the field was: the cond's branches keep one type
        return node._replace(**{name: varying_like(averaged, field)})

    return jax.tree.map(mean, state, is_leaf=_is_moments)


def desloc(
    inner: optax.GradientTransformation,
    first_every: int,
    second_every: int,
    *,
    axis_name: str = REPLICA,
) -> optax.GradientTransformationExtraArgs:
    """``inner`` with its first moments averaged every ``first_every`` steps and its second
    moments every ``second_every`` steps (0: never).

    After inner step ``k`` (1-based, the steps taken including this one), on every replica:

    .. math::

        m_r \\leftarrow \\operatorname{mean}_{r'} m_{r'} \\ \\text{if } K_u \\mid k,
        \\qquad
        v_r \\leftarrow \\operatorname{mean}_{r'} v_{r'} \\ \\text{if } K_v \\mid k

    (the released code's order: after the local step). With the round of
    :func:`co2jax.local_sgd` at ``H = K_x`` (parameters averaged after every H-th step)
    this is DES-LOC. The moments are Adam's ``mu`` and ``nu`` (``optax.scale_by_adam``,
    inside ``adam``, ``adamw`` and any chain or ``inject_hyperparams`` around them) and an
    SGD momentum ``trace`` (a first moment); Adam's step count is never averaged.

    Args:
      inner: the local optimizer; it must keep moments (refused at ``init`` otherwise:
        without them this would be Local SGD under another name).
      first_every: K_u in inner steps (>= 0; 0: never).
      second_every: K_v in inner steps (>= 0; 0: never).
      axis_name: the replica axis.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`DESLocState`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, co2jax
      >>> tx = co2jax.desloc(optax.adam(0.1), first_every=1, second_every=2)
      >>> state = jax.vmap(tx.init)(jnp.zeros((2, 1)))
      >>> _, state = jax.jit(jax.vmap(tx.update, axis_name="replica"))(
      ...     jnp.array([[1.0], [3.0]]), state)
      >>> state.inner[0].mu   # averaged after step 1: (0.1 * 1 + 0.1 * 3) / 2
      Array([[0.2],
             [0.2]], dtype=float32)
      >>> state.inner[0].nu   # not yet (K_v = 2)
      Array([[0.001],
             [0.009]], dtype=float32)

    References:
      Iacob et al., "DES-LOC: Desynced Low Communication Adaptive Optimizers for Training
      Foundation Models", arXiv 2505.22549.
    """
    check_transform("inner", inner)
    first_every = check_int("first_every", first_every, 0)
    second_every = check_int("second_every", second_every, 0)
    check_axis_name("axis_name", axis_name)
    inner = optax.with_extra_args_support(inner)

    def init(params) -> DESLocState:
        state = inner.init(params)
        first, second = moment_fields(state)
        if not first and not second:
            raise ValueError(
                "desloc averages the inner optimizer's moments (Adam's mu and nu, a momentum "
                "trace): this inner transform keeps none (plain SGD is Local SGD)"
            )
        return DESLocState(state, jnp.zeros([], jnp.int32))

    def update(updates, state: DESLocState, params=None, **extra_args):
        axis_size(axis_name)
        updates, inner_state = inner.update(updates, state.inner, params, **extra_args)
        count = optax.safe_increment(state.count)
        for every, table in ((first_every, FIRST), (second_every, SECOND)):
            if every:
                inner_state = jax.lax.cond(
                    count % every == 0,
                    lambda s, table=table: average_moments(s, table, axis_name),
                    lambda s: s,
                    inner_state,
                )
        return updates, DESLocState(inner_state, count)

    return optax.GradientTransformationExtraArgs(init, update)


def desloc_step_bytes(params, replicas: int, first_every: int, second_every: int) -> float:
    """Bytes one replica sends per inner step, on average: a ring all-reduce of a float32
    copy of the parameters every ``first_every`` steps and another every ``second_every``
    (the first moment and the second; the parameters' own average is the round's)."""
    n = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    rate = sum(1 / k for k in (first_every, second_every) if k)
    return ring_bytes(4 * n, replicas) * rate


@register("DES-LOC: parameters every round, Adam's moments on their own longer periods")
@dataclasses.dataclass(frozen=True)
class DESLocSettings(Settings, Guard):
    """DES-LOC's settings (arXiv 2505.22549): the moments' periods in rounds of H = K_x
    inner steps (the paper's K_u = 3 K_x, K_v = 6 K_x); the parameters are averaged every
    round, as Local SGD."""

    algorithm: str = setting("desloc", "the algorithm")
    first_moment_every: int = setting(
        3, "K_u / K_x: rounds between first-moment averages (0: never)"
    )
    second_moment_every: int = setting(
        6, "K_v / K_x: rounds between second-moment averages (0: never)"
    )

    def check(self, bounds) -> None:
        for name in ("first_moment_every", "second_moment_every"):
            if getattr(self, name) < 0:
                fail(name, getattr(self, name), "must be >= 0 (rounds; 0: never)")

    def periods(self, sync_every: int) -> tuple[int, int]:
        """``(K_u, K_v)`` in inner steps at round length ``sync_every``."""
        return self.first_moment_every * sync_every, self.second_moment_every * sync_every

    def build(self, context, reduce) -> OuterOptimizer:
        return local_sgd(reduce=reduce)

    def inner(self, transform, context):
        if context.sync_every is None:
            raise ValueError("desloc needs the round length (Context.sync_every)")
        return desloc(transform, *self.periods(context.sync_every))

    def step_bytes(self, params, replicas: int, sync_every: int) -> float:
        return desloc_step_bytes(params, replicas, *self.periods(sync_every))


__all__ = ["DESLocState", "average_moments", "desloc", "desloc_step_bytes", "moment_fields"]
