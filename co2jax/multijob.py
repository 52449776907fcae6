"""Replicas as separate JAX jobs: the outer exchange over JAX's transfer service.

In the seed papers' setting each replica is its own job (its own processes, its own local
mesh of ``data`` x ``model`` devices), and replicas meet only at the outer step, over a slow
link. Here every job runs the same :class:`~co2jax.OuterOptimizer` as the SPMD round engine,
with its reduce step replaced by an :class:`Exchange`: the job publishes its payload on its
own transfer server (:mod:`jax.experimental.transfer`) and pulls every peer's payload on a
background thread, then averages the R payloads in float32, in rank order.

A round of :class:`JobTrainer`:

- synchronous algorithms (``staleness == 0``, DiLoCo): H inner steps, then publish, pull and
  apply; the job waits for the slowest peer and the link;
- delayed algorithms (``staleness >= 1``: CO2, delayed and eager DiLoCo): the payload depends
  on the state only, so it is published and the pull started *before* the inner steps, which
  run while the payloads move; the job waits only for what is left after its compute.

Rendezvous is a list of addresses, one transfer server per replica, by rank (:class:`Peers`,
from arguments, a JSON file or the ``CO2JAX_PEERS`` / ``CO2JAX_RANK`` environment variables).
A peer that does not deliver within ``timeout_s`` raises :class:`PeerError` naming the peer
and the round; the job's state (and checkpoints) before the round are untouched.

Example (two shells; the same script with rank 0 and 1)::

    peers = co2jax.multijob.Peers(("127.0.0.1:7000", "127.0.0.1:7001"), rank=0)
    trainer = co2jax.multijob.JobTrainer(loss_fn, optax.adamw(1e-3), co2jax.co2(...),
                                         peers, sync_every=32)
    state = trainer.init(params)
    for batch in batches:                      # [H, B, ...] per round, this job's data
        state, metrics = trainer.round(state, batch)
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from co2jax._base import OuterOptimizer, check_int


class PeerError(RuntimeError):
    """A peer did not deliver its payload in time (missing, dead or too slow)."""


def _check_address(name: str, address: str) -> tuple[str, int]:
    host, sep, port = str(address).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name} must be 'host:port' with a port in 1..65535, got {address!r}")
    return host, int(port)


@dataclasses.dataclass(frozen=True)
class Peers:
    """Where every replica's transfer server listens, and which one this job is.

    Attributes:
      addresses: ``"host:port"`` of each replica's transfer server, by rank (this job's own
        included: it listens there).
      rank: this job's replica index.
      timeout_s: how long a round waits for a peer's payload before :class:`PeerError`.
      latency_ms: a delay the exchange adds before every pull, standing for link latency
        where the network cannot add it (this kernel's ``tc`` has no ``netem``); 0 = none.
    """

    addresses: tuple[str, ...]
    rank: int
    timeout_s: float = 120.0
    latency_ms: float = 0.0

    def __post_init__(self):
        addresses = tuple(self.addresses)
        object.__setattr__(self, "addresses", addresses)
        if len(addresses) < 1:
            raise ValueError(f"addresses must name at least one replica, got {addresses!r}")
        for i, a in enumerate(addresses):
            _check_address(f"addresses[{i}]", a)
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"addresses must be distinct, got {addresses!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < len(addresses):
            raise ValueError(f"rank must be in [0, {len(addresses)}), got rank={self.rank!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got timeout_s={self.timeout_s!r}")
        if not self.latency_ms >= 0:
            raise ValueError(f"latency_ms must be >= 0, got latency_ms={self.latency_ms!r}")

    @property
    def replicas(self) -> int:
        return len(self.addresses)

    @classmethod
    def from_file(cls, path: str, rank: int, **kw) -> Peers:
        """From a JSON file ``{"addresses": [...], "timeout_s": ..., "latency_ms": ...}``."""
        with open(path) as f:
            spec = json.load(f)
        if not isinstance(spec, dict) or "addresses" not in spec:
            raise ValueError(f"{path}: expected a JSON object with 'addresses', got {spec!r}")
        return cls(tuple(spec.pop("addresses")), rank, **{**spec, **kw})

    @classmethod
    def from_env(cls, **kw) -> Peers:
        """From ``CO2JAX_PEERS`` (comma-separated addresses) and ``CO2JAX_RANK``."""
        peers, rank = os.environ.get("CO2JAX_PEERS"), os.environ.get("CO2JAX_RANK")
        if not peers or rank is None or not rank.isdigit():
            raise ValueError(
                "set CO2JAX_PEERS (host:port,host:port,...) and CO2JAX_RANK (an integer); got "
                f"CO2JAX_PEERS={peers!r}, CO2JAX_RANK={rank!r}"
            )
        return cls(tuple(p.strip() for p in peers.split(",")), int(rank), **kw)


def _uuid(step: int, source: int, dest: int, replicas: int) -> int:
    return (step * replicas + source) * replicas + dest + 1


class Exchange:
    """The outer exchange between R jobs: every job's payload reaches every other job.

    ``start(step, payload)`` publishes this job's payload once per peer (a transfer can be
    pulled once) and starts pulling the peers' payloads of the same step on a daemon thread;
    ``finish(future)`` waits for them (at most ``peers.timeout_s``) and returns the float32
    mean of the R payloads, summed in rank order, in the payload's dtypes. Bytes on the wire
    per step: ``(R - 1) *`` the payload's bytes, sent and received by each job.
    """

    def __init__(self, peers: Peers, device: jax.Device | None = None):
        from jax.experimental import transfer

        self.peers = peers
        self.device = device or jax.local_devices()[0]
        host, _ = _check_address("address", peers.addresses[peers.rank])
        self.server = transfer.start_transfer_server(
            self.device.client, peers.addresses[peers.rank], [f"{host}:0"]
        )
        self._connections: dict[int, Any] = {}
        self.bytes_sent = 0

    def _connection(self, peer: int):
        if peer not in self._connections:
            self._connections[peer] = self.server.connect(self.peers.addresses[peer])
        return self._connections[peer]

    def start(self, step: int, payload: Any) -> Future:
        leaves, treedef = jax.tree.flatten(payload)
        leaves = [_on_device(x, self.device) for x in leaves]
        rank, replicas = self.peers.rank, self.peers.replicas
        for peer in range(replicas):
            if peer != rank:
                self.server.await_pull(_uuid(step, rank, peer, replicas), leaves)
                self.bytes_sent += sum(x.nbytes for x in leaves)
        future: Future = Future()
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in leaves]

        def pull() -> None:
            try:
                got = {rank: leaves}
                for peer in range(replicas):
                    if peer == rank:
                        continue
                    if self.peers.latency_ms:
                        time.sleep(self.peers.latency_ms / 1e3)
                    try:
                        arrays = self._connection(peer).pull(
                            _uuid(step, peer, rank, replicas), specs
                        )
                        got[peer] = jax.block_until_ready(arrays)
                    except Exception as e:  # the connection broke: the peer is gone
                        raise PeerError(
                            f"replica {rank}: pulling the payload of step {step} from peer "
                            f"{peer} ({self.peers.addresses[peer]}) failed: {e}"
                        ) from e
                mean = _rank_order_mean([got[r] for r in range(replicas)])
                future.set_result(jax.tree.unflatten(treedef, mean))
            except BaseException as e:  # delivered to finish()
                future.set_exception(e)

        threading.Thread(target=pull, name=f"co2jax-exchange-{step}", daemon=True).start()
        future.step = step
        return future

    def finish(self, future: Future) -> Any:
        try:
            return future.result(timeout=self.peers.timeout_s)
        except TimeoutError:
            missing = [
                f"{r} ({a})" for r, a in enumerate(self.peers.addresses) if r != self.peers.rank
            ]
            raise PeerError(
                f"replica {self.peers.rank}: the payloads of step {future.step} did not arrive "
                f"within timeout_s={self.peers.timeout_s} from peers {', '.join(missing)}: a "
                "peer is missing, has died or is too slow"
            ) from None

    def exchange(self, step: int, payload: Any) -> Any:
        """``finish(start(step, payload))``."""
        return self.finish(self.start(step, payload))


def _on_device(x: jax.Array, device: jax.Device) -> jax.Array:
    """``x`` (replicated over the job's mesh) as a plain array on ``device``: the copy its
    shard on that device already holds, without the mesh's sharding type."""
    x = jnp.asarray(x)
    for shard in x.addressable_shards:
        if shard.device == device and shard.data.shape == x.shape:
            return shard.data
    return jax.device_put(np.asarray(x), device)


@jax.jit
def _rank_order_mean(payloads: list[list[jax.Array]]) -> list[jax.Array]:
    out = []
    for leaves in zip(*payloads, strict=True):
        total = leaves[0].astype(jnp.float32)
        for x in leaves[1:]:
            total = total + x.astype(jnp.float32)
        out.append((total / len(leaves)).astype(leaves[0].dtype))
    return out


class JobState(NamedTuple):
    """One job's state: ``params`` (its replica's parameters), ``inner_state``,
    ``outer_state`` (the algorithm's, as in the SPMD engine), ``round``."""

    params: Any
    inner_state: Any
    outer_state: Any
    round: int


class JobMetrics(NamedTuple):
    """``losses`` [H]; ``compute_s`` (the inner steps), ``wait_s`` (waiting for the exchange
    after them), ``round_s`` (the whole round), ``bytes_sent`` (this round, to all peers)."""

    losses: np.ndarray
    compute_s: float
    wait_s: float
    round_s: float
    bytes_sent: int


class JobTrainer:
    """One replica of a multi-job run (see the module docstring).

    Args:
      loss_fn, inner: as :class:`co2jax.RoundTrainer`'s.
      outer: the algorithm, exactly as the SPMD engine takes it; its ``reduce`` is not used
        (the exchange replaces it). A job has no replica axis to read R from: build eager
        updates with ``num_replicas`` set.
      peers: this job's :class:`Peers`.
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
        from co2jax.algorithms.data_parallel import no_sync
        from co2jax.engine import RoundTrainer
        from co2jax.mesh import make_mesh

        if not isinstance(outer, OuterOptimizer):
            raise ValueError(f"outer must be a co2jax.OuterOptimizer, got outer={outer!r}")
        if not isinstance(peers, Peers):
            raise ValueError(f"peers must be a co2jax.multijob.Peers, got peers={peers!r}")
        self.sync_every = check_int("sync_every", sync_every, 1)
        mesh = mesh if mesh is not None else make_mesh(replica=1, data=-1)
        if mesh.shape.get("replica") != 1:
            raise ValueError(
                f"a job's mesh must have replica=1 (replicas are jobs), got {dict(mesh.shape)}"
            )
        self.outer, self.peers, self.mesh = outer, peers, mesh
        # not donated: a round that fails on a peer leaves the state it was given intact
        # no_sync: the round engine on a replica-1 mesh runs just the H inner steps
        self.local = RoundTrainer(loss_fn, inner, no_sync(), mesh, sync_every, donate=False)
        self.exchange = Exchange(peers, mesh.devices.flat[0])
        self._replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        self._payload = jax.jit(outer.payload)
        self._apply = jax.jit(outer.apply)
        self._idle = None  # the local engine's (outer state, round): fixed, never read

    def init(self, params: Any) -> JobState:
        """The job's state from the (same on every job) initial parameters."""
        local = self.local.init(params)
        self._idle = (local.outer_state, local.round)
        outer_state = jax.jit(self.outer.init, out_shardings=self._replicated)(params)
        return JobState(local.params, local.inner_state, outer_state, 0)

    def round(self, state: JobState, batch: Any) -> tuple[JobState, JobMetrics]:
        """H inner steps on ``batch`` ([H, B, ...]: this job's data), then the outer step
        with the exchanged payloads. Raises :class:`PeerError` (state unchanged) when a
        peer's payload does not arrive in time."""
        from co2jax.engine import TrainState

        began = time.perf_counter()
        sent = self.exchange.bytes_sent
        one = lambda t: jax.tree.map(lambda x: x[0], t)
        delayed = self.outer.staleness >= 1
        if delayed:  # the payload depends on the state only: send it before the inner steps
            future = self.exchange.start(
                state.round, self._payload(one(state.params), state.outer_state)
            )
        local = TrainState(state.params, state.inner_state, *self._idle)
        local, metrics = self.local.round(local, jax.tree.map(lambda x: x[None], batch))
        losses = np.asarray(metrics.loss)[0]  # waits for the inner steps
        computed = time.perf_counter()
        params = one(local.params)
        if not delayed:
            future = self.exchange.start(state.round, self._payload(params, state.outer_state))
        reduced = jax.device_put(self.exchange.finish(future), self._replicated)
        waited = time.perf_counter()
        params, outer_state = self._apply(params, state.outer_state, reduced)
        params = jax.tree.map(
            lambda x, ref: jax.device_put(x[None], ref.sharding), params, local.params
        )
        params = jax.block_until_ready(params)
        new = JobState(params, local.inner_state, outer_state, state.round + 1)
        done = time.perf_counter()
        return new, JobMetrics(
            losses,
            computed - began,
            waited - computed,
            done - began,
            self.exchange.bytes_sent - sent,
        )
