"""The round engine: H inner steps and the outer communication of every replica as one program.

One call of :meth:`RoundTrainer.round` runs every replica's round on a ``(replica, data,
model)`` mesh, mapped by hand over ``replica`` only (:func:`co2jax.mesh.replica_map`): the H
inner steps as ``lax.scan`` loops (never unrolled) and the outer optimizer's schedule where
its steps fall (:mod:`co2jax.engines.walk`, run by :mod:`co2jax.engines.execute`). A delayed
algorithm's payload is sent before the loop and applied after it, with no data dependence
either way, so the compiler may run its reduction concurrently with the loop; a transfer in
chunks reduces chunk k inside iteration k, under that step's compute; Streaming DiLoCo's
fragments are sent and merged inside the iterations their steps fall in.

Inside a replica, the algorithm and the inner optimizer see whole logical tensors; how they
are split over ``data`` and ``model`` is a sharding the compiler keeps
(:mod:`co2jax.engines.layout`): the parameters as ``param_specs`` say (tensor parallelism),
with ``fsdp`` also over ``data``, and with ``shard_outer_state`` the outer state 1/D per
device. A layout changes no value. The inner step's gradient is data-parallel over the
replica's batch (:mod:`co2jax.engines.gradients`).
Per-replica state carries an explicit leading replica axis sharded over ``replica``
(parameters that entered replica-invariant would silently become data-parallel).

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
from co2jax._checks import check_flag, check_transform
from co2jax.algorithms.gpa import check_inner_under_outer
from co2jax.axes import DATA, MODEL, REPLICA, communicates
from co2jax.comm import policy
from co2jax.comm.participation import (
    check_participation,
    check_weighable,
    weighable,
    weighted,
)
from co2jax.comm.reducer import values
from co2jax.engines import walk as walker
from co2jax.engines.batches import check_batch, shapes_key
from co2jax.engines.execute import Carry, RoundDriver, Specs, cosine, inner_step
from co2jax.engines.layout import Layout, full_spec
from co2jax.engines.program import RoundPlan, RoundProgram, check_spread, choose
from co2jax.mesh import compiler_sharded, replica_map, replicas_per_slice, warn_hybrid
from co2jax.protocol import OuterOptimizer, resolve
from co2jax.tree import varying_like

REDUCER_CHOICES = policy.CHOICES


class TrainState(NamedTuple):
    """Per-replica training state; every leaf has a leading replica axis of size R.

    Attributes:
      params: each replica's parameters (replica-varying).
      inner_state: each replica's inner optimizer state (replica-varying, never reset).
      outer_state: the outer optimizer's state. Its replica-invariant fields hold R equal
        copies along the leading axis, one per replica group, which is where they live anyway.
      round: [R] int32, rounds completed.
      model_state: each replica's model state that is not parameters (an nnx model's
        ``BatchStat`` statistics, RNG keys and counts, counters; ``()`` for none): carried
        from step to step and round to round, never averaged or touched by the outer step.
    """

    params: optax.Params
    inner_state: optax.OptState
    outer_state: Any
    round: jax.Array
    model_state: Any = ()


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
      aux: the loss function's auxiliary outputs (``has_aux``), each leaf ``[R, H, ...]``
        (``{}`` without).
    """

    loss: jax.Array
    pseudo_gradient_norm: jax.Array
    cosine_to_mean: jax.Array
    bytes_communicated: jax.Array
    aux: Any = ()


