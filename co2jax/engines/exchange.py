"""The outer exchange between replicas that run as separate JAX jobs (the transfer service).

Every job publishes its (encoded) payload on its own transfer server
(:mod:`jax.experimental.transfer`) and pulls every peer's on a background thread; the caller
combines the R payloads, in rank order, as the reducer's gather form says
(:class:`co2jax.comm.Encoded`). Rendezvous is a list of addresses, one transfer server per
replica, by rank (:class:`Peers`, from arguments, a JSON file or the ``CO2JAX_PEERS`` /
``CO2JAX_RANK`` environment variables). A peer that does not deliver within ``timeout_s``
raises :class:`PeerError` naming the peer and the exchange; with a quorum below R
(:class:`Peers`), :mod:`co2jax.engines.membership` goes on without it.

Every transfer has a key, which names it on the server: with ``Peers.secret`` the key is
derived from the secret (:func:`transfer_key`), so a job that does not hold the secret can
neither name nor pull another job's payloads. What the transfer service does not protect:
the bytes travel unencrypted and unauthenticated, so run the jobs on a private network or
through a tunnel (``docs/multijob.md``, the trust model).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import hmac
import json
import os
import socket
import threading
import time
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


PROBE_EVERY_S = 0.25
"""How often a silent peer that is waited for is checked for a listening server."""

KEPT_OFFERS = 8
"""Exchanges whose offers to a peer are tracked, to be withdrawn if it is found gone."""

KINDS = ("payload", "decision", "hello", "welcome")
"""What a transfer carries: a round's payload, the coordinator's decision on an exchange, a
restarted job's greeting, the state handed to it."""


@dataclasses.dataclass(frozen=True)
class Peers:
    """Where every replica's transfer server listens, which one this job is, and how an
    exchange treats a peer that fails.

    Attributes:
      addresses: ``"host:port"`` of each replica's transfer server, by rank (this job's own
        included: it listens there).
      rank: this job's replica index.
      timeout_s: how long an exchange waits for a peer's payload before :class:`PeerError`
        (or, with a quorum, before it goes on without the peer).
      latency_ms: a delay the exchange adds before every pull, standing for link latency
        where the network cannot add it (this kernel's ``tc`` has no ``netem``); 0 = none.
      quorum: the fewest replicas (this one included) an exchange may go on with. ``None``
        (default): every replica, and any missing one raises :class:`PeerError`. Below R, a
        dead, late or bad peer is left out of that exchange, not the run
        (:mod:`co2jax.engines.membership`).
      grace_s: once a quorum has arrived, how much longer an exchange waits for the rest.
      allow_minority: accept a quorum that is not a majority (``quorum <= R / 2``, refused
        otherwise): the two sides of a network partition could then both reach their
        quorum, go on, and their anchors part for good (split brain).
      secret: a per-run secret shared by every job (never logged, not in ``repr``): transfer
        keys are derived from it (HMAC-SHA256), so a job without it cannot name, and so
        cannot pull, another job's payloads. ``None``: predictable keys.
    """

    addresses: tuple[str, ...]
    rank: int
    timeout_s: float = 120.0
    latency_ms: float = 0.0
    quorum: int | None = None
    grace_s: float = 0.5
    secret: str | None = dataclasses.field(default=None, repr=False)
    allow_minority: bool = False

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
        q = self.quorum
        if q is not None and (
            isinstance(q, bool) or not isinstance(q, int) or not 1 <= q <= len(addresses)
        ):
            raise ValueError(f"quorum must be None or in 1..{len(addresses)}, got quorum={q!r}")
        if not isinstance(self.allow_minority, bool):
            raise ValueError(
                f"allow_minority must be True or False, got allow_minority={self.allow_minority!r}"
            )
        if q is not None and 2 * q <= len(addresses) and not self.allow_minority:
            raise ValueError(
                f"quorum={q} of {len(addresses)} replicas is not a majority: both sides of a "
                f"network partition could go on and their anchors part; use quorum >= "
                f"{len(addresses) // 2 + 1}, or allow_minority=True"
            )
        if not self.grace_s >= 0:
            raise ValueError(f"grace_s must be >= 0, got grace_s={self.grace_s!r}")
        if self.secret is not None and (not isinstance(self.secret, str) or len(self.secret) < 16):
            raise ValueError("secret must be a string of at least 16 characters (not shown)")

    @property
    def replicas(self) -> int:
        return len(self.addresses)

    @property
    def tolerant(self) -> bool:
        """A quorum below R: exchanges go on without failed peers."""
        return self.quorum is not None and self.quorum < self.replicas

    @classmethod
    def from_file(cls, path: str, rank: int, **kw) -> Peers:
        """From a JSON file ``{"addresses": [...], "timeout_s": ..., "latency_ms": ...,
        "quorum": ..., "grace_s": ..., "secret": ...}`` (keep such a file private)."""
        with open(path) as f:
            spec = json.load(f)
        if not isinstance(spec, dict) or "addresses" not in spec:
            raise ValueError(
                f"{path}: expected a JSON object with 'addresses', got keys "
                f"{sorted(spec) if isinstance(spec, dict) else type(spec).__name__}"
            )
        return cls(tuple(spec.pop("addresses")), rank, **{**spec, **kw})

    @classmethod
    def from_env(cls, **kw) -> Peers:
        """From ``CO2JAX_PEERS`` (comma-separated addresses), ``CO2JAX_RANK`` and, when set,
        ``CO2JAX_SECRET``."""
        peers, rank = os.environ.get("CO2JAX_PEERS"), os.environ.get("CO2JAX_RANK")
        if not peers or rank is None or not rank.isdigit():
            raise ValueError(
                "set CO2JAX_PEERS (host:port,host:port,...) and CO2JAX_RANK (an integer); got "
                f"CO2JAX_PEERS={peers!r}, CO2JAX_RANK={rank!r}"
            )
        if os.environ.get("CO2JAX_SECRET"):
            kw = {"secret": os.environ["CO2JAX_SECRET"], **kw}
        return cls(tuple(p.strip() for p in peers.split(",")), int(rank), **kw)


