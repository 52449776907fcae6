"""DeMo (arXiv 2411.19870): decoupled momentum, as an optax transform that communicates every
step (like :func:`co2jax.data_parallel`, it is the inner transform; the outer one is
:func:`co2jax.no_sync`).

The released optimizer's step, per parameter ``p`` with learning rate ``lr``, is a sign-SGD
step on a gradient it replaces:

    p *= 1 - lr * weight_decay                      (decoupled, before anything else)
    delta = decay * delta + lr * grad               (the learning rate enters the momentum)
    q = TopK(DCT(delta)) ; delta -= IDCT(q)
    grad = IDCT(contributor mean of all_gather(q)) ; grad = sign(grad)
    p -= lr * grad                                  (torch SGD, momentum 0)

As an optax update (added to the parameters): ``-lr * weight_decay * p - lr * sign(u)``,
``u`` the decoded gather, with ``lr`` the schedule's value at this step for both uses.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from co2jax._checks import check_axis_name, check_int, check_positive, check_unit_interval
from co2jax.algorithms.data_parallel import no_sync
from co2jax.algorithms.registry import register
from co2jax.algorithms.settings import DCTTopK, Settings, fail, setting
from co2jax.axes import REPLICA, axis_size
from co2jax.comm.dct import all_gather_dct_topk
from co2jax.protocol import OuterOptimizer


class DeMoState(NamedTuple):
    """State of :func:`demo` (one per replica).

    Attributes:
      delta: the momentum less what this replica has sent of it (float32, parameter-shaped).
        Replica-varying.
      count: 0-d int32, the number of steps taken (the learning-rate schedule's argument).
        Replica-invariant.
    """

    delta: optax.Updates
    count: jax.Array


def _check_learning_rate(value: Any):
    if callable(value):
        return value
    check_positive("learning_rate", value)
    return lambda count: value


def demo(
    learning_rate: optax.ScalarOrSchedule,
    decay: float = 0.999,
    k: int = 32,
    chunk: int = 64,
    weight_decay: float = 0.0,
    *,
    axis_name: str = REPLICA,
) -> optax.GradientTransformationExtraArgs:
    """DeMo: sign-SGD on the replicas' shared top-k DCT coefficients of a local momentum.

    Per step, on every replica r, for every parameter:

    .. math::

        \\delta_r &\\leftarrow \\beta \\delta_r + \\mathrm{lr}\\, g_r, \\qquad
        q_r = \\mathrm{TopK}_k(\\mathrm{DCT}_{chunk}(\\delta_r)), \\qquad
        \\delta_r \\leftarrow \\delta_r - \\mathrm{IDCT}(q_r) \\\\
        u &= \\mathrm{IDCT}(\\text{contributor mean of } \\mathrm{all\\_gather}(q)), \\qquad
        \\theta \\leftarrow \\theta - \\mathrm{lr}\\,\\lambda\\,\\theta
            - \\mathrm{lr}\\, \\mathrm{sign}(u)

    Nothing else crosses the replica axis: no all-reduce of the gradient. ``u`` is the same
    on every replica, so replicas that start equal stay equal. The contributor mean averages
    each coefficient over the replicas that selected it (:func:`co2jax.comm.
    all_gather_dct_topk`). Defaults of the released code: beta 0.999, k 32, chunk 64, weight
    decay 0.

    Args:
      learning_rate: lr (> 0), or an optax schedule of the step count.
      decay: beta, the momentum's decay, in [0, 1) (the released code refuses 1).
      k: coefficients kept per chunk (>= 1).
      chunk: the target chunk size per axis (>= 1; each axis uses its largest divisor
        ``<= chunk``).
      weight_decay: lambda (>= 0), decoupled; needs ``params`` in ``update`` when nonzero.
      axis_name: the replica axis.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`DeMoState`.

    Example:
      >>> import jax, jax.numpy as jnp, co2jax
      >>> opt = co2jax.demo(0.1, k=1, chunk=2)
      >>> state = jax.vmap(opt.init)(jnp.zeros((2, 2)))
      >>> grads = jnp.array([[1.0, 1.0], [3.0, 1.0]])  # 2 replicas
      >>> updates, state = jax.jit(jax.vmap(opt.update, axis_name="replica"))(grads, state)
      >>> updates  # the same signed step on both replicas
      Array([[-0.1, -0.1],
             [-0.1, -0.1]], dtype=float32)

    References:
      DeMo, arXiv 2411.19870.
    """
    schedule = _check_learning_rate(learning_rate)
    beta = check_unit_interval("decay", decay)
    k = check_int("k", k, 1)
    chunk = check_int("chunk", chunk, 1)
    real = isinstance(weight_decay, numbers.Real) and not isinstance(weight_decay, bool)
    if not real or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ValueError(
            f"weight_decay must be a finite number >= 0, got weight_decay={weight_decay!r}"
        )
    weight_decay = float(weight_decay)
    check_axis_name("axis_name", axis_name)
    reducer = all_gather_dct_topk(k, chunk, axis_name)

    def init(params: optax.Params) -> DeMoState:
        delta = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        return DeMoState(delta, jnp.zeros([], jnp.int32))

    def update(updates, state: DeMoState, params=None, **extra_args):
        del extra_args
        axis_size(axis_name)
        if weight_decay and params is None:
            raise ValueError("demo with weight_decay > 0 needs params in update")
        lr = jnp.asarray(schedule(state.count), jnp.float32)
        delta = jax.tree.map(
            lambda d, g: beta * d + lr * g.astype(jnp.float32), state.delta, updates
        )
        q = reducer.encode(delta)
        delta = jax.tree.map(lambda d, s: d - s, delta, q.decode())
        u = reducer(q)
        step = jax.tree.map(lambda s, g: (-lr * jnp.sign(s)).astype(g.dtype), u, updates)
        if weight_decay:
            step = jax.tree.map(
                lambda s, p: s - (lr * weight_decay * p.astype(jnp.float32)).astype(s.dtype),
                step,
                params,
            )
        return step, DeMoState(delta, optax.safe_increment(state.count))

    return optax.GradientTransformationExtraArgs(init, update)


@register("DeMo: sign steps on shared top-k DCT coefficients of a local momentum, every step")
@dataclasses.dataclass(frozen=True)
class DeMoSettings(Settings, DCTTopK):
    """DeMo's settings (arXiv 2411.19870): its momentum and DCT top-k, at the inner learning
    rate (DeMo is the inner optimizer; nothing is exchanged per round)."""

    algorithm: str = setting("demo", "the algorithm")
    momentum: float = setting(0.9, "the local momentum's decay, in [0, 1)")

    def check(self, bounds) -> None:
        if not 0 <= self.momentum < 1:
            fail("momentum", self.momentum, "must be in [0, 1)")

    def build(self, context, reduce) -> OuterOptimizer:
        return no_sync()

    def inner(self, transform, context):
        # DeMo is the whole inner optimizer: sign steps at the inner learning rate
        if context.inner_learning_rate is None:
            raise ValueError("demo needs the inner learning rate (Context.inner_learning_rate)")
        return demo(context.inner_learning_rate, self.momentum, self.topk, self.dct_chunk)

    def step_bytes(self, params, replicas: int, sync_every: int) -> float:
        return all_gather_dct_topk(self.topk, self.dct_chunk).wire_bytes(params, replicas)
