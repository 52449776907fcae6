"""Runnable experiments and the models they train (not part of the installed co2jax package)."""
