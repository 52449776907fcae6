"""The outer-optimizer protocol: pure functions and a static schedule of transfers.

An outer optimizer is what a replica runs around its inner steps. Its communication is a
static *schedule*: a tuple of :class:`Transfer`, each one payload put on the wire after
``send`` inner steps of the round and applied after ``apply`` of them (``None``: after the
round's last step, H). Per transfer ``i``::

    payload, state = outer.send(params, state, i)        # local: what goes on the wire
    reduced = outer.reducer(payload)                     # collective over the replica axis
    params, state = outer.apply(params, state, i, reduced)   # local: the outer update

- a synchronous algorithm (DiLoCo) has one transfer sent and applied at the end;
- a delayed one (CO2, delayed and eager DiLoCo) sends at step 0 the payload it already has
  (computed from the state only) and applies it at the end: its reduction has the whole
  round to hide behind;
- Streaming DiLoCo has one transfer per fragment, each sent ``tau`` steps before it is
  applied;
- a transfer may be cut into ``chunks`` pieces, sent at the K steps from its send on (at
  most the steps before its apply, :func:`spread`): each of those steps carries 1/K of the
  bytes.

``send`` may change the state (error feedback records what compression left out of the
payload actually sent). The three drivers (the round engine, the per-step adapter and the
multi-job trainer) execute any schedule through :func:`plan`; none of them looks at what the
algorithm is. ``outer.sync(params, state)`` is the one-shot, round-level form.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from co2jax._checks import check_int
from co2jax.axes import REPLICA
from co2jax.comm.reducer import Reducer

Params = Any
State = Any
Payload = Any


class Transfer(NamedTuple):
    """One payload of a round: taken after ``send`` inner steps, its reduction applied after
    ``apply`` (``None``: after the last step, H), in ``chunks`` pieces (chunk c sent after
    ``send + c`` steps, ``chunks <= apply - send``)."""

    send: int | None = None
    apply: int | None = None
    chunks: int = 1


SYNCHRONOUS = (Transfer(None, None),)
"""Sent and applied after the round's last step (DiLoCo)."""
DELAYED = (Transfer(0, None),)
"""Sent before the round's first step, applied after its last (CO2, delayed DiLoCo)."""


class Action(NamedTuple):
    """What a driver does at the boundary before inner step ``at`` (``at == H``: after the
    last step), in :func:`plan`'s order.

    ``kind``: ``"sync"`` (send, reduce and apply a transfer sent and applied at ``at``),
    ``"send"`` (take the payload and reduce its chunk 0), ``"chunk"`` (reduce chunk
    ``chunk``) or ``"apply"`` (apply the assembled reduction).
    """

    at: int
    kind: str
    transfer: int
    chunk: int = 0


class StateRoles(NamedTuple):
    """What the fields of an outer optimizer's state are for: declared once on the state's
    type as ``ROLES``, read by the drivers and wrappers through :func:`roles_of` and
    :func:`anchor_of` (never by a field's name).

    Attributes:
      anchor: the field holding the parameters replicas restart from (replica-invariant
        unless the algorithm is ``replica_local``); ``None`` when the state has none.
      replica_varying: fields that differ between replicas by design (a replica's own
        payloads, residuals, factors): a rejoining job takes them fresh.
      advances: fields that advance on every sync, even one whose step is skipped (payloads
        in flight, sync counters).
      wraps: the field holding a wrapped algorithm's state (whose roles apply within it).
    """

    anchor: str | None = None
    replica_varying: tuple[str, ...] = ()
    advances: tuple[str, ...] = ()
    wraps: str | None = None


def checked_roles(cls: type) -> type:
    """Class decorator of a state type: raises ``TypeError`` when the class is defined if its
    ``ROLES`` (:class:`StateRoles`) name a field it does not have, so a renamed field
    cannot leave a role pointing nowhere.

    Example:
      >>> from typing import NamedTuple
      >>> @checked_roles
      ... class BadState(NamedTuple):
      ...     anchor: int
      ...     ROLES = StateRoles("anchr")
      Traceback (most recent call last):
      ...
      TypeError: BadState.ROLES names 'anchr', not a field of BadState (its fields: anchor)
    """
    roles, fields = cls.__dict__.get("ROLES"), getattr(cls, "_fields", ())
    if not isinstance(roles, StateRoles):
        raise TypeError(f"{cls.__name__}.ROLES must be a StateRoles, got {roles!r}")
    named = [roles.anchor, roles.wraps, *roles.replica_varying, *roles.advances]
    for name in named:
        if name is not None and name not in fields:
            raise TypeError(
                f"{cls.__name__}.ROLES names {name!r}, not a field of {cls.__name__} (its "
                f"fields: {', '.join(fields)})"
            )
    return cls


def roles_of(state: Any) -> StateRoles:
    """The :class:`StateRoles` ``state``'s type declares (none: every field plain)."""
    return getattr(type(state), "ROLES", StateRoles())