def transfer_key(peers: Peers, kind: str, step: int, source: int, dest: int) -> int:
    """The transfer-service key of what ``source`` sends ``dest`` at exchange ``step``: with
    a secret, the first 63 bits of HMAC-SHA256(secret, kind/step/source/dest), else a
    predictable number."""
    R = peers.replicas
    if peers.secret is None:
        return (((step * len(KINDS) + KINDS.index(kind)) * R + source) * R + dest) + 1
    message = f"{kind}/{step}/{source}/{dest}/{R}".encode()
    digest = hmac.new(peers.secret.encode(), message, hashlib.sha256).digest()
    return (int.from_bytes(digest[:8], "big") & (2**63 - 1)) | 1


class Pending:
    """One exchange in flight: the peers' arrays as they arrive (``got``, by rank, this
    job's own included) and why a peer failed (``failed``, by rank)."""

    def __init__(self, step: int, label: str, own: int, leaves: list):
        self.step, self.label = step, label
        self.own = own
        self.got: dict[int, list] = {own: leaves}
        self.failed: dict[int, str] = {}
        self.gone: set[int] = set()  # peers whose pull failed (not a payload refused)
        self.cond = threading.Condition()

    def gone_peer(self, peer: int, reason: str) -> None:
        """``peer`` failed because it is gone (its link broke, or nothing answers at its
        address), not because its payload was refused."""
        with self.cond:
            self.failed[peer] = reason
            self.gone.add(peer)
            self.cond.notify_all()

    def refuse_own(self, reason: str) -> None:
        """Leaves this job's own payload out (``reason``: why), as its peers leave it out."""
        with self.cond:
            self.got.pop(self.own, None)
            self.failed[self.own] = reason
            self.cond.notify_all()

    def settled(self, replicas: int) -> bool:
        return len(self.got) + len(self.failed) >= replicas

    def arrived(self) -> dict[int, list]:
        """A copy of ``got`` taken under the lock: the pull threads keep adding to it, so
        anything that iterates over the arrived payloads iterates over this."""
        with self.cond:
            return dict(self.got)


