"""Replicas as separate JAX jobs exchanging through the transfer service (loopback)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import harness
import jax
import jax.numpy as jnp
import multijob_worker as worker
import numpy as np
import pytest
import textbook as tb
from test_engine import engine_loss, textbook_batch

import co2jax

# processes: each runs or kills processes under deadlines (.ci/run runs the slow ones
# in one pytest process, with nothing beside them)
pytestmark = pytest.mark.processes

TESTS = Path(__file__).parent
TIMEOUT_S = 240


def test_port_blocks_are_free_disjoint_and_below_the_ephemeral_range():
    blocks = harness.free_port_blocks(3, 16, seed=0)
    assert len(blocks) == 3 and all(p + 16 <= harness.ephemeral_low() for p in blocks)
    spans = [set(range(p, p + 16)) for p in blocks]
    assert not (spans[0] & spans[1] or spans[0] & spans[2] or spans[1] & spans[2])


def launch(out_dir: Path, modes: dict[int, str], names: tuple[str, ...] = ()) -> dict[int, int]:
    """Starts one worker per rank in ``modes`` (training ``names``, default every algorithm);
    returns their exit codes (killed at the deadline: a test never hangs)."""
    blocks = harness.free_port_blocks(worker.REPLICAS, len(worker.algorithms()))
    addresses = ",".join(f"127.0.0.1:{p}" for p in blocks)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    procs = {}
    try:
        for rank, mode in modes.items():
            with open(out_dir / f"worker_{rank}.log", "wb") as log:
                procs[rank] = subprocess.Popen(
                    [
                        sys.executable,
                        str(TESTS / "multijob_worker.py"),
                        str(rank),
                        addresses,
                        str(out_dir),
                        mode,
                        ",".join(names),
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
        deadline = time.monotonic() + TIMEOUT_S
        while None in [p.poll() for p in procs.values()] and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        for p in procs.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return {rank: p.returncode for rank, p in procs.items()}


def _logs(out_dir: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in out_dir.glob("*.log"))


@pytest.fixture(scope="module")
def results(request, tmp_path_factory):
    """The jobs' trajectories of the algorithms whose cases of
    :func:`test_jobs_equal_the_spmd_engine` this session runs (the workers train those only)."""
    names = tuple(
        item.callspec.params["name"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_jobs_equal_the_spmd_engine"
        and not item.get_closest_marker("skip")
    )
    out_dir = tmp_path_factory.mktemp("multijob")
    codes = launch(out_dir, {r: "run" for r in range(worker.REPLICAS)}, names)
    if set(codes.values()) != {0}:
        pytest.fail(f"workers exited with {codes}\n{_logs(out_dir)}")
    return out_dir


def _spmd(name: str, rounds: int = worker.ROUNDS) -> np.ndarray:
    """The SPMD round engine on a (replica=2, data=2) mesh, the same algorithm and data."""
    problem = worker.problem()
    H = tb.REGISTERED_H
    outer, inner = harness.registered(name, problem, worker.LR, H)
    mesh = co2jax.make_mesh(
        replica=worker.REPLICAS, data=worker.DATA_DEVICES, devices=jax.devices("cpu")[:4]
    )
    trainer = co2jax.RoundTrainer(engine_loss, inner, outer, mesh, H)
    state = trainer.init(harness.unflatten(jnp.asarray(problem.theta0, jnp.float32)))
    out = []
    for _ in range(rounds):
        state, _ = trainer.round(state, textbook_batch(problem, H))
        out.append(np.asarray(harness.flatten(jax.device_get(state.params)), np.float64))
    return np.stack(out)  # [rounds, R, dim]


@pytest.mark.parametrize("name", worker.algorithms())
@pytest.mark.cases("algorithms", 14)
def test_jobs_equal_the_spmd_engine(name, results):
    """Two jobs (each its own process and 2-device mesh) exchanging through the transfer
    service follow the SPMD round engine's trajectory, to float32 rounding (the outer step
    runs in a program of its own, so XLA's fusion, and with it FMA contraction, may differ;
    the mean of two payloads is summed in the same order). Every schedule: synchronous,
    delayed (sent before the inner steps), per fragment (Streaming DiLoCo) and encoded
    sparse payloads (SparseLoCo)."""
    want = _spmd(name)
    for rank in range(worker.REPLICAS):
        got = np.load(results / f"{name}_{rank}.npy")
        np.testing.assert_allclose(got, want[:, rank], rtol=1e-6, atol=1e-6)
    assert not np.allclose(want[-1], worker.problem().theta0)  # the run moved


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_missing_peer_fails_with_a_clear_error(tmp_path):
    """Rank 0 alone: its first exchange times out with PeerError naming the peer; the state
    it had (the initial parameters) is intact."""
    codes = launch(tmp_path, {0: "wait"})
    assert codes == {0: 0}, _logs(tmp_path)
    error = (tmp_path / "error_0.txt").read_text()
    assert "round 0" in error and "1 (127.0.0.1:" in error and "timeout_s=4.0" in error, error
    problem = worker.problem()
    kept = np.load(tmp_path / "kept_0.npy")
    np.testing.assert_array_equal(kept, problem.theta0.astype(np.float32))


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_peer_dying_mid_run_fails_the_others_cleanly(tmp_path):
    """Rank 1 exits after its first round; rank 0 fails in the second with PeerError and
    keeps the state of the first round, which is the SPMD engine's."""
    codes = launch(tmp_path, {0: "wait", 1: "die"})
    assert codes == {0: 0, 1: 3}, _logs(tmp_path)
    assert "round 1" in (tmp_path / "error_0.txt").read_text()
    want = _spmd(worker.algorithms()[0], rounds=1)
    np.testing.assert_allclose(np.load(tmp_path / "kept_0.npy"), want[0, 0], rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(addresses=(), rank=0), "at least one"),
        (dict(addresses=("localhost",), rank=0), r"addresses\[0\]"),
        (dict(addresses=("a:1", "a:1"), rank=0), "distinct"),
        (dict(addresses=("a:1", "a:2"), rank=2), "rank"),
        (dict(addresses=("a:1",), rank=0, timeout_s=0), "timeout_s"),
        (dict(addresses=("a:1",), rank=0, latency_ms=-1), "latency_ms"),
    ],
)
def test_peers_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        co2jax.Peers(**kwargs)


def test_peers_from_env_and_file(tmp_path, monkeypatch):
    monkeypatch.setenv("CO2JAX_PEERS", "127.0.0.1:7000, 127.0.0.1:7001")
    monkeypatch.setenv("CO2JAX_RANK", "1")
    peers = co2jax.Peers.from_env(timeout_s=5)
    assert peers.addresses == ("127.0.0.1:7000", "127.0.0.1:7001") and peers.rank == 1
    path = tmp_path / "peers.json"
    path.write_text('{"addresses": ["h:1", "h:2", "h:3"], "latency_ms": 20}')
    peers = co2jax.Peers.from_file(str(path), rank=2)
    assert peers.replicas == 3 and peers.latency_ms == 20
    monkeypatch.delenv("CO2JAX_RANK")
    with pytest.raises(ValueError, match="CO2JAX_RANK"):
        co2jax.Peers.from_env()
