"""The outer exchange between replicas that run as separate JAX jobs (the transfer service).

Every job publishes its (encoded) payload on its own transfer server
(:mod:`jax.experimental.transfer`) and pulls every peer's on a background thread; the caller
combines the R payloads, in rank order, as the reducer's gather form says
(:class:`co2jax.comm.Encoded`). Rendezvous is a list of addresses, one transfer server per
replica, by rank (:class:`Peers`, from arguments, a JSON file or the ``CO2JAX_PEERS`` /
``CO2JAX_RANK`` environment variables). A peer that does not deliver within ``timeout_s``
raises :class:`PeerError` naming the peer and the exchange.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


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

    ``start(step, leaves)`` publishes this job's payload (a list of arrays) once per peer (a
    transfer can be pulled once) and starts pulling the peers' payloads of the same exchange
    ``step`` (a counter every job advances alike) on a daemon thread; ``finish(future)``
    waits for them (at most ``peers.timeout_s``) and returns the R payloads in rank order.
    Bytes on the wire per exchange: ``(R - 1) *`` the payload's bytes, sent and received by
    each job.
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

    def start(self, step: int, leaves: list, label: str | None = None) -> Future:
        leaves = [_on_device(x, self.device) for x in leaves]
        rank, replicas = self.peers.rank, self.peers.replicas
        label = label or f"exchange {step}"
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
                            f"replica {rank}: pulling the payload of {label} from peer "
                            f"{peer} ({self.peers.addresses[peer]}) failed: {e}"
                        ) from e
                future.set_result([got[r] for r in range(replicas)])
            except BaseException as e:  # delivered to finish()
                future.set_exception(e)

        threading.Thread(target=pull, name=f"co2jax-exchange-{step}", daemon=True).start()
        future.label = label
        return future

    def finish(self, future: Future) -> list:
        try:
            return future.result(timeout=self.peers.timeout_s)
        except TimeoutError:
            missing = [
                f"{r} ({a})" for r, a in enumerate(self.peers.addresses) if r != self.peers.rank
            ]
            raise PeerError(
                f"replica {self.peers.rank}: the payloads of {future.label} did not arrive "
                f"within timeout_s={self.peers.timeout_s} from peers {', '.join(missing)}: a "
                "peer is missing, has died or is too slow"
            ) from None

    def exchange(self, step: int, leaves: list) -> list:
        """``finish(start(step, leaves))``."""
        return self.finish(self.start(step, leaves))


def _on_device(x: jax.Array, device: jax.Device) -> jax.Array:
    """``x`` (replicated over the job's mesh) as a plain array on ``device``: the copy its
    shard on that device already holds, without the mesh's sharding type."""
    x = jnp.asarray(x)
    for shard in x.addressable_shards:
        if shard.device == device and shard.data.shape == x.shape:
            return shard.data
    return jax.device_put(np.asarray(x), device)
