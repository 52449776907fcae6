"""The receiver threads of a job's exchange add payloads while the job reads them: every read
of ``Pending.got`` that iterates goes through a snapshot taken under the pending's lock.

Before, ``JobTrainer._side`` iterated ``pending.got`` while a late peer's payload arrived:
``RuntimeError: dictionary changed size during iteration`` in 4 of 14 runs of a quorum
scenario. The scenario here is the same interleaving, forced: a thread keeps delivering
payloads while ``_side`` reads them, 50 times."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest

from co2jax.engines.exchange import Pending
from co2jax.engines.multijob import JobTrainer

# processes: each runs or kills processes under deadlines (.ci/run runs the slow ones
# in one pytest process, with nothing beside them)
pytestmark = pytest.mark.processes

PEERS = 20_000


def _racing_exchange():
    """An exchange whose ``start`` returns a pending that a receiver thread keeps filling
    (as the pull threads of :meth:`co2jax.engines.exchange.Exchange.start` do) and whose
    ``wait`` returns at once (a quorum's grace ran out with peers still arriving)."""
    threads = []

    def start(step, leaves, label):
        pending = Pending(step, label, 0, leaves)

        def deliver():
            for peer in range(1, PEERS):
                with pending.cond:
                    pending.got[peer] = [np.asarray([peer], np.uint32)]
                    pending.cond.notify_all()

        threads.append(threading.Thread(target=deliver, daemon=True))
        threads[-1].start()
        return pending

    exchange = types.SimpleNamespace(start=start, wait=lambda pending, until=None: pending)
    return exchange, threads


def test_side_exchanges_read_arriving_payloads_safely():
    for _ in range(50):
        exchange, threads = _racing_exchange()
        job = types.SimpleNamespace(
            exchange=exchange,
            peers=types.SimpleNamespace(tolerant=True),
            membership=types.SimpleNamespace(participants=(0,)),
            _exchanges=0,
        )
        got = JobTrainer._side(job, np.asarray([7], np.uint32), "drift")
        assert got[0] == 7 and all(int(v) == r for r, v in got.items() if r)
        for t in threads:
            t.join()


def test_arrived_is_a_consistent_snapshot():
    pending = Pending(0, "x", 0, [1])
    stop = threading.Event()

    def deliver():
        for peer in range(1, 50_000):
            if stop.is_set():
                return
            with pending.cond:
                pending.got[peer] = [peer]

    t = threading.Thread(target=deliver, daemon=True)
    t.start()
    try:
        for _ in range(300):
            snapshot = pending.arrived()
            assert sorted(snapshot) == list(range(len(snapshot)))  # no gap: taken whole
    finally:
        stop.set()
        t.join()


def test_bytes_sent_is_documented_as_counted():
    """``JobMetrics.bytes_sent`` counts every offered array, a payload's 16-byte frame with
    it (the docs said payload bytes only)."""
    from pathlib import Path

    from co2jax.engines.jobstate import frame

    leaves = [np.zeros((3, 5), np.float32), np.zeros(7, np.int8)]
    framed = frame(leaves, rank=1, step=4, weight=2.0)
    overhead = sum(x.nbytes for x in framed) - sum(x.nbytes for x in leaves)
    assert overhead == 16
    docs = (Path(__file__).resolve().parents[1] / "docs" / "multijob.md").read_text()
    assert "16-byte frame" in " ".join(docs.split())
