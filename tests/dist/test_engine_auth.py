"""`EngineKeys`: which key each endpoint takes under each pair of keys (srt/utils/auth.py::decide_request_auth),
that the keys never show in a printout, that `ADMIN_PATHS` are the endpoints SGLang 0.5.23 marks admin, and that
the embedded engine guards its endpoints that way."""

import ast
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from cases.engine_cases import engine_client, run, save_engine_model
from cases.sglang_env import sglang_file, sglang_site

from megarl.engines.client.auth import ADMIN_PATHS, EngineKeys
from megarl.engines.client.sampling import SamplingParams
from megarl.engines.embedded.__main__ import parse_args
from megarl.engines.embedded.engine import EmbeddedEngine, EngineArgs
from megarl.engines.embedded.server import EngineServer
from megarl.ports import free_port


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


def test_generated_keys_always_pass_as_command_line_values() -> None:
    """The servers take the keys as `--api-key KEY --admin-api-key KEY`; argparse reads a value starting with "-"
    as an option (a urlsafe token did so in 1 of 32 runs)."""
    for _ in range(500):
        keys = EngineKeys.generate()
        args = parse_args(["--model-path", "m", "--api-key", str(keys.api), "--admin-api-key", str(keys.admin)])
        assert (args.api_key, args.admin_api_key) == (keys.api, keys.admin)


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


@pytest.mark.slow  # installs the pinned sglang wheel on first use (tests/cases/sglang_env.py)
def test_the_key_each_endpoint_takes_is_sglangs() -> None:
    """Every path the embedded engine serves (those megarl calls) is one SGLang serves, and `ADMIN_PATHS` holds
    exactly those SGLang marks ADMIN_OPTIONAL (they take only --admin-api-key when it is set)."""
    levels = _auth_levels(sglang_file(sglang_site(), "srt/entrypoints/http_server.py").read_text())
    assert levels["/update_weights_from_tensor"] == "ADMIN_OPTIONAL" and levels["/generate"] == "NORMAL"
    served = {resource.canonical for resource in EngineServer(None).app().router.resources()}  # type: ignore[arg-type]
    assert served <= set(levels), sorted(served - set(levels))
    assert {path for path in served if levels[path] == "ADMIN_OPTIONAL"} == ADMIN_PATHS
    assert {levels[path] for path in served - ADMIN_PATHS} == {"NORMAL"}


async def _status(url: str, path: str, key: str | None) -> int:
    """The HTTP status of a POST of `{}` (a GET for /health*) to `path` with `key` as the bearer token (or none)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    method = "GET" if path.startswith("/health") else "POST"
    async with aiohttp.ClientSession() as session, session.request(method, url + path, json={}, headers=headers) as r:
        return r.status


def test_keys_guard_endpoints_as_sglangs_auth_levels_do(tmp_path: Path) -> None:
    """With both keys set (srt/utils/auth.py::decide_request_auth): /health* is open, /generate takes only the API
    key, the control endpoints only the admin key (401 otherwise); the client sends each endpoint its key."""
    engine = EmbeddedEngine(EngineArgs(model_path=str(save_engine_model(tmp_path / "model"))))
    keys = EngineKeys(api="api-s3cret", admin="admin-s3cret")

    async def scenario() -> tuple[dict[str, list[int]], int, bool]:
        runner = web.AppRunner(EngineServer(engine, keys).app())
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}"
        statuses = {  # with no key, the API key, the admin key
            path: [await _status(url, path, key) for key in (None, keys.api, keys.admin)]
            for path in ("/generate", "/flush_cache", "/update_weight_version", "/health_generate")
        }
        client = engine_client(url, keys)
        (result,) = await client.generate([1, 2], SamplingParams(max_new_tokens=2, ignore_eos=True))
        await client.pause_generation("abort")
        await client.continue_generation()
        flushed = await client.flush_cache()
        await client.close()
        await runner.cleanup()
        return statuses, len(result.output_ids), flushed

    try:
        statuses, generated, flushed = run(scenario())
    finally:
        engine.shutdown()
    assert statuses["/generate"][:2] == [401, 400]  # the API key passes (the empty body is then refused)
    assert statuses["/generate"][2] == 401
    assert statuses["/flush_cache"] == [401, 401, 200] and statuses["/update_weight_version"][:2] == [401, 401]
    assert statuses["/health_generate"] == [200, 200, 200]
    assert generated == 2 and flushed
