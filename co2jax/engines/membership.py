"""Quorum exchanges between jobs: who took part in an exchange, decided once for everyone.

With a quorum below R (:class:`~co2jax.engines.exchange.Peers`), a job goes on without a
peer that is dead, late (past the grace window), or whose payload is malformed or not
finite. Every job must combine the same payloads, or the anchors part, so one job decides:

- The *coordinator* is the lowest rank that took part in the previous exchange. It waits
  for a quorum and the grace window (for every job at the run's first exchange, which
  waits out the jobs' start and compilation), takes the payloads it holds as the exchange's set S,
  and sends S to every other job (a *decision*). The others wait for the decision, then for
  any payload of S they do not yet hold (at most ``timeout_s``), and combine S in rank
  order. A job left out of S applies the same reduced payload as the others, so its own
  contribution is lost and its anchor stays identical.
- If the coordinator fails, the next rank of the previous set takes over. A candidate is
  gone when its connection breaks (a payload of its that was refused does not count), or
  when its decision is not in ``grace_s`` after this job's own wait and its server refuses
  a TCP connection (:meth:`~co2jax.engines.exchange.Exchange.reachable`: a pull from a
  process that died can hang). The next candidate does not count a passed candidate's
  payload, which may have reached some jobs and not others. A job that cannot
  get candidate k's decision (attempt k) turns to candidate k + 1. A candidate that cannot
  get the decisions of those before it decides itself.
- *Rejoin*: a restarted job greets every peer (:func:`greet`). A job outside the last set
  is looked for by every other job (a pull of its greeting). The coordinator admits a
  greeted job in the decision of a round's last exchange and, after that round, sends it
  its whole state (:meth:`co2jax.JobTrainer.rejoin`). The admitted job takes part from the
  next exchange on, which waits for it (at most ``timeout_s``): it starts late by the
  hand-over and its compilation, and a job later than the grace window at every exchange
  would never catch up.

A partition between live jobs cannot give two sides a quorum: a quorum that is not a
majority is refused unless ``Peers(allow_minority=True)``. A peer found gone has the offers
made to it withdrawn (:class:`~co2jax.engines.exchange.Exchange`).
Every change of membership is logged (logger ``co2jax.jobs``) and recorded in
:attr:`Membership.events`.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import NamedTuple

import numpy as np

from co2jax.engines.exchange import PROBE_EVERY_S, Exchange, PeerError, Pending

log = logging.getLogger("co2jax.jobs")

OUT, IN, ADMITTED = 0, 1, 2
PROBES, PROBE_RETRY_S = 4, 2.0


class Decision(NamedTuple):
    """An exchange's outcome: ``participants`` (ranks, sorted), ``admitted`` (ranks that
    join from the next exchange), ``left_out`` (rank -> why) and ``carried`` (ranks whose
    late payload of the previous exchange in this slot is merged here)."""

    participants: tuple[int, ...]
    admitted: tuple[int, ...]
    left_out: dict
    carried: tuple[int, ...] = ()


def greet(exchange: Exchange) -> int:
    """A restarted job's greeting (its rank and a fresh nonce, which keys the state handed
    to it), offered to every peer once; returns the nonce."""
    peers = exchange.peers
    nonce = secrets.randbelow(2**31 - 2) + 1
    hello = [np.asarray([peers.rank, nonce], np.int32)]
    exchange.publish("hello", 0, hello, range(peers.replicas))
    return nonce


class Membership:
    """Every job's view of who takes part, kept equal on all jobs by the decisions."""

    def __init__(self, exchange: Exchange):
        self.exchange, self.peers = exchange, exchange.peers
        self.previous: tuple[int, ...] = tuple(range(self.peers.replicas))
        self.participants: tuple[int, ...] = self.previous  # the last decision's set
        self.events: list[str] = []
        self._greeted: dict[int, int] = {}  # rank -> nonce
        self._probes: dict[int, list] = {}  # rank -> [(thread, started)]
        self.decided_last = False  # this job decided the last exchange
        self._awaited: set[int] = set()  # admitted ranks the next exchange waits for

    # greetings ------------------------------------------------------------------------

    def _probe(self) -> None:
        """Looks for the greeting of every rank outside the last set, on a new connection
        each time (a connection to a dead process may hang): a new look when the last one
        has been waiting ``PROBE_RETRY_S``, at most ``PROBES`` waiting per rank."""
        now = time.monotonic()
        for rank in range(self.peers.replicas):
            if rank in self.previous or rank in self._greeted or rank == self.peers.rank:
                continue
            alive = [(t, at) for t, at in self._probes.get(rank, []) if t.is_alive()]
            self._probes[rank] = alive
            if len(alive) >= PROBES or (alive and now - alive[-1][1] < PROBE_RETRY_S):
                continue

            def pull(rank=rank) -> None:
                try:
                    hello = self.exchange.pull(
                        "hello", 0, rank, [np.zeros(2, np.int32)], fresh=True
                    )
                    self._greeted[rank] = int(np.asarray(hello[0])[1])
                except Exception:  # not up yet: looked for again at the next exchange
                    pass

            thread = threading.Thread(target=pull, daemon=True)
            thread.start()
            alive.append((thread, now))

    # decisions ------------------------------------------------------------------------

    def _pull_decision(self, step: int, attempt: int, source: int) -> np.ndarray | None:
        """``source``'s decision of exchange ``step`` (attempt ``attempt``), or ``None`` when
        ``source`` is gone. A live candidate decides about when this job is done waiting; if
        its decision is not in after ``grace_s``, ``source`` is probed every
        ``PROBE_EVERY_S`` (:meth:`~co2jax.engines.exchange.Exchange.reachable`): a dead
        process refuses the connection at once, where a pull on the kept connection to a
        process that died after a restart can hang until ``timeout_s``. A live, late
        candidate is waited for, at most ``timeout_s``."""
        out: list = []
        settled = threading.Event()

        def pull() -> None:
            try:
                like = [np.zeros(2 * self.peers.replicas, np.int32)]
                key_step = step * self.peers.replicas + attempt
                out.append(np.asarray(self.exchange.pull("decision", key_step, source, like)[0]))
            except Exception:  # the connection broke: it is gone
                pass
            settled.set()

        deadline = time.monotonic() + self.peers.timeout_s
        threading.Thread(target=pull, daemon=True).start()
        settled.wait(self.peers.grace_s)
        while not settled.is_set() and time.monotonic() < deadline:
            if not self.exchange.reachable(source):
                self._event(f"replica {source} is unreachable: the next rank decides")
                self.exchange.lost(source)
                break
            settled.wait(min(PROBE_EVERY_S, max(deadline - time.monotonic(), 0.0)))
        return out[0] if out else None

    def decide(self, pending: Pending, round_end: bool, late: tuple | None = None) -> Decision:
        """The set of ``pending``'s exchange, the same on every job (see the module
        docstring); raises :class:`PeerError` when fewer than the quorum took part or this
        job cannot get the decision or a payload it names. ``late``: ``(previous pending,
        ranks left out of it)`` of this slot, whose payloads that have arrived since are
        carried into this exchange."""
        me, R, quorum = self.peers.rank, self.peers.replicas, self.peers.quorum
        self._probe()
        # the run's first exchange waits for everyone (at most timeout_s): jobs start and
        # compile at different times, and a grace window is for the rounds after
        self.exchange.wait(pending, quorum if pending.step > 0 else None)
        # a job admitted at the last round's end starts late by the hand-over and its
        # compilation: waited for once (at most timeout_s), or it would stay behind for good
        awaited, self._awaited = self._awaited, set()
        if awaited:
            self.exchange.wait(pending, until=tuple(sorted(awaited)))
        mask, self.decided_last = None, False
        passed: set[int] = set()  # candidates found gone: none of them counts either
        for attempt, candidate in enumerate(sorted(self.previous)):
            if candidate in pending.gone:  # its connection broke: it is gone, the next decides
                passed.add(candidate)
                continue
            if candidate == me:
                mask = np.full(2 * R, OUT, np.int32)
                # a candidate that died before deciding may have reached this job and not
                # another: counting its payload would leave that job lacking it
                arrived_now = set(pending.arrived()) - passed  # the pull threads add to it
                mask[sorted(arrived_now)] = IN
                if late is not None:
                    with late[0].cond:
                        arrived = [r for r in late[1] if r in late[0].got]
                    mask[[R + r for r in arrived]] = IN
                if round_end:
                    for rank in set(self._greeted) - set(arrived_now):
                        mask[rank] = ADMITTED
                if int(np.sum(mask[:R] == IN)) < quorum:
                    raise PeerError(
                        f"replica {me}: {pending.label}: only {int(np.sum(mask[:R] == IN))} of "
                        f"quorum={quorum} replicas took part; "
                        f"{self.exchange.missing(pending, range(R))}"
                    )
                self.exchange.publish("decision", pending.step * R + attempt, [mask], range(R))
                self.decided_last = True
                break
            mask = self._pull_decision(pending.step, attempt, candidate)
            passed.add(candidate)
            if mask is not None:
                break
        if mask is None:
            raise PeerError(f"replica {me}: {pending.label}: no coordinator's decision arrived")
        participants = tuple(int(r) for r in np.flatnonzero(mask[:R] == IN))
        admitted = tuple(int(r) for r in np.flatnonzero(mask[:R] == ADMITTED))
        carried = tuple(int(r) for r in np.flatnonzero(mask[R:] == IN))
        self.exchange.wait(pending, until=participants)
        lacking = [r for r in participants if r not in pending.got]
        if carried:
            self.exchange.wait(late[0], until=carried)
            lacking += [f"{r} (late)" for r in carried if r not in late[0].got]
        if lacking:
            raise PeerError(
                f"replica {me}: {pending.label}: the coordinator counted peers {lacking}, whose "
                f"payloads this job lacks: {self.exchange.missing(pending, lacking)}"
            )
        gone = "gone before it decided (its payload not counted)"
        left = {
            r: pending.failed.get(r, gone if r in passed else "late: not within the grace window")
            for r in range(R)
        }
        left = {r: why for r, why in left.items() if r not in participants}
        self._record(pending.label, participants, admitted, left)
        self.previous = tuple(sorted({*participants, *admitted}))
        self._awaited = set(admitted)
        self.participants = participants
        for r in (*admitted, *participants):
            if r not in admitted:
                self._greeted.pop(r, None)
        return Decision(participants, admitted, left, carried)

    def nonce(self, rank: int) -> int:
        """The nonce of ``rank``'s greeting (it keys the state handed to it), once."""
        return self._greeted.pop(rank)

    def _record(self, label: str, participants, admitted, left) -> None:
        before = set(self.previous)
        for r in sorted(before - set(participants)):
            self._event(f"{label}: replica {r} left out ({left.get(r, 'absent')})")
        for r in sorted(set(participants) - before):
            self._event(f"{label}: replica {r} takes part again")
        for r in admitted:
            self._event(f"{label}: replica {r} admitted: it rejoins from the next exchange")

    def note(self, text: str) -> None:
        """Records and logs a membership event."""
        self._event(text)

    def _event(self, text: str) -> None:
        self.events.append(text)
        log.warning("replica %d: %s", self.peers.rank, text)
