"""Test configuration: 8 emulated CPU devices, set once before any JAX backend starts."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax

jax.config.update("jax_num_cpu_devices", 8)
