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
(and checkpoints) before the round are untouched. With a quorum below R
(``Peers(quorum=...)``) the round goes on without it (:mod:`co2jax.engines.membership`), a
restarted job rejoins with :meth:`JobTrainer.rejoin`, and every payload is framed and
checked (:mod:`co2jax.engines.jobstate`): a malformed or non-finite one is dropped like a
dead peer's. Each payload carries its weight (the job's tokens this round: per-job step
counts are token-weighted, and ``dylu=True`` sets them from the jobs' measured step times).

Example (two shells; the same script with rank 0 and 1)::

    peers = co2jax.Peers(("127.0.0.1:7000", "127.0.0.1:7001"), rank=0)
    trainer = co2jax.JobTrainer(loss_fn, optax.adamw(1e-3), co2jax.co2(...), peers,
                                sync_every=32)
    state = trainer.init(params)
    for batch in batches:                      # [H, B, ...] per round, this job's data
        state, metrics = trainer.round(state, batch)
"""

from __future__ import annotations

import math
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
from co2jax.comm.participation import clipped_mean
from co2jax.comm.reducer import Encoded, values
from co2jax.engines import jobstate, recovery, rejoin
from co2jax.engines import walk as walker
from co2jax.engines.drift import DriftError, check_drift, invariant_part
from co2jax.engines.exchange import Exchange, PeerError, Peers
from co2jax.engines.jobround import JobCarry, JobRound
from co2jax.engines.jobstate import JobState
from co2jax.engines.membership import Membership
from co2jax.engines.round import RoundTrainer, TrainState
from co2jax.mesh import compiler_sharded, make_mesh
from co2jax.protocol import OuterOptimizer, resolve
from co2jax.tree import fingerprint, tree_all_finite

STALE_WEIGHT = 2**-0.5
"""A carried payload's weight factor: ``1 / sqrt(1 + staleness)`` at staleness 1."""


class JobMetrics(NamedTuple):
    """``losses`` [steps]; ``compute_s`` (the inner steps), ``wait_s`` (waiting for
    exchanges once the steps before an apply were done), ``round_s`` (the whole round),
    ``bytes_sent`` (this round, to all peers: each framed payload, 16 bytes of frame
    included, and the side exchanges' arrays), ``steps`` (inner steps taken), and per
    exchange of the round ``participants`` (the ranks combined) and ``left_out`` (rank ->
    why); ``admitted``: ranks admitted at the round's end; ``carried``: per exchange, the
    ranks whose late payload of the previous round was merged into it (``late="carry"``)."""

    losses: np.ndarray
    compute_s: float
    wait_s: float
    round_s: float
    bytes_sent: int
    steps: int = 0
    participants: tuple = ()
    left_out: tuple = ()
    admitted: tuple = ()
    carried: tuple = ()


