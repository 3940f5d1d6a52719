"""Files a user names and files the suite ships.

The shipped configs (``configs/`` in a checkout, linked from ``kanscale/configs``) travel inside
the wheel as ``kanscale/configs``, so presets resolve the same way from a checkout, an editable
install and a plain ``pip install``. A path a config names is looked up as given (absolute, or relative to the
working directory), then among the shipped configs: ``configs/deepspeed/zero3.json`` works from
any directory.

Every file a user names is read the same way: as UTF-8 text (a non-UTF-8 file is refused naming
the byte and the fix), and with duplicate keys refused, in YAML (a second ``training:`` section
would otherwise silently replace the first) as in JSON.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from kanscale.errors import ConfigError

_PACKAGE_DIR = Path(__file__).resolve().parent


def configs_dir() -> Path:
    """The shipped configs: the wheel's copy, else the checkout's ``configs/`` (which
    kanscale/configs links to: resolved, so messages name the folder a user sees)."""
    packaged = _PACKAGE_DIR / "configs"
    return packaged.resolve() if packaged.is_dir() else _PACKAGE_DIR.parent / "configs"


def find_file(path: str, field: str, what: str) -> Path:
    """A file a config or flag names: as given, else among the shipped configs (a leading
    ``configs/`` is optional there)."""
    shipped = configs_dir() / Path(path).as_posix().removeprefix("configs/")
    for candidate in (Path(path), shipped):
        if is_file(candidate):
            return candidate
    raise ConfigError(f"{field}: {what} {path} does not exist (looked in the working directory and in {configs_dir()})")


def is_file(path: Path) -> bool:
    """Whether ``path`` is a file; False for a path no file could have (a name too long)."""
    try:
        return path.is_file()
    except OSError:
        return False


def preset_names(kind: str) -> list[str]:
    """The shipped presets of one kind (``experiments``, ``strategies``, ``studies``)."""
    return sorted(p.stem for p in (configs_dir() / kind).glob("*.yaml"))


# a folder of presets -> what one of its files is
PRESET_KINDS = {"strategies": "strategy", "experiments": "experiment", "studies": "study"}


def find_preset(name: str, kind: str, field: str) -> Path:
    """``zero3`` -> the shipped configs/strategies/zero3.yaml; a path to a YAML file (given, or
    under the shipped configs) is taken as it is."""
    if name.endswith((".yaml", ".yml")):
        return find_file(name, field, f"{PRESET_KINDS.get(kind, kind)} file")
    path = configs_dir() / kind / f"{name}.yaml"
    if not is_file(path):
        raise ConfigError(
            f"{field}: no preset named {name!r}; presets: {', '.join(preset_names(kind))} "
            f"(the shipped configs/{kind}/), or give a YAML file"
        )
    return path


# Values a YAML document may stand for once its aliases are written out: far above any real
# config, far below what an alias bomb ("billion laughs") expands to.
MAX_YAML_VALUES = 100_000


class DuplicateKeyError(yaml.constructor.ConstructorError):
    """A YAML mapping that names one key twice."""


class AliasBombError(yaml.composer.ComposerError):
    """A YAML document whose aliases expand to more values than any config holds."""


def expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values ``node`` stands for with every alias written out (memoised per node; a
    node met again while it is being counted, a cyclic alias, counts as too many)."""
    if id(node) in sizes:
        return sizes[id(node)]
    sizes[id(node)] = MAX_YAML_VALUES + 1
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [child for pair in node.value for child in pair]
    else:
        children = []
    size = 1
    for child in children:
        size += expanded_size(child, sizes)
        if size > MAX_YAML_VALUES:
            break
    sizes[id(node)] = min(size, MAX_YAML_VALUES + 1)
    return sizes[id(node)]


# Lists and mappings inside each other: a config nests a few levels; PyYAML and json recurse once
# per level and give up near Python's recursion limit with a RecursionError.
MAX_NESTING = 64


class TooDeepError(yaml.composer.ComposerError):
    """A YAML document nested deeper than any config is."""


def check_nesting(text: str) -> None:
    """Refuse YAML (JSON is YAML too) nested deeper than MAX_NESTING, from its events: PyYAML's
    parser does not recurse, its composer does."""
    depth = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            depth += 1
            if depth > MAX_NESTING:
                raise TooDeepError(
                    None,
                    None,
                    f"it nests lists and mappings more than {MAX_NESTING} deep (a config needs a few levels); "
                    "flatten it",
                )
        elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            depth -= 1


