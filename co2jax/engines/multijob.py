"""Replicas as separate JAX jobs: the outer schedule executed over JAX's transfer service.

In the seed papers' setting each replica is its own job (its own processes, its own local
mesh of ``data`` x ``model`` devices), and replicas meet only at the outer steps, over a slow
link. :class:`JobTrainer` runs the same :class:`~co2jax.OuterOptimizer` as the SPMD round
engine and executes its schedule (:func:`co2jax.protocol.plan`) the same way, with every
reduction replaced by an :class:`~co2jax.engines.exchange.Exchange` of the reducer's gather
form: at a transfer's send step the job publishes its encoded payload and pulls the peers'
on a background thread while its next inner steps run; at the apply step it waits for what
is left, combines the R payloads in rank order and applies them.

- synchronous algorithms (DiLoCo): H inner steps, then publish, pull and apply; the job waits
  for the slowest peer and the link;
- delayed algorithms (CO2, delayed and eager DiLoCo): the payload is published before the
  inner steps, which run while it moves;
- Streaming DiLoCo: each fragment is published ``tau`` steps before it is applied.

A peer that does not deliver within ``timeout_s`` raises
:class:`~co2jax.engines.exchange.PeerError` naming the peer and the round; the job's state
(and checkpoints) before the round are untouched.

Example (two shells; the same script with rank 0 and 1)::

    peers = co2jax.Peers(("127.0.0.1:7000", "127.0.0.1:7001"), rank=0)
    trainer = co2jax.JobTrainer(loss_fn, optax.adamw(1e-3), co2jax.co2(...), peers,
                                sync_every=32)
    state = trainer.init(params)
    for batch in batches:                      # [H, B, ...] per round, this job's data
        state, metrics = trainer.round(state, batch)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from co2jax.algorithms.data_parallel import no_sync
from co2jax.axes import REPLICA
from co2jax.comm import chunks
from co2jax.comm.reducer import Encoded, values
from co2jax.engines.exchange import Exchange, Peers
from co2jax.engines.round import RoundTrainer, TrainState
from co2jax.mesh import make_mesh
from co2jax.protocol import OuterOptimizer, plan, resolve


class JobState(NamedTuple):
    """One job's state: ``params`` (its replica's parameters), ``inner_state``,
    ``outer_state`` (the algorithm's, as in the SPMD engine), ``round``."""

    params: Any
    inner_state: Any
    outer_state: Any
    round: int


class JobMetrics(NamedTuple):
    """``losses`` [H]; ``compute_s`` (the inner steps), ``wait_s`` (waiting for exchanges
    once the steps before an apply were done), ``round_s`` (the whole round),
    ``bytes_sent`` (this round, to all peers)."""

    losses: np.ndarray
    compute_s: float
    wait_s: float
    round_s: float
    bytes_sent: int


class JobTrainer:
    """One replica of a multi-job run (see the module docstring).

    Args:
      loss_fn, inner: as :class:`co2jax.RoundTrainer`'s.
      outer: the algorithm, exactly as the SPMD engine takes it. Its reducer must have a
        gather form (``encode``; every all-gather reducer, the exact means and the sparse
        top-k have one): the jobs exchange its encodings. A job has no replica axis to read
        R from: build eager updates with ``num_replicas`` set.
      peers: this job's :class:`~co2jax.engines.exchange.Peers`.
      sync_every: H.
      mesh: this job's local mesh with axes ``replica`` (size 1) and ``data`` (default: all
        local devices on ``data``).
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], jax.Array],
        inner: optax.GradientTransformation,
        outer: OuterOptimizer,
        peers: Peers,
        sync_every: int,
        mesh: jax.sharding.Mesh | None = None,
    ):
        if not isinstance(outer, OuterOptimizer):
            raise ValueError(f"outer must be a co2jax.OuterOptimizer, got outer={outer!r}")
        if not isinstance(peers, Peers):
            raise ValueError(f"peers must be a co2jax.Peers, got peers={peers!r}")
        self.transfers = resolve(outer, sync_every)
        self.sync_every = sync_every
        if self.transfers and outer.reducer.encode is None:
            raise ValueError(
                f"outer.reducer={outer.reducer.name!r} has no gather form (encode) for jobs to "
                "exchange; use an all-gather reducer (co2jax.comm.all_gather_compressed)"
                + (
                    " (a gossip reducer exchanges with a group of replicas only: run it in the "
                    "SPMD drivers)"
                    if outer.reducer.name.startswith("gossip")
                    else ""
                )
            )
        mesh = mesh if mesh is not None else make_mesh(replica=1, data=-1)
        if mesh.shape.get(REPLICA) != 1:
            raise ValueError(
                f"a job's mesh must have replica=1 (replicas are jobs), got {dict(mesh.shape)}"
            )
        self.loss_fn, self.inner, self.outer, self.peers, self.mesh = (
            loss_fn,
            inner,
            outer,
            peers,
            mesh,
        )
        self.actions = plan(self.transfers)
        self._local: dict[int, RoundTrainer] = {}
        self.exchange = Exchange(peers, mesh.devices.flat[0])
        self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._send = jax.jit(self._encoded_send, static_argnums=2)
        self._chunk = jax.jit(self._encoded_chunk, static_argnums=(1, 2))
        self._combine = jax.jit(lambda encoded: encoded.combine())
        self._join = jax.jit(self._join_chunks, static_argnums=2)
        self._apply = jax.jit(outer.apply, static_argnums=2)
        self._idle = None  # the local engines' (outer state, round): fixed, never read
        self._exchanges = 0  # every job numbers its exchanges alike

    def _trainer(self, steps: int) -> RoundTrainer:
        """The local engine for ``steps`` inner steps (no sync: the replica-1 mesh runs just
        the steps). Not donated: a round that fails on a peer leaves its state intact."""
        if steps not in self._local:
            self._local[steps] = RoundTrainer(
                self.loss_fn, self.inner, no_sync(), self.mesh, steps, donate=False
            )
        return self._local[steps]

    def _encoded_send(self, params, outer_state, i):
        payload, outer_state = self.outer.send(params, outer_state, i)
        if self.transfers[i].chunks > 1:
            return payload, outer_state
        if not isinstance(payload, Encoded):
            payload = self.outer.reducer.encode(payload)
        return payload, outer_state

    def _plan(self, payload, i):
        return chunks.plan(payload, self.outer.reducer, self.transfers[i].chunks)

    def _encoded_chunk(self, payload, i, c):
        plan = self._plan(payload, i)
        piece = chunks.as_payload(plan, chunks.take(chunks.split(plan, payload), c))
        return piece if isinstance(piece, Encoded) else self.outer.reducer.encode(piece)

    def _join_chunks(self, pieces, payload, i):
        plan = self._plan(payload, i)
        acc = chunks.zeros(plan)
        for c, vectors in enumerate(pieces):
            acc = chunks.put(acc, c, vectors)
        return chunks.finish(plan, acc)

    def init(self, params: Any) -> JobState:
        """The job's state from the (same on every job) initial parameters."""
        local = self._trainer(self.sync_every).init(params)
        self._idle = (local.outer_state, local.round)
        outer_state = jax.jit(self.outer.init, out_shardings=self._replicated)(params)
        for i in range(len(self.transfers)):  # a replica axis read here has no binding
            try:
                jax.eval_shape(
                    lambda p, s, i=i: self.outer.apply(
                        p, s, i, values(self.outer.send(p, s, i)[0])
                    ),
                    params,
                    outer_state,
                )
            except NameError as e:
                raise ValueError(
                    "this outer optimizer reads the replica count from the replica axis, which "
                    "a job does not have: build it with num_replicas set"
                ) from e
        return JobState(local.params, local.inner_state, outer_state, 0)

    def _start(self, encoded, label: str):
        leaves, treedef = jax.tree.flatten(encoded)
        future = self.exchange.start(self._exchanges, leaves, label)
        self._exchanges += 1
        return future, treedef

    def _finish(self, pending) -> Any:
        future, treedef = pending
        payloads = self.exchange.finish(future)  # R lists of leaves, in rank order
        stacked = [jnp.stack(col) for col in zip(*payloads, strict=True)]
        encoded = jax.tree.unflatten(treedef, jax.device_put(stacked, self._replicated))
        return self._combine(encoded)

    def round(self, state: JobState, batch: Any) -> tuple[JobState, JobMetrics]:
        """H inner steps on ``batch`` ([H, B, ...]: this job's data) and the schedule's
        exchanges. Raises :class:`~co2jax.engines.exchange.PeerError` (state unchanged)
        when a peer's payload does not arrive in time."""
        began = time.perf_counter()
        sent = self.exchange.bytes_sent
        one = lambda t: jax.tree.map(lambda x: x[0], t)
        cuts = sorted({0, self.sync_every, *(a.at for a in self.actions)})
        local = TrainState(state.params, state.inner_state, *self._idle)
        outer_state, store, losses = state.outer_state, {}, []
        compute = wait = 0.0
        for start, stop in zip(cuts, [*cuts[1:], None], strict=True):
            for a in (a for a in self.actions if a.at == start):
                label = f"round {state.round}, transfer {a.transfer}"
                params = one(local.params)
                if a.kind in ("sync", "send"):
                    payload, outer_state = self._send(params, outer_state, a.transfer)
                    if self.transfers[a.transfer].chunks == 1:
                        store[a.transfer] = (payload, [self._start(payload, label)])
                    else:
                        store[a.transfer] = (payload, [])
                if a.kind in ("send", "chunk") and self.transfers[a.transfer].chunks > 1:
                    payload, pending = store[a.transfer]
                    encoded = self._chunk(payload, a.transfer, a.chunk)
                    pending.append(self._start(encoded, f"{label}, chunk {a.chunk}"))
                if a.kind in ("sync", "apply"):
                    payload, pending = store.pop(a.transfer)
                    t0 = time.perf_counter()
                    reduced = [self._finish(p) for p in pending]
                    wait += time.perf_counter() - t0
                    if self.transfers[a.transfer].chunks > 1:
                        pieces = [list(r) for r in reduced]
                        reduced = [self._join(pieces, payload, a.transfer)]
                    params, outer_state = self._apply(params, outer_state, a.transfer, reduced[0])
                    params = jax.tree.map(
                        lambda x, ref: jax.device_put(x[None], ref.sharding), params, local.params
                    )
                    local = local._replace(params=params)
            if stop is None or stop == start:
                continue
            t0 = time.perf_counter()
            segment = jax.tree.map(lambda x, a=start, b=stop: x[None, a:b], batch)
            local, metrics = self._trainer(stop - start).round(local, segment)
            losses.append(np.asarray(metrics.loss)[0])  # waits for the steps
            compute += time.perf_counter() - t0
        params = jax.block_until_ready(local.params)
        new = JobState(params, local.inner_state, outer_state, state.round + 1)
        done = time.perf_counter()
        return new, JobMetrics(
            np.concatenate(losses),
            compute,
            wait,
            done - began,
            self.exchange.bytes_sent - sent,
        )
