"""megarl's `/classify` (reward models served by engines) checked against SGLang 0.5.23's own code, on CPU.

The bodies megarl sends (the `rm` source's, `EngineClient.classify`'s) and others SGLang takes (text, a batch with
rids) are recorded at an embedded classification server in this process, then parsed by SGLang's own
`EmbeddingReqInput` (compiled from the wheel's io_struct.py, validated by pydantic as FastAPI does, normalized;
tests/cases/sglang_side.py `classify`) in one side process, which also parses the reward engines' command lines.
The replies the embedded engine gave carry the fields SGLang's tokenizer manager builds, and its refusals are
SGLang's words.
"""

import ast
import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import ClientSession, web
from cases.reward_cases import save_classifier
from cases.sglang_env import run_side, sglang_file, sglang_site

from megarl.assets import asset_path
from megarl.config.reward import DiscriminativeRMConfig, RewardEnginesConfig
from megarl.engines.client import sglang_api
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.client import EngineClient
from megarl.engines.embedded.classify import NOT_EMBEDDING, Classifier, ClassifierArgs, ClassifyServer
from megarl.engines.embedded.server import EngineServer
from megarl.engines.replicas.launch import sglang_base_args
from megarl.engines.replicas.reward_engines import reward_engine_configs
from megarl.engines.replicas.sglang_command import LOOPBACK, sglang_command
from megarl.ports import free_port
from megarl.rewards.sources import Trajectory
from megarl.scoring.classify import ClassifierSource

pytestmark = pytest.mark.slow
TM = "srt/managers/tokenizer_manager.py"
MESSAGES = [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]
OTHER_BODIES = [
    {"text": "Is 2 the answer?"},
    {"text": ["one", "two three"], "rid": ["r0", "r1"]},
    {"input_ids": [[5, 6], [7, 8, 9]], "rid": ["a", "b"]},
]
REFUSED = [{}, {"text": "x", "input_ids": [1]}]
"""Bodies SGLang refuses in normalize_batch_and_arguments (400, its ValueError's text)."""
Exchange = tuple[dict[str, Any], int, Any]
"""A body, the status the embedded engine answered and its JSON reply."""


async def _exchanges(model: Path) -> list[Exchange]:
    """Serve `model` with `--is-embedding` in this process, recording what megarl's callers send and get."""
    records: list[Exchange] = []

    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        response = await handler(request)
        assert isinstance(response, web.Response) and response.text is not None
        records.append((await request.json(), response.status, json.loads(response.text)))
        return response

    classifier, keys, port = Classifier(ClassifierArgs(model_path=str(model))), EngineKeys(api="k"), free_port()
    app = ClassifyServer(classifier, keys).app()
    app.middlewares.insert(0, record)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, LOOPBACK, port).start()
    url = f"http://{LOOPBACK}:{port}"
    source = ClassifierSource(DiscriminativeRMConfig(enable=True, path=str(model), backend="server"), [url], keys)
    client = EngineClient(url, keys)
    try:
        await source.score(Trajectory("t", MESSAGES, MESSAGES[:1], "2", "", sample_id="s0"))
        await client.classify([[1, 2, 3], [4, 5]])
        async with ClientSession(headers={"Authorization": "Bearer k"}) as session:
            for body in OTHER_BODIES + REFUSED:
                async with session.post(url + "/classify", json=body) as response:
                    await response.read()
    finally:
        await asyncio.gather(source.close(), client.close())
        await runner.cleanup()
        classifier.close()
    return records


@pytest.fixture(scope="module")
def site() -> Path:
    return sglang_site()


@pytest.fixture(scope="module")
def exchanges(tmp_path_factory: pytest.TempPathFactory) -> list[Exchange]:
    return asyncio.run(_exchanges(save_classifier(tmp_path_factory.mktemp("rm") / "model")))


def _command_lines() -> list[list[str]]:
    """A classifier's replicas (SGLang's own `--is-embedding` and a tokenizer of its own) and a judge's."""
    engines = RewardEnginesConfig(engine="sglang", tensor_parallel_size=2)
    keys, path = EngineKeys(api="k", admin="a"), str(asset_path("models/tiny_dense"))
    rm = reward_engine_configs(engines, path, str(asset_path("tokenizer")), random_init=True)
    judge = reward_engine_configs(engines, path, None, random_init=False)
    lines = [sglang_base_args(*rm, LOOPBACK, keys, classify=True), sglang_base_args(*judge, LOOPBACK, keys)]
    return [sglang_command(args)[3:] for args in lines]


@pytest.fixture(scope="module")
def sglang_answer(site: Path, exchanges: list[Exchange]) -> dict[str, Any]:
    fields = ["is_embedding", "model_path", "tokenizer_path", "load_format", "tp_size"]
    request = {"argvs": _command_lines(), "fields": fields, "bodies": [body for body, _, _ in exchanges]}
    return dict(run_side(site, "classify", request))


