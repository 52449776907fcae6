"""The round engine across 2 CPU processes (4 devices each) equals the one-process run.

Two workers (``distributed_worker.py``) join one run on 127.0.0.1 through
:func:`co2jax.distributed.initialize`, build one (replica=4, data=2) mesh over the 8 devices
of both, and run DiLoCo and CO2; here the same rounds run on the 8 emulated devices of this
process and through the numpy textbook loops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import distributed_worker as worker
import harness
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import textbook as tb
from test_algorithms import CASES
from test_engine import run_engine

import co2jax
import co2jax.distributed

# processes: each runs or kills processes under deadlines (.ci/run runs the slow ones
# in one pytest process, with nothing beside them)
pytestmark = pytest.mark.processes

TOL = harness.TOL[jnp.dtype(jnp.float32)]
PROCESSES, TIMEOUT_S = 2, 180
TESTS = Path(__file__).resolve().parent


def _free_port() -> int:
    return harness.free_port_blocks(1, 1)[0]  # below the ephemeral range


def _logs(log_dir: Path) -> str:
    return "\n".join(
        f"--- worker {i} stdout+stderr ---\n{(log_dir / f'worker_{i}.log').read_text()}"
        for i in range(PROCESSES)
    )


def launch(out_dir: Path) -> None:
    """Runs the workers to completion; fails with their logs; never leaves one running."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent), env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)  # the workers set their own device count
    args = [str(_free_port()), None, str(PROCESSES), str(out_dir)]
    procs = []
    try:
        for i in range(PROCESSES):
            args[1] = str(i)
            with open(out_dir / f"worker_{i}.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(TESTS / "distributed_worker.py"), *args],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,  # its own process group, killed below
                    )
                )
        deadline = time.monotonic() + TIMEOUT_S
        # poll rather than wait on one: a worker that dies leaves its peer blocked
        while True:
            codes = [p.poll() for p in procs]  # every one, so that all return codes are set
            if None not in codes or any(codes) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # it may exit meanwhile
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    codes = [p.returncode for p in procs]
    if codes != [0] * PROCESSES:
        timed_out = time.monotonic() > deadline
        pytest.fail(
            f"workers exited with {codes}{' (timed out)' if timed_out else ''}\n{_logs(out_dir)}"
        )


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[np.ndarray]]:
    out_dir = tmp_path_factory.mktemp("distributed")
    launch(out_dir)
    return {
        name: [np.load(out_dir / f"{name}_{i}.npy") for i in range(PROCESSES)]
        for name in worker.ALGORITHMS
    }


@pytest.mark.parametrize("name", list(worker.ALGORITHMS))
def test_two_processes_equal_one(name, results):
    case = next(c for c in CASES if c.name == name)
    problem = tb.make_problem(replicas=worker.REPLICAS, examples=2)
    mesh = co2jax.make_mesh(
        replica=worker.REPLICAS, data=worker.DATA, devices=jax.devices("cpu")[:8]
    )
    want, *_ = run_engine(case.make(), problem, mesh, rounds=worker.ROUNDS)
    for got in results[name]:  # every process reads the same, whole parameters
        assert got.shape == (worker.ROUNDS, worker.REPLICAS, problem.theta0.size)
        np.testing.assert_allclose(got, want, **TOL)
        np.testing.assert_allclose(got, case.textbook(problem)[: worker.ROUNDS], **TOL)


@pytest.fixture
def clean_env(monkeypatch):
    for var in (
        co2jax.distributed.ENV_COORDINATOR,
        co2jax.distributed.ENV_NUM_PROCESSES,
        co2jax.distributed.ENV_PROCESS_ID,
    ):
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "args, match",
    [
        (dict(coordinator_address="10.0.0.1"), "coordinator_address='10.0.0.1'"),
        (dict(coordinator_address="h:0"), "port in 1..65535"),
        (dict(num_processes=0), "num_processes=0"),
        (dict(num_processes=2, process_id=2), r"process_id must be an integer in \[0, 2\)"),
        (dict(process_id=-1), "process_id=-1"),
        (dict(local_device_count=0), "local_device_count=0"),
        (dict(cpu_collectives="nccl"), "cpu_collectives='nccl'"),
    ],
)
def test_initialize_rejects_bad_arguments(args, match, clean_env):
    with pytest.raises(ValueError, match=match):
        co2jax.distributed.initialize(**args)


def test_initialize_reads_the_environment(clean_env):
    clean_env.setenv(co2jax.distributed.ENV_NUM_PROCESSES, "two")
    with pytest.raises(ValueError, match=r"\$CO2JAX_NUM_PROCESSES must be an integer"):
        co2jax.distributed.initialize()
    clean_env.setenv(co2jax.distributed.ENV_NUM_PROCESSES, "2")
    clean_env.setenv(co2jax.distributed.ENV_PROCESS_ID, "5")
    with pytest.raises(ValueError, match="process_id=5"):
        co2jax.distributed.initialize()


def test_initialize_single_process_needs_no_coordinator(clean_env):
    # the backend of this process has started: only the no-service path can run here
    info = co2jax.distributed.initialize(num_processes=1)
    assert info == (0, 1, jax.local_device_count(), jax.device_count())
