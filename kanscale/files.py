"""Files a user names and files the suite ships.

The shipped configs (``configs/`` in a checkout) travel inside the wheel as ``kanscale/configs``,
so presets resolve the same way from a checkout, an editable install and a plain
``pip install``. A path a config names is looked up as given (absolute, or relative to the
working directory), then among the shipped configs: ``configs/deepspeed/zero3.json`` works from
any directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from kanscale.errors import ConfigError

_PACKAGE_DIR = Path(__file__).resolve().parent


def configs_dir() -> Path:
    """The shipped configs: the wheel's copy, else the checkout's ``configs/``."""
    packaged = _PACKAGE_DIR / "configs"
    return packaged if packaged.is_dir() else _PACKAGE_DIR.parent / "configs"


def find_file(path: str, field: str, what: str) -> Path:
    """A file a config or flag names: as given, else among the shipped configs (a leading
    ``configs/`` is optional there)."""
    shipped = configs_dir() / Path(path).as_posix().removeprefix("configs/")
    for candidate in (Path(path), shipped):
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{field}: {what} {path} does not exist (looked in the working directory and in {configs_dir()})")


def preset_names(kind: str) -> list[str]:
    """The shipped presets of one kind (``experiments``, ``strategies``, ``studies``)."""
    return sorted(p.stem for p in (configs_dir() / kind).glob("*.yaml"))


def find_preset(name: str, kind: str, field: str) -> Path:
    """``zero3`` -> the shipped configs/strategies/zero3.yaml; a path to a YAML file (given, or
    under the shipped configs) is taken as it is."""
    if name.endswith((".yaml", ".yml")):
        return find_file(name, field, f"{kind.rstrip('s')} file")
    path = configs_dir() / kind / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"{field}: no preset named {name!r}; presets: {', '.join(preset_names(kind))} "
                          f"(the shipped configs/{kind}/), or give a YAML file")
    return path


def read_yaml(path: str | Path, field: str | None = None) -> Any:
    """Parse a YAML file, or raise a ConfigError naming the file (and ``field``) and the place."""
    text = _read(path, field)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{_prefix(field)}{path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None


def read_json(path: str | Path, field: str | None = None) -> Any:
    """Parse a JSON file, or raise a ConfigError naming the file (and ``field``) and the place."""
    text = _read(path, field)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{_prefix(field)}{path} is not valid JSON ({err.msg} at line {err.lineno})") from None


def read_mapping(path: str | Path, field: str | None = None, what: str = "a mapping") -> dict[str, Any]:
    """A YAML or JSON file (by suffix) that must hold a mapping; empty YAML reads as {}."""
    data = read_json(path, field) if str(path).endswith(".json") else read_yaml(path, field)
    if data is None and not str(path).endswith(".json"):
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{_prefix(field)}{path} must hold {what}, got {type(data).__name__}")
    return data


def _read(path: str | Path, field: str | None) -> str:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{_prefix(field)}config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"{_prefix(field)}{path} is a directory; give a file")
    return path.read_text()


def _prefix(field: str | None) -> str:
    return f"{field}: " if field else ""
