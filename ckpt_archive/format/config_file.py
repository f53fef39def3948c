"""Reading the experiment's files (config, metrics, data ids) with their value types kept: one loader.

``pack --config/--metrics/--data-ids`` and the policy's session config (``restore --session-config``,
``verify``'s completeness lint) read files through :func:`load_value_file`, so a file means the same
everywhere: YAML is YAML 1.2 through ruamel.yaml's safe loader, so ``1e-4`` is a float (PyYAML's 1.1
rules read it as a string), ``null`` stays None and ``yes`` stays a string.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ckpt_archive.errors import SourceError, first_line
from ckpt_archive.format import jsonio


def load_value_file(path: str | os.PathLike, *, what: str = "file") -> Any:
    """Read a JSON, YAML (1.2) or TOML file keeping value types.

    YAML is read with ruamel.yaml's YAML 1.2 safe loader, so ``1e-4`` is a float (PyYAML's 1.1 rules
    read it as a string), ``null`` stays None, ``4`` an int and ``false`` a bool. A ``.txt`` file of
    one id per line (data ids) gives a list of str. Another suffix is read as JSON, then as YAML.

    Args:
        path: the file.
        what: how messages name the file (``"config file"``).

    Returns:
        plain Python values (dict, list, str, int, float, bool, None; dates as ISO strings).

    Raises:
        SourceError: missing or unparsable, naming the file and the parser's message.
    """
    p = Path(path)
    if not p.is_file():
        raise SourceError(f"{what} not found", where=str(p))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise SourceError(f"{what} is not UTF-8 text (JSON, YAML, TOML or one id per line)", where=str(p)) from None
    suffix = p.suffix.lower()
    try:
        if suffix == ".json":
            return jsonio.loads(text, where=str(p))
        if suffix in (".yaml", ".yml"):
            return _yaml(text)
        if suffix == ".toml":
            try:
                import tomllib
            except ModuleNotFoundError:  # Python < 3.11
                import tomli as tomllib
            return _plain(tomllib.loads(text))
        if suffix in (".txt", ".ids", ".lst"):
            return [line.strip() for line in text.splitlines() if line.strip()]
        # unknown suffix: try JSON, then YAML
        try:
            return jsonio.loads(text, where=str(p))
        except ValueError:
            return _yaml(text)
    except SourceError:
        raise
    except Exception as exc:  # parsers raise many types; report one line naming the file
        raise SourceError(f"cannot parse {what}: {first_line(exc)}",
                          where=str(p)) from None


def load_config(config: dict | str | os.PathLike | None) -> dict:
    """A config as a dict: a dict as is, ``{}`` for None, else a file read by :func:`load_value_file`.

    Raises:
        SourceError: the file is missing, cannot be parsed, or does not hold a mapping (the message
            names the file).
    """
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    data = load_value_file(config, what="config")
    if not isinstance(data, dict):
        raise SourceError("config is not a mapping", where=str(Path(config)))
    return data


def _yaml(text: str) -> Any:
    from ruamel.yaml import YAML

    y = YAML(typ="safe", pure=True)
    y.version = (1, 2)
    return _plain(y.load(text))


def _plain(value: Any) -> Any:
    """Turn parser-specific containers/scalars into plain JSON-able Python values."""
    import datetime as _dt

    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, bool) or value is None or isinstance(value, (int, float, str)):
        return value
    return str(value)


__all__ = ["load_value_file", "load_config"]
