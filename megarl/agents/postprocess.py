"""Agent-loop outputs → one padded `Batch`, rows in the order of the outputs.

Tensors (P = prompt_length, R = response_length):

    prompts            [B, P]    left-padded prompt ids
    responses          [B, R]    right-padded response ids (model and tool/user tokens)
    input_ids          [B, P+R]  prompts ‖ responses
    attention_mask     [B, P+R]  1 on real tokens
    position_ids       [B, P+R]  0.. over real tokens (0 on left padding)
    response_mask      [B, R]    1 = model token, 0 = tool/user token or padding
    rollout_log_probs  [B, R]    the engine's log-probs (0 where response_mask is 0)
    rollout_versions   [B, R]    int64: the weight version number that sampled each model token (a partial
                                 rollout spans several); -1 where response_mask is 0 or the loop reported none
    rm_scores          [B, R]    the loop's reward at the last real response token, 0 elsewhere
    num_turns          [B]       model + tool/user turns
    routed_experts     [B, P+R, moe_layers·k]  only when the loops return routings (R3): the experts each MoE
                                 layer sent each token to, aligned with input_ids, -1 where there is no record;
                                 only the MoE layers, in decoder order (`RoutingLayout`), in the smallest integer
                                 type that holds the expert indices (`batch.routing_dtype`)

Non-tensors: `loop_reward` (float, or None when no tool or interaction ran: `rm_scores` is then 0 and
the reward comes from elsewhere), `finish_reason`, `agent_metrics` (dict per row), `messages`; the agent
worker adds `response_text` (`response_texts`: what the rule rewards score and the rollout dumps show).
"""

from dataclasses import dataclass
from typing import Any

import torch

from megarl.agents.base import AgentOutput
from megarl.batch import NO_RECORD, ROUTING_COLUMN, Batch, routing_dtype
from megarl.models.spec import load_hf_config, model_spec


@dataclass(frozen=True, kw_only=True, slots=True)
class RoutingLayout:
    """Which of an engine's routings the `routed_experts` column keeps. SGLang answers every decoder layer
    (`RoutedExpertsCapturer`: `[tokens, num_hidden_layers, top_k]`, dense layers 0); the column keeps the MoE
    layers only, so a dense-first model (GLM-4.5, DeepSeek-V3: `first_k_dense_replace`) ships no dense entries."""

    num_layers: int
    """Decoder layers the engines answer for (the model's `num_hidden_layers`)."""
    moe_layers: tuple[int, ...]
    """The decoder layers that route, ascending: column ordinal j is decoder layer `moe_layers[j]`."""
    num_experts: int

    @classmethod
    def of(cls, model_path: str) -> "RoutingLayout":
        spec = model_spec(load_hf_config(model_path))
        moe = tuple(layer for layer, routed in enumerate(spec.moe_layers) if routed)
        return cls(num_layers=spec.num_layers, moe_layers=moe, num_experts=spec.num_experts)

    def keep(self, rows: torch.Tensor) -> torch.Tensor:
        """An engine's `[n, num_layers·k]` routing → `[n, moe_layers·k]` in the column's dtype."""
        if rows.shape[1] % self.num_layers:
            raise ValueError(f"engine routing of width {rows.shape[1]} is not {self.num_layers} layers × top-k")
        by_layer = rows.view(len(rows), self.num_layers, -1)[:, list(self.moe_layers)]
        return by_layer.flatten(1).to(routing_dtype(self.num_experts))