def find_state(state: Any, kind: type) -> Any:
    """The first node of type ``kind`` in ``state`` (through the states it wraps and the
    transforms' states it holds), or ``None``: how an algorithm reads its own state back
    where wrappers (a guard, error feedback) put it.

    Example:
      >>> import jax.numpy as jnp, co2jax
      >>> from co2jax.algorithms.guards import SkipNonfiniteState
      >>> outer = co2jax.skip_nonfinite(co2jax.diloco(co2jax.outer_sgd(0.7)))
      >>> find_state(outer.init(jnp.ones(2)), SkipNonfiniteState).num_skipped
      Array(0, dtype=int32)
    """
    is_kind = lambda node: isinstance(node, kind)
    return next((n for n in jax.tree.leaves(state, is_leaf=is_kind) if is_kind(n)), None)


def anchor_of(state: Any) -> Any:
    """The anchor ``state`` holds (through the states it wraps), or ``None``.

    Example:
      >>> import jax.numpy as jnp, co2jax
      >>> outer = co2jax.skip_nonfinite(co2jax.error_feedback(co2jax.diloco(
      ...     co2jax.outer_sgd(0.7), reduce=co2jax.comm.all_gather_compressed(
      ...         co2jax.comm.int8(block=4)))))
      >>> anchor_of(outer.init({"w": jnp.ones(2)}))
      {'w': Array([1., 1.], dtype=float32)}
    """
    roles = roles_of(state)
    if roles.anchor is not None:
        return getattr(state, roles.anchor)
    if roles.wraps is not None:
        return anchor_of(getattr(state, roles.wraps))
    return None


class OuterOptimizer(NamedTuple):
    """An outer-optimizer algorithm as a tuple of pure functions and a static schedule.

    Attributes:
      init: ``init(params) -> state``, called per replica with that replica's parameters (all
        replicas start from the same parameters). Each state type documents which of its
        fields are replica-varying and which are replica-invariant.
      send: ``send(params, state, i) -> (payload, state)``: transfer ``i``'s payload from the
        replica's current parameters (and the state, which it may update).
      reducer: the cross-replica reduction (:class:`co2jax.comm.Reducer`).
      apply: ``apply(params, state, i, reduced) -> (params, state)``: transfer ``i``'s outer
        update from the reduced payload.
      schedule: the round's transfers (:class:`Transfer`), in order.
      replica_local: True when the anchor and outer state differ between replicas (eager
        updates), so a driver must keep them replica-varying.
      accepts_gathered: True when ``apply`` also takes the replicas' payloads un-reduced, as
        :class:`co2jax.kernels.Gathered` (a fused outer update averages them in its pass).
      period: the H the schedule's step numbers are for (``None``: any H).
      fused: True when ``apply`` is one fused outer update (:func:`co2jax.kernels.outer_update`,
        the Pallas kernel where ``implementation`` says).
      recovers_nonfinite: True when a non-finite round is survivable (set by
        :func:`co2jax.skip_nonfinite`): the engines then restart a poisoned replica from the
        anchor at the round's end (the round engine, :mod:`co2jax.engines.recovery`, which
        does so for any algorithm with an outer reduction and a shared anchor) or skip a
        non-finite inner step (``local_updates``, whose updates are additive and cannot undo
        a NaN).
    """

    init: Callable[[Params], State]
    send: Callable[[Params, State, int], tuple[Payload, State]]
    reducer: Reducer
    apply: Callable[[Params, State, int, Any], tuple[Params, State]]
    schedule: tuple[Transfer, ...] = SYNCHRONOUS
    replica_local: bool = False
    accepts_gathered: bool = False
    period: int | None = None
    recovers_nonfinite: bool = False
    fused: bool = False

    def reduce(self, payload: Payload) -> Any:
        """``reducer(payload)``."""
        return self.reducer(payload)

    @property
    def overlapped(self) -> bool:
        """Some transfer is sent before the step it is applied at."""
        return any(t.send != t.apply for t in self.schedule)

    def sync(self, params: Params, state: State) -> tuple[Params, State]:
        """Every transfer at once, after the round's inner steps: ``apply . reduce . send``.

        The round-level form of a schedule whose transfers are all applied after the last
        step and sent then or before the first (a payload sent at step 0 depends on the
        state only); a schedule that applies during the round (Streaming DiLoCo) raises.
        """
        for i, t in enumerate(self.schedule):
            if t.apply is not None or t.send not in (None, 0):
                raise ValueError(
                    f"transfer {i} of this outer optimizer is sent or applied during the round "
                    f"({t}); run it with co2jax.RoundTrainer or co2jax.local_updates"
                )
        # the round's actions in plan order (a payload sent at step 0 first, then every
        # apply), through the one executor; no inner step runs between them here
        return act(_RoundSync(self), (params, state), plan(resolve(self, self.period or 1)))


def payload_shapes(outer: OuterOptimizer, params: Params, state: State, i: int) -> Any:
    """``ShapeDtypeStruct``s of transfer ``i``'s payload (``send`` traced, nothing run).
    A ``send`` that reads the replica axis (a weight per replica, say) is traced with the
    axis bound where it is not (``jax.vmap(tx.init)`` of a per-step transform)."""
    send = lambda p, s: outer.send(p, s, i)[0]
    try:
        return jax.eval_shape(send, params, state)
    except NameError:
        one = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct((1, *x.shape), x.dtype), t)
        out = jax.eval_shape(jax.vmap(send, axis_name=REPLICA), one(params), one(state))
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), out)


