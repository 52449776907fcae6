"""The README's main job, in miniature: it runs and its traffic column is what it claims."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "experiments"))

import quickstart


@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_quickstart_runs_and_counts_bytes():
    steps, sync_every = 4, 2
    rows = {r["algorithm"]: r for r in quickstart.main(steps, sync_every, batch=4, seed=0)}
    assert list(rows) == ["DDP", "Local SGD", "DiLoCo", "CO2"]
    for r in rows.values():
        assert np.isfinite(r["eval_loss"]) and np.isfinite(r["train_loss"])
    # the payload is the parameters (float32): DDP all-reduces it every step, the others
    # once per sync
    n_params = (32 * 64 + 64) + (64 * 64 + 64) + (64 * 10 + 10)
    assert rows["DDP"]["mbytes"] * 1e6 == steps * n_params * 4
    for name in ("Local SGD", "DiLoCo", "CO2"):
        assert rows[name]["mbytes"] * 1e6 == (steps // sync_every) * n_params * 4
