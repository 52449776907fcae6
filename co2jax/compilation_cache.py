"""JAX's persistent compilation cache and multi-device XLA:CPU programs: a guard.

XLA:CPU runs a program's operations as a graph and orders its collectives by one shared
"communicator" resource, so every device enters them in the program's order. An executable
loaded from JAX's persistent compilation cache (``jax_compilation_cache_dir``) gets a fresh
resource per collective when it is deserialized (jax/jaxlib 0.10.2), so collectives with no
data path between them (a delayed exchange beside the inner loop, metrics beside an update)
may run in a different order on each device. Measured here: CO2's round on a 4 x 2 CPU mesh
ran from a fresh compile and aborted in XLA's rendezvous (two devices waiting in a data-axis
all-reduce, their replica partners in a replica-axis one) every time it was loaded from the
cache. Two unordered collectives over the same devices could also meet in one rendezvous
(the shard_map ones share an op id) and mix their values; that was not observed. A fresh
compile is safe.

So on CPU with more than one device the cache must stay off. :func:`guard` says so (a
warning, once per process) or turns it off; :class:`co2jax.RoundTrainer` calls it, and the
experiment driver turns the cache off. The deserialization above is XLA:CPU's own; GPU and
TPU executables were not examined, and the guard leaves them alone.

Example:
  >>> import jax
  >>> from co2jax import compilation_cache
  >>> compilation_cache.unsafe_reason(jax.devices()[:1]) is None  # one device: nothing to order
  True
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import jax
from jax.experimental.compilation_cache import compilation_cache as _cache

__all__ = ["guard", "unsafe_reason"]


def unsafe_reason(devices: Sequence) -> str | None:
    """Why loading programs over ``devices`` from the persistent cache is unsafe, or None
    (the cache is off, or the devices are not several CPU devices)."""
    devices = list(devices)
    if len(devices) < 2 or any(d.platform != "cpu" for d in devices):
        return None
    if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
        return None
    return (
        f"JAX's persistent compilation cache (jax_compilation_cache_dir="
        f"{jax.config.jax_compilation_cache_dir!r}) is on for a program over {len(devices)} "
        "CPU devices: XLA:CPU loses the order of a program's collectives when it loads it "
        "from the cache, and a round whose collectives are independent (a delayed exchange "
        "beside the inner loop) can deadlock or mix values (co2jax.compilation_cache)"
    )


def guard(devices: Sequence, *, disable: bool = False) -> bool:
    """Warns where :func:`unsafe_reason` finds a hazard, and with ``disable`` turns the
    persistent cache off for the rest of the process (``jax_enable_compilation_cache``).
    Returns whether there was a hazard."""
    reason = unsafe_reason(devices)
    if reason is None:
        return False
    if disable:
        jax.config.update("jax_enable_compilation_cache", False)
        _cache.reset_cache()  # JAX decides once per process whether it uses the cache
        warnings.warn(f"{reason}; turned it off", stacklevel=2)
    else:
        warnings.warn(f"{reason}; turn it off (jax_enable_compilation_cache=False)", stacklevel=2)
    return True
