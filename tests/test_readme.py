"""The README's quickstart snippet runs as written and trains."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_examples_run_and_converge(capsys):
    """The optax-loop quickstart, then the round engine continuing it (8 emulated devices)."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) == 2
    namespace: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), namespace)
    assert float(namespace["loss"].mean()) < 0.03
    exec(compile(blocks[1], "README.md", "exec"), namespace)
    assert float(namespace["metrics"].loss[:, -1].mean()) < 0.03
    assert capsys.readouterr().out.count("loss") == 2


def test_readme_holds_exactly_two_setup_commands():
    text = README.read_text()
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        assert text.count(marker) == 1
        command = text.split(marker)[1].split("```")[1].strip()
        assert command.startswith("python3 -m venv .venv && ") and "\n" not in command
