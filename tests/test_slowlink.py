"""The slow-link testbed's smoke test: two namespaces, one shaped link (needs root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.processes,
    pytest.mark.skipif(
        not hasattr(os, "geteuid")
        or os.geteuid() != 0
        or shutil.which("ip") is None
        or shutil.which("tc") is None,
        reason="the testbed needs root, ip and tc",
    ),
]


def _namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("co2tb-")]


# A minute of the testbed: -m slow. Its twin below (a failing run cleans up) stays quick.
@pytest.mark.slow
def test_shaped_link_runs_carries_the_payload_and_cleans_up(tmp_path):
    """DiLoCo between two jobs over a 200 Mbit/s shaped link: the run completes, each job's
    link carried at least its payloads (tc's counters), and no namespace is left."""
    cmd = [sys.executable, "-m", "benchmarks.slowlink", "--replicas", "2", "--rate-mbit", "200"]
    cmd += ["--rounds", "1", "--algorithms", "diloco", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    (row,) = summary["rows"]
    payload = json.loads((tmp_path / "diloco_0.json").read_text())["payload_bytes"]
    # 2 rounds (one compiling), one payload to the one peer each
    assert all(b >= 2 * payload for b in row["link_bytes"]), (row["link_bytes"], payload)
    assert "| diloco |" in (tmp_path / "report.md").read_text()
    assert _namespaces() == []


def test_cleanup_after_a_failing_run(tmp_path):
    """A job that cannot start (a bad argument reaches it) fails the run with an error and
    still leaves no namespace behind."""
    cmd = [sys.executable, "-m", "benchmarks.slowlink", "--replicas", "2", "--rate-mbit", "200"]
    cmd += ["--rounds", "1", "--sync-every", "0", "--algorithms", "diloco", "--out", str(tmp_path)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "jobs exited with" in done.stderr, done.stderr[-2000:]
    assert _namespaces() == []
