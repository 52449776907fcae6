"""The round engine: H inner steps and the outer communication of every replica as one program.

One call of :meth:`RoundTrainer.round` runs, on every device of a ``(replica, data, model)``
mesh (``jax.shard_map``), the H inner steps as one ``lax.scan`` (never unrolled): gradients
averaged over ``data`` inside the replica, nothing over ``replica``. The outer optimizer's
schedule (:func:`co2jax.protocol.plan`) runs where its steps fall
(:mod:`co2jax.engines.execute`): a delayed algorithm's payload is sent before the loop and
applied after it, with no data dependence either way, so the compiler may run its reduction
concurrently with the loop; a transfer in chunks reduces chunk k inside iteration k, under
that step's compute; Streaming DiLoCo's fragments are sent and merged inside the iterations
their steps fall in.

Per-replica state carries an explicit leading replica axis sharded over ``replica``
(parameters that entered replica-invariant would silently become data-parallel). With
``shard_outer_state=True`` the outer step runs on 1/D of every parameter-shaped leaf per
device, and with ``fsdp=True`` the parameters and inner state are sharded too
(:mod:`co2jax.engines.sharding`). Both need element-wise optimizers (every co2jax algorithm,
AdamW and SGD are).

Example:
  >>> import jax, jax.numpy as jnp, optax, co2jax
  >>> mesh = co2jax.make_mesh(replica=1, data=1, devices=jax.devices()[:1])
  >>> loss = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
  >>> trainer = co2jax.RoundTrainer(loss, optax.sgd(0.1), co2jax.local_sgd(), mesh, sync_every=4)
  >>> state = trainer.init({"w": jnp.zeros(())})
  >>> batch = {"x": jnp.ones((1, 4, 8)), "y": 2 * jnp.ones((1, 4, 8))}  # [R, H, B]
  >>> state, metrics = trainer.round(state, batch)
  >>> metrics.loss.shape, round(float(state.params["w"][0]), 4)
  ((1, 4), 1.1808)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from co2jax import compilation_cache
from co2jax._checks import check_transform
from co2jax.axes import DATA, REPLICA
from co2jax.comm import chunks, policy
from co2jax.comm.participation import check_participation, weighted
from co2jax.comm.reducer import values
from co2jax.engines.batches import check_batch, shapes_key
from co2jax.engines.execute import Carry, RoundSchedule, _like
from co2jax.engines.sharding import Layout
from co2jax.kernels.api import target_backend
from co2jax.protocol import OuterOptimizer, resolve
from co2jax.protocol import spread as spread_transfers
from co2jax.tree import tree_all_finite, tree_bytes, tree_select

REDUCER_CHOICES = policy.CHOICES


class TrainState(NamedTuple):
    """Per-replica training state; every leaf has a leading replica axis of size R.

    Attributes:
      params: each replica's parameters (replica-varying).
      inner_state: each replica's inner optimizer state (replica-varying, never reset).
      outer_state: the outer optimizer's state. Its replica-invariant fields hold R equal
        copies along the leading axis, one per replica group, which is where they live anyway.
      round: [R] int32, rounds completed.
    """

    params: optax.Params
    inner_state: optax.OptState
    outer_state: Any
    round: jax.Array


class RoundMetrics(NamedTuple):
    """What one round reports (leading axis: replica).

    Attributes:
      loss: [R, H] the loss of every inner step (mean over the replica's data shards).
      pseudo_gradient_norm: [R] L2 norm of what this replica put on the wire this round (all
        transfers together; decoded values of a compressed payload).
      cosine_to_mean: [R] cosine between that payload and the replicas' reduced mean (1 when
        replicas agree; mean over the round's transfers; for delayed algorithms, of the
        earlier round's payload).
      bytes_communicated: [R] bytes this replica sent over the replica axis this round (each
        reducer's ``wire_bytes``).
    """

    loss: jax.Array
    pseudo_gradient_norm: jax.Array
    cosine_to_mean: jax.Array
    bytes_communicated: jax.Array


class RoundTrainer:
    """Builds and runs the round program of an outer-optimizer algorithm on a mesh.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` for one inner step on one device's slice
        of the batch.
      inner: the inner optax transform.
      outer: an :class:`~co2jax.OuterOptimizer`.
      mesh: a mesh with ``"replica"`` and ``"data"`` axes (see :func:`co2jax.make_mesh`).
      sync_every: H, inner steps per round.
      reducer: ``"auto"`` (:func:`co2jax.comm.policy.select`: an exact mean the target
        overlaps; a compressed or other specific reduction is kept), ``"outer"`` (the
        algorithm's own), or an exact mean (``"pmean"``, ``"all_gather"``, ``"ring"``) in
        place of the algorithm's exact mean.
      spread: cut every overlapped transfer (sent before the step it is applied at) into
        chunks reduced one per inner step, each under that step's compute: ``None`` (auto:
        on TPU, :func:`co2jax.comm.policy.spreads`), ``True``, ``False``, or a chunk count.
        The auto count is a chunk per step, each at least 1 MiB
        (:func:`co2jax.comm.policy.chunk_count`). The result equals the unspread round's
        (chunks are cut on the payload's wire form, :mod:`co2jax.comm.chunks`).
      shard_outer_state: shard the outer state over ``data`` inside each replica.
      fsdp: also shard the parameters and the inner optimizer state over ``data`` (FSDP /
        ZeRO-3 style). Implies ``shard_outer_state``; needs an element-wise inner optimizer.
      donate: donate the input state's buffers to the round's output.
      check_vma: ``shard_map``'s varying-axis type check. Leave it on, except for an outer
        optimizer built with ``implementation="interpret"``: Pallas' interpreter is not typed
        for it (compiled kernels are).
      exclude_nonfinite: leave a replica whose payload has a NaN or an Inf out of that
        reduction (its weight 0, :mod:`co2jax.comm.participation`) instead of averaging it.

    Participation (:meth:`round`'s ``weights``, ``steps``): each reduction is weighted
    (:func:`co2jax.comm.weighted`); every replica applies the same reduced payload, so a
    left-out replica continues from the new anchor like the others.
    """

    def __init__(
        self,
        loss_fn: Callable[[optax.Params, Any], jax.Array],
        inner: optax.GradientTransformation,
        outer: OuterOptimizer,
        mesh: jax.sharding.Mesh,
        sync_every: int,
        *,
        reducer: str = "auto",
        spread: bool | int | None = None,
        shard_outer_state: bool = False,
        fsdp: bool = False,
        donate: bool = True,
        check_vma: bool = True,
        exclude_nonfinite: bool = False,
    ):
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable, got loss_fn={loss_fn!r}")
        self.inner = optax.with_extra_args_support(check_transform("inner", inner))
        if not isinstance(outer, OuterOptimizer):
            raise ValueError(f"outer must be a co2jax.OuterOptimizer, got outer={outer!r}")
        missing = {REPLICA, DATA} - set(mesh.axis_names)
        if missing:
            raise ValueError(
                f"mesh must have axes {REPLICA!r} and {DATA!r}, got mesh.axis_names="
                f"{mesh.axis_names!r}"
            )
        self.transfers = resolve(outer, sync_every)
        if not (
            spread is None or isinstance(spread, bool) or (isinstance(spread, int) and spread >= 1)
        ):
            raise ValueError(
                f"spread must be None, True, False or a chunk count >= 1, got spread={spread!r}"
            )
        self.spread = spread
        self.sync_every = sync_every
        self.reducer = policy.check_choice_for(reducer, outer.reducer)
        self.loss_fn, self.outer, self.mesh = loss_fn, outer, mesh
        self.replicas, self.data = mesh.shape[REPLICA], mesh.shape[DATA]
        self.platform = mesh.devices.flat[0].platform
        compilation_cache.guard(mesh.devices.flat)  # a warning: unsafe on a CPU mesh
        self.layout = Layout(self.data, shard_outer_state, fsdp)
        self.fsdp = self.layout.fsdp
        self.reducers: tuple = ()  # per transfer, chosen when a program is built
        self.run = self.transfers  # the transfers as the program runs them (chunks)
        self.reducer_kind: str | None = None if reducer == "auto" else reducer
        self._donate = donate
        self._check_vma = bool(check_vma)
        self.exclude_nonfinite = bool(exclude_nonfinite)
        self._compiled: dict = {}
        self._inits: dict = {}
        self._checked: set = set()

    # ------------------------------------------------------------------------------------
    # state

    def state_specs(self, state: TrainState) -> TrainState:
        """The PartitionSpec of every leaf of ``state`` (leading replica axis included)."""
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
        return TrainState(
            self.layout.param_specs(state.params),
            self.layout.param_specs(state.inner_state),
            self.layout.outer_specs(self.outer.init, one),
            P(REPLICA),
        )

    def _shardings(self, specs):
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )

    def _init_unplaced(self, params: optax.Params) -> TrainState:
        stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (self.replicas, *x.shape)), params)
        return TrainState(
            stacked,
            jax.vmap(self.inner.init)(stacked),
            jax.vmap(self.outer.init)(stacked),
            jnp.zeros((self.replicas,), jnp.int32),
        )

    def abstract_state(self, params: optax.Params) -> TrainState:
        """``jax.ShapeDtypeStruct`` leaves with shardings: for AOT compilation and memory."""
        shapes = jax.eval_shape(self._init_unplaced, params)
        shardings = self._shardings(self.state_specs(shapes))
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
        )

    def init(self, params: optax.Params) -> TrainState:
        """Every replica starts from ``params`` (one replica's parameters, no leading axis)."""
        key = shapes_key(params)
        if key not in self._inits:  # one program per parameter shapes: a new seed reuses it
            abstract = jax.eval_shape(self._init_unplaced, params)
            shardings = self._shardings(self.state_specs(abstract))
            self._inits[key] = jax.jit(self._init_unplaced, out_shardings=shardings)
        return self._inits[key](params)

    # ------------------------------------------------------------------------------------
    # validation

    def check_batch(self, state: TrainState, batch: Any) -> None:
        """Raises ``ValueError`` unless every batch leaf is ``[replica, H, B, ...]``, D | B,
        and ``loss_fn`` returns a scalar on one device's slice
        (:func:`co2jax.engines.batches.check_batch`)."""
        args = self.replicas, self.sync_every, self.data, self.loss_fn, self._checked
        check_batch(state.params, batch, *args)

    # ------------------------------------------------------------------------------------
    # the schedule, as segment events

    def _choose(self, payload_shapes: list) -> tuple:
        chosen = [
            policy.select(
                self.outer.reducer,
                self.reducer,
                platform=self.platform,
                replicas=self.replicas,
                payload_elements=sum(x.size for x in jax.tree.leaves(shapes)),
                overlapped=t.send < t.apply,
                # spread, every overlapped transfer is reduced in pieces inside its steps
                whole=t.chunks == 1 and (self.run == self.transfers or t.send == t.apply),
                accepts_gathered=self.outer.accepts_gathered,
                axis_name=REPLICA,
            )
            for t, shapes in zip(self.run, payload_shapes, strict=True)
        ]
        kinds = {kind for kind, _ in chosen}
        self.reducer_kind = kinds.pop() if len(kinds) == 1 else "/".join(k for k, _ in chosen)
        return tuple(r for _, r in chosen)

    def _spread(self, payload_shapes: list) -> tuple:
        """The transfers as this program runs them: overlapped ones in chunks where spread."""
        spread = self.spread
        if spread is not None and spread is not False and not self.outer.reducer.chunkable:
            raise ValueError(
                f"spread={spread!r}: the reducer {self.outer.reducer.name!r} sends its payload "
                "only whole (it cannot be cut into chunks); use spread=None or False"
            )
        if spread is None:
            spread = policy.spreads(self.platform) and self.outer.reducer.chunkable
        if spread is False:
            return self.transfers
        if spread is True:
            count = lambda t, i: policy.chunk_count(t.apply - t.send, tree_bytes(payload_shapes[i]))
        else:
            count = lambda t, i: spread
        return spread_transfers(self.transfers, count)

    def _wire_bytes(self, payload_shapes: list, reducers: tuple) -> float:
        """Bytes one replica sends per round: every transfer (every chunk) by its reducer."""
        total = 0.0
        for t, shapes, reducer in zip(self.run, payload_shapes, reducers, strict=True):
            if t.chunks == 1:
                total += reducer.wire_bytes(shapes, self.replicas)
                continue
            plan = chunks.plan(shapes, reducer, t.chunks)
            piece = [
                jax.ShapeDtypeStruct(plan.piece_shape(g), plan.dtypes[g])
                for g in range(len(plan.units))
            ]
            total += t.chunks * reducer.wire_bytes(piece, self.replicas)
        return total

    # ------------------------------------------------------------------------------------
    # the round

    def _body(self, payload_shapes, param_shapes, reducers, params, inner, outer, rnd, batch, part):
        squeeze = lambda t: jax.tree.map(lambda x: x[0], t)
        params, inner, outer, rnd, batch, part = map(
            squeeze, (params, inner, outer, rnd, batch, part)
        )
        weight, taken = part
        if weight is not None or self.exclude_nonfinite:
            w = jnp.float32(1) if weight is None else weight
            reducers = tuple(weighted(r, w, REPLICA, self.exclude_nonfinite) for r in reducers)
        layout = self.layout
        schedule = RoundSchedule(
            self.outer,
            self.run,
            reducers,
            layout,
            self.sync_every,
            payload_shapes,
        )
        inflight = ((),) * len(self.transfers)
        carry = Carry(params, inner, outer, jnp.zeros((len(self.transfers), 3)), inflight)
        store, plans, losses = {}, {}, []

        def step(c: Carry, xs, segment) -> tuple[Carry, jax.Array]:
            b, k = xs
            c = schedule.in_step(k, c, plans, segment)
            # gradients are averaged over the data shards explicitly; nothing crosses
            # "replica" here
            full = layout.gather_params(c.params, param_shapes)
            loss, grads = jax.value_and_grad(self.loss_fn)(full, b)
            grads = layout.reduce_grads(grads, param_shapes, c.params)
            updates, inner_state = self.inner.update(grads, c.inner_state, c.params)
            p = optax.apply_updates(c.params, updates)
            if taken is not None:  # a replica with fewer steps this round holds after them
                p, inner_state = tree_select(k < taken, (p, inner_state), (c.params, c.inner_state))
            c = c._replace(params=p, inner_state=inner_state)
            return c, jax.lax.pmean(loss, DATA)

        steps = jnp.arange(self.sync_every, dtype=jnp.int32)
        for start, stop in schedule.segments():
            carry = schedule.boundary(start, carry, store, plans)
            xs = jax.tree.map(lambda x, a=start, b=stop: x[a:b], (batch, steps))
            if stop - start == 1:  # one step: straight-line code, not a loop of one
                carry, loss = step(carry, jax.tree.map(lambda x: x[0], xs), (start, stop))
                losses.append(loss[None])
                continue
            carry, seg = jax.lax.scan(lambda c, x, s=(start, stop): step(c, x, s), carry, xs)
            losses.append(seg)
        carry = schedule.boundary(self.sync_every, carry, store, plans)
        if self.outer.recovers_nonfinite:
            carry = carry._replace(inner_state=self._reset_nonfinite(carry))
        losses = jnp.concatenate(losses)
        norm, cosine = schedule.metrics(carry)
        nbytes = self._wire_bytes(payload_shapes, reducers)
        metrics = RoundMetrics(losses, norm, cosine, jnp.asarray(nbytes, jnp.float32))
        out = (carry.params, carry.inner_state, carry.outer_state, rnd + 1)
        return jax.tree.map(lambda x: x[None], (*out, metrics))

    def _reset_nonfinite(self, c: Carry):
        """The inner state, or ``inner.init`` of the parameters where it is not finite
        (decided per replica, over all of its data shards)."""
        ok = tree_all_finite(c.inner_state)
        kind = getattr(jax.typeof(ok), "manual_axis_type", None)
        axes = tuple(sorted(set(kind.varying) - {REPLICA})) if kind is not None else ()
        if axes:
            ok = jax.lax.pmin(ok.astype(jnp.int32), axes) > 0
        fresh = _like(self.inner.init(c.params), c.inner_state)
        return tree_select(ok, c.inner_state, fresh)

    def round_fn(self, state: TrainState, weights: bool = False, steps: bool = False):
        """The jitted, shard_map'd round for states shaped like ``state`` (taking per-replica
        ``weights`` and ``steps`` when those are set)."""
        specs = self.state_specs(state)
        one = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), t)
        param_shapes, outer_shapes = one(state.params), one(state.outer_state)
        payload_shapes = [
            jax.eval_shape(
                lambda p, s, i=i: values(self.outer.send(p, s, i)[0]), param_shapes, outer_shapes
            )
            for i in range(len(self.transfers))
        ]
        self.run = self._spread(payload_shapes)
        reducers = self._choose(payload_shapes)
        self.reducers = reducers
        metric_spec = RoundMetrics(P(REPLICA), P(REPLICA), P(REPLICA), P(REPLICA))
        part = (P(REPLICA) if weights else None, P(REPLICA) if steps else None)
        fn = jax.shard_map(
            lambda p, i, o, r, b, w: self._body(
                payload_shapes, param_shapes, reducers, p, i, o, r, b, w
            ),
            mesh=self.mesh,
            in_specs=(*specs, P(REPLICA, None, DATA), part),
            out_specs=(*specs, metric_spec),
            check_vma=self._check_vma,
        )
        return jax.jit(
            lambda s, b, w=(None, None): (lambda *o: (TrainState(*o[:4]), o[4]))(*fn(*s, b, w)),
            donate_argnums=(0,) if self._donate else (),
        )

    def _get(self, state, part=(None, None)):
        flags = tuple(x is not None for x in part)
        key = shapes_key(state), flags
        if key not in self._compiled:
            self._compiled[key] = self.round_fn(state, *flags)
        return self._compiled[key]

    def participation(self, weights=None, steps=None) -> tuple:
        """``(weights, steps)`` checked (:func:`co2jax.comm.participation.check_participation`)
        and placed over ``replica`` (``None`` stays ``None``)."""
        w, n = check_participation(self.outer, self.replicas, self.sync_every, weights, steps)
        where = NamedSharding(self.mesh, P(REPLICA))
        return tuple(x if x is None else jax.device_put(x, where) for x in (w, n))

    def round(
        self, state: TrainState, batch: Any, weights=None, steps=None
    ) -> tuple[TrainState, RoundMetrics]:
        """One round: H inner steps per replica on ``batch`` ([R, H, B, ...]) and the
        schedule's transfers; ``weights`` and ``steps`` ([R]) as
        :func:`co2jax.comm.participation.check_participation` says."""
        self.check_batch(state, batch)
        part = self.participation(weights, steps)
        with target_backend(self.platform):  # fused updates are traced for the mesh's platform
            return self._get(state, part)(state, self.place_batch(batch), part)

    def place_batch(self, batch: Any) -> Any:
        """Puts ``batch`` ([R, H, B, ...] leaves) on the mesh: replica and data sharded."""
        sharding = NamedSharding(self.mesh, P(REPLICA, None, DATA))
        return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)

    def lower(self, state: TrainState, batch: Any):
        """``jax.stages.Lowered`` of the round (concrete or ``ShapeDtypeStruct`` arguments)."""
        self.check_batch(state, batch)
        with target_backend(self.platform):
            return self._get(state).lower(state, batch)
