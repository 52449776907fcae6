"""The round engine: H inner steps and the sync of every replica as one compiled program.

One call of :meth:`RoundTrainer.round` runs, on every device of a ``(replica, data, model)``
mesh (``jax.shard_map``):

1. for a delayed algorithm (``outer.staleness >= 1``), the reduction over ``replica`` of the
   payload produced in an earlier round, issued *before* the inner loop and consumed only after
   it: no data dependence either way, so the compiler may run it concurrently with the loop;
2. H inner steps as one ``lax.scan`` (never unrolled): gradients averaged over ``data``
   inside the replica, nothing over ``replica``;
3. for a synchronous algorithm, the reduction of this round's payload;
4. the outer update, then every replica restarts from what it returned.

The communication is expressed as :mod:`co2jax.segments` events (issue at one step, consume at
a later one), the mechanism Streaming DiLoCo's fragments reuse.

Per-replica state carries an explicit leading replica axis sharded over ``replica``
(parameters that entered replica-invariant would silently become data-parallel). With
``shard_outer_state=True`` the outer state (anchor, momentum, in-flight pseudo-gradients) is
also sharded over ``data`` inside each replica (ZeRO-1 style): each device holds, reduces and
updates 1/D of it, and the new parameters are rebuilt over ``data``. With ``fsdp=True`` the
parameters and the inner optimizer state are sharded the same way (FSDP / ZeRO-3): each inner
step all-gathers the parameters over ``data`` and reduce-scatters the gradients, and the outer
step runs on the shards in place. Both need element-wise optimizers (every co2jax algorithm,
AdamW and SGD are). A leaf is split along its largest dim that ``data`` divides; a leaf with
none stays whole on every device.

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

from co2jax import reducers as _reducers
from co2jax._base import OuterOptimizer, check_int, check_transform
from co2jax.kernels.api import target_backend
from co2jax.kernels.layout import Gathered
from co2jax.mesh import DATA, REPLICA
from co2jax.segments import Consume, Issue, scan_segments
from co2jax.streaming import StreamingOuter

REDUCER_CHOICES = ("auto", "outer", *_reducers.KINDS)


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


class _Carry(NamedTuple):
    params: optax.Params
    inner_state: optax.OptState
    outer_state: Any
    norm: jax.Array
    cosine: jax.Array


class RoundMetrics(NamedTuple):
    """What one round reports (leading axis: replica).

    Attributes:
      loss: [R, H] the loss of every inner step (mean over the replica's data shards).
      pseudo_gradient_norm: [R] L2 norm of the payload this replica put on the wire.
      cosine_to_mean: [R] cosine between that payload and the replicas' reduced mean (1 when
        replicas agree; for delayed algorithms, of the earlier round's payload).
      bytes_communicated: [R] bytes this replica sent over the replica axis this round
        (ring model of the chosen reducer; see :func:`co2jax.reducers.wire_bytes`).
    """

    loss: jax.Array
    pseudo_gradient_norm: jax.Array
    cosine_to_mean: jax.Array
    bytes_communicated: jax.Array


def _shard_dim(shape: tuple[int, ...], parts: int) -> int | None:
    """The dim a leaf is sharded on over ``data``: the largest one ``parts`` divides."""
    if parts <= 1:
        return None
    dims = [d for d in range(len(shape)) if shape[d] % parts == 0 and shape[d] >= parts]
    return max(dims, key=lambda d: (shape[d], -d)) if dims else None


ALL_GATHER_LIMIT = 256 * 2**20
"""Largest ``R * payload`` (float32 bytes) the auto policy all-gathers on TPU."""


def auto_reducer(platform: str, replicas: int, staleness: int, payload_elements: int = 0) -> str:
    """The reducer the engine picks: one the target compiler overlaps with the inner loop.

    A synchronous sync cannot overlap anything, so it uses the all-reduce. A delayed one uses,
    on TPU, the all-gather (one asynchronous collective around the loop) while R <= 4 and the R
    gathered float32 copies of the payload stay under :data:`ALL_GATHER_LIMIT`, else the
    ppermute ring (two chunk buffers; its last step overlaps). The limit is measured: for a
    1B-parameter model on a v5e slice the all-gather round needed 26 GiB of temporaries
    (unsharded; HBM is 16 GiB) and 400 s to compile (sharded), the all-reduce round 3 GiB and
    11 s (``benchmarks/README.md``). Elsewhere the all-reduce (asynchronous by default on GPU;
    XLA:CPU runs every collective synchronously). See ``docs/overlap.md``.
    """
    if staleness == 0 or platform != "tpu":
        return "pmean"
    gathered = replicas * payload_elements * 4  # the all-gather reducer sums in float32
    if replicas <= 4 and gathered <= ALL_GATHER_LIMIT:
        return "all_gather"
    return "ring"


class RoundTrainer:
    """Builds and runs the round program of an outer-optimizer algorithm on a mesh.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` for one inner step on one device's slice
        of the batch.
      inner: the inner optax transform.
      outer: an :class:`~co2jax.OuterOptimizer`.
      mesh: a mesh with ``"replica"`` and ``"data"`` axes (see :func:`co2jax.make_mesh`).
      sync_every: H, inner steps per round.
      reducer: ``"auto"`` (see :func:`auto_reducer`; an algorithm whose ``reduce`` is a
        compressed collective, :func:`co2jax.compression.all_gather_compressed`, keeps it),
        ``"outer"`` (the algorithm's own ``reduce``), or one of ``co2jax.reducers.KINDS``.
      shard_outer_state: shard the outer state over ``data`` inside each replica.
      fsdp: also shard the parameters and the inner optimizer state over ``data`` (FSDP /
        ZeRO-3 style): each inner step all-gathers the parameters over ``data`` for the
        forward and backward pass and reduce-scatters the gradients; the outer step runs on
        the shards in place. Implies ``shard_outer_state``; needs an element-wise inner
        optimizer (AdamW, SGD, ...).
      donate: donate the input state's buffers to the round's output.
      check_vma: ``shard_map``'s varying-axis type check. Leave it on, except for an outer
        optimizer built with ``implementation="interpret"``: Pallas' interpreter is not typed
        for it (compiled kernels are).
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
        shard_outer_state: bool = False,
        fsdp: bool = False,
        donate: bool = True,
        check_vma: bool = True,
    ):
        if not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable, got loss_fn={loss_fn!r}")
        self.inner = optax.with_extra_args_support(check_transform("inner", inner))
        if not isinstance(outer, (OuterOptimizer, StreamingOuter)):
            raise ValueError(
                f"outer must be a co2jax.OuterOptimizer or StreamingOuter, got outer={outer!r}"
            )
        self.streaming = isinstance(outer, StreamingOuter)
        if self.streaming and (shard_outer_state or fsdp):
            raise ValueError(
                "Streaming DiLoCo runs with whole outer state: got shard_outer_state="
                f"{shard_outer_state!r}, fsdp={fsdp!r}"
            )
        if self.streaming and outer.sync_every != sync_every:
            raise ValueError(
                f"sync_every={sync_every!r} differs from the streaming schedule's "
                f"sync_every={outer.sync_every!r}"
            )
        missing = {REPLICA, DATA} - set(mesh.axis_names)
        if missing:
            raise ValueError(
                f"mesh must have axes {REPLICA!r} and {DATA!r}, got mesh.axis_names="
                f"{mesh.axis_names!r}"
            )
        self.sync_every = check_int("sync_every", sync_every, 1)
        if reducer not in REDUCER_CHOICES:
            raise ValueError(f"reducer must be one of {REDUCER_CHOICES}, got reducer={reducer!r}")
        self.loss_fn, self.outer, self.mesh = loss_fn, outer, mesh
        self.replicas, self.data = mesh.shape[REPLICA], mesh.shape[DATA]
        self.platform = mesh.devices.flat[0].platform
        self.reducer = reducer
        self.reducer_kind = None if reducer == "auto" else reducer  # auto: set per program
        self.fsdp = bool(fsdp)
        self.shard_outer_state = bool(shard_outer_state) or self.fsdp
        self._donate = donate
        self._check_vma = bool(check_vma)
        self._compiled: dict = {}

    # ------------------------------------------------------------------------------------
    # shardings

    def _outer_dim(self, shape) -> int | None:
        return _shard_dim(tuple(shape), self.data) if self.shard_outer_state else None

    def _outer_spec(self, leaf) -> P:
        # full-length specs, so that the shardings jit returns equal the ones init makes
        spec = [REPLICA] + [None] * (len(leaf.shape) - 1)
        dim = self._outer_dim(leaf.shape[1:])
        if dim is not None:
            spec[1 + dim] = DATA
        return P(*spec)

    def state_specs(self, state: TrainState) -> TrainState:
        """The PartitionSpec of every leaf of ``state`` (leading replica axis included)."""
        if self.fsdp:
            rep = lambda tree: jax.tree.map(self._outer_spec, tree)
        else:
            rep = lambda tree: jax.tree.map(lambda x: P(REPLICA, *[None] * (x.ndim - 1)), tree)
        return TrainState(
            rep(state.params),
            rep(state.inner_state),
            jax.tree.map(self._outer_spec, state.outer_state),
            P(REPLICA),
        )

    def _shardings(self, specs):
        return jax.tree.map(
            lambda s: NamedSharding(self.mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
        )

    # ------------------------------------------------------------------------------------
    # state

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
        abstract = jax.eval_shape(self._init_unplaced, params)
        shardings = self._shardings(self.state_specs(abstract))
        return jax.jit(self._init_unplaced, out_shardings=shardings)(params)

    # ------------------------------------------------------------------------------------
    # validation

    def check_batch(self, state: TrainState, batch: Any) -> None:
        """Raises ``ValueError`` unless every batch leaf is ``[replica, H, B, ...]``, D | B,
        and ``loss_fn`` returns a scalar on one device's slice."""
        leaves = jax.tree_util.tree_leaves_with_path(batch)
        if not leaves:
            raise ValueError("batch must have at least one array leaf")
        for path, leaf in leaves:
            shape = tuple(jnp.shape(leaf))
            name = jax.tree_util.keystr(path) or "batch"
            if len(shape) < 3:
                raise ValueError(
                    f"batch leaf {name} must be [replica, H, batch, ...], got shape {shape}"
                )
            if shape[0] != self.replicas or shape[1] != self.sync_every:
                raise ValueError(
                    f"batch leaf {name} has shape {shape}: its leading dims must be "
                    f"(replica={self.replicas}, H={self.sync_every}, ...)"
                )
            if shape[2] % self.data:
                raise ValueError(
                    f"batch leaf {name} has shape {shape}: its batch dim {shape[2]} must be a "
                    f"multiple of the data axis size {self.data}"
                )
        params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), state.params)
        one = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((x.shape[2] // self.data, *x.shape[3:]), x.dtype), batch
        )
        out = jax.eval_shape(self.loss_fn, params, one)
        if not (hasattr(out, "shape") and out.shape == ()):
            raise ValueError(
                f"loss_fn must return a scalar, got {getattr(out, 'shape', type(out).__name__)}"
            )

    # ------------------------------------------------------------------------------------
    # the round

    def _shard_local(self, tree):
        """This data shard of each (full) parameter-shaped leaf, along the outer state's dim."""
        if self.fsdp:  # the parameters already are shards
            return tree

        def leaf(x):
            dim = self._outer_dim(x.shape)
            if dim is None:
                return x
            size = x.shape[dim] // self.data
            start = jax.lax.axis_index(DATA) * size
            return jax.lax.dynamic_slice_in_dim(x, start, size, axis=dim)

        return jax.tree.map(leaf, tree)

    def _unshard(self, shards, full_like):
        if self.fsdp:
            return shards

        # An all-gather would type its result as varying over "data"; params are
        # data-invariant, so place the shard in a zero buffer and psum it over the data axis
        # (the fast, intra-replica axis) instead.
        def leaf(x, ref):
            dim = self._outer_dim(ref.shape)
            if dim is None:
                return x
            start = jax.lax.axis_index(DATA) * x.shape[dim]
            full = jnp.zeros(ref.shape, x.dtype)
            return jax.lax.psum(jax.lax.dynamic_update_slice_in_dim(full, x, start, dim), DATA)

        return jax.tree.map(leaf, shards, full_like)

    def _payload_stats(self, payload, reduced, payload_shapes) -> tuple[jax.Array, jax.Array]:
        """L2 norm of this replica's whole payload and its cosine with the reduced mean.

        Data shards of a leaf (a local shape that differs from the full one) are summed over
        ``data``; whole leaves are counted once.
        """
        sharded = jnp.zeros(3, jnp.float32)  # |p|^2, |r|^2, <p, r>
        whole = jnp.zeros(3, jnp.float32)
        leaves = zip(
            jax.tree.leaves(payload),
            jax.tree.leaves(reduced),
            jax.tree.leaves(payload_shapes),
            strict=True,
        )
        for p, r, full in leaves:
            p, r = p.astype(jnp.float32), r.astype(jnp.float32)
            sums = jnp.stack([jnp.sum(p * p), jnp.sum(r * r), jnp.sum(p * r)])
            if p.shape != full.shape:
                sharded = sharded + sums
            else:
                whole = whole + sums
        if self.shard_outer_state and self.data > 1:
            sharded = jax.lax.psum(sharded, DATA)
        pp, rr, pr = sharded + whole
        norm = jnp.sqrt(pp)
        cosine = jnp.where(pp * rr > 0, pr / jnp.sqrt(jnp.where(pp * rr > 0, pp * rr, 1.0)), 0.0)
        return norm, cosine

    def _choose_reducer(self, payload_shapes) -> tuple[str, Any]:
        kind = self.reducer
        if kind == "auto" and getattr(self.outer.reduce, "codec", None) is not None:
            kind = "outer"  # a compressed collective: never swapped for an uncompressed one
        if kind == "auto":
            elements = sum(x.size for x in jax.tree.leaves(payload_shapes))
            kind = auto_reducer(self.platform, self.replicas, self.outer.staleness, elements)
        reduce = self.outer.reduce if kind == "outer" else _reducers.make(kind, REPLICA)
        if kind == "all_gather" and getattr(self.outer, "accepts_gathered", False):
            # the R payloads go to the outer update un-reduced: a fused update averages them
            # in its own pass (co2jax.kernels)
            reduce = _reducers.all_gather_stacked(REPLICA)
        return kind, reduce

    def round_events(self, payload_shapes, reduce=None) -> list[Issue | Consume]:
        """The round's communication as segment events (see :mod:`co2jax.segments`).

        A delayed payload depends on the state only, so its reduction is issued before the
        first inner step; a synchronous one after the last. Both are consumed after the last
        step by the outer update.
        """
        outer, H = self.outer, self.sync_every
        if reduce is None:
            reduce = self._choose_reducer(payload_shapes)[1]
        if self.streaming:
            return self._streaming_events(reduce)

        def issue(c: _Carry):
            payload = outer.payload(self._shard_local(c.params), c.outer_state)
            reduced = reduce(payload)
            mean = reduced.mean() if isinstance(reduced, Gathered) else reduced
            # statistics of the reduced value are only needed when it is consumed
            return reduced, self._payload_stats(payload, mean, payload_shapes)

        def consume(c: _Carry, value) -> _Carry:
            reduced, (norm, cosine) = value
            shards, outer_state = outer.apply(self._shard_local(c.params), c.outer_state, reduced)
            outer_state = self._whole_leaves_data_invariant(outer_state, c.outer_state)
            return c._replace(
                params=self._unshard(shards, c.params),
                outer_state=outer_state,
                norm=norm,
                cosine=cosine,
            )

        at = 0 if outer.staleness else H
        return [Issue(at, "sync", issue), Consume(H, "sync", consume)]

    def _streaming_events(self, reduce) -> list[Issue | Consume]:
        """Fragment p issued ``tau`` steps before it is applied; metrics summed over them."""
        outer = self.outer._replace(reduce=reduce)
        count = outer.fragments.count

        def on_reduced(c: _Carry, p, payload, reduced) -> _Carry:
            sums = jnp.stack(
                [
                    sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in payload),
                    sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in reduced),
                    sum(
                        jnp.sum(x.astype(jnp.float32) * y.astype(jnp.float32))
                        for x, y in zip(payload, reduced, strict=True)
                    ),
                ]
            )
            pp, rr, pr = sums
            cos = jnp.where(pp * rr > 0, pr / jnp.sqrt(jnp.where(pp * rr > 0, pp * rr, 1.0)), 0.0)
            # norm accumulates |Delta|^2 (square-rooted after the round), cosine its mean
            return c._replace(norm=c.norm + pp, cosine=c.cosine + cos / count)

        return outer.events(
            lambda c: (c.params, c.outer_state),
            lambda c, params, state: c._replace(params=params, outer_state=state),
            on_reduced,
        )

    def _whole_leaves_data_invariant(self, new, old):
        """Averages over ``data`` a whole (unsharded) outer-state leaf that the update made
        data-varying: a statistic of this device's shards, such as CO2's ``penalty_scale``."""
        if not self.shard_outer_state or self.data <= 1:
            return new

        def leaf(x, ref):
            varying = jax.typeof(x).manual_axis_type.varying
            if DATA in varying and DATA not in jax.typeof(ref).manual_axis_type.varying:
                return jax.lax.pmean(x, DATA)
            return x

        return jax.tree.map(leaf, new, old)

    def _gather_params(self, params, param_shapes):
        """Full parameters for the forward pass: FSDP shards all-gathered over ``data``;
        whole leaves marked data-varying so that grad gives this shard's gradient."""

        def leaf(p, full):
            if p.shape != full.shape:
                return jax.lax.all_gather(p, DATA, axis=self._outer_dim(full.shape), tiled=True)
            return jax.lax.pcast(p, DATA, to="varying")

        return jax.tree.map(leaf, params, param_shapes)

    def _reduce_grads(self, grads, param_shapes, params):
        """The data-mean of the gradients, reduce-scattered to this device's FSDP shards."""

        def leaf(g, full, p):
            if p.shape != full.shape:
                dim = self._outer_dim(full.shape)
                summed = jax.lax.psum_scatter(g, DATA, scatter_dimension=dim, tiled=True)
                return summed / self.data
            return jax.lax.pmean(g, DATA)

        return jax.tree.map(leaf, grads, param_shapes, params)

    def _body(
        self,
        payload_shapes,
        param_shapes,
        kind,
        reduce,
        params,
        inner_state,
        outer_state,
        rnd,
        batch,
    ):
        squeeze = lambda t: jax.tree.map(lambda x: x[0], t)
        params, inner_state, outer_state, rnd, batch = map(
            squeeze, (params, inner_state, outer_state, rnd, batch)
        )

        def step(c: _Carry, b) -> tuple[_Carry, jax.Array]:
            # gradients are averaged over the data shards explicitly; nothing crosses
            # "replica" here
            full = self._gather_params(c.params, param_shapes)
            loss, grads = jax.value_and_grad(self.loss_fn)(full, b)
            grads = self._reduce_grads(grads, param_shapes, c.params)
            updates, inner = self.inner.update(grads, c.inner_state, c.params)
            p = optax.apply_updates(c.params, updates)
            return c._replace(params=p, inner_state=inner), jax.lax.pmean(loss, DATA)

        carry = _Carry(params, inner_state, outer_state, jnp.float32(0), jnp.float32(0))
        events = self.round_events(payload_shapes, reduce)
        carry, losses = scan_segments(step, carry, batch, events)
        if self.streaming:
            carry = carry._replace(norm=jnp.sqrt(carry.norm))
        params, inner_state, outer_state = carry.params, carry.inner_state, carry.outer_state

        nbytes = sum(self._wire_bytes(kind, shapes) for shapes in self._payloads(payload_shapes))
        metrics = RoundMetrics(losses, carry.norm, carry.cosine, jnp.asarray(nbytes, jnp.float32))
        out = (params, inner_state, outer_state, rnd + 1)
        return jax.tree.map(lambda x: x[None], (*out, metrics))

    def _payloads(self, payload_shapes) -> list[Any]:
        """The payloads one round sends: one per fragment (streaming), else the one."""
        return list(payload_shapes) if self.streaming else [payload_shapes]

    def _wire_bytes(self, kind: str, payload_shapes) -> float:
        """Bytes one replica sends to reduce one payload with the chosen reducer."""
        reduce = self.outer.reduce if kind == "outer" else None
        by_tree = getattr(reduce, "tree_wire_bytes", None)
        if by_tree is not None:  # a collective that knows its own layout
            return by_tree(payload_shapes, self.replicas)
        counted = getattr(reduce, "wire_bytes", None)
        if counted is not None:  # a compressed collective: its encoded values, scales, indices
            return counted(sum(x.size for x in jax.tree.leaves(payload_shapes)), self.replicas)
        payload_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(payload_shapes))
        return _reducers.wire_bytes(
            "pmean" if kind == "outer" else kind, payload_bytes, self.replicas
        )

    def round_fn(self, state: TrainState):
        """The jitted, shard_map'd round for states shaped like ``state``."""
        specs = self.state_specs(state)
        one = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), t)
        if self.streaming:  # one payload per fragment
            payload_shapes = [
                jax.eval_shape(
                    lambda a, b, p=p: self.outer.payload(a, b, p),
                    one(state.params),
                    one(state.outer_state),
                )
                for p in range(self.outer.fragments.count)
            ]
        else:
            payload_shapes = jax.eval_shape(
                self.outer.payload, one(state.params), one(state.outer_state)
            )
        param_shapes = one(state.params)
        kind, reduce = self._choose_reducer(payload_shapes)
        self.reducer_kind = kind
        batch_spec = P(REPLICA, None, DATA)
        metric_spec = RoundMetrics(P(REPLICA), P(REPLICA), P(REPLICA), P(REPLICA))
        fn = jax.shard_map(
            lambda p, i, o, r, b: self._body(
                payload_shapes, param_shapes, kind, reduce, p, i, o, r, b
            ),
            mesh=self.mesh,
            in_specs=(*specs, batch_spec),
            out_specs=(*specs, metric_spec),
            check_vma=self._check_vma,
        )
        return jax.jit(
            lambda s, b: (lambda *o: (TrainState(*o[:4]), o[4]))(*fn(*s, b)),
            donate_argnums=(0,) if self._donate else (),
        )

    def _get(self, state):
        key = jax.tree.structure(state), tuple((x.shape, x.dtype) for x in jax.tree.leaves(state))
        if key not in self._compiled:
            self._compiled[key] = self.round_fn(state)
        return self._compiled[key]

    def round(self, state: TrainState, batch: Any) -> tuple[TrainState, RoundMetrics]:
        """One round: H inner steps per replica on ``batch`` ([R, H, B, ...]), then the sync."""
        self.check_batch(state, batch)
        with target_backend(self.platform):  # fused updates are traced for the mesh's platform
            return self._get(state)(state, self.place_batch(batch))

    def place_batch(self, batch: Any) -> Any:
        """Puts ``batch`` ([R, H, B, ...] leaves) on the mesh: replica and data sharded."""
        sharding = NamedSharding(self.mesh, P(REPLICA, None, DATA))
        return jax.tree.map(lambda x: jax.device_put(x, sharding), batch)

    def lower(self, state: TrainState, batch: Any):
        """``jax.stages.Lowered`` of the round (concrete or ``ShapeDtypeStruct`` arguments)."""
        self.check_batch(state, batch)
        with target_backend(self.platform):
            return self._get(state).lower(state, batch)
