"""The goodput benchmark's chaos driver end to end, small: 3 jobs, 10 rounds, the
coordinator killed after round 4 and restarted with rejoin (benchmarks/goodput.py)."""

from __future__ import annotations

import json

import pytest

from benchmarks import goodput

# processes: each runs or kills processes under deadlines (.ci/run runs the slow ones
# in one pytest process, with nothing beside them)
pytestmark = pytest.mark.processes


@pytest.mark.slow  # 6 processes, about a minute
@pytest.mark.slow  # 4 s or more; a quicker test of its code runs by default
def test_a_killed_coordinator_rejoins_and_the_anchors_agree(tmp_path):
    grace = 0.5
    goodput.main(
        [
            "--replicas", "3", "--rounds", "10", "--kill-every", "4", "--pad-s", "1",
            "--grace-s", str(grace), "--out", str(tmp_path),
            "--cache-dir", str(tmp_path / "cache"),
        ]
    )  # fmt: skip
    summary = json.loads((tmp_path / "summary.json").read_text())
    free, chaos = summary["free"], summary["chaos"]
    assert [k["rank"] for k in chaos["kills"]] == [0]  # the coordinator first
    assert free["rounds"] == chaos["rounds"] == 10
    assert free["anchors_agree"] and chaos["anchors_agree"]
    assert chaos["useful_steps"] < free["useful_steps"]  # the victim missed rounds
    assert 0.5 < summary["goodput"] <= 1.1
    assert chaos["longest_stall_s"] <= grace + 1.0, chaos["longest_stalls"]
    assert "goodput" in (tmp_path / "report.md").read_text()