class JobTrainer:
    """One replica of a multi-job run (see the module docstring).

    Args:
      loss_fn, inner: as :class:`co2jax.RoundTrainer`'s.
      outer: the algorithm, exactly as the SPMD engine takes it. Its reducer must have a
        gather form (``encode``; every all-gather reducer, the exact means and the sparse
        top-k have one): the jobs exchange its encodings. A job has no replica axis to read
        R from: build eager updates with ``num_replicas`` set.
      peers: this job's :class:`~co2jax.engines.exchange.Peers` (its quorum, grace window
        and secret).
      sync_every: H.
      mesh: this job's local mesh with axes ``replica`` (size 1) and ``data`` (default: all
        local devices on ``data``).
      drift_every: every this many rounds, the jobs compare fingerprints of their anchors
        (:mod:`co2jax.engines.drift`); a mismatch raises :class:`~co2jax.DriftError` (its
        ``state`` attribute holds the round's result). 0: never. Equal on every job.
      dylu: each round, the jobs share their time per inner step (the least of their last 3
        rounds', so a round that compiled does not count) and each takes DyLU's step count
        (:func:`co2jax.engines.jobstate.dylu_steps`, to the nearest multiple of H/8) in the
        next, changed only when it moves by more than 10% (each count compiles its program
        once). Equal on every job.
      min_steps: DyLU's floor.
      late: what becomes of a payload that misses its exchange's grace window (with a
        quorum): ``"drop"`` (lost), or ``"carry"``: merged into the same exchange of the next
        round if it has arrived by then, its weight times ``1/sqrt(2)`` (the staleness
        weight ``1/sqrt(1 + s)`` of asynchronous Local-SGD, at staleness s = 1). Every job
        merges the same ones (the coordinator's decision names them).
      robust: combine the participants' decoded payloads with
        :func:`co2jax.comm.participation.clipped_mean` (each scaled down to the median norm)
        instead of the reducer's mean, so one faulty job cannot move the anchor arbitrarily.
        For reducers that average decoded payloads (exact, quantized, low-rank); a mean over
        contributors (top-k, DCT) is refused (SparseLoCo's production collective clips to
        the median itself).
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], jax.Array],
        inner: optax.GradientTransformation,
        outer: OuterOptimizer,
        peers: Peers,
        sync_every: int,
        mesh: jax.sharding.Mesh | None = None,
        *,
        drift_every: int = 0,
        dylu: bool = False,
        min_steps: int = 5,
        robust: bool = False,
        late: str = "drop",
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
                    " (a gossip or region reducer exchanges with a group of replicas only: run "
                    "it in the SPMD drivers)"
                    if outer.reducer.reach != "all"
                    else ""
                )
            )
        jobstate.check_options(outer, peers, self.transfers, sync_every, drift_every, dylu, late)
        mesh = compiler_sharded(mesh if mesh is not None else make_mesh(replica=1, data=-1))
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
        self.drift_every, self.dylu, self.min_steps = drift_every, bool(dylu), min_steps
        self.robust = bool(robust)
        self.late, self._carry = late, {}
        self._walks: dict[int, walker.Walk] = {}
        self._local: dict[int, RoundTrainer] = {}
        self.exchange = Exchange(peers, mesh.devices.flat[0])
        self.membership = Membership(self.exchange)
        self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._send = jax.jit(self._encoded_send, static_argnums=2)
        self._chunk = jax.jit(self._encoded_chunk, static_argnums=(1, 2))
        self._combine = jax.jit(lambda encoded: encoded.combine())
        self._weighted = jax.jit(lambda encoded, w: encoded.combine(w))
        self._clipped = jax.jit(
            lambda enc, w: clipped_mean(
                jax.vmap(lambda d: Encoded(d, enc.form).decode())(enc.data), w
            )
        )
        self._join = jax.jit(self._join_chunks, static_argnums=2)
        self._apply = jax.jit(outer.apply, static_argnums=2)
        self._fingerprint = jax.jit(lambda s: fingerprint(invariant_part(s)))
        self._finite = jax.jit(lambda encoded: tree_all_finite(values(encoded)))
        self._restart = jax.jit(self._restart_poisoned)
        self._idle = None  # the local engines' (outer state, round): fixed, never read
        self._exchanges = 0
        self._next_steps, self._times = sync_every, []

    def _walk(self, n: int) -> walker.Walk:
        """The round's walk for ``n`` inner steps (below H only for transfers sent at step 0
        or H and applied at H, :func:`co2jax.engines.jobstate.check_steps`): each chunk
        published at a boundary of its own."""
        if n not in self._walks:
            H = self.sync_every
            at = lambda step: n if step == H else step
            transfers = tuple(
                t._replace(send=at(t.send), apply=at(t.apply), chunks=min(t.chunks, max(1, n)))
                for t in self.transfers
            )
            self._walks[n] = walker.walk(transfers, n, chunks_in_steps=False)
        return self._walks[n]

    def _trainer(self, steps: int) -> RoundTrainer:
        """The local engine for ``steps`` inner steps (no sync: the replica-1 mesh runs just
        the steps). Not donated: a round that fails on a peer leaves its state intact."""
        if steps not in self._local:
            self._local[steps] = RoundTrainer(
                self.loss_fn, self.inner, no_sync(), self.mesh, steps, donate=False
            )
        return self._local[steps]

    def _restart_poisoned(self, params, inner_state, outer_state):
        """:func:`co2jax.engines.recovery.restart_poisoned` of this job (its parameters and
        inner state carry the local engine's replica axis of 1)."""
        one = lambda tree: jax.tree.map(lambda x: x[0], tree)
        params, inner_state, outer_state = recovery.restart_poisoned(
            one(params), one(inner_state), outer_state, self.inner.init, self.outer.init
        )
        two = lambda tree: jax.tree.map(lambda x: x[None], tree)
        return two(params), two(inner_state), outer_state

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
        jobstate.check_inner_is_local(self.inner, params, self.mesh, REPLICA)
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
        for i in range(len(self.transfers) if self.robust else 0):  # refused before any round
            first = jax.tree.map(lambda x: x[0], local.params)
            form = jax.eval_shape(
                lambda p, s, i=i: self._encoded_send(p, s, i), first, outer_state
            )[0]
            if getattr(getattr(form, "form", None), "per_index", False):
                raise ValueError(
                    f"robust=True averages decoded payloads, and reducer "
                    f"{self.outer.reducer.name!r} averages per index over contributors"
                )
        return JobState(local.params, local.inner_state, outer_state, 0, 0, ())

    # exchanges ------------------------------------------------------------------------

    def _start(self, encoded, label: str, weight: float):
        leaves, treedef = jax.tree.flatten(encoded)
        step = self._exchanges
        leaves = [jnp.asarray(x) for x in leaves]
        # checked on its values: a NaN can hide in an encoding's integer codes; a NaN weight
        # tells the peers (jobstate.check_frame), and this job leaves its own out too
        finite = bool(self._finite(encoded))
        framed = jobstate.frame(leaves, self.peers.rank, step, weight if finite else math.nan)
        check = lambda peer, arrays: jobstate.check_frame(arrays, framed, peer, step)
        pending = self.exchange.start(step, framed, label, check)
        if not finite:
            pending.refuse_own(jobstate.NONFINITE)
        self._exchanges += 1
        return pending, treedef

    def _finish(self, started, round_end: bool, record: dict) -> Any:
        pending, treedef = started
        R = self.peers.replicas
        stale: list = []
        if self.peers.tolerant:
            slot = len(record["participants"])  # this exchange's place in the round
            late = self._carry.pop(slot, None) if self.late == "carry" else None
            decision = self.membership.decide(pending, round_end, late)
            ranks = decision.participants
            record["admitted"] = decision.admitted or record.get("admitted", ())
            record["carried"].append(decision.carried)
            stale = [late[0].got[r] for r in decision.carried]
            if self.late == "carry":
                self._carry[slot] = (pending, tuple(r for r in range(R) if r not in ranks))
        else:
            self.exchange.finish(pending)  # every peer's, checked, or PeerError
            ranks = tuple(range(R))
        record["participants"].append(ranks)
        record["left_out"].append(
            {r: pending.failed.get(r, "late") for r in range(R) if r not in ranks}
        )
        payloads = [pending.got[r] for r in ranks] + stale
        weights = np.asarray([float(np.asarray(p[1])[0]) for p in payloads], np.float32)
        weights[len(ranks) :] *= STALE_WEIGHT
        if not weights.sum() > 0:
            raise PeerError(f"replica {self.peers.rank}: {pending.label}: every weight is 0")
        stacked = [jnp.stack(col) for col in zip(*[p[2:] for p in payloads], strict=True)]
        encoded = jax.tree.unflatten(treedef, jax.device_put(stacked, self._replicated))
        if self.robust:  # a contributor mean was refused by init()
            return self._clipped(encoded, jax.device_put(weights, self._replicated))
        if len(payloads) == R and np.all(weights == weights[0]):
            return self._combine(encoded)
        return self._weighted(encoded, jax.device_put(weights, self._replicated))

    def _side(self, value: np.ndarray, label: str) -> dict:
        """A small exchange of ``value`` (uint32 or float32 ``[1]``), by rank: every peer's,
        or with a quorum what the last exchange's set sends (at most ``timeout_s``)."""
        step = self._exchanges
        self._exchanges += 1
        pending = self.exchange.start(step, [value], label)
        if self.peers.tolerant:  # every job of the last exchange's set (they are alive)
            self.exchange.wait(pending, until=self.membership.participants)
            return {r: np.asarray(v[0])[0] for r, v in pending.arrived().items()}
        return {r: np.asarray(v[0])[0] for r, v in enumerate(self.exchange.finish(pending))}

    # the round ------------------------------------------------------------------------

    def _steps(self, steps, weight) -> tuple[int, float]:
        n = self._next_steps if steps is None else steps
        return jobstate.check_steps(self.transfers, self.sync_every, n, weight)

    def round(
        self,
        state: JobState,
        batch: Any,
        steps: int | None = None,
        weight: float | None = None,
        step_time: float | None = None,
    ) -> tuple[JobState, JobMetrics]:
        """``steps`` inner steps (default H, or DyLU's count) on ``batch`` ([H, B, ...]:
        this job's data; its first ``steps`` entries are used) and the schedule's exchanges,
        this job's payloads weighing ``weight`` (default: ``steps``, its tokens at its batch
        size); ``step_time``: the time per inner step it shares for DyLU (default: this
        round's). Raises :class:`~co2jax.engines.exchange.PeerError` (state unchanged) when
        a peer's payload does not arrive in time (without a quorum) or fewer than the quorum
        take part."""
        n, weight = self._steps(steps, weight)
        began = time.perf_counter()
        sent = self.exchange.bytes_sent
        self._exchanges = state.exchanges
        self.membership.previous = state.members or tuple(range(self.peers.replicas))
        self.membership.participants = self.membership.previous
        local = TrainState(state.params, state.inner_state, *self._idle)
        job = JobRound(self, self._walk(n), batch, weight, state.fresh, f"round {state.round}")
        carry = walker.run(job.walk, job, JobCarry(local, state.outer_state))
        local, outer_state, record = carry.local, carry.outer_state, job.record
        if self.transfers:  # a poisoned job restarts from the anchor (engines.recovery)
            params, inner_state, outer_state = self._restart(
                local.params, local.inner_state, outer_state
            )
            like = lambda new, ref: jax.device_put(new, ref.sharding)
            local = local._replace(
                params=jax.tree.map(like, params, local.params),
                inner_state=jax.tree.map(like, inner_state, local.inner_state),
            )
        losses, compute, wait = job.losses, job.compute, job.wait
        params = jax.block_until_ready(local.params)
        members = self.membership.previous if self.peers.tolerant else ()
        new = JobState(params, local.inner_state, outer_state, state.round + 1, 0, members)
        if self.dylu:
            label = f"round {state.round}, step times"
            # the least of the last 3 rounds' times: a round that compiled is not the pace
            self._times = [*self._times[-2:], compute / n if step_time is None else step_time]
            times = self._side(np.asarray([min(self._times)], np.float32), label)
            grid = max(self.sync_every // 8, 1)
            proposed = jobstate.dylu_steps(
                self.sync_every, [times[r] for r in sorted(times)], self.min_steps, grid
            )[sorted(times).index(self.peers.rank)]
            if abs(proposed - self._next_steps) > 0.1 * self._next_steps:  # no jitter
                self._next_steps = proposed
        if self.drift_every and new.round % self.drift_every == 0:
            digest = np.asarray([int(self._fingerprint(outer_state))], np.uint32)
            prints = {
                int(r): int(v) for r, v in self._side(digest, f"round {state.round}, drift").items()
            }
        new = new._replace(exchanges=self._exchanges)  # after the side exchanges
        if self.drift_every and new.round % self.drift_every == 0:
            try:
                check_drift(prints, state.round)
            except DriftError as e:
                e.state = new
                raise
        if record["admitted"] and self.membership.decided_last:
            rejoin.welcome(self, new, record["admitted"])
        done = time.perf_counter()
        return new, JobMetrics(
            np.concatenate(losses),
            compute,
            wait,
            done - began,
            self.exchange.bytes_sent - sent,
            n,
            tuple(record["participants"]),
            tuple(record["left_out"]),
            tuple(record["admitted"]),
            tuple(record["carried"]),
        )

    # rejoin and checkpoints (co2jax.engines.rejoin)

    def rejoin(self, params: Any) -> JobState:
        """The state of a restarted job, handed over by a live peer
        (:func:`co2jax.engines.rejoin.rejoin`); ``params``: the initial parameters."""
        return rejoin.rejoin(self, params)

    def save(self, directory: str, state: JobState) -> None:
        """Writes ``state`` to ``directory`` (orbax; :func:`co2jax.engines.rejoin.save`)."""
        rejoin.save(self, directory, state)

    def restore(self, directory: str, params: Any) -> JobState:
        """The state :meth:`save` wrote; ``params``: the initial parameters (for the shapes)."""
        return rejoin.restore(self, directory, params)
