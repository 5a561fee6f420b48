"""The generative judge (`reward_model.generative`): an LLM on its own engines rates each trajectory.

Per trajectory: `prompt_template` filled with the prompt's last user message, the response text and the ground
truth, after the optional system prompt, is rendered with the judge's chat template (add_generation_prompt) and
sent to one of the judge's engines (round-robin) as SGLang `/generate` input_ids with `n = samples`. Each reply
is parsed (`parser`):

- number: the last number of the reply, mapped from `score_range` onto [0, 1] and clipped;
- boxed: the last `\\boxed{x}` of the reply, mapped the same way;
- yes_no: P(yes) / (P(yes) + P(no)) at the reply's first position, from the log-probs SGLang returns for
  `token_ids_logprob` = the two `yes_no_tokens` (`meta_info.output_token_ids_logprobs`). That ratio is read, not
  sampled, so one 1-token request is made whatever `samples` is.

The component is the mean over samples, with `parse_failures` (unparsable replies, over all tries) as an extra. An
unparsable reply fails the try, as do connection errors and HTTP 429/5xx; tries follow `reward_model.generative.
retry`. The engines are spoken to over plain HTTP: `megarl.rewards` sits below `megarl.engines` in the layering.
"""

import asyncio
import itertools
import math
import re
from typing import Any, Protocol

import aiohttp
import transformers

from megarl.config.reward import GenerativeRMConfig
from megarl.rewards.retry import Transient, with_retries
from megarl.rewards.sources import Component, Trajectory
from megarl.scoring.remote import new_session, post_json

_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)")
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


class BearerKeys(Protocol):
    """What the judge needs of `megarl.engines.client.auth.EngineKeys`: the key a path takes."""

    def for_path(self, path: str) -> str | None: ...


def scaled(value: float, score_range: list[float]) -> float:
    """`value` mapped from [low, high] = `score_range` onto [0, 1], clipped."""
    low, high = score_range
    return min(1.0, max(0.0, (value - low) / (high - low)))


def parse_number(reply: str, score_range: list[float]) -> float:
    """The last number of `reply`, scaled; `Transient` when it has none."""
    numbers = _NUMBER.findall(reply)
    if not numbers:
        raise Transient(f"the judge's reply {reply[:200]!r} holds no number")
    return scaled(float(numbers[-1]), score_range)


def parse_boxed(reply: str, score_range: list[float]) -> float:
    """The number in the last `\\boxed{...}` of `reply`, scaled; `Transient` when there is none."""
    boxes = _BOXED.findall(reply)
    if not boxes or not _NUMBER.fullmatch(boxes[-1].strip()):
        raise Transient(f"the judge's reply {reply[:200]!r} holds no \\boxed{{number}}")
    return scaled(float(boxes[-1].strip()), score_range)


def parse_yes_no(first_logprobs: dict[int, float], yes_id: int, no_id: int) -> float:
    """P(yes) / (P(yes) + P(no)) from the log-probs of the reply's first position; `Transient` when both are
    missing or -inf."""
    yes, no = first_logprobs.get(yes_id, -math.inf), first_logprobs.get(no_id, -math.inf)
    if yes == no == -math.inf:
        raise Transient(f"no log-prob for the yes/no ids {yes_id}, {no_id} at the reply's first position")
    return 1.0 / (1.0 + math.exp(no - yes)) if no - yes < 700 else 0.0


def load_tokenizer(cfg: GenerativeRMConfig) -> Any:
    """The judge's tokenizer (`tokenizer_path`, else `path`)."""
    return transformers.AutoTokenizer.from_pretrained(cfg.tokenizer_path or cfg.path)


def _single_token_ids(cfg: GenerativeRMConfig, tokenizer: Any) -> tuple[list[int], list[str]]:
    """The ids of `yes_no_tokens`, and a problem for each that is not exactly one token."""
    ids, problems = [], []
    for token in cfg.yes_no_tokens:
        encoded = tokenizer.encode(token, add_special_tokens=False)
        if len(encoded) != 1:
            problems.append(
                f"reward_model.generative.yes_no_tokens: {token!r} is {len(encoded)} tokens {encoded} of the judge's "
                "tokenizer, not one; pick single tokens"
            )
        ids.append(encoded[0] if encoded else -1)
    return ids, problems


def _tokenizer_problems(cfg: GenerativeRMConfig, tokenizer: Any) -> list[str]:
    problems = []
    if tokenizer.chat_template is None:
        problems.append(f"reward_model.generative: the judge's tokenizer {tokenizer.name_or_path} has no chat template")
    if cfg.parser == "yes_no" and len(cfg.yes_no_tokens) != 2:
        problems.append(f"reward_model.generative.yes_no_tokens={cfg.yes_no_tokens} must be two tokens (yes, no)")
    if cfg.parser == "yes_no":
        problems += _single_token_ids(cfg, tokenizer)[1]
    return problems


