"""Reading helpers: every field of a sidecar is read through :class:`_Fields`, so a bad file is
one clear error naming the file and the field."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Mapping

from .formats import READ_VERSIONS, SidecarError

class _Fields:
    """Typed access to one JSON object of a sidecar; failures name the file and the field."""

    def __init__(self, data: Any, where: str, error: type[SidecarError], fix: str):
        self.where, self.error, self.fix = where, error, fix
        if not isinstance(data, Mapping):
            self.fail(f"holds a {type(data).__name__}, expected a JSON object")
        self.data = data

    def fail(self, what: str):
        raise self.error(f"{self.where} {what}. Fix: {self.fix}")

    def get(self, key: str, kind: type | tuple[type, ...], *, optional: bool = False,
            default: Any = None) -> Any:
        if key not in self.data:
            if optional:
                return default
            self.fail(f"has no {key!r} field")
        value = self.data[key]
        if value is None and optional:
            return default
        if isinstance(value, bool) and kind in (int, float, (int, float)):
            self.fail(f"field {key!r} must be a number, got {value!r}")
        if not isinstance(value, kind):
            names = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
            self.fail(f"field {key!r} must be {names}, got {type(value).__name__} {value!r}")
        return value

    def obj(self, key: str, *, optional: bool = False) -> dict:
        return dict(self.get(key, dict, optional=optional, default={}))

    def sub(self, data: Any, where: str) -> "_Fields":
        return _Fields(data, f"{self.where}: {where}", self.error, self.fix)


def _read_json(path: Path, error: type[SidecarError], missing: str, fix: str) -> Any:
    if not path.is_file():
        raise error(missing)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise error(f"cannot read the sidecar {path}: {exc}. Fix: {fix}") from None
    except RecursionError:  # nested deeper than Python's JSON reader goes: no sidecar is
        raise error(f"cannot read the sidecar {path}: its JSON is nested deeper than "
                    f"{sys.getrecursionlimit()} levels (no qkrope sidecar is). Fix: {fix}") from None


def _brief(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_format(f: _Fields, fmt: str) -> None:
    got = f.data.get("format")
    if got != fmt:
        f.fail(f"is not a qkrope sidecar of format {fmt!r} (got format={got!r})")
    version = f.data.get("format_version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        f.fail(f"has format_version {version!r}; this qkrope reads versions "
               f"{', '.join(map(str, READ_VERSIONS))}")


def _dims(f: _Fields, value: Any, key: str, allowed: tuple[type, ...]) -> list:
    if not isinstance(value, list) or any(isinstance(d, bool) or not isinstance(d, allowed)
                                          for d in value):
        f.fail(f"field {key!r} must be a list of {'/'.join(t.__name__ for t in allowed)}, got "
               f"{value!r}")
    return list(value)


def _positive_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1
