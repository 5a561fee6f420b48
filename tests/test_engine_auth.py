"""`EngineKeys`: which key each endpoint takes under each pair of keys (srt/utils/auth.py::decide_request_auth),
that the keys never show in a printout, and that `ADMIN_PATHS` are the endpoints SGLang 0.5.23 marks admin."""

import ast

import pytest
from sglang_env import sglang_file, sglang_site

from megarl.engines.auth import ADMIN_PATHS, EngineKeys
from megarl.engines.embedded.server import EngineServer


@pytest.mark.parametrize(
    ("keys", "generate", "flush"),
    [
        (EngineKeys(), None, None),  # nothing configured: everything open
        (EngineKeys(api="a"), "a", "a"),  # only --api-key: it guards every endpoint
        (EngineKeys(admin="m"), None, "m"),  # only --admin-api-key: the NORMAL endpoints stay open
        (EngineKeys(api="a", admin="m"), "a", "m"),  # both: each level takes its own key only
    ],
)
def test_each_endpoint_takes_the_key_sglang_requires(keys: EngineKeys, generate: str | None, flush: str | None) -> None:
    assert (keys.for_path("/generate"), keys.for_path("/flush_cache")) == (generate, flush)
    assert keys.for_path("/health_generate") is None and keys.allows("/ready", None)
    for path, key in (("/generate", generate), ("/update_weights_from_tensor", flush)):
        assert keys.allows(path, f"Bearer {key}") and keys.allows(path, f"bearer {key}")
        assert keys.allows(path, None) == (key is None) and keys.allows(path, "Bearer wrong") == (key is None)
    if generate != flush:  # one level's key does not open the other's endpoints
        assert not keys.allows("/flush_cache", f"Bearer {generate}")


def test_generated_keys_differ_and_never_print() -> None:
    keys, other = EngineKeys.generate(), EngineKeys.generate()
    assert keys.api and keys.admin and len({keys.api, keys.admin, other.api, other.admin}) == 4
    shown = f"{keys!r} {keys} {[keys]}"
    assert keys.api not in shown and keys.admin not in shown and "<set>" in shown


def _auth_levels(source: str) -> dict[str, str]:
    """Path → the `AuthLevel` of its handler's `@auth_level(...)` (NORMAL without one), for every `@app.*(path)`."""
    levels = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            decorators = [ast.unparse(d) for d in node.decorator_list]
            marked = [d.split("AuthLevel.")[1].rstrip(")") for d in decorators if d.startswith("auth_level(")]
            for deco in node.decorator_list:
                path = deco.args[0] if isinstance(deco, ast.Call) and deco.args else None
                if isinstance(path, ast.Constant) and ast.unparse(deco.func).startswith("app."):
                    levels[path.value] = marked[0] if marked else "NORMAL"
    return levels


@pytest.mark.slow  # installs the pinned sglang wheel on first use (tests/sglang_env.py)
def test_the_key_each_endpoint_takes_is_sglangs() -> None:
    """Every path the embedded engine serves (those megarl calls) is one SGLang serves, and `ADMIN_PATHS` holds
    exactly those SGLang marks ADMIN_OPTIONAL (they take only --admin-api-key when it is set)."""
    levels = _auth_levels(sglang_file(sglang_site(), "srt/entrypoints/http_server.py").read_text())
    assert levels["/update_weights_from_tensor"] == "ADMIN_OPTIONAL" and levels["/generate"] == "NORMAL"
    served = {resource.canonical for resource in EngineServer(None).app().router.resources()}  # type: ignore[arg-type]
    assert served <= set(levels), sorted(served - set(levels))
    assert {path for path in served if levels[path] == "ADMIN_OPTIONAL"} == ADMIN_PATHS
    assert {levels[path] for path in served - ADMIN_PATHS} == {"NORMAL"}
