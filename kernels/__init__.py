"""Pallas kernels for the outer update, with their jnp references (installed as ``co2jax.kernels``).

- :func:`outer_update`: the fused reduce-and-update on pytrees, dispatched between the
  Pallas kernel and the jnp reference (``implementation="auto" | "pallas" | "interpret" |
  "xla"``).
- :class:`OuterUpdateSpec`: what it computes; :class:`BlockSizes`: how the kernel tiles.
- :class:`Gathered` / :func:`make_layout`: the replicas' payloads all-gathered in the
  kernel's bucket layout.

The folder lives at the repository top level as ``kernels/`` and is installed under the
``co2jax`` namespace only (``pyproject.toml``: ``package-dir``).
"""

from co2jax.kernels.api import (
    IMPLEMENTATIONS,
    gather_layout,
    minimum_bytes,
    outer_update,
    resolve,
)
from co2jax.kernels.layout import Gathered, Layout, make_layout
from co2jax.kernels.reference import OuterUpdateOut, outer_update_reference
from co2jax.kernels.spec import BlockSizes, OuterUpdateSpec, default_block_sizes

__all__ = [
    "IMPLEMENTATIONS",
    "BlockSizes",
    "Gathered",
    "Layout",
    "OuterUpdateOut",
    "OuterUpdateSpec",
    "default_block_sizes",
    "gather_layout",
    "make_layout",
    "minimum_bytes",
    "outer_update",
    "outer_update_reference",
    "resolve",
]
