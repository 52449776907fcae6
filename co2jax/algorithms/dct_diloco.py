"""DCT-momentum DiLoCo (arXiv 2510.03371): the outer momentum is shared only through the top-k
DCT coefficients of each chunk; the rest of it stays on the replica as a residual.

Derivation from the released code's outer step (a DeMo-style SGD optimizer stepped once per
round on the anchor, with the pseudo-gradient as its gradient), per replica r:

    param.grad = (anchor_r - theta_r) * H_r / (sum_j H_j / R)       -> g_r
    delta *= decay ; delta += grad                                 -> delta = beta delta + g_r
    q = TopK(DCT(delta)) ; delta -= IDCT(q)                        -> sent in ``send``
    Q = all_gather(q) ; delta = delta + IDCT(contributor mean of Q)
    grad = grad + delta * decay ; anchor -= lr * grad (plain SGD)  -> in ``apply``

so the step uses the replica's own ``g_r`` (not the gathered one) plus ``beta`` times the
momentum after the gathered part was added back. Nothing in the code is a Nesterov buffer of
its own: ``delta`` is both the momentum and the residual. ``send`` runs the first three lines
(it changes the state: the residual is what the payload left out, as in error feedback);
``apply`` recomputes ``g_r`` from the same parameters (the schedule is synchronous, so the
parameters ``apply`` sees are the ones ``send`` saw) and runs the rest.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from co2jax._checks import check_axis_name, check_int, check_positive, check_unit_interval
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import DCTTopK, LearningRate, Settings, fail, setting
from co2jax.axes import REPLICA
from co2jax.comm.dct import all_gather_dct_topk
from co2jax.comm.reducer import values
from co2jax.protocol import SYNCHRONOUS, OuterOptimizer, Params, StateRoles, checked_roles


@checked_roles
class DCTDiLoCoState(NamedTuple):
    """State of :func:`dct_diloco` (one per replica).

    Attributes:
      anchor: the parameters this replica started the current round from. Replica-varying
        (every replica steps its own anchor with its own ``g_r`` and residual). Same dtype as
        the parameters.
      delta: the outer momentum, less what the replica has sent of it, plus the gathered
        average (float32). Replica-varying.
      count: 0-d int32, the number of syncs so far. Replica-invariant.
    """

    anchor: Params
    delta: Params
    count: jax.Array

    ROLES = StateRoles("anchor", advances=("count",))


def _check_weight(weight: Any) -> float | tuple[float, ...]:
    if isinstance(weight, numbers.Real) and not isinstance(weight, bool):
        return check_positive("weight", weight)
    if isinstance(weight, Sequence) and not isinstance(weight, str) and len(weight) > 0:
        ok = all(
            isinstance(w, numbers.Real) and not isinstance(w, bool) and math.isfinite(w) and w > 0
            for w in weight
        )
        if ok:
            return tuple(float(w) for w in weight)
    raise ValueError(
        f"weight must be a finite number > 0 or a non-empty sequence of them (one per "
        f"replica), got weight={weight!r}"
    )


def dct_diloco(
    learning_rate: float = 0.7,
    decay: float = 0.95,
    k: int = 32,
    chunk: int = 64,
    *,
    weight: float | Sequence[float] = 1.0,
    axis_name: str = REPLICA,
) -> OuterOptimizer:
    """DCT-momentum DiLoCo: a replica-local anchor and momentum; only the top-k DCT
    coefficients of each chunk of the momentum cross the wire.

    Per replica r, every round, with ``theta_r`` its parameters after the inner steps:

    .. math::

        g_r &= w_r (\\phi_r - \\theta_r) \\\\
        \\delta_r &\\leftarrow \\beta \\delta_r + g_r, \\qquad
        q_r = \\mathrm{TopK}_k(\\mathrm{DCT}_{chunk}(\\delta_r)), \\qquad
        \\delta_r \\leftarrow \\delta_r - \\mathrm{IDCT}(q_r) \\\\
        \\hat g &= \\mathrm{IDCT}(\\text{contributor mean of } \\mathrm{all\\_gather}(q)),
        \\qquad \\delta_r \\leftarrow \\delta_r + \\hat g \\\\
        \\phi_r &\\leftarrow \\phi_r - \\eta (g_r + \\beta \\delta_r), \\qquad
        \\theta_r \\leftarrow \\phi_r

    (the anchor ``phi_r`` is replica-local: the local ``g_r`` and residual enter it). The
    contributor mean averages each coefficient over the replicas that selected it
    (:func:`co2jax.comm.all_gather_dct_topk`). Each line is the released code's, in its order
    (see the comment above the code). ``w_r = H_r / mean_j H_j`` weights replicas that ran
    different numbers of inner steps; with equal H it is 1. Defaults of the released code:
    eta 0.7, beta 0.95, chunk 64, k 32 (H 128 in its GPT configuration belongs to the
    training loop).

    Args:
      learning_rate: eta (> 0).
      decay: beta, the momentum's decay, in [0, 1) (the released code refuses 1).
      k: coefficients kept per chunk (>= 1).
      chunk: the target chunk size per axis (>= 1; each axis uses its largest divisor
        ``<= chunk``).
      weight: ``w_r``: one number for every replica, or a sequence of R numbers, replica r
        taking ``weight[axis_index(axis_name)]`` (a separate job passes its own number).
      axis_name: the replica axis.

    Returns:
      An :class:`~co2jax.OuterOptimizer` with :class:`DCTDiLoCoState`, ``replica_local``.

    Example:
      >>> import jax, jax.numpy as jnp, co2jax
      >>> outer = co2jax.dct_diloco(learning_rate=1.0, decay=0.5, k=1, chunk=2)
      >>> state = jax.vmap(outer.init)(jnp.zeros((2, 2)))
      >>> params = jnp.array([[-1.0, -1.0], [-3.0, -3.0]])  # g_r = (1, 1) and (3, 3)
      >>> params, state = jax.jit(jax.vmap(outer.sync, axis_name="replica"))(params, state)
      >>> params  # -(g_r + half the shared (2, 2)): the anchors stay replica-local
      Array([[-2., -2.],
             [-4., -4.]], dtype=float32)

    References:
      DCT-momentum DiLoCo, arXiv 2510.03371; DeMo, arXiv 2411.19870.
    """
    eta = check_positive("learning_rate", learning_rate)
    beta = check_unit_interval("decay", decay)
    k = check_int("k", k, 1)
    chunk = check_int("chunk", chunk, 1)
    weight = _check_weight(weight)
    check_axis_name("axis_name", axis_name)
    reducer = all_gather_dct_topk(k, chunk, axis_name)

    def init(params: Params) -> DCTDiLoCoState:
        delta = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return DCTDiLoCoState(params, delta, jnp.zeros([], jnp.int32))

    def own_weight() -> jax.Array | float:
        if isinstance(weight, float):
            return weight
        return jnp.asarray(weight, jnp.float32)[jax.lax.axis_index(axis_name)]

    def pseudo_gradient(params: Params, state: DCTDiLoCoState) -> Params:
        w = own_weight()
        return jax.tree.map(
            lambda a, p: (a.astype(jnp.float32) - p.astype(jnp.float32)) * w,
            state.anchor,
            params,
        )

    def send(params: Params, state: DCTDiLoCoState, i: int = 0):
        g = pseudo_gradient(params, state)
        delta = jax.tree.map(lambda d, x: beta * d + x, state.delta, g)
        q = reducer.encode(delta)
        delta = jax.tree.map(lambda d, s: d - s, delta, q.decode())
        return q, state._replace(delta=delta)

    def apply(params: Params, state: DCTDiLoCoState, i: int, reduced: Any):
        g = pseudo_gradient(params, state)
        shared = values(reduced)
        delta = jax.tree.map(lambda d, s: d + s.astype(jnp.float32), state.delta, shared)
        anchor = jax.tree.map(
            lambda a, x, d: (a.astype(jnp.float32) - eta * (x + beta * d)).astype(a.dtype),
            state.anchor,
            g,
            delta,
        )
        return anchor, DCTDiLoCoState(anchor, delta, state.count + 1)

    return OuterOptimizer(init, send, reducer, apply, SYNCHRONOUS, replica_local=True)


@register("replica-local DiLoCo sharing only the top-k DCT coefficients of its momentum")
@dataclasses.dataclass(frozen=True)
class DCTDiLoCoSettings(Settings, LearningRate, DCTTopK):
    """DCT-momentum DiLoCo's settings (arXiv 2510.03371)."""

    algorithm: str = setting("dct_diloco", "the algorithm")
    decay: float = setting(0.95, "the momentum's decay, in [0, 1)")

    def check(self, bounds) -> None:
        if not 0 <= self.decay < 1:
            fail("decay", self.decay, "must be in [0, 1)")

    def build(self, context, reduce) -> OuterOptimizer:
        return dct_diloco(self.learning_rate, self.decay, self.topk, self.dct_chunk)