def test_megarls_bodies_are_sglangs_embedding_requests(exchanges: list[Exchange], sglang_answer: dict) -> None:
    """Every body megarl sends passes its schema and SGLang's EmbeddingReqInput; where SGLang sees one prompt the
    embedded engine answers one object, where it sees a batch a list as long, with the rids asked for."""
    assert len(exchanges) == 2 + len(OTHER_BODIES) + len(REFUSED)
    assert exchanges[0][0] == {"input_ids": exchanges[0][0]["input_ids"]}  # the rm source: one prompt, no rid
    assert exchanges[1][0] == {"input_ids": [[1, 2, 3], [4, 5]]}  # EngineClient.classify: one batch
    for (body, status, reply), theirs in zip(exchanges, sglang_answer["requests"], strict=True):
        if "error" in theirs:
            continue
        sglang_api.check_payload("/classify", body)
        assert status == 200 and theirs["is_single"] == isinstance(reply, dict), (body, theirs)
        replies = [reply] if theirs["is_single"] else reply
        assert len(replies) == theirs["batch_size"]
        params = theirs["sampling_params"]
        assert all(p == {"max_new_tokens": 0} for p in (params if isinstance(params, list) else [params]))
        if body.get("rid") is not None:
            assert [r["meta_info"]["id"] for r in replies] == theirs["rid"]
        if body.get("input_ids") is not None:
            assert theirs["input_ids"] == body["input_ids"]
            prompts = body["input_ids"] if isinstance(body["input_ids"][0], list) else [body["input_ids"]]
            assert [r["meta_info"]["prompt_tokens"] for r in replies] == [len(p) for p in prompts]


def test_refusals_are_sglangs(exchanges: list[Exchange], sglang_answer: dict, site: Path) -> None:
    """What SGLang's normalization refuses the embedded engine refuses with 400 and the same message; `/classify` on
    a generation engine is answered as SGLang's tokenizer manager answers it."""
    refused = [
        (ex, theirs) for ex, theirs in zip(exchanges, sglang_answer["requests"], strict=True) if "error" in theirs
    ]
    assert [ex[0] for ex, _ in refused] == REFUSED
    for (_, status, reply), theirs in refused:
        assert status == 400 and theirs["error"] == f"ValueError: {reply['error']['message']}"
    assert NOT_EMBEDDING.replace("\n", "") in sglang_file(site, TM).read_text().replace('"\n                "', "")
    app = EngineServer(engine=None).app()  # routes only; no handler runs on the engine
    (route,) = [r for r in app.router.routes() if r.resource is not None and r.resource.canonical == "/classify"]
    response = asyncio.run(route.handler(None))
    assert response.status == 400 and json.loads(response.text) == {"error": {"message": NOT_EMBEDDING}}


def _handle_batch_output(site: Path) -> ast.AsyncFunctionDef:
    tree = ast.parse(sglang_file(site, TM).read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "_handle_batch_output")


def test_replies_carry_sglangs_fields(exchanges: list[Exchange], site: Path) -> None:
    """tokenizer_manager.py::_handle_batch_output for a BatchEmbeddingOutput: `{embedding, meta_info}`, meta_info
    the dict every reply starts with plus e2e_latency once finished; finish_reason FINISH_LENGTH(0).to_json()."""
    handler = _handle_batch_output(site)
    dicts = [n.value for n in ast.walk(handler) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict)]
    keys = [[ast.literal_eval(k) for k in d.keys if k is not None] for d in dicts]
    meta = next(k for k, d in zip(keys, dicts, strict=True) if "id" in k and "finish_reason" in k)
    assert ["embedding", "meta_info"] in keys and "meta_info['e2e_latency'] = " in ast.unparse(handler)
    finish = next(n for n in ast.walk(ast.parse(sglang_file(site, "srt/managers/schedule_batch.py").read_text()))
                  if isinstance(n, ast.ClassDef) and n.name == "FINISH_LENGTH")  # fmt: skip
    finish_keys = [ast.literal_eval(k) for n in ast.walk(finish) if isinstance(n, ast.Dict) for k in n.keys if k]
    for _, status, reply in exchanges:
        for one in [] if status != 200 else [reply] if isinstance(reply, dict) else reply:
            assert list(one) == ["embedding", "meta_info"]
            assert set(one["meta_info"]) == {*meta, "e2e_latency"}
            assert list(one["meta_info"]["finish_reason"]) == finish_keys
            assert one["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
            assert len(one["embedding"]) == 1 and isinstance(one["embedding"][0], float)  # num_labels = 1


def test_reward_engine_command_lines_parse_in_sglang(sglang_answer: dict) -> None:
    """The classifier's replicas start with SGLang's `--is-embedding` (and its tokenizer), the judge's without."""
    rm, judge = sglang_answer["server_args"]
    assert rm["fields"]["is_embedding"] is True and judge["fields"]["is_embedding"] is False
    assert rm["fields"]["tokenizer_path"] == str(asset_path("tokenizer"))
    assert rm["fields"]["load_format"] == "dummy" and judge["fields"]["load_format"] == "auto"
    assert rm["fields"]["tp_size"] == judge["fields"]["tp_size"] == 2