class Exchange:
    """The outer exchange between R jobs: every job's payload reaches every other job.

    ``start(step, leaves, label, check)`` publishes this job's payload (a list of arrays)
    once per peer (a transfer can be pulled once) and pulls every peer's payload of the same
    exchange ``step`` (a counter every job advances alike), each on a daemon thread;
    ``check(peer, arrays)`` returns why a received payload is unusable (or ``None``).
    :meth:`wait` returns when every peer has answered, or a quorum has and the grace window
    has passed, or at the timeout; :meth:`finish` is the strict form (every peer, else
    :class:`PeerError`). Bytes on the wire per exchange: ``(R - 1) *`` the payload's bytes,
    sent and received by each job. A connection that failed is opened again at the next
    pull, so a restarted peer is reached at its address.

    **A peer that is gone.** A peer whose connection broke or whose server refuses a
    connection (:meth:`reachable`) is *away*: the payload and decision offers made to it in
    the last ``KEPT_OFFERS`` exchanges, which it will never pull, are withdrawn (this job
    pulls them from its own server, in the background, and drops them), and
    :meth:`start` neither offers to it nor pulls from it (it fails at once, ``gone``)
    until its server accepts a connection again (a restarted job). So what a dead peer
    leaves on the server is bounded: nothing once it is found gone, at most
    ``KEPT_OFFERS`` exchanges' offers before (older ones, assumed pulled, are not
    tracked).
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
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.away: set[int] = set()  # peers found gone, until they answer a connection
        self._offers: dict[int, collections.deque] = {}  # peer -> recent (key, arrays)
        self.withdrawn = 0  # offers taken back from peers found gone

    def _connection(self, peer: int):
        with self._lock:
            if peer not in self._connections:
                self._connections[peer] = self.server.connect(self.peers.addresses[peer])
            return self._connections[peer]

    def _forget(self, peer: int) -> None:
        with self._lock:
            self._connections.pop(peer, None)

    def reachable(self, peer: int, timeout_s: float = 1.0) -> bool:
        """Whether ``peer``'s transfer server accepts a TCP connection within ``timeout_s``
        (opened and closed at once; nothing is sent). A dead process's port refuses it at
        once, where a pull from it may hang."""
        host, port = _check_address("address", self.peers.addresses[peer])
        try:
            with socket.create_connection((host.strip("[]"), port), timeout=timeout_s):
                return True
        except OSError:
            return False

    def publish(self, kind: str, step: int, leaves: list, dests) -> None:
        """Offers ``leaves`` to each rank in ``dests`` (one pull each); not to a peer that
        is away (a payload or a decision: one it would never pull)."""
        leaves = [_on_device(x, self.device) for x in leaves]
        tracked = kind in ("payload", "decision")
        for peer in dests:
            if peer == self.peers.rank or (tracked and peer in self.away):
                continue
            key = transfer_key(self.peers, kind, step, self.peers.rank, peer)
            self.server.await_pull(key, leaves)
            self.bytes_sent += sum(x.nbytes for x in leaves)
            if tracked:
                with self._lock:
                    recent = self._offers.setdefault(peer, collections.deque(maxlen=KEPT_OFFERS))
                    recent.append((key, leaves))

    def outstanding(self, peer: int) -> int:
        """Offers to ``peer`` this job still tracks (at most ``KEPT_OFFERS``)."""
        with self._lock:
            return len(self._offers.get(peer, ()))

    def lost(self, peer: int) -> None:
        """``peer`` is gone: it is away, and the offers made to it are withdrawn, each on a
        daemon thread (an offer it had pulled before it died is not offered any more, and
        that thread waits for nothing until the process ends)."""
        with self._lock:
            self.away.add(peer)
            offers = list(self._offers.pop(peer, ()))
        if not offers:
            return
        sharding = jax.sharding.SingleDeviceSharding(self.device)

        def take_back(key: int, leaves: list) -> None:
            specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in leaves]
            try:
                own = self.server.connect(self.peers.addresses[self.peers.rank])
                jax.block_until_ready(own.pull(key, specs))
            except Exception:  # nothing to take back
                return
            with self._lock:
                self.withdrawn += 1

        for key, leaves in offers:
            threading.Thread(target=take_back, args=(key, leaves), daemon=True).start()

    def _returned(self) -> None:
        """Peers away whose server accepts a connection again (restarted): back."""
        for peer in sorted(self.away):
            if self.reachable(peer, PROBE_EVERY_S):
                with self._lock:
                    self.away.discard(peer)

    def pull(self, kind: str, step: int, source: int, like: list, fresh: bool = False) -> list:
        """``source``'s ``kind`` transfer of ``step`` to this job, shaped like ``like``
        (blocks until it is offered; raises when the connection fails). ``fresh``: on a
        connection of its own, not the one kept for ``source``."""
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding) for x in like]
        if self.peers.latency_ms:
            time.sleep(self.peers.latency_ms / 1e3)
        key = transfer_key(self.peers, kind, step, source, self.peers.rank)
        if fresh:
            connection = self.server.connect(self.peers.addresses[source])
            return jax.block_until_ready(connection.pull(key, specs))
        try:
            return jax.block_until_ready(self._connection(source).pull(key, specs))
        except Exception:
            self._forget(source)
            raise

    def start(self, step: int, leaves: list, label: str | None = None, check=None) -> Pending:
        leaves = [_on_device(x, self.device) for x in leaves]
        rank, replicas = self.peers.rank, self.peers.replicas
        self._returned()
        pending = Pending(step, label or f"exchange {step}", rank, leaves)
        for peer in self.away:
            pending.gone_peer(peer, "gone: its server refused a connection, or its link broke")
        self.publish("payload", step, leaves, range(replicas))

        def pull(peer: int) -> None:
            try:
                arrays = self.pull("payload", step, peer, leaves)
                reason = check(peer, arrays) if check is not None else None
            except Exception as e:  # the connection broke: the peer is gone
                self.lost(peer)
                pending.gone_peer(peer, f"pulling its payload failed: {e}")
                return
            with pending.cond:
                if reason is None:
                    pending.got[peer] = arrays
                else:
                    pending.failed[peer] = reason
                pending.cond.notify_all()

        for peer in range(replicas):
            if peer != rank and peer not in pending.gone:
                name = f"co2jax-exchange-{step}-{peer}"
                threading.Thread(target=pull, args=(peer,), name=name, daemon=True).start()
        return pending

    def wait(self, pending: Pending, quorum: int | None = None, until=None) -> Pending:
        """Waits until every peer has answered, or ``quorum`` payloads are in and
        ``peers.grace_s`` more has passed, or ``peers.timeout_s`` (from the call); with
        ``until`` (ranks), until those have answered (at most the timeout): after
        ``grace_s``, each of them still silent is probed every ``PROBE_EVERY_S``
        (:meth:`reachable`), and one whose process is gone fails (a pull from a process
        that died can hang)."""
        replicas, began = self.peers.replicas, time.monotonic()
        deadline, quorum_at = began + self.peers.timeout_s, None
        probe_at = began + self.peers.grace_s
        with pending.cond:
            while True:
                now = time.monotonic()
                if until is not None:
                    silent = [r for r in until if r not in pending.got and r not in pending.failed]
                    if not silent:
                        return pending
                    if now >= probe_at:
                        for r in silent:
                            if not self.reachable(r, PROBE_EVERY_S):
                                pending.gone_peer(r, "unreachable: its process is gone")
                                self.lost(r)
                        probe_at = now + PROBE_EVERY_S
                        continue
                elif pending.settled(replicas):
                    return pending
                elif quorum is not None and len(pending.got) >= quorum:
                    quorum_at = now if quorum_at is None else quorum_at
                    if now >= quorum_at + self.peers.grace_s:
                        return pending
                if now >= deadline:
                    return pending
                limit = (
                    deadline if quorum_at is None else min(deadline, quorum_at + self.peers.grace_s)
                )
                if until is not None:
                    limit = min(limit, probe_at)
                pending.cond.wait(max(limit - now, 0.001))

    def missing(self, pending: Pending, ranks) -> str:
        """Why each of ``ranks`` has no payload in ``pending``."""
        reasons = []
        for r in ranks:
            if r in pending.got:
                continue
            late = f"nothing arrived within timeout_s={self.peers.timeout_s}"
            why = pending.failed.get(r, f"{late}: missing, dead or too slow")
            reasons.append(f"peer {r} ({self.peers.addresses[r]}): {why}")
        return "; ".join(reasons)

    def finish(self, pending: Pending) -> list:
        """The R payloads in rank order; :class:`PeerError` if any peer's is missing."""
        self.wait(pending)
        every = range(self.peers.replicas)
        if len(pending.got) < self.peers.replicas:
            raise PeerError(
                f"replica {self.peers.rank}: the payloads of {pending.label} are incomplete: "
                f"{self.missing(pending, every)}"
            )
        return [pending.got[r] for r in every]

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
