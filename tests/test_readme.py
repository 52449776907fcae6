"""The README's quickstart snippet runs as written and trains."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_quickstart_runs_and_converges(capsys):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 1
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert float(namespace["loss"].mean()) < 0.03
    assert "loss" in capsys.readouterr().out


def test_readme_holds_exactly_two_setup_commands():
    text = README.read_text()
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        assert text.count(marker) == 1
        command = text.split(marker)[1].split("```")[1].strip()
        assert command.startswith("python3 -m venv .venv && ") and "\n" not in command