def judge_problems(cfg: GenerativeRMConfig) -> list[str]:
    """Start-up checks of an enabled judge beyond `reward_model_problems`: the template formats, the tokenizer
    loads and has a chat template, and yes_no's tokens are single tokens of it."""
    problems = []
    try:
        cfg.prompt_template.format(prompt="", response="", ground_truth="")
    except (KeyError, IndexError, ValueError) as error:
        problems.append(
            f"reward_model.generative.prompt_template does not format ({type(error).__name__}: {error}); "
            "write literal braces as {{ and }}"
        )
    try:
        tokenizer = load_tokenizer(cfg)
    except (OSError, ValueError) as error:
        return [*problems, f"reward_model.generative: the judge's tokenizer does not load: {error}"]
    return problems + _tokenizer_problems(cfg, tokenizer)


class JudgeSource:
    """Scores trajectories with the judge served at `urls` (SGLang or embedded engines), at most `concurrency`
    requests at a time; `keys` are the engines' keys (`EngineKeys`), None for engines without."""

    name = "judge"

    def __init__(self, cfg: GenerativeRMConfig, urls: list[str], keys: BearerKeys | None = None) -> None:
        if not urls:
            raise ValueError("the judge needs at least one engine URL")
        self.cfg = cfg
        self.tokenizer = load_tokenizer(cfg)
        if problems := _tokenizer_problems(cfg, self.tokenizer):
            raise ValueError("; ".join(problems))
        self.yes_no_ids = _single_token_ids(cfg, self.tokenizer)[0] if cfg.parser == "yes_no" else []
        key = keys.for_path("/generate") if keys is not None else None
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._urls = itertools.cycle([url.rstrip("/") + "/generate" for url in urls])
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self._session: aiohttp.ClientSession | None = None

    def render(self, trajectory: Trajectory) -> list[int]:
        """The judge's prompt ids for `trajectory`."""
        cfg = self.cfg
        user = cfg.prompt_template.format(
            prompt=trajectory.prompt_text, response=trajectory.response_text, ground_truth=trajectory.ground_truth
        )
        system = [{"role": "system", "content": cfg.system_prompt}] if cfg.system_prompt is not None else []
        text = self.tokenizer.apply_chat_template(
            [*system, {"role": "user", "content": user}],
            tokenize=False,
            add_generation_prompt=True,
            **cfg.chat_template_kwargs,
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _request(self, input_ids: list[int]) -> dict[str, Any]:
        """The `/generate` body: `samples` replies, or for yes_no one token with the yes/no log-probs."""
        yes_no = self.cfg.parser == "yes_no"
        sampling = {
            "temperature": self.cfg.temperature,
            "max_new_tokens": 1 if yes_no else self.cfg.max_new_tokens,
            "n": 1 if yes_no else self.cfg.samples,
        }
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sampling}
        if yes_no:
            body |= {"return_logprob": True, "token_ids_logprob": self.yes_no_ids}
        return body

    def parse(self, reply: dict[str, Any]) -> float:
        """One `/generate` reply element's score in [0, 1]; `Transient` when unparsable."""
        if self.cfg.parser == "yes_no":
            positions = reply["meta_info"].get("output_token_ids_logprobs") or [None]
            first = {int(e[1]): -math.inf if e[0] is None else float(e[0]) for e in positions[0] or []}
            return parse_yes_no(first, *self.yes_no_ids)
        text = self.tokenizer.decode(reply["output_ids"], skip_special_tokens=True)
        if self.cfg.parser == "boxed":
            return parse_boxed(text, self.cfg.score_range)
        return parse_number(text, self.cfg.score_range)

    async def _try(self, input_ids: list[int], failures: list[int]) -> list[float]:
        """One request's scores; an unparsable reply fails the whole try (counted in `failures[0]`)."""
        if self._session is None or self._session.closed:
            self._session = new_session()
        answer = await post_json(self._session, next(self._urls), self._request(input_ids), self._headers)
        values, errors = [], []
        for reply in answer if isinstance(answer, list) else [answer]:
            try:
                values.append(self.parse(reply))
            except Transient as error:
                errors.append(error)
        failures[0] += len(errors)
        if errors:
            raise Transient(f"{len(errors)} of {len(errors) + len(values)} judge replies unparsable; {errors[0]}")
        return values

    async def score(self, trajectory: Trajectory) -> Component:
        input_ids = self.render(trajectory)
        failures = [0]
        what = f"judge for sample {trajectory.sample_id!r}"
        async with self._slots:  # held across retries: the wait for a slot is not part of a try's timeout
            values, retries = await with_retries(lambda: self._try(input_ids, failures), self.cfg.retry, what)
        return Component(sum(values) / len(values), {"parse_failures": float(failures[0])}, retries)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        self._session = None