def to_batch(
    outputs: list[AgentOutput],
    prompt_length: int,
    response_length: int,
    pad_token_id: int,
    routing: RoutingLayout | None = None,
) -> Batch:
    """The padded batch of `outputs` (module docstring); `routing` lays out the loops' routed experts, if any."""
    num_rows = len(outputs)
    prompts = torch.full((num_rows, prompt_length), pad_token_id, dtype=torch.long)
    responses = torch.full((num_rows, response_length), pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((num_rows, prompt_length), dtype=torch.long)
    response_attention = torch.zeros((num_rows, response_length), dtype=torch.long)
    response_mask = torch.zeros((num_rows, response_length), dtype=torch.long)
    log_probs = torch.zeros((num_rows, response_length), dtype=torch.float32)
    versions = torch.full((num_rows, response_length), -1, dtype=torch.long)
    rm_scores = torch.zeros((num_rows, response_length), dtype=torch.float32)
    for i, out in enumerate(outputs):
        num_prompt, num_response = len(out.prompt_ids), len(out.response_ids)
        if num_prompt > prompt_length:
            raise ValueError(f"row {i}: prompt of {num_prompt} tokens > data.max_prompt_length={prompt_length}")
        assert num_response <= response_length, "agent loops stay within the response budget"
        assert len(out.response_mask) == num_response == len(out.response_logprobs), "aligned response columns"
        prompts[i, prompt_length - num_prompt :] = torch.tensor(out.prompt_ids, dtype=torch.long)
        prompt_mask[i, prompt_length - num_prompt :] = 1
        responses[i, :num_response] = torch.tensor(out.response_ids, dtype=torch.long)
        response_attention[i, :num_response] = 1
        response_mask[i, :num_response] = torch.tensor(out.response_mask, dtype=torch.long)
        log_probs[i, :num_response] = torch.tensor(out.response_logprobs, dtype=torch.float32)
        if out.response_versions is not None:
            assert len(out.response_versions) == num_response, "aligned response columns"
            versions[i, :num_response] = torch.tensor(out.response_versions, dtype=torch.long)
        if out.reward is not None and num_response:
            rm_scores[i, num_response - 1] = out.reward
    attention_mask = torch.cat([prompt_mask, response_attention], dim=1)
    return Batch.from_dict(
        tensors=_routed_experts(outputs, prompt_length, response_length, routing)
        | {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
            "response_mask": response_mask,
            "rollout_log_probs": log_probs * response_mask,
            "rollout_versions": versions.masked_fill(response_mask == 0, -1),
            "rm_scores": rm_scores,
            "num_turns": torch.tensor([out.num_turns for out in outputs], dtype=torch.long),
        },
        non_tensors={
            "loop_reward": [out.reward for out in outputs],
            "finish_reason": [out.finish_reason for out in outputs],
            "agent_metrics": [out.metrics for out in outputs],
            "messages": [out.messages for out in outputs],
        },
    )


def response_texts(outputs: list[AgentOutput], tokenizer: Any) -> list[str]:
    """Each response (model and tool/user tokens) as text, special tokens dropped."""
    return [tokenizer.decode(out.response_ids, skip_special_tokens=True) for out in outputs]


def _routed_experts(
    outputs: list[AgentOutput], prompt_length: int, response_length: int, layout: RoutingLayout | None
) -> dict[str, torch.Tensor]:
    """`{"routed_experts": [B, P+R, moe_layers·k]}` placed like `input_ids`, or {} when no loop returned routings."""
    routed = [out.routed_experts for out in outputs]
    if all(rows is None for rows in routed):
        return {}
    assert layout is not None, "loops return routings only when the worker asks, with the model's layout"
    kept = [None if rows is None else layout.keep(rows) for rows in routed]
    width = next(rows.shape[1] for rows in kept if rows is not None)
    dtype = routing_dtype(layout.num_experts)
    column = torch.full((len(outputs), prompt_length + response_length, width), NO_RECORD, dtype=dtype)
    for i, (out, rows) in enumerate(zip(outputs, kept, strict=True)):
        if rows is None:  # the engine forwarded nothing of this row (e.g. aborted while queued): routed live
            continue
        start = prompt_length - len(out.prompt_ids)
        column[i, start : start + len(rows)] = rows
    return {ROUTING_COLUMN: column}
