"""Extension points are dotted paths to callables (`package.module:function`), imported here."""

import importlib
from collections.abc import Callable
from typing import Any


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
