"""The bearer keys of a run's engines, and which key each endpoint takes, as SGLang 0.5.23 decides it.

SGLang (`srt/utils/auth.py::decide_request_auth`) lets `/health*`, `/ready*` and `/metrics*` through
unconditionally. Every other endpoint is NORMAL or ADMIN_OPTIONAL (its `@auth_level` in
`srt/entrypoints/http_server.py`): an ADMIN_OPTIONAL one (weights, LoRA adapters, memory, pause, abort, flush,
version) takes only `--admin-api-key` when that is set, else `--api-key`; a NORMAL one (`/generate`, `/model_info`,
`/server_info`) takes `--api-key` when that is set. The header is `Authorization: Bearer <key>`; a refusal is 401.

Each run starts all its engines with one fresh pair of keys (`EngineKeys.generate`, in the trainer's and
`megarl-serve`'s launch; both write them to `<trainer.run_dir>/engine_keys.json`), whatever address they
bind to: a loopback port is open to every process and user on the node (other jobs on a shared cluster node
included), and the admin endpoints load weights and release memory. One path also means the keyed path is the
one every CPU test runs. Keys never reach logs: `EngineKeys` prints without them and `ServerProcess` masks
them in the command lines and output it logs.
"""

import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

OPEN_PREFIXES = ("/health", "/ready", "/metrics")
"""Paths that need no key (decide_request_auth)."""
ADMIN_PATHS = frozenset(
    {
        "/flush_cache",
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/begin_weight_update",
        "/end_weight_update",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/destroy_weights_update_group",
        "/update_weights_from_distributed",
        "/update_weight_version",
        "/get_weights_by_name",
        "/load_lora_adapter_from_tensors",
        "/unload_lora_adapter",
    }
)
"""The endpoints megarl calls that SGLang marks `AuthLevel.ADMIN_OPTIONAL`; the others it calls are NORMAL
(tests/dist/test_sglang_contract.py checks both against http_server.py)."""


@dataclass(frozen=True, slots=True, repr=False)
class EngineKeys:
    """`api` for SGLang's `--api-key`, `admin` for `--admin-api-key`; None = not set."""

    api: str | None = None
    admin: str | None = None

    @classmethod
    def generate(cls) -> "EngineKeys":
        """A fresh random pair (256 bits each), in hex: a key travels as a command-line value, where one starting
        with "-" (1 in 64 of `token_urlsafe`'s) would be read as an option by the servers' argument parsers."""
        return cls(api=secrets.token_hex(32), admin=secrets.token_hex(32))

    def __repr__(self) -> str:
        return f"EngineKeys(api={_shown(self.api)}, admin={_shown(self.admin)})"

    def write(self, path: Path) -> Path:
        """The keys as JSON (`api_key`, `admin_api_key`) at `path`, created readable and writable by its owner
        only: how a person reaches a run's engines by hand (`<trainer.run_dir>/engine_keys.json`)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        path.unlink(missing_ok=True)  # an existing file would keep its mode
        with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:
            json.dump({"api_key": self.api, "admin_api_key": self.admin}, out)
        return path

    def values(self) -> tuple[str, ...]:
        return tuple(key for key in (self.api, self.admin) if key)

    def for_path(self, path: str) -> str | None:
        """The key a request to `path` must carry; None when it needs none."""
        if path.startswith(OPEN_PREFIXES):
            return None
        if path in ADMIN_PATHS:
            return self.admin or self.api
        return self.api

    def allows(self, path: str, authorization: str | None) -> bool:
        """Server side: whether a request to `path` with this Authorization header may pass (constant-time)."""
        key = self.for_path(path)
        if key is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), key.encode())


def _shown(key: str | None) -> str:
    return "None" if key is None else "<set>"
