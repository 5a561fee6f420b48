"""`EngineKeys`: which key each endpoint takes under each pair of keys (srt/utils/auth.py::decide_request_auth),
and that the keys never show in a printout."""

import pytest

from megarl.engines.auth import EngineKeys


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
