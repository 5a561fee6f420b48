"""`--enable-deterministic-inference` in the embedded engine (the real engine thread, in-process, CPU): a seeded
request's tokens and log-probs are the same bits alone, admitted together with seven others of other lengths,
joining seven rows already decoding, and after the same prompt ran before (no prefix-cache hit). Without the flag
they differ in the last bits on this 2-core machine (a row's matmul changes with the number of rows and its
attention with the shared padding; measured: 21 of 40 log-probs in the batch of eight); the flag reaches both
engines' command lines."""

import threading

import pytest
import torch
from cases.engine_cases import save_engine_model

from megarl.config.model import ModelConfig
from megarl.config.rollout import RolloutConfig
from megarl.engines.client.auth import EngineKeys
from megarl.engines.embedded.batch import Sequence
from megarl.engines.embedded.engine import EmbeddedEngine, EngineArgs
from megarl.engines.embedded.sampler import RowSampling
from megarl.engines.replicas.launch import embedded_command, sglang_base_args
from megarl.engines.replicas.sglang_command import sglang_command

NEW_TOKENS = 24


def _seq(rid: str, prompt: list[int], seed: int, new_tokens: int = NEW_TOKENS) -> Sequence:
    sampling = RowSampling(temperature=1.0, top_p=1.0, top_k=-1, generator=torch.Generator().manual_seed(seed))
    return Sequence(rid=rid, prompt=prompt, sampling=sampling, max_new_tokens=new_tokens, stop_ids=frozenset())


class _Collector:
    """Finished sequences by rid; `wait` blocks until the named ones are in."""

    def __init__(self) -> None:
        self.done: dict[str, Sequence] = {}
        self.cond = threading.Condition()

    def __call__(self, seq: Sequence) -> None:
        with self.cond:
            self.done[seq.rid] = seq
            self.cond.notify_all()

    def wait(self, *rids: str) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: set(rids) <= set(self.done), timeout=120), rids


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> EmbeddedEngine:
    model = save_engine_model(tmp_path_factory.mktemp("deterministic") / "model")
    engine = EmbeddedEngine(EngineArgs(model_path=str(model), enable_deterministic_inference=True))
    yield engine
    engine.shutdown()


def _prompts() -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(7)
    target = torch.randint(3, 500, (23,), generator=g).tolist()
    return target, [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 11, 17, 31, 47, 64, 90)]


def test_a_seeded_request_gives_the_same_bits_whatever_runs_beside_it(engine: EmbeddedEngine) -> None:
    target, others = _prompts()
    runs: list[Sequence] = []
    collect = _Collector()
    engine.submit([_seq("alone", target, 1234)], collect)
    collect.wait("alone")
    runs.append(collect.done["alone"])
    crowd = [_seq(f"crowd{i}", p, 100 + i, 10 + 3 * i) for i, p in enumerate(others)]
    engine.submit([*crowd[:3], _seq("batched", target, 1234), *crowd[3:]], collect)  # one admission, 8 rows
    collect.wait("batched", *(s.rid for s in crowd))
    runs.append(collect.done["batched"])
    early = [_seq(f"early{i}", p, 200 + i, 40) for i, p in enumerate(others)]
    engine.submit(early, collect)
    engine.submit([_seq("joining", target, 1234)], collect)  # admitted while the early rows decode, or after
    collect.wait("joining", *(s.rid for s in early))
    runs.append(collect.done["joining"])
    engine.submit([_seq("again", target, 1234)], collect)  # the same prompt ran before: no cached prefix is used
    collect.wait("again")
    runs.append(collect.done["again"])
    assert all(s.finish is not None and s.finish.type == "length" for s in runs)
    assert runs[1].cached_tokens == runs[3].cached_tokens == 0
    for run in runs[1:]:
        assert run.output == runs[0].output, run.rid
        assert run.logprobs == runs[0].logprobs, run.rid  # float equality: the same bits
    assert engine.stats.max_batch_size >= 7  # the rows did run side by side
    assert engine.prefix_cache is None


def test_the_flag_reaches_both_engines_command_lines() -> None:
    cfg, model, keys = RolloutConfig(deterministic_inference=True), ModelConfig(path="/m"), EngineKeys()
    assert "--enable-deterministic-inference" in embedded_command(cfg, model, "127.0.0.1", 1, "cpu", keys)
    assert "--enable-deterministic-inference" in sglang_command(sglang_base_args(cfg, model, "127.0.0.1", keys))
    plain = RolloutConfig()
    assert "--enable-deterministic-inference" not in embedded_command(plain, model, "127.0.0.1", 1, "cpu", keys)
    assert "--enable-deterministic-inference" not in sglang_command(sglang_base_args(plain, model, "127.0.0.1", keys))
