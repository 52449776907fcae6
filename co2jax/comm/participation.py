"""Participation: a round's reduction over the replicas that take part, weighted.

Each replica ``r`` carries a weight ``w_r >= 0`` in a round: 0 leaves it out (dead, late, or
a non-finite payload), a token count weighs uneven replicas. The weighted reduction of the
payloads ``x_r`` is, for a mean (exact or compressed: each replica's payload decoded),

.. math::

    \\bar x = \\frac{\\sum_r w_r\\, x_r}{\\sum_r w_r},

and for a mean over contributors (top-k, DCT top-k, SparseLoCo's production collective),
per index ``i``, over the replicas that sent it,

.. math::

    \\bar x_i = \\frac{\\sum_{r \\ni i} w_r\\, x_{r,i}}{\\sum_{r \\ni i} w_r}.

With 0/1 weights both are the reducer's own reduction over the participants alone (the
median clip of the production collective takes the participants' median): a test checks
that for every gather form against the subset's ``combine``. A left-out replica's payload is
zeroed before it is sent, so a NaN in it cannot reach the mean.

Token weighting: ``w_r = tokens_r`` (this round's tokens of replica r), the heterogeneous-H
rule of the DCT-momentum code (``g_r * H_r / mean_j H_j`` averaged uniformly is the same
mean). :func:`token_weights` also gives ``tokens_r^2 / steps_r``.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from co2jax.comm import pmean
  >>> x, w = jnp.array([1.0, 2.0, 6.0]), jnp.array([1.0, 1.0, 0.0])
  >>> jax.vmap(lambda x, w: weighted(pmean(), w)(x), axis_name="replica")(x, w)
  Array([1.5, 1.5, 1.5], dtype=float32)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from co2jax._checks import check_choice
from co2jax.axes import REPLICA, axis_size
from co2jax.comm.reducer import Encoded, Payload, Reducer, all_gather_tree, values
from co2jax.tree import all_over_shards, tree_all_finite

WEIGHT_RULES = ("tokens", "tokens_squared_per_step")


def _zero_where_out(payload: Payload, take: jax.Array) -> Payload:
    leaves = payload.data if isinstance(payload, Encoded) else payload
    zeroed = jax.tree.map(lambda x: jnp.where(take, x, jnp.zeros_like(x)), leaves)
    return Encoded(zeroed, payload.form) if isinstance(payload, Encoded) else zeroed


def weighted(
    reducer: Reducer,
    weight: jax.Array,
    axis_name: str = REPLICA,
    exclude_nonfinite: bool = False,
) -> Reducer:
    """``reducer`` weighted by this replica's ``weight`` (a 0-d value, inside the replica
    axis; the replicas' weights must not all be 0).

    An exact mean (``reducer.exact``, not gathered) becomes one ``psum`` of ``w_r x_r`` and
    one of ``w_r``, in float32; any reducer with a gather form all-gathers its encoding and
    the weights and combines them weighted (a gathered reducer's replicas are averaged here,
    not in a fused update). A reducer with neither (the two-step compressed all-reduce, a
    gossip exchange) is refused. ``exclude_nonfinite``: a replica whose payload has a NaN or
    an Inf is left out of this reduction (weight 0).
    """
    if reducer.reach != "all" or (reducer.encode is None and not reducer.exact):
        raise ValueError(
            f"participation weights need an exact mean or a reducer with a gather form, got "
            f"reducer={reducer.name!r}"
            + (
                " (a gossip or region exchange has no all-replica reduction)"
                if reducer.reach != "all"
                else ""
            )
        )

    def reduce(payload: Payload):
        axis_size(axis_name)
        if not jax.tree.leaves(payload):
            return payload
        w = jnp.asarray(weight, jnp.float32)
        if exclude_nonfinite:
            # on the values: a NaN can hide in an encoding (integer codes, a clipped scale)
            finite = tree_all_finite(values(payload))
            w = jnp.where(all_over_shards(finite, {REPLICA}), w, 0.0)
        payload = _zero_where_out(payload, w > 0)
        if reducer.exact and not reducer.gathered and not isinstance(payload, Encoded):
            total = jax.lax.psum(w, axis_name)
            return jax.tree.map(
                lambda x: (jax.lax.psum(x.astype(jnp.float32) * w, axis_name) / total).astype(
                    x.dtype
                ),
                payload,
            )
        encoded = payload if isinstance(payload, Encoded) else reducer.encode(payload)
        gathered, weights = all_gather_tree((encoded, w), axis_name)  # one collective
        return gathered.combine(weights)

    # not split over a replica's devices: the weight is a value of the replica's program
    # (a split reduction runs in a region of its own), and a finiteness check sees the whole
    # payload
    return reducer._replace(
        name=f"weighted({reducer.name})", reduce=reduce, gathered=False, splittable=False
    )


def token_weights(tokens, steps=None, rule: str = "tokens") -> np.ndarray:
    """Per-replica weights from this round's token counts: ``"tokens"`` (``w_r = tokens_r``)
    or ``"tokens_squared_per_step"`` (``w_r = tokens_r^2 / steps_r``, needs ``steps``)."""
    check_choice("rule", rule, WEIGHT_RULES)
    tokens = np.asarray(tokens, np.float64)
    if tokens.ndim != 1 or not np.all(np.isfinite(tokens)) or np.any(tokens < 0):
        raise ValueError(f"tokens must be a vector of counts >= 0, got tokens={tokens.tolist()}")
    if rule == "tokens":
        return tokens
    if steps is None:
        raise ValueError(f"rule={rule!r} needs steps (inner steps per replica)")
    steps = np.asarray(steps, np.float64)
    if steps.shape != tokens.shape or np.any(steps <= 0):
        raise ValueError(
            f"steps must be {tokens.shape[0]} counts > 0 (one per replica), got steps="
            f"{steps.tolist()}"
        )
    return tokens**2 / steps


def check_weights(name: str, weights, replicas: int) -> np.ndarray:
    """``weights`` as float32 ``[replicas]``; raises ``ValueError`` naming ``name`` unless
    every weight is finite and >= 0 and one is > 0."""
    try:
        w = np.asarray(weights, np.float64)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be {replicas} numbers, got {name}={weights!r}") from None
    if w.shape != (replicas,) or not np.all(np.isfinite(w)) or np.any(w < 0) or not w.sum() > 0:
        raise ValueError(
            f"{name} must be {replicas} finite weights >= 0 (one per replica), not all 0, got "
            f"{name}={w.tolist() if w.ndim else weights!r}"
        )
    return w.astype(np.float32)


def weighable(outer) -> bool:
    """``outer``'s reductions can weigh replicas: it has outer transfers and a
    replica-invariant anchor."""
    return bool(outer.schedule) and not outer.replica_local


def check_weighable(outer, what: str) -> None:
    """Raises ``ValueError`` (naming ``what``) unless :func:`weighable`."""
    if not outer.schedule:
        raise ValueError(
            f"{what}: needs an outer reduction; this outer optimizer has none (its replicas "
            "meet inside the inner steps, as data parallel's gradient mean)"
        )
    if outer.replica_local:
        raise ValueError(
            f"{what}: needs a replica-invariant anchor; this outer optimizer keeps "
            "replica-local anchors (outer.replica_local)"
        )


def check_participation(outer, replicas: int, steps_per_round: int, weights=None, steps=None):
    """A round's participation checked before any compute: ``(weights, steps)`` as float32
    and int32 ``[replicas]`` arrays or ``None``.

    ``weights``: each replica's weight in the round's reductions (0 leaves it out); finite,
    >= 0, not all 0. ``steps``: replica r takes only its first ``steps[r]`` inner steps, in
    1..H (in one SPMD program the later ones are computed and discarded: a simulation of
    uneven replicas); without ``weights`` each replica weighs its ``steps[r]`` (its tokens, at
    equal batches). Both need a replica-invariant anchor (not ``outer.replica_local``).
    """
    if weights is None and steps is None:
        return None, None
    check_weighable(outer, "participation weights and per-replica steps")
    if steps is not None:
        n = np.asarray(steps)
        if (
            n.shape != (replicas,)
            or not np.issubdtype(n.dtype, np.integer)
            or np.any(n < 1)
            or np.any(n > steps_per_round)
        ):
            raise ValueError(
                f"steps must be {replicas} integers in 1..H={steps_per_round} (one per "
                f"replica), got steps={n.tolist()}"
            )
        weights = n if weights is None else weights
        steps = n.astype(np.int32)
    return check_weights("weights", weights, replicas), steps


def clipped_mean(stacked, weights=None, eps: float = 1e-12):
    """Robust aggregation: each replica's values (a pytree of leaves stacked on a leading
    replica axis) scaled down to the median of the replicas' norms, then the (weighted)
    mean. The norm is the whole payload's L2 norm; the median is the lower median over the
    replicas of weight > 0. One faulty replica r can then move the mean by at most
    ``w_r m / sum_j w_j`` in norm, not arbitrarily:

    .. math::

        \\bar x = \\frac{\\sum_r w_r \\min(1, m / \\|x_r\\|)\\, x_r}{\\sum_r w_r},
        \\qquad m = \\mathrm{median}_{r: w_r > 0} \\|x_r\\|

    Example:
      >>> import jax.numpy as jnp
      >>> x = {"g": jnp.array([[1.0, 0.0], [0.0, 2.0], [1000.0, 0.0]])}
      >>> clipped_mean(x)["g"].round(4)  # the third replica is scaled to norm 2, the median
      Array([1.    , 0.6667], dtype=float32)
    """
    leaves = [x.astype(jnp.float32) for x in jax.tree.leaves(stacked)]
    R = leaves[0].shape[0]
    w = jnp.ones((R,), jnp.float32) if weights is None else jnp.asarray(weights, jnp.float32)
    norms = jnp.sqrt(sum(jnp.sum(x.reshape(R, -1) ** 2, axis=1) for x in leaves))
    present = w > 0
    ranked = jnp.sort(jnp.where(present, norms, jnp.inf))
    median = ranked[(jnp.sum(present) - 1) // 2]
    scale = w * jnp.minimum(1.0, median / (norms + eps)) / jnp.sum(w)
    return jax.tree.map(
        lambda x: jnp.tensordot(scale, x.astype(jnp.float32), axes=1).astype(x.dtype), stacked
    )
