"""Orbax checkpoints that are checked on restore, with a fallback to the previous good one.

Each checkpoint holds two orbax items: ``state`` (the train state, ``StandardSave``) and
``digest`` (JSON: a SHA-256 of every leaf's bytes, dtype and shape, and of the whole), and a
third, ``data``, when a Grain data iterator is saved with it (``grain.checkpoint``: its state,
one JSON file per process). On restore the newest checkpoint is read and its digest
recomputed; a checkpoint that cannot be read, or whose bytes do not match its digest (a
flipped bit, a truncated file), is skipped with a one-line warning naming it and the step
restored instead, down to the oldest kept; the data iterator is restored from the step whose
state was.

A state with leaves that are not fully addressable from this process (a multi-host run) is
saved without a digest (``"sha256": null``); it is restored unchecked.

Example:
  >>> import tempfile, jax.numpy as jnp
  >>> from experiments.checkpoints import Checkpoints
  >>> with tempfile.TemporaryDirectory() as d:
  ...     ckpt = Checkpoints(d, keep=2)
  ...     ckpt.save(1, {"w": jnp.ones(3)})
  ...     step, state = ckpt.restore({"w": jnp.zeros(3)})
  ...     ckpt.close()
  >>> step, state["w"].tolist()
  (1, [1.0, 1.0, 1.0])
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path
from typing import Any

import grain
import jax
import numpy as np


def digest(state: Any) -> dict:
    """The SHA-256 of every leaf (bytes, dtype, shape) and of the whole, or ``None`` values
    for a state that is not fully addressable here."""
    leaves = jax.tree.leaves(state)
    if not all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return {"sha256": None, "leaves": None}
    per_leaf = []
    for x in leaves:
        a = np.asarray(jax.device_get(x))
        h = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode())
        h.update(np.ascontiguousarray(a).tobytes())
        per_leaf.append(h.hexdigest())
    whole = hashlib.sha256("".join(per_leaf).encode()).hexdigest()
    return {"sha256": whole, "leaves": per_leaf}


def _digest_mismatch(found: dict, recorded: dict) -> str:
    """What differs between a state's digest and the recorded one, in one line."""
    have, want = found["leaves"] or [], recorded.get("leaves") or []
    if len(have) != len(want):
        return f"{len(have)} leaves where the digest records {len(want)}"
    bad = [i for i, (a, b) in enumerate(zip(have, want, strict=True)) if a != b]
    if not bad:  # every leaf matches: the recorded whole-state digest itself is damaged
        return "the recorded digest of the whole state is damaged (every leaf matches)"
    shown = ", ".join(str(i) for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
    return f"{len(bad)} of {len(have)} leaves differ from their recorded digest (leaves {shown})"


class CheckpointError(RuntimeError):
    """No kept checkpoint could be restored."""


class Checkpoints:
    """An orbax ``CheckpointManager`` in ``directory`` keeping ``keep`` checkpoints."""

    def __init__(self, directory: str | Path, keep: int):
        import orbax.checkpoint as ocp

        self._ocp = ocp
        handlers = {  # every item's handler: a restore of some items knows the others
            "state": ocp.StandardCheckpointHandler(),
            "digest": ocp.JsonCheckpointHandler(),
            "run": ocp.JsonCheckpointHandler(),
            "data": grain.checkpoint.CheckpointHandler(),
        }
        self.manager = ocp.CheckpointManager(
            Path(directory).absolute(),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep),
            item_handlers=handlers,
        )

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, data: Any = None, run: dict | None = None) -> None:
        """Saves ``state`` and its digest at ``step`` (and the Grain iterator ``data``'s
        state, and ``run``, the run's identity, when given) and waits until all are
        written."""
        ocp = self._ocp
        items = dict(state=ocp.args.StandardSave(state), digest=ocp.args.JsonSave(digest(state)))
        if run is not None:
            items["run"] = ocp.args.JsonSave(run)
        if data is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data)
        self.manager.save(step, args=ocp.args.Composite(**items))
        self.manager.wait_until_finished()

    def run_of(self, step: int) -> dict | None:
        """The identity of the run that saved ``step`` (None for a checkpoint without one)."""
        if "run" not in self.manager.item_metadata(step):
            return None
        restored = self.manager.restore(
            step, args=self._ocp.args.Composite(run=self._ocp.args.JsonRestore())
        )
        return restored["run"]

    def newest_run(self) -> tuple[int, dict | None] | None:
        """``(step, identity)`` of the newest checkpoint whose identity reads back (identity
        None: a checkpoint written without one), or None when none does: read before the
        state, so that another run's checkpoints are named as such, not as a state whose
        tree does not match."""
        for step in reversed(self.steps()):
            try:
                return step, self.run_of(step)
            except Exception:  # unreadable: the restore will skip it and say so
                continue
        return None

    def restore_data(self, step: int, iterator: Any) -> bool:
        """Sets the Grain ``iterator`` to the state saved at ``step``; False (iterator
        untouched) when that checkpoint holds none."""
        if "data" not in self.manager.item_metadata(step):
            return False
        args = self._ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(iterator))
        self.manager.restore(step, args=args)
        return True

    def _restore(self, step: int, target: Any) -> Any:
        ocp = self._ocp
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(target), digest=ocp.args.JsonRestore()
        )
        restored = self.manager.restore(step, args=args)
        state, recorded = restored["state"], restored["digest"]
        if recorded is None or "sha256" not in recorded:
            raise CheckpointError("no digest recorded")
        if recorded["sha256"] is not None:
            found = digest(state)
            if found["sha256"] != recorded["sha256"]:
                raise CheckpointError(_digest_mismatch(found, recorded))
        return state

    def restore(self, target: Any) -> tuple[int | None, Any]:
        """The newest checkpoint that reads back and matches its digest, as ``(step,
        state)``; ``(None, None)`` when there is none. Raises :class:`CheckpointError` when
        checkpoints exist but none is good."""
        steps = self.steps()[::-1]
        failures = []
        for n, step in enumerate(steps):
            try:
                state = self._restore(step, target)
            except Exception as e:  # unreadable, torn or altered: try the one before
                reason = (
                    str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
                )
                failures.append(f"step {step}: {reason}")
                after = f"restoring step {steps[n + 1]}" if n + 1 < len(steps) else "none left"
                print(
                    f"warning: checkpoint step {step} is unusable ({reason}); {after}",
                    file=sys.stderr,
                )
                continue
            return step, state
        if steps:
            raise CheckpointError("no kept checkpoint could be restored: " + "; ".join(failures))
        return None, None

    def close(self) -> None:
        self.manager.close()
