"""Joining a multi-process (multi-host) run: a thin, validated wrapper over JAX's own.

Afterwards ``jax.devices()`` lists every process's devices, and one mesh over all of them
(:func:`co2jax.make_mesh`) runs the round engine as one program. See ``docs/multihost.md``.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax

ENV_COORDINATOR = "CO2JAX_COORDINATOR"
ENV_NUM_PROCESSES = "CO2JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "CO2JAX_PROCESS_ID"
CPU_COLLECTIVES = ("gloo", "mpi")


class DistributedInfo(NamedTuple):
    """Where this process stands once the run has started.

    Attributes:
      process_id: this process's index, ``0 <= process_id < num_processes``.
      num_processes: processes in the run.
      local_devices: number of devices this process drives.
      global_devices: number of devices of all processes together.
    """

    process_id: int
    num_processes: int
    local_devices: int
    global_devices: int


def _from_env(value: Any, name: str, var: str, cast=str) -> Any:
    if value is not None or var not in os.environ:
        return value
    try:
        return cast(os.environ[var])
    except ValueError:
        raise ValueError(
            f"{name} from ${var} must be an integer, got {os.environ[var]!r}"
        ) from None


def _check_int(name: str, value: Any, low: int, high: int | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if not ok or (high is not None and value >= high):
        bound = f">= {low}" if high is None else f"in [{low}, {high})"
        raise ValueError(f"{name} must be an integer {bound}, got {name}={value!r}")


def _check_address(address: Any) -> None:
    host, sep, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
    if not (sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536):
        raise ValueError(
            f"coordinator_address must be 'host:port' with a port in 1..65535, "
            f"got coordinator_address={address!r}"
        )


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    local_device_count: int | None = None,
    cpu_collectives: str | None = None,
    **kwargs: Any,
) -> DistributedInfo:
    """Starts this process's part of a multi-process run and reports where it stands.

    Each process calls this once, before any other JAX call. Process 0 runs a small
    coordinator service at ``coordinator_address``; the others connect to it, exchange their
    device lists, and from then on every process sees every device. Arguments left ``None`` are
    read from ``$CO2JAX_COORDINATOR``, ``$CO2JAX_NUM_PROCESSES`` and ``$CO2JAX_PROCESS_ID``;
    those still unset are detected by JAX itself, which recognizes (first match wins)
    Open MPI (``OMPI_MCA_orte_hnp_uri``, ``OMPI_COMM_WORLD_SIZE/RANK/LOCAL_RANK``), SLURM
    (``SLURM_JOB_ID``, ``SLURM_STEP_NODELIST``, ``SLURM_NTASKS``, ``SLURM_PROCID``,
    ``SLURM_LOCALID``; the coordinator is the first node, its port derived from the job id or
    taken from ``$JAX_COORDINATOR_PORT``), Cloud TPU VMs (the VM metadata server, or on GKE
    ``TPU_WORKER_HOSTNAMES``/``TPU_PROCESS_ADDRESSES`` and ``TPU_WORKER_ID``) and Kubernetes
    indexed jobs. Under SLURM and Open MPI on GPUs each process then drives one GPU.

    ``num_processes=1`` with no coordinator skips the distributed service, so one script runs
    both locally and on a cluster. With more than one process, CPU cross-process collectives
    are switched on (gloo) unless already configured.

    Args:
      coordinator_address: ``"host:port"`` of process 0, reachable from every process.
      num_processes: processes in the run, >= 1.
      process_id: this process's index in ``[0, num_processes)``.
      local_device_count: CPU devices this process emulates (``jax_num_cpu_devices``).
      cpu_collectives: the CPU cross-process collectives, one of ``"gloo"``, ``"mpi"``.
      **kwargs: passed on to ``jax.distributed.initialize`` (e.g. ``local_device_ids``,
        ``initialization_timeout``).

    Returns:
      A :class:`DistributedInfo`.

    Raises:
      ValueError: on a malformed argument (checked before anything starts).
      RuntimeError: (from JAX) when a JAX backend has already started.

    Example:
      >>> initialize("10.0.0.1", num_processes=2, process_id=0)
      Traceback (most recent call last):
      ValueError: coordinator_address must be 'host:port' with a port in 1..65535, ...

      Two processes on one machine, 4 CPU devices each (one line per process)::

      >>> initialize("127.0.0.1:8476", 2, 0, local_device_count=4)  # doctest: +SKIP
      DistributedInfo(process_id=0, num_processes=2, local_devices=4, global_devices=8)
      >>> initialize("127.0.0.1:8476", 2, 1, local_device_count=4)  # doctest: +SKIP
      DistributedInfo(process_id=1, num_processes=2, local_devices=4, global_devices=8)
      >>> initialize()  # on a TPU pod or under SLURM: detected  # doctest: +SKIP
    """
    coordinator_address = _from_env(coordinator_address, "coordinator_address", ENV_COORDINATOR)
    num_processes = _from_env(num_processes, "num_processes", ENV_NUM_PROCESSES, int)
    process_id = _from_env(process_id, "process_id", ENV_PROCESS_ID, int)
    if coordinator_address is not None:
        _check_address(coordinator_address)
    if num_processes is not None:
        _check_int("num_processes", num_processes, 1)
    if process_id is not None:
        _check_int("process_id", process_id, 0, num_processes)
    if local_device_count is not None:
        _check_int("local_device_count", local_device_count, 1)
    if cpu_collectives is not None and cpu_collectives not in CPU_COLLECTIVES:
        raise ValueError(
            f"cpu_collectives must be one of {CPU_COLLECTIVES}, got "
            f"cpu_collectives={cpu_collectives!r}"
        )

    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", local_device_count)
    if cpu_collectives is not None:
        jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    elif num_processes != 1 and jax.config.jax_cpu_collectives_implementation is None:
        # without them a CPU client runs programs on its own devices only; the setting does
        # nothing on other platforms, so no need to know the platform yet
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if not (num_processes == 1 and coordinator_address is None):
        jax.distributed.initialize(coordinator_address, num_processes, process_id, **kwargs)
    return DistributedInfo(
        jax.process_index(), jax.process_count(), jax.local_device_count(), jax.device_count()
    )
