"""XLA flags the experiments set for GPUs, where co2jax owns the process.

An outer reduction issued before the inner loop hides behind it only if the GPU's scheduler
lets it: in flight while the loop's compute runs, and beside the inner data-parallel
reductions. These flags ask for that (each checked to exist in the installed jaxlib by
``tests/test_experiments.py``; XLA refuses an unknown flag at start-up):

- ``--xla_gpu_enable_latency_hiding_scheduler=true``: schedule an asynchronous collective's
  start early and its done late, around compute it does not depend on.
- ``--xla_gpu_enable_highest_priority_async_stream=true``: collectives on the
  highest-priority stream, so each starts as soon as its inputs are ready.
- ``--xla_gpu_experimental_parallel_collective_overlap_limit=2``: two collectives in flight
  at once (the outer reduction and an inner step's gradient reduction).

They only concern GPU programs (CPU and TPU ignore ``xla_gpu_*`` flags). A flag the user
already set in ``XLA_FLAGS`` is left as set.

Example:
  >>> env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
  >>> apply(env)
  >>> env["XLA_FLAGS"].split()[0]
  '--xla_gpu_enable_latency_hiding_scheduler=false'
  >>> len(env["XLA_FLAGS"].split()) == len(GPU_FLAGS)
  True
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

GPU_FLAGS = (
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    "--xla_gpu_enable_highest_priority_async_stream=true",
    "--xla_gpu_experimental_parallel_collective_overlap_limit=2",
)


def apply(environ: MutableMapping[str, str] | None = None) -> None:
    """Adds :data:`GPU_FLAGS` to ``XLA_FLAGS`` in ``environ`` (default: this process's
    environment; read when JAX starts its backend), keeping every flag already set there."""
    environ = os.environ if environ is None else environ
    current = environ.get("XLA_FLAGS", "").split()
    names = {flag.split("=", 1)[0] for flag in current}
    added = [flag for flag in GPU_FLAGS if flag.split("=", 1)[0] not in names]
    environ["XLA_FLAGS"] = " ".join([*current, *added])
