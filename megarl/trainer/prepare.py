"""What `megarl-train` does after validation and before any worker exists: write the resolved
config to the run directory, print the batch-size algebra, load the tokenizer and the datasets.
"""

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf

from megarl.config import MegarlConfig
from megarl.plan.facts import (
    batch_sizes,
    critic_enabled,
    reward_pool_devices,
    rollout_devices,
    samples_per_prompt,
    training_devices,
)

if TYPE_CHECKING:
    from megarl.batch import Batch
    from megarl.data import RLDataset, StatefulDataLoader

logger = logging.getLogger("megarl")


def write_resolved_config(cfg: MegarlConfig, run_dir: Path) -> Path:
    """Write `config.yaml` (every key, resolved) atomically into `run_dir`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    tmp.replace(path)
    return path


def describe_batches(cfg: MegarlConfig) -> list[str]:
    """Human-readable batch-size algebra of the training roles."""
    lines = [
        f"devices: {training_devices(cfg)} training, {rollout_devices(cfg)} rollout ({cfg.trainer.placement}); "
        f"{rollout_devices(cfg) // cfg.rollout.tensor_parallel_size} rollout replica(s) of "
        f"tp={cfg.rollout.tensor_parallel_size}"
        + "".join(f"; {devices} {name}" for name, devices in reward_pool_devices(cfg).items())
    ]
    for role in ["actor", "critic"] if critic_enabled(cfg) else ["actor"]:
        s = batch_sizes(cfg, role)
        micro = "token-budget micro-batches" if s.micro_batches is None else f"{s.micro_batches} micro-batch(es)"
        per_device = "" if s.trajectories_per_device is None else f" = {s.trajectories_per_device} per DP rank"
        lines.append(
            f"{role}: {cfg.data.train_batch_size} prompts × n={samples_per_prompt(cfg)} = {s.trajectories_per_step} "
            f"trajectories/step → {s.mini_batches_per_step} mini-batch(es) of {s.trajectories_per_mini_batch} over "
            f"DP={s.dp}{per_device}, {micro} each"
        )
    return lines


def build_dataset(cfg: MegarlConfig, files: list[str], tokenizer: Any, max_samples: int | None) -> "RLDataset":
    """The prompt dataset of `files` with the config's template, length and tool settings."""
    from megarl.data import RLDataset, load_tool_schemas

    tool_path = cfg.rollout.multi_turn.tool_config_path
    return RLDataset(
        files,
        tokenizer,
        max_prompt_length=cfg.data.max_prompt_length,
        prompt_key=cfg.data.prompt_key,
        truncation=cfg.data.truncation,
        filter_overlong_prompts=cfg.data.filter_overlong_prompts,
        tool_schemas=load_tool_schemas(tool_path) if tool_path else None,
        default_agent_name=cfg.rollout.default_agent,
        max_samples=max_samples,
        chat_template_kwargs=cfg.data.chat_template_kwargs,
    )


@dataclass(kw_only=True, slots=True)
class PreparedData:
    tokenizer: Any
    loader: "StatefulDataLoader[Batch]"
    val_loader: "StatefulDataLoader[Batch] | None"
    total_steps: int


def prepare_run(cfg: MegarlConfig) -> PreparedData:
    """Write the config, report the batch algebra, load tokenizer and datasets; nothing is spawned."""
    from transformers import AutoTokenizer

    from megarl.data import StatefulDataLoader, collate_prompts

    config_path = write_resolved_config(cfg, Path(cfg.trainer.run_dir))
    logger.info("resolved config: %s", config_path)
    for line in describe_batches(cfg):
        logger.info(line)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    if cfg.trainer.mode == "sft":
        return prepare_sft(cfg, tokenizer)

    def collate(rows: list[dict[str, Any]]) -> "Batch":
        return collate_prompts(rows, tokenizer.pad_token_id, cfg.data.max_prompt_length)

    dataset = build_dataset(cfg, cfg.data.train_files, tokenizer, cfg.data.max_train_samples)
    loader = StatefulDataLoader(
        dataset, cfg.data.train_batch_size, collate, shuffle=cfg.data.shuffle, seed=cfg.data.seed
    )
    steps = cfg.trainer.total_training_steps or len(loader) * cfg.trainer.total_epochs
    logger.info(
        "data: %d training prompts (%d over-long dropped), %d steps/epoch, %d steps planned",
        len(dataset),
        dataset.num_filtered,
        len(loader),
        steps,
    )
    val_loader = None
    if cfg.data.val_files:
        val = build_dataset(cfg, cfg.data.val_files, tokenizer, cfg.data.max_val_samples)
        logger.info("validation: %d prompts (%d over-long dropped)", len(val), val.num_filtered)
        size = cfg.data.val_batch_size or len(val)
        val_loader = StatefulDataLoader(val, size, collate, shuffle=False, drop_last=False)
    return PreparedData(tokenizer=tokenizer, loader=loader, val_loader=val_loader, total_steps=steps)


def prepare_sft(cfg: MegarlConfig, tokenizer: Any) -> PreparedData:
    """trainer.mode=sft: the chat datasets tokenized (assistant spans as the loss mask), their loaders; a dataset
    without any assistant turn stops here (`DataError`), before anything is spawned."""
    from megarl.agents.chat_tokens import ChatTokens
    from megarl.data import StatefulDataLoader
    from megarl.data.sft import SFTDataset, collate_sft

    chat = ChatTokens(tokenizer, cfg.data.chat_template_kwargs)
    s = cfg.sft

    def dataset(files: list[str], max_samples: int | None) -> SFTDataset:
        return SFTDataset(
            files,
            chat,
            max_length=s.max_length,
            messages_key=s.messages_key,
            tools_key=s.tools_key,
            max_samples=max_samples,
        )

    def collate(rows: list[dict[str, Any]]) -> "Batch":
        return collate_sft(rows, tokenizer.pad_token_id)

    train = dataset(cfg.data.train_files, cfg.data.max_train_samples)
    loader = StatefulDataLoader(train, cfg.data.train_batch_size, collate, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    steps = cfg.trainer.total_training_steps or len(loader) * cfg.trainer.total_epochs
    logger.info("sft: %d conversations, %d steps/epoch, %d steps planned", len(train), len(loader), steps)
    val_loader = None
    if cfg.data.val_files:
        val = dataset(cfg.data.val_files, cfg.data.max_val_samples)
        size = cfg.data.val_batch_size or len(val)
        val_loader = StatefulDataLoader(val, size, collate, shuffle=False, drop_last=False)
    return PreparedData(tokenizer=tokenizer, loader=loader, val_loader=val_loader, total_steps=steps)