def json_nesting(text: str) -> int:
    """How deep JSON text nests arrays and objects (brackets inside strings not counted), without
    recursing: json's decoder recurses once per level."""
    depth = deepest = 0
    # drop the strings (escapes included), then count the brackets left
    for bracket in re.findall(r"[][{}]", re.sub(r'"(?:[^"\\]|\\.)*"', "", text)):
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


class _StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, but a key given twice in one mapping is an error: PyYAML keeps the
    last value, so a repeated section silently resets what the first one set. Keys a merge
    (``<<: *base``) brings in may be overridden, as YAML intends. A document whose aliases
    expand beyond :data:`MAX_YAML_VALUES` is refused before it is built."""

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is not None and expanded_size(node, {}) > MAX_YAML_VALUES:
            raise AliasBombError(
                None,
                None,
                f"its aliases (*name) expand to more than {MAX_YAML_VALUES} values (an alias "
                "bomb?); write the values out",
                node.start_mark,
            )
        return node

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        # ``!!map`` on a sequence reaches here with another node: the base class refuses it
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, yaml.Mark] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    first = seen.setdefault(key, key_node.start_mark)
                except TypeError:
                    continue  # unhashable: the base class refuses it with its own message
                if first is not key_node.start_mark:
                    raise DuplicateKeyError(
                        None,
                        None,
                        f"duplicate key {key!r} ({_places(first, key_node.start_mark)}); "
                        "keep one: the second would silently replace the first",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)


def _places(first: yaml.Mark, second: yaml.Mark) -> str:
    if first.line == second.line:
        return f"line {first.line + 1}, columns {first.column + 1} and {second.column + 1}"
    return f"lines {first.line + 1} and {second.line + 1}"


def parse_yaml_text(text: str) -> Any:
    """YAML text as the suite reads every YAML: safe types only, duplicate keys refused
    (:class:`DuplicateKeyError`, a ``yaml.YAMLError``), nesting bounded (:class:`TooDeepError`)."""
    check_nesting(text)
    return yaml.load(text, Loader=_StrictLoader)


def parse_yaml_value(text: str, field: str) -> Any:
    """A value typed on the command line (``--set key=VALUE``), read as YAML so ``[2, 32, 1]`` and
    ``null`` work; text that is not YAML is taken as the string it is, but a mapping with a
    duplicate key is refused as in a file."""
    try:
        return parse_yaml_text(text)
    except (DuplicateKeyError, AliasBombError, TooDeepError) as err:
        raise ConfigError(f"{field}: {err.problem}") from None
    except yaml.YAMLError:
        return text


def read_yaml(path: str | Path, field: str | None = None) -> Any:
    """Parse a YAML file, or raise a ConfigError naming the file (and ``field``) and the place."""
    text = _read(path, field)
    try:
        return parse_yaml_text(text)
    except (DuplicateKeyError, AliasBombError, TooDeepError) as err:
        raise ConfigError(f"{_prefix(field)}{path}: {err.problem}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError(f"{_prefix(field)}{path} is not valid YAML{where}: {getattr(err, 'problem', err)}") from None


class _DuplicateJSONKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object_pairs_hook: an object that names a key twice is refused (json keeps the last)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateJSONKey(key)
        obj[key] = value
    return obj


def read_json(path: str | Path, field: str | None = None) -> Any:
    """Parse a JSON file, or raise a ConfigError naming the file (and ``field``) and the place."""
    text = _read(path, field)
    depth = json_nesting(text)
    if depth > MAX_NESTING:
        raise ConfigError(
            f"{_prefix(field)}{path}: it nests arrays and objects {depth:,} deep, more than {MAX_NESTING} (a config "
            "needs a few levels); flatten it"
        )
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError as err:
        raise ConfigError(f"{_prefix(field)}{path} is not valid JSON ({err.msg} at line {err.lineno})") from None
    except _DuplicateJSONKey as err:
        # json does not say where an object's keys are; the lines that name the key as a key
        # (those of other objects included) point the reader there
        pattern = re.compile(re.escape(json.dumps(err.key)) + r"\s*:")
        lines = [str(n) for n, line in enumerate(text.splitlines(), start=1) if pattern.search(line)]
        where = f" (it is named on lines {', '.join(lines)})" if len(lines) > 1 else ""
        raise ConfigError(
            f"{_prefix(field)}{path}: duplicate key {json.dumps(err.key)} in one object{where}; "
            "keep one: the second would silently replace the first"
        ) from None


def read_mapping(path: str | Path, field: str | None = None, what: str = "a mapping") -> dict[str, Any]:
    """A YAML or JSON file (by suffix) that must hold a mapping; empty YAML reads as {}."""
    data = read_json(path, field) if str(path).endswith(".json") else read_yaml(path, field)
    if data is None and not str(path).endswith(".json"):
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{_prefix(field)}{path} must hold {what}, got {type(data).__name__}")
    return data


def not_utf8(data: bytes, err: UnicodeDecodeError) -> str:
    """Where ``data`` stops being UTF-8, for a message: ``byte 0xe9 at line 3, column 7``."""
    line = data.count(b"\n", 0, err.start) + 1
    column = err.start - (data.rfind(b"\n", 0, err.start) + 1) + 1
    return f"byte 0x{data[err.start]:02x} at line {line}, column {column} is not UTF-8"


def _read(path: str | Path, field: str | None) -> str:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{_prefix(field)}config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"{_prefix(field)}{path} is a directory; give a file")
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # a leading byte-order mark, as some editors write, is dropped
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{_prefix(field)}{path} is not UTF-8 text ({not_utf8(data, err)}); save it as UTF-8, e.g. "
            f"iconv -f LATIN1 -t UTF-8 {path} > {path.stem}.utf8{path.suffix}"
        ) from None


def _prefix(field: str | None) -> str:
    return f"{field}: " if field else ""


def check_typed_path(text: str, field: str) -> None:
    """A path as a user typed it, refused before anything is made where no file system could hold
    it as typed: a NUL character, a name longer than the file system holds, a path longer than the
    system resolves. (A newline or another control character is a legal name: it is kept as typed,
    every command quoting it; only an sbatch directive cannot hold one, which the SLURM launch says.)"""
    shown = repr(short_text(text))
    if "\x00" in text:
        raise ConfigError(f"{field}: {shown} holds a NUL character, which no file name can: give the path without it")
    name_max, path_max = os.pathconf("/", "PC_NAME_MAX"), os.pathconf("/", "PC_PATH_MAX")
    longest = max(Path(text).parts, key=lambda part: len(os.fsencode(part)), default="")
    if len(os.fsencode(longest)) > name_max:
        raise ConfigError(
            f"{field}: {shown} has a name of {len(os.fsencode(longest))} bytes; the file system holds at most "
            f"{name_max} per name: give a shorter one"
        )
    if len(os.fsencode(text)) >= path_max:
        raise ConfigError(
            f"{field}: {shown} is {len(os.fsencode(text))} bytes; paths here are shorter than {path_max}: "
            "give a shorter one"
        )


MAX_ECHOED = 200  # the most characters of one thing a user typed that a message repeats


def short_text(text: str, limit: int = MAX_ECHOED // 2) -> str:
    """``text`` for a message: whole if short, else its first ``limit`` characters and its length."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def bounded(message: str, typed: Sequence[str]) -> str:
    """``message`` with every long piece of what the user typed in ``typed`` (an argument, or the
    value of a ``KEY=VALUE``, or an item of a comma-separated list) cut to its start and its
    length, and the whole cut to a few thousand characters: a refusal names what it refuses
    without repeating a multi-megabyte argument."""
    pieces = {p for t in typed for p in (t, *t.split("=", 1)[1:], *t.split(",")) if len(p) > MAX_ECHOED}
    for piece in sorted(pieces, key=len, reverse=True):
        message = message.replace(piece, short_text(piece))
    # and any long unbroken run, wherever it came from (a value read from a file, argparse's quote)
    message = re.sub(rf"\S{{{MAX_ECHOED + 1},}}", lambda m: short_text(m.group()), message)
    limit = 20 * MAX_ECHOED
    return message if len(message) <= limit else f"{message[:limit]}... ({len(message) - limit:,} more characters)"
