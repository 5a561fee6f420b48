"""The generative judge against an embedded engine process serving a tiny random judge (keyed, like a run's engines),
and the engine's `token_ids_logprob` (SGLang's /generate field) through the client."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from cases.engine_cases import engine_client, run, start_engine
from cases.reward_cases import save_judge

from megarl.config.reward import GenerativeRMConfig, RetryConfig
from megarl.engines.client.auth import EngineKeys
from megarl.engines.client.client import EngineError
from megarl.engines.client.sampling import SamplingParams
from megarl.rewards.sources import Component, RewardSourceError, Trajectory
from megarl.scoring.judge import JudgeSource

KEYS = EngineKeys(api="judge-key")
SEVEN = "7"
RETRY = RetryConfig(timeout_s=60.0, max_retries=2, backoff_s=0.01, max_backoff_s=0.02)
TRAJECTORIES = [
    Trajectory(
        data_source="toy",
        messages=[],
        prompt_messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": f"What is {i} + {i}?"}],
        response_text=f"It is {2 * i + i % 3}.",
        ground_truth=str(2 * i),
        sample_id=f"s{i}",
    )
    for i in range(4)
]


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`save_judge`'s random judge, its reply's first token made "7": the random model answers the same token to
    every judge prompt, and the row of "7" in lm_head becomes twice that token's row (so its logit doubles)."""
    path = save_judge(tmp_path_factory.mktemp("judge") / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    judge = JudgeSource(GenerativeRMConfig(enable=True, path=str(path)), ["http://unused"])
    with torch.no_grad():
        logits = model(torch.tensor([judge.render(TRAJECTORIES[0])])).logits[0, -1]
        seven = tokenizer.encode(SEVEN, add_special_tokens=False)[0]
        model.lm_head.weight[seven] = 2 * model.lm_head.weight[int(logits.argmax())]
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def judge_url(judge_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server, url = start_engine(judge_dir, tmp_path_factory.mktemp("logs"), "--api-key", str(KEYS.api))
    yield url
    server.stop()


def _config(judge_dir: Path, **overrides: object) -> GenerativeRMConfig:
    return GenerativeRMConfig(enable=True, path=str(judge_dir), retry=RETRY, **overrides)  # type: ignore[arg-type]


def _score_all(cfg: GenerativeRMConfig, url: str) -> list[Component]:
    async def main() -> list[Component]:
        judge = JudgeSource(cfg, [url, url], KEYS)
        try:
            return [await judge.score(t) for t in TRAJECTORIES]
        finally:
            await judge.close()

    return run(main())


def _first_logits(judge_dir: Path) -> list[torch.Tensor]:
    """transformers' logits [v] of the judge's first reply token to each trajectory, the prompt rendered here."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(judge_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()
    logits = []
    for t in TRAJECTORIES:
        user = GenerativeRMConfig().prompt_template.format(prompt=t.prompt_text, response=t.response_text)
        messages = [{"role": "user", "content": user}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with torch.no_grad():
            logits.append(model(torch.tensor([tokenizer.encode(text, add_special_tokens=False)])).logits[0, -1])
    return logits


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_yes_no_is_the_softmax_of_the_two_logits(judge_dir: Path, judge_url: str, temperature: float) -> None:
    cfg = _config(judge_dir, parser="yes_no", yes_no_tokens=["Y", "N"], temperature=temperature, samples=3)
    scores = _score_all(cfg, judge_url)
    tokenizer = transformers.AutoTokenizer.from_pretrained(judge_dir)
    yes, no = (tokenizer.encode(t, add_special_tokens=False)[0] for t in "YN")
    for logits, score in zip(_first_logits(judge_dir), scores, strict=True):
        expected = torch.softmax(logits[[yes, no]] / (temperature or 1.0), dim=-1)[0].item()
        assert abs(score.value - expected) <= 1e-4
        assert score.retries == 0 and score.extra == {"parse_failures": 0.0}
    assert len({round(s.value, 6) for s in scores}) > 1  # the judge prompt differs, and so does P(yes)


def test_number_is_the_replys_number_over_the_score_range(judge_dir: Path, judge_url: str) -> None:
    scores = _score_all(_config(judge_dir, max_new_tokens=1, samples=3, score_range=[0.0, 20.0]), judge_url)
    assert [(s.value, s.retries, s.extra) for s in scores] == [(pytest.approx(0.35), 0, {"parse_failures": 0.0})] * 4


def test_unparsable_replies_are_retried_then_fail(judge_dir: Path, judge_url: str) -> None:
    cfg = _config(judge_dir, parser="boxed", max_new_tokens=1, samples=2)  # the reply "7" has no \boxed{}
    with pytest.raises(RewardSourceError, match="2 of 2 judge replies unparsable") as caught:
        _score_all(cfg, judge_url)
    assert caught.value.retries == RETRY.max_retries
    assert "failed 3 time(s)" in str(caught.value) and "sample 's0'" in str(caught.value)


def test_a_judge_without_the_engines_key_fails_at_once(judge_dir: Path, judge_url: str) -> None:
    async def main() -> None:
        judge = JudgeSource(_config(judge_dir, max_new_tokens=1), [judge_url])
        try:
            await judge.score(TRAJECTORIES[0])
        finally:
            await judge.close()

    with pytest.raises(RewardSourceError, match="HTTP 401") as caught:
        run(main())
    assert caught.value.retries == 0


def test_generate_returns_the_log_probs_of_the_named_ids(judge_dir: Path, judge_url: str) -> None:
    """`token_ids_logprob` through EngineClient.generate: each output position's log-probs of the named ids, at the
    sampling temperature, equal transformers' log_softmax there; an id outside the vocabulary is a 400."""
    prompt, named = [5, 6, 7, 8], [31, 54, 65, 4095]
    model = transformers.AutoModelForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()

    async def main() -> tuple[list, list]:
        client = engine_client(judge_url, KEYS)
        sampling = SamplingParams(max_new_tokens=3, temperature=0.5, ignore_eos=True, sampling_seed=1)
        try:
            with_ids = await client.generate(prompt, sampling, return_logprob=True, token_ids_logprob=named)
            without = await client.generate(prompt, sampling, return_logprob=True)
            with pytest.raises(EngineError, match="out-of-vocabulary token id 4096"):
                await client.generate(prompt, sampling, return_logprob=True, token_ids_logprob=[4096])
        finally:
            await client.close()
        return with_ids, without

    with_ids, without = run(main())
    assert without[0].output_token_ids_logprobs is None
    result = with_ids[0]
    assert result.output_token_ids_logprobs is not None and len(result.output_token_ids_logprobs) == 3
    with torch.no_grad():
        logits = model(torch.tensor([prompt + result.output_ids])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits / 0.5, dim=-1)[:, named]  # [3, 4]
    got = torch.tensor([[position[i] for i in named] for position in result.output_token_ids_logprobs])
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