def resolve(outer: OuterOptimizer, steps: int) -> tuple[Transfer, ...]:
    """``outer.schedule`` for rounds of ``steps`` inner steps: ``None`` replaced by H and
    every transfer checked (``0 <= send <= apply <= H``, ``apply >= 1``, chunks that fit)."""
    steps = check_int("sync_every", steps, 1)
    if outer.period is not None and outer.period != steps:
        raise ValueError(
            f"sync_every={steps} differs from the H this outer optimizer's schedule was made "
            f"for ({outer.period})"
        )
    if not outer.schedule:
        return ()
    out = []
    for i, t in enumerate(outer.schedule):
        send = steps if t.send is None else t.send
        apply = steps if t.apply is None else t.apply
        if not (0 <= send <= apply <= steps and apply >= 1):
            raise ValueError(
                f"transfer {i} must have 0 <= send <= apply <= H={steps} and apply >= 1, got "
                f"send={send}, apply={apply}"
            )
        span = max(1, apply - send)
        if isinstance(t.chunks, bool) or not isinstance(t.chunks, int) or not 1 <= t.chunks <= span:
            raise ValueError(
                f"transfer {i} (send={send}, apply={apply}) can be cut into 1..{span} chunks, "
                f"got chunks={t.chunks!r}"
            )
        out.append(Transfer(send, apply, t.chunks))
    return tuple(out)


def chunk_steps(t: Transfer) -> list[int]:
    """The step each chunk of a resolved transfer is sent at."""
    return [t.send + c for c in range(t.chunks)]


PHASE = {"sync": 0, "apply": 0, "send": 1, "chunk": 2}
"""The one phase table: at a boundary, the transfers applied there run first, then those sent
there, then the chunks due (every driver's walk orders its actions by :func:`action_key`)."""


def action_key(a: Action) -> tuple[int, int, int]:
    """Where ``a`` runs among the actions of its boundary: by :data:`PHASE`, then by transfer,
    then by chunk."""
    return PHASE[a.kind], a.transfer, a.chunk


def plan(transfers: tuple[Transfer, ...]) -> list[Action]:
    """The actions of a round, by boundary: first every transfer applied there (in schedule
    order; one sent there too is sent just before), then every transfer sent there and
    applied later, then the chunks due there."""
    actions = []
    for i, t in enumerate(transfers):
        if t.send == t.apply:
            actions.append(Action(t.apply, "sync", i))
            continue
        actions.append(Action(t.send, "send", i))
        for c, step in enumerate(chunk_steps(t)[1:], start=1):
            actions.append(Action(step, "chunk", i, c))
        actions.append(Action(t.apply, "apply", i))
    return sorted(actions, key=lambda a: (a.at, *action_key(a)))


def act(driver: Any, carry: Any, actions: tuple[Action, ...] | list[Action]) -> Any:
    """The one executor of a schedule's actions: runs ``actions`` in order through
    ``driver`` (its ``send(carry, i)``, ``chunk(carry, i, c)`` and ``apply(carry, i)``); a
    ``sync`` is a send then an apply of the same transfer. Every driver runs its actions
    here: the round engine and separate jobs through :func:`co2jax.engines.walk.run`, the
    per-step adapter one boundary at a time, :meth:`OuterOptimizer.sync` a whole round."""
    for a in actions:
        if a.kind in ("sync", "send"):
            carry = driver.send(carry, a.transfer)
        if a.kind == "chunk":
            carry = driver.chunk(carry, a.transfer, a.chunk)
        if a.kind in ("sync", "apply"):
            carry = driver.apply(carry, a.transfer)
    return carry


class _RoundSync:
    """:meth:`OuterOptimizer.sync`'s driver: each transfer reduced at its send and applied
    at its apply; the carry is ``(params, state)``."""

    def __init__(self, outer: OuterOptimizer):
        self.outer, self.reduced = outer, {}

    def send(self, carry, i):
        payload, state = self.outer.send(carry[0], carry[1], i)
        self.reduced[i] = self.outer.reducer(payload)
        return carry[0], state

    def chunk(self, carry, i, c):  # a round-level sync sends every transfer whole
        raise AssertionError(f"transfer {i} in chunks in a round-level sync")

    def apply(self, carry, i):
        return self.outer.apply(carry[0], carry[1], i, self.reduced.pop(i))


def spread(transfers: tuple[Transfer, ...], chunks=None) -> tuple[Transfer, ...]:
    """Resolved transfers with every overlapped one cut into chunks: ``chunks(transfer,
    i)`` of them (default: one per step it spans; capped at the span)."""
    out = []
    for i, t in enumerate(transfers):
        span = max(1, t.apply - t.send)
        k = span if chunks is None else chunks(t, i)
        out.append(t._replace(chunks=max(1, min(span, int(k)))))
    return tuple(out)
