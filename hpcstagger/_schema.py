"""Validation of TOML/dict configuration: typed fields, defaults, and errors that name the field.

A :class:`Table` lists its fields. :meth:`Table.parse` rejects unknown keys (listing every valid
key with its default), reports a missing required key, and checks each value with the field's
checker, naming it by its dotted path (``job[1].ranks must be an integer >= 1, got 0``).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import sys
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable, Mapping, Sequence

from hpcstagger.errors import ConfigError

__all__ = ["REQUIRED", "Field", "Table", "number", "integer", "string", "choice", "boolean", "size",
           "command", "str_map", "number_list", "table", "load_toml", "check_tables", "toml_value"]


class _Required:
    def __repr__(self) -> str:
        return "required"


REQUIRED: Any = _Required()
Checker = Callable[[str, Any], Any]


@dataclass(frozen=True)
class Field:
    """One key of a table: its default (or REQUIRED), a checker ``(where, value) -> value``, and a
    short description of the default for error messages (``shown``; defaults to ``repr``)."""

    name: str
    check: Checker
    default: Any = REQUIRED
    shown: str | None = None

    def describe(self) -> str:
        if self.default is REQUIRED:
            return f"{self.name} (required)"
        return f"{self.name} (default {self.shown if self.shown is not None else _toml_repr(self.default)})"


def _toml_repr(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "unset"
    if isinstance(value, float) and math.isinf(value):
        return "unlimited"
    return repr(value)


class Table:
    """A named table of fields."""

    def __init__(self, name: str, fields: Sequence[Field]):
        self.name = name
        self.fields = {f.name: f for f in fields}

    def valid_keys(self) -> str:
        return ", ".join(f.describe() for f in self.fields.values())

    def parse(self, where: str, data: Any) -> dict[str, Any]:
        """Check ``data`` (a mapping) against the fields; return every field's value (defaults filled).

        ``where`` is the dotted path of the table in messages (``cache``, ``job[2]``).
        Raises ConfigError naming the first unknown, missing or bad key.
        """
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"[{where}] must be a table, got {type(data).__name__} {data!r}")
        for key in data:
            if key not in self.fields:
                raise ConfigError(f"unknown key {where}.{key}; valid keys of [{self.name}]: {self.valid_keys()}")
        out: dict[str, Any] = {}
        for name, f in self.fields.items():
            if name in data:
                out[name] = f.check(f"{where}.{name}", data[name])
            elif f.default is REQUIRED:
                raise ConfigError(f"missing {where}.{name} (required); valid keys of [{self.name}]: "
                                  f"{self.valid_keys()}")
            else:
                out[name] = f.default
        return out


def load_toml(path: str | os.PathLike[str], what: str) -> dict[str, Any]:
    """Read TOML file ``path`` (a ``what``: "spec file", "scenario file") into a dict.

    Raises ConfigError for a missing or unreadable file, or text that is not UTF-8 TOML.
    """
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    name = os.fspath(path)
    try:
        with open(name, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise ConfigError(f"{what} {name} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {name}: {exc.strerror or exc}") from None
    try:
        return tomllib.loads(text.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {name} is not valid TOML: {exc}") from None


# A job spec and a scenario share [dataset], [cache], [loader] and [[job]]; these tables (and a job
# spec's [[job]] command) are one kind's alone, so a file of the other kind is named as such, with the
# fix. (A spec's job may carry a scenario's job keys, sample_time among them.)
_ONLY = {"scenario": (("storage", "node"), ""), "job spec": (("run", "plan", "checkpoint", "slurm"), "command")}
_GIVE = {"scenario": "give the scenario that 'hpcstagger calibrate SPEC' writes (the spec's [plan] scenario)",
         "job spec": "give the job spec ([run], [[job]] tables with a command); a scenario goes in its [plan] "
                     "scenario"}


def check_tables(data: Mapping[str, Any], known: Sequence[str], valid: str, kind: str) -> None:
    """ConfigError for a table of ``data`` not in ``known`` (``valid`` lists them for the message),
    and for a file of the other kind: a job spec read as a ``kind`` "scenario" or the reverse."""
    other = "job spec" if kind == "scenario" else "scenario"
    tables, job_key = _ONLY[other]
    jobs = data.get("job")
    jobs = [jobs] if isinstance(jobs, Mapping) else jobs if isinstance(jobs, list) else []
    sign = next((f"[{k}]" for k in data if k in tables), None)
    if sign is None and job_key and any(isinstance(j, Mapping) and job_key in j for j in jobs):
        sign = f"[[job]] {job_key}"
    if sign is not None:
        raise ConfigError(f"this is a {other} (it has {sign}), not a {kind}: {_GIVE[kind]}")
    for key in data:
        if key not in known:
            raise ConfigError(f"unknown table [{key}]; valid tables: {valid}")


# ---------------------------------------------------------------------------- checkers


def number(*, minimum: float | None = None, exclusive: bool = False, allow_inf: bool = False) -> Checker:
    """A real number, at least (or, with ``exclusive``, above) ``minimum``."""

    def check(where: str, value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        v = float(value)
        if math.isnan(v) or (math.isinf(v) and not allow_inf):
            raise ConfigError(f"{where} must be a finite number, got {value!r}")
        if minimum is not None and (v < minimum or (exclusive and v == minimum)):
            raise ConfigError(f"{where} must be {'>' if exclusive else '>='} {minimum:g}, got {value!r}")
        return v

    return check


def integer(*, minimum: int | None = None, maximum: int | None = None) -> Checker:
    """A whole number (an integral float such as 1e4 is accepted), at least ``minimum`` and at most ``maximum``."""

    def check(where: str, value: Any) -> int:
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or (isinstance(value, float) and (not math.isfinite(value) or value != int(value)))):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ConfigError(f"{where} must be an integer >= {minimum}, got {value!r}")
        if maximum is not None and value > maximum:
            raise ConfigError(f"{where} must be an integer <= {maximum}, got {value!r}")
        return int(value)

    return check


def string(*, pattern: str | None = None, hint: str = "", allow_empty: bool = False) -> Checker:
    """A string, optionally matching ``pattern`` (``hint`` says what is allowed)."""

    def check(where: str, value: Any) -> str:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        _no_nul(where, value)
        if not value and not allow_empty:
            raise ConfigError(f"{where} must not be empty")
        if pattern is not None and value and not re.fullmatch(pattern, value):
            raise ConfigError(f"{where} = {value!r} is not valid{': ' + hint if hint else ''}")
        return value

    return check


def _no_nul(where: str, value: str) -> None:
    # No path, argument or environment variable can hold one; the OS would refuse it much later.
    if "\x00" in value:
        raise ConfigError(f"{where} must not contain a NUL character, got {value!r}")


def choice(*options: str) -> Checker:
    """One of ``options``."""

    def check(where: str, value: Any) -> str:
        if value not in options:
            raise ConfigError(f"{where} must be one of {', '.join(repr(o) for o in options)}, got {value!r}")
        return value

    return check


def boolean() -> Checker:
    """true or false."""

    def check(where: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value

    return check


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def size(where: str, value: Any) -> int:
    """A byte count: a number, or a string such as ``"512MB"``, ``"1.5GiB"`` (1 kB = 1000 B)."""
    if isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?\d+)?)\s*([A-Za-z]*)\s*", value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ConfigError(f"{where} = {value!r} is not a size; use bytes or a number with a unit "
                              "(B, kB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. \"512MB\"")
        v = float(m.group(1)) * _UNITS[unit]
        if not math.isfinite(v):
            raise ConfigError(f"{where} = {value!r} is too large for a size")
        return int(v)
    return int(number(minimum=0)(where, value))


def command(where: str, value: Any) -> tuple[str, ...]:
    """A command: a list of strings, or one string split like a shell would (no expansion)."""
    if isinstance(value, str):
        try:
            parts = shlex.split(value)
        except ValueError as exc:
            raise ConfigError(f"{where}: cannot split {value!r} into words ({exc})") from None
    elif isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        parts = list(value)
    else:
        raise ConfigError(f"{where} must be a string or a list of strings, got {value!r}")
    if not parts:
        raise ConfigError(f"{where} must not be empty")
    for i, part in enumerate(parts):
        _no_nul(f"{where}[{i}]", part)
    return tuple(parts)


def str_map(where: str, value: Any) -> dict[str, str]:
    """A table of string values (numbers are turned into strings), e.g. environment variables."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a table of strings, got {value!r}")
    out = {}
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, (str, int, float)):
            raise ConfigError(f"{where}.{k} must be a string or a number, got {v!r}")
        if not k or "=" in str(k):
            raise ConfigError(f"{where}: {str(k)!r} is not a variable name (it must be non-empty, without '=')")
        _no_nul(f"{where}.{k}", str(k) + str(v))
        out[str(k)] = str(v)
    return out


def number_list(*, minimum: float | None = None, exclusive: bool = False) -> Checker:
    """A non-empty list of numbers (a single number is taken as a list of one)."""
    each = number(minimum=minimum, exclusive=exclusive)

    def check(where: str, value: Any) -> tuple[float, ...]:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]
        if not isinstance(value, (list, tuple)) or not value:
            raise ConfigError(f"{where} must be a non-empty list of numbers, got {value!r}")
        return tuple(each(f"{where}[{i}]", v) for i, v in enumerate(value))

    return check


def table(where: str, value: Any) -> dict[str, Any]:
    """Any table, returned as a plain dict."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must be a table, got {value!r}")
    return dict(value)


def optional(check: Checker) -> Checker:
    """``check``, or None for a missing/empty value (use with ``default=None``)."""

    def wrapped(where: str, value: Any) -> Any:
        return None if value is None or value == "" else check(where, value)

    return wrapped


def toml_value(value: Any) -> str:
    """``value`` (bool, int, float with inf, str, or a list of them) as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
