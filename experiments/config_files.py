"""Config files (``--config FILE``): YAML or JSON, read strictly, and where each setting is.

A key set twice in one mapping is refused (YAML and JSON parsers keep the last silently, and
a second ``train:`` section would replace the first whole); a refused setting names the
file's line and its text (:func:`where_in`), as the user wrote it (``rounds: yes``, which
YAML reads as True).

Example:
  >>> import pathlib, tempfile
  >>> path = pathlib.Path(tempfile.mkdtemp()) / "run.yaml"
  >>> _ = path.write_text("train:\\n  rounds: 3\\ntrain:\\n  seed: 1\\n")
  >>> read_file(str(path))
  Traceback (most recent call last):
  ...
  experiments.config.ConfigError: --config='...run.yaml': line 3: train is set twice (first ...
"""

from __future__ import annotations

import json
from pathlib import Path

from experiments.config import Config, ConfigError, merge


def read_file(path: str) -> dict:
    """A config file's mapping: YAML (``.yaml``, ``.yml``, or any other name) or JSON
    (``.json``); PyYAML comes with flax. A key set twice in one mapping is refused (YAML and
    JSON parsers keep the last silently, and a second ``train:`` section would replace the
    first whole)."""
    return _read(path)[0]


def file_lines(path: str) -> dict[str, tuple[int, str]]:
    """``{dotted key: (line, "key: value" as written)}`` of a YAML config file's settings
    (empty for JSON): where a refused setting came from, in the file's own words."""
    return _read(path)[1]


def _read(path: str) -> tuple[dict, dict[str, tuple[int, str]]]:
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as e:
        raise ConfigError("--config", f"cannot be read ({e.strerror})", path) from None
    lines: dict[str, tuple[int, str]] = {}
    try:
        if path.endswith(".json"):
            tree = json.loads(text, object_pairs_hook=lambda pairs: _unique_pairs(pairs, path))
        else:
            node = yaml.compose(text, Loader=yaml.SafeLoader)
            if node is not None:
                _yaml_lines(node, "", lines, path)
            tree = yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        if isinstance(e, ConfigError):
            raise
        first = " ".join(str(e).split())[:200]
        raise ConfigError(
            "--config",
            f"is not valid {'JSON' if path.endswith('.json') else 'YAML'}: {first}",
            path,
        ) from None
    return ({} if tree is None else tree), lines


def _unique_pairs(pairs: list, path: str) -> dict:
    keys = [k for k, _ in pairs]
    twice = next((k for i, k in enumerate(keys) if k in keys[:i]), None)
    if twice is not None:
        raise ConfigError("--config", f"{twice!r} is set twice in one object", path)
    return dict(pairs)


def _yaml_lines(node, prefix: str, out: dict, path: str) -> None:
    """Records each scalar setting's line and text; refuses a key set twice in a mapping."""
    import yaml

    if not isinstance(node, yaml.MappingNode):
        return
    seen: dict[str, int] = {}
    for key_node, value_node in node.value:
        key, line = str(key_node.value), key_node.start_mark.line + 1
        if key in seen:
            raise ConfigError(
                "--config",
                f"line {line}: {prefix}{key} is set twice (first at line {seen[key]})",
                path,
            )
        seen[key] = line
        if isinstance(value_node, yaml.ScalarNode):
            out[prefix + key] = (line, f"{key}: {value_node.value}")
        _yaml_lines(value_node, f"{prefix}{key}.", out, path)


def from_file(config: Config, path: str) -> Config:
    """``config`` with the file at ``path`` merged on top (:func:`merge`)."""
    tree, lines = _read(path)
    try:
        return merge(config, tree, path)
    except ConfigError as e:
        raise (e if e.key == "--config" else e.within(where_in(path, lines, e.key))) from None


def where_in(path: str, lines: dict[str, tuple[int, str]], key: str) -> str:
    """``path``, with the line that sets ``key`` and its text where the file is YAML."""
    if key not in lines:
        return path
    line, text = lines[key]
    return f"{path}, line {line}: {text}"
