"""Extension points are dotted paths to callables (`package.module:function`), imported here, and YAML
lists of plugin classes (tools, interactions)."""

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml

T = TypeVar("T")


def import_callable(path: str) -> Callable[..., Any]:
    """Import `package.module:name` or `package.module.name`, naming the path in any error."""
    module_name, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{path!r} is not a dotted path; write `package.module:function`")
    try:
        obj = getattr(importlib.import_module(module_name), attr)
    except Exception as err:  # a user's module may fail to load in any way; name the path either way
        raise ValueError(f"cannot import {path!r}: {type(err).__name__}: {err}") from err
    if not callable(obj):
        raise ValueError(f"{path!r} is a {type(obj).__name__}, not a function")
    return obj


@dataclass(kw_only=True, slots=True)
class PluginEntry(Generic[T]):
    where: str
    """`file: key[i]`, for error messages."""
    cls: type[T]
    spec: dict[str, Any]
    """The whole YAML entry."""


def load_class_list(path: str | Path, key: str, base: type[T], required: tuple[str, ...] = ()) -> list[PluginEntry[T]]:
    """The `key:` list of a YAML file whose entries name a `class_name` (a `base` subclass), imported.

    Errors name the file, the entry (`key[i]`) and what is missing."""
    spec = yaml.safe_load(Path(path).read_text())
    if not isinstance(spec, dict) or not isinstance(spec.get(key), list):
        raise ValueError(f"{path}: expected a mapping with a `{key}:` list")
    entries = []
    for i, entry in enumerate(spec[key]):
        where = f"{path}: {key}[{i}]"
        missing = [k for k in ("class_name", *required) if not isinstance(entry, dict) or k not in entry]
        if missing:
            raise ValueError(f"{where} needs {' and '.join(missing)}")
        cls = import_callable(entry["class_name"])
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"{where}: class_name {entry['class_name']!r} is not a {base.__name__} subclass")
        entries.append(PluginEntry(where=where, cls=cls, spec=entry))
    return entries
