"""SIGINT and SIGTERM as a flag that a run reads at its round boundaries.

This module imports nothing but the standard library, so a command installs its handlers on
its first line, before it imports JAX: a Ctrl-C while JAX loads used to be raised as
``KeyboardInterrupt`` inside JAX's garbage-collection callback, where Python prints
"Exception ignored" and drops it, and the run trained to its end with exit status 0 (4 of 10
SIGINTs sent during start-up). With the handler in place first, the signal only sets
:attr:`Signals.signum`; the run stops before its first round, or after the round it is in.

    python -m experiments.train ...   # experiments/train.py calls install_early() first

Example:
  >>> import os, signal
  >>> with Signals() as s:
  ...     os.kill(os.getpid(), signal.SIGTERM)
  ...     s.signum == signal.SIGTERM
  True
"""

from __future__ import annotations

import signal
import sys
import threading


class Signals:
    """SIGINT/SIGTERM set a flag the loop reads at the next round boundary (a second one
    interrupts at once); handlers are installed only in the main thread. Entered again while
    installed (the command installs them on its first line, the run enters them again), it
    keeps the flag: a signal during start-up stops the run at its first round boundary."""

    def __init__(self):
        self.signum, self._old, self._depth = None, {}, 0

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: stopping after this round", file=sys.stderr)

    def __enter__(self):
        self._depth += 1
        if self._depth == 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth:
            return
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


_EARLY: Signals | None = None


def install_early() -> Signals:
    """Installs the process's command-line handlers now (a command's first line, before its
    heavy imports) and keeps them to the process's end; returns them. Called again, returns
    the same ones."""
    global _EARLY
    if _EARLY is None:
        _EARLY = Signals().__enter__()
    return _EARLY


def command_signals() -> Signals:
    """The handlers :func:`install_early` installed, else new ones (a command called as a
    function, ``main([...])``, installs them when it starts)."""
    return _EARLY if _EARLY is not None else Signals()


def release_early() -> int | None:
    """Restores the handlers :func:`install_early` replaced (a command that takes Ctrl-C as
    ``KeyboardInterrupt`` from here on: the comparison sweep) and returns the signal that
    arrived during start-up, if one did."""
    global _EARLY
    if _EARLY is None:
        return None
    early, _EARLY = _EARLY, None
    early.__exit__(None, None, None)
    return early.signum