class RoundTrainer:
    """Builds and runs the round program of an outer-optimizer algorithm on a mesh.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss over the examples of
        ``batch`` (``[b, ...]`` leaves): each ``data`` device takes the gradient on its slice
        of the replica's batch of the step and the slices' gradients are averaged (under
        FSDP the step gathers the parameters and keeps the batch split); either way, the
        whole batch's mean (:mod:`co2jax.engines.gradients`). With ``has_aux`` it returns
        ``(loss, aux)``, ``aux`` a pytree of means over the examples (accuracy, ...),
        reported per step in :attr:`RoundMetrics.aux`. A model with state that is not parameters
        (:meth:`init`'s ``model_state``; :class:`co2jax.NnxModel` builds all of this from an
        ``nnx.Module``) has ``loss_fn(params, batch, model_state) -> (loss, model_state)``,
        or ``(loss, (aux, model_state))`` with ``has_aux``; its step takes the replica's
        whole batch (the compiler splits it over ``data``).
      inner: the inner optax transform (any: it sees whole tensors at every layout).
      outer: an :class:`~co2jax.OuterOptimizer`.
      mesh: a mesh with ``"replica"`` and ``"data"`` axes, and optionally ``"model"`` (see
        :func:`co2jax.make_mesh`); its ``data`` and ``model`` axes are used as ``Auto``.
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
      param_specs: how each parameter is split inside a replica: a ``PartitionSpec`` (or
        ``None``) per parameter over ``model`` (tensor parallelism) and/or ``data``; default
        every parameter whole. The inner and outer state follow their parameters.
      shard_outer_state: split the outer state over ``data`` inside each replica (1/D).
      fsdp: also split the parameters and the inner optimizer state over ``data`` (FSDP /
        ZeRO-3 style). Implies ``shard_outer_state``.
      donate: donate the input state's buffers to the round's output.
      check_vma: ``shard_map``'s varying-axis type check. Leave it on, except for an outer
        optimizer built with ``implementation="interpret"``: Pallas' interpreter is not typed
        for it (compiled kernels are).
      exclude_nonfinite: leave a replica whose payload has a NaN or an Inf out of that
        reduction (its weight 0, :mod:`co2jax.comm.participation`) instead of averaging it.
        Needs an outer reduction and a replica-invariant anchor. Whatever the setting, a
        replica whose state went non-finite restarts from the anchor at the round's end
        (:mod:`co2jax.engines.recovery`).
      offload_outer_state: keep the outer state (anchor, momentum, payloads in flight,
        error-feedback residuals) in host memory (``memory_kind="pinned_host"``), moved to
        the accelerator for each outer send and apply and back after: the accelerator
        holds it only around the outer step (:class:`~co2jax.engines.execute.RoundDriver`).
        The same values; each round moves the outer state in and out once per send/apply.
      split_payload: each chunk of a spread transfer is split over the replica's devices,
        each sending its slice over the replica axis (the replica sends its payload once:
        :func:`co2jax.comm.policy.chunk_shards`). ``False``: every device sends the whole
        chunk (what the compiler does with a replicated payload; the same values). A payload
        sent in one piece, or by a reducer that is not ``splittable``, goes whole, except an
        overlapped one from a split outer state (``shard_outer_state``, ``fsdp``): that one
        stays split, so its all-gather stays in flight across the inner loop on TPU
        (:func:`co2jax.engines.program.splits_whole`).

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
        param_specs: Any = None,
        shard_outer_state: bool = False,
        fsdp: bool = False,
        donate: bool = True,
        check_vma: bool = True,
        exclude_nonfinite: bool = False,
        split_payload: bool = True,
        has_aux: bool = False,
        offload_outer_state: bool = False,
    ):
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable, got loss_fn={loss_fn!r}")
        self.inner = optax.with_extra_args_support(check_transform("inner", inner))
        if not isinstance(outer, OuterOptimizer):
            raise ValueError(f"outer must be a co2jax.OuterOptimizer, got outer={outer!r}")
        missing = {REPLICA, DATA} - set(mesh.axis_names)
        extra = set(mesh.axis_names) - {REPLICA, DATA, MODEL}
        if missing or extra:
            raise ValueError(
                f"mesh must have axes {REPLICA!r} and {DATA!r} (and optionally {MODEL!r}), got "
                f"mesh.axis_names={mesh.axis_names!r}"
            )
        self.transfers = resolve(outer, sync_every)
        self.spread = check_spread(spread)
        self.sync_every = sync_every
        self.reducer = policy.check_choice_for(reducer, outer.reducer)
        self.loss_fn, self.outer = loss_fn, outer
        self.mesh = compiler_sharded(mesh)
        self.replicas, self.data = mesh.shape[REPLICA], mesh.shape[DATA]
        self.platform = mesh.devices.flat[0].platform
        compilation_cache.guard(mesh.devices.flat)  # a warning: unsafe on a CPU mesh
        warn_hybrid(mesh)  # replicas sharing TPU slices: more DCN bytes than one per slice
        self.layout = Layout(dict(mesh.shape), shard_outer_state, fsdp)
        self.fsdp = self.layout.fsdp
        self.param_specs = param_specs
        self._donate = donate
        self._check_vma = bool(check_vma)
        self.exclude_nonfinite = check_flag("exclude_nonfinite", exclude_nonfinite)
        # a poisoned replica restarts from the shared anchor (co2jax.engines.recovery)
        self.restarts = outer.recovers_nonfinite or weighable(outer)
        if self.exclude_nonfinite:
            check_weighable(outer, "exclude_nonfinite=True")
        self.split_payload = check_flag("split_payload", split_payload)
        self.has_aux = check_flag("has_aux", has_aux)
        self.offload_outer_state = check_flag("offload_outer_state", offload_outer_state)
        self._programs: dict = {}
        self._inits: dict = {}
        self._specs: dict = {}
        self._checked: set = set()  # batch shapes checked, and "inner_local" once checked

    # ------------------------------------------------------------------------------------
    # state

    def _per_replica_specs(self, params: Any) -> Specs:
        """Per-replica specs of the state for one replica's parameter shapes."""
        key = shapes_key(params)
        if key not in self._specs:
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
            R, layout = self.replicas, self.layout
            param = layout.param_specs(shapes, self.param_specs)
            self._specs[key] = Specs(
                param,
                layout.inner_specs(self.inner.init, shapes, param, R),
                layout.outer_specs(self.outer.init, shapes, self.param_specs, R),
                layout.outer_param_specs(shapes, self.param_specs),
            )
        return self._specs[key]

    def state_specs(self, state: TrainState) -> TrainState:
        """The PartitionSpec of every leaf of ``state`` (leading replica axis included)."""
        one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
        specs = self._per_replica_specs(one)
        full = lambda tree, like: jax.tree.map(
            lambda s, x: full_spec(s, x.ndim - 1), tree, like, is_leaf=_is_spec
        )
        return TrainState(
            full(specs.params, state.params),
            full(specs.inner_state, state.inner_state),
            full(specs.outer_state, state.outer_state),
            P(REPLICA),
            jax.tree.map(lambda _: P(REPLICA), state.model_state),
        )

    def _shardings(self, specs):
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs, is_leaf=_is_spec)

    def _state_shardings(self, specs: TrainState) -> TrainState:
        """The state's shardings: the outer state's in host memory when offloaded."""
        shardings = self._shardings(specs)
        if not self.offload_outer_state:
            return shardings
        host = lambda s: s.with_memory_kind("pinned_host")
        return shardings._replace(outer_state=jax.tree.map(host, shardings.outer_state))

    def _init_unplaced(self, params: optax.Params, model_state: Any = ()) -> TrainState:
        stack = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (self.replicas, *x.shape)), t)
        stacked = stack(params)
        per_replica = lambda init: jax.vmap(init, axis_name=REPLICA)(stacked)
        return TrainState(
            stacked,
            per_replica(self.inner.init),
            per_replica(self.outer.init),
            jnp.zeros((self.replicas,), jnp.int32),
            replica_keys(stack(model_state)),
        )

    def abstract_state(self, params: optax.Params, model_state: Any = ()) -> TrainState:
        """``jax.ShapeDtypeStruct`` leaves with shardings: for AOT compilation and memory."""
        shapes = jax.eval_shape(self._init_unplaced, params, model_state)
        shardings = self._state_shardings(self.state_specs(shapes))
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
        )

    def init(self, params: optax.Params, model_state: Any = ()) -> TrainState:
        """Every replica starts from ``params`` (one replica's parameters, no leading axis)
        and ``model_state`` (its state that is not parameters, :attr:`TrainState.model_state`;
        every typed PRNG key in it gets the replica's index folded in, so replicas draw
        different dropout masks)."""
        for path, x in jax.tree_util.tree_leaves_with_path(params):
            spec = getattr(getattr(x, "sharding", None), "spec", ())
            if any(REPLICA in (e if isinstance(e, tuple) else (e,)) for e in spec):
                raise ValueError(
                    f"init takes one replica's parameters, without a replica axis; params"
                    f"{jax.tree_util.keystr(path)} is split over {REPLICA!r} ({spec}): pass "
                    "one replica's copy (e.g. jax.tree.map(lambda x: x[0], state.params))"
                )
        check_inner_under_outer(self.inner, self.outer, params)
        key = shapes_key((params, model_state))
        if key not in self._inits:  # one program per parameter shapes: a new seed reuses it
            abstract = jax.eval_shape(self._init_unplaced, params, model_state)
            shardings = self._state_shardings(self.state_specs(abstract))
            self._inits[key] = jax.jit(self._init_unplaced, out_shardings=shardings)
        return self._inits[key](params, model_state)

    # ------------------------------------------------------------------------------------
    # validation

    def check_batch(self, state: TrainState, batch: Any) -> None:
        """Raises ``ValueError`` unless every batch leaf is ``[replica, H, B, ...]``, D | B,
        and ``loss_fn`` returns a scalar on what it is handed
        (:func:`co2jax.engines.batches.check_batch`)."""
        stateful = bool(jax.tree.leaves(state.model_state))
        loss = lambda p, b, *m: self.engine_loss(p, b, *m)[0]
        args = self.replicas, self.sync_every, self.data, loss, self._checked
        whole = self.fsdp or stateful  # such a step takes the replica's whole batch
        slices = 1 if whole else self.data
        check_batch(state.params, batch, *args, slices=slices, model_state=state.model_state)

    def engine_loss(self, params, batch, model_state=()):
        """``loss_fn`` as the step calls it: ``(loss, (aux, model_state))`` (``aux`` ``{}``
        without ``has_aux``; ``model_state`` ``()`` for a model without one)."""
        stateful = bool(jax.tree.leaves(model_state))
        out = self.loss_fn(params, batch, model_state) if stateful else self.loss_fn(params, batch)
        if not (self.has_aux or stateful):
            return out, ({}, ())
        form = "(loss, (aux, model_state))" if self.has_aux and stateful else (
            "(loss, aux)" if self.has_aux else "(loss, model_state)"
        )  # fmt: skip
        if not (isinstance(out, tuple) and len(out) == 2):
            raise ValueError(f"loss_fn must return {form}, got {_described(out)}")
        loss, rest = out
        if self.has_aux and stateful:
            if not (isinstance(rest, tuple) and len(rest) == 2):
                raise ValueError(f"loss_fn must return {form}, got (loss, {_described(rest)})")
            return loss, rest
        return (loss, (rest, ())) if self.has_aux else (loss, ({}, rest))

    # ------------------------------------------------------------------------------------
    # the round

    def _body(self, plan: RoundPlan, specs: Specs, params, inner, outer, rnd, model, batch, part):
        weight, taken = part
        reducers = plan.reducers
        if weight is not None or self.exclude_nonfinite:
            w = jnp.float32(1) if weight is None else weight
            reducers = tuple(weighted(r, w, REPLICA, self.exclude_nonfinite) for r in reducers)
        step = inner_step(
            self.engine_loss, self.inner, specs, taken, not self.fsdp, self._check_vma
        )
        driver = RoundDriver(
            self.outer,
            plan.walk,
            reducers,
            step,
            batch,
            specs,
            plan.shards,
            self.offload_outer_state,
            plan.split,
        )
        count = len(plan.transfers)
        sums = varying_like(jnp.zeros((count, 3)), jax.lax.axis_index(REPLICA))
        start = Carry(params, inner, outer, sums, ((),) * count, model)
        carry = walker.run(plan.walk, driver, start)
        if self.restarts:
            carry = driver.restart_poisoned(carry, self.inner.init)
        norm, cos = jnp.float32(0), jnp.float32(0)
        if count:
            norm, cos = jnp.sqrt(jnp.sum(carry.sums[:, 0])), jnp.mean(cosine(carry.sums))
        metrics = RoundMetrics(
            jnp.concatenate(driver.losses),
            norm,
            cos,
            jnp.float32(plan.wire_bytes),
            driver.step_aux(),
        )
        state = carry.params, carry.inner_state, carry.outer_state, rnd + 1, carry.model_state
        return *state, metrics

    def _plan(self, state: TrainState) -> tuple[RoundPlan, Specs]:
        one = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), t)
        bare = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
        payload_shapes = [
            jax.eval_shape(
                jax.vmap(
                    lambda p, s, i=i: values(self.outer.send(p, s, i)[0]),
                    axis_name=REPLICA,
                    axis_size=self.replicas,
                ),
                bare(state.params),
                bare(state.outer_state),
            )
            for i in range(len(self.transfers))
        ]
        payload_shapes = [one(shapes) for shapes in payload_shapes]
        plan = choose(
            self.outer,
            self.transfers,
            self.sync_every,
            payload_shapes,
            reducer=self.reducer,
            spread=self.spread,
            platform=self.platform,
            replicas=self.replicas,
            split_state=self.layout.sharded,
            devices_per_replica=self.mesh.devices.size // self.replicas,
            split_payload=self.split_payload,
            shared_slices=replicas_per_slice(self.mesh) > 1,
        )
        return plan, self._per_replica_specs(one(state.params))

    def program(self, state: TrainState, weights: bool = False, steps: bool = False):
        """The round for states shaped like ``state`` (taking per-replica ``weights`` and
        ``steps`` when those are set): a :class:`~co2jax.engines.program.RoundProgram`, its
        plan (transfers, reducers, bytes) and the jitted function, built once per shapes."""
        key = shapes_key(state), (weights, steps)
        if key in self._programs:
            return self._programs[key]
        plan, specs = self._plan(state)
        out_shardings = (
            self._state_shardings(self.state_specs(state)),
            self._shardings(METRIC_SPECS),
        )
        body = replica_map(
            lambda p, i, o, r, m, b, w: self._body(plan, specs, p, i, o, r, m, b, w),
            self.mesh,
            check_vma=self._check_vma,
        )
        fn = jax.jit(
            lambda s, b, w=(None, None): (lambda *o: (TrainState(*o[:5]), o[5]))(*body(*s, b, w)),
            out_shardings=(TrainState(*out_shardings[0]), out_shardings[1]),
            donate_argnums=(0,) if self._donate else (),
            compiler_options=policy.compiler_options(self.platform, plan.reducers, self.replicas)
            or None,
        )
        self._programs[key] = RoundProgram(plan, fn)
        return self._programs[key]

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
        if weights is not None or steps is not None or self.exclude_nonfinite:
            self.check_inner_is_local(state)
        flags = tuple(x is not None for x in part)
        return self.program(state, *flags).fn(state, self.place_batch(batch), part)

    def check_inner_is_local(self, state: TrainState) -> None:
        """Raises ``ValueError`` when the inner transform communicates over the replica axis
        (SPARTA's every-step averaging, DDP's gradient mean): a weight, a step count or
        ``exclude_nonfinite`` cannot leave a replica out of an exchange inside its inner
        steps (a poisoned replica has already reached the others). Traced once when it passes."""
        if "inner_local" in self._checked:
            return
        one = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
        params, inner = (jax.tree.map(one, t) for t in (state.params, state.inner_state))
        step = lambda g, s, p: self.inner.update(g, s, p)[0]
        if communicates(step, (params, inner, params), REPLICA):
            raise ValueError(
                "participation weights, per-replica steps and exclude_nonfinite: the inner "
                f"transform communicates over {REPLICA!r} every step (SPARTA, data parallel), "
                "so a replica cannot be left out of a round"
            )
        self._checked.add("inner_local")

    def place_batch(self, batch: Any) -> Any:
        """Puts ``batch`` ([R, H, B, ...] leaves) on the mesh: replica and data sharded."""
        sharding = NamedSharding(self.mesh, P(REPLICA, None, DATA))
        return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)

    def lower(self, state: TrainState, batch: Any):
        """``jax.stages.Lowered`` of the round (concrete or ``ShapeDtypeStruct`` arguments)."""
        self.check_batch(state, batch)
        sharding = NamedSharding(self.mesh, P(REPLICA, None, DATA))
        batch = jax.tree.map(
            lambda x: (
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
                if isinstance(x, jax.ShapeDtypeStruct)
                else jax.device_put(x, sharding)
            ),
            batch,
        )
        return self.program(state).fn.lower(state, batch)


METRIC_SPECS = RoundMetrics(P(REPLICA), P(REPLICA), P(REPLICA), P(REPLICA), P(REPLICA))


def replica_keys(model_state: Any) -> Any:
    """``model_state`` (leaves ``[R, ...]``) with replica r's typed PRNG keys folded with r:
    each replica draws its own random numbers from the same seed."""

    def fold(x):
        if not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return x
        return jax.vmap(jax.random.fold_in)(x, jnp.arange(x.shape[0], dtype=jnp.uint32))

    return jax.tree.map(fold, model_state)


def _described(x: Any) -> str:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"an array of shape {tuple(x.shape)}"
    return f"a {type(x).__name__}"


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)
