"""`trainer.mode` against the rest of the config: what SFT reads and refuses (`megarl.plan.gate` calls these).

SFT trains the actor alone on a chat dataset: no engines, rewards, reference, critic or teacher. Keys that would
start or steer those are refused by name when `trainer.mode=sft` (the base config's RL defaults, such as
`rollout.n` or `algorithm.use_kl_loss`, are simply not read).
"""

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from megarl.config.root import MegarlConfig
from megarl.config.sft import TRAINER_MODES


def mode_problems(cfg: MegarlConfig) -> list[str]:
    """`trainer.mode` is known; in SFT, no RL-only key is on."""
    mode = cfg.trainer.mode
    if mode not in TRAINER_MODES:
        return [f"trainer.mode={mode!r} is unknown; choose one of {', '.join(TRAINER_MODES)}"]
    if mode == "rl":
        return []
    fix = "remove it (trainer.mode=sft trains the actor alone on sft.* data)"
    problems = [f"trainer.mode=sft does not use {key}: {fix}" for key in rl_only_keys_set(cfg)]
    if cfg.actor.lora.enabled and cfg.model.random_init and cfg.sft.hf_output is not None:
        problems.append(
            "sft.hf_output merges the LoRA adapters into model.path's weights, but model.random_init=true has none: "
            "give model.path a checkpoint with weights, or set sft.hf_output=null (megarl-convert lora-to-peft exports "
            "the adapters alone)"
        )
    return problems


def rl_only_keys_set(cfg: MegarlConfig) -> list[str]:
    """The RL-only settings that are on, as `key=value`."""
    t, alg, rm = cfg.trainer, cfg.algorithm, cfg.reward_model
    checks = {
        f"trainer.driver={t.driver}": t.driver != "sync",
        f"trainer.placement={t.placement}": t.placement != "colocated",
        f"trainer.critic_warmup={t.critic_warmup}": t.critic_warmup > 0,
        "critic.enable=true": cfg.critic.enable is True,
        "algorithm.distillation.enable=true": alg.distillation.enable,
        "algorithm.filter_groups.enable=true": alg.filter_groups.enable,
        "reward_model.discriminative.enable=true": rm.discriminative.enable,
        "reward_model.generative.enable=true": rm.generative.enable,
        f"reward_model.remote.url={rm.remote.url}": rm.remote.url is not None,
        f"reward.function={cfg.reward.function}": cfg.reward.function is not None,
        f"actor.router_replay={cfg.actor.router_replay}": cfg.actor.router_replay != "disabled",
    }
    return [key for key, on in checks.items() if on]


def sft_file_problems(cfg: MegarlConfig) -> list[str]:
    """Each SFT data file exists and has the messages column (its rows are checked when the dataset loads)."""
    files = [("data.train_files", f) for f in cfg.data.train_files] + [
        ("data.val_files", f) for f in cfg.data.val_files
    ]
    problems = (
        [] if cfg.data.train_files else ["data.train_files is empty; give chat parquet files (megarl-preprocess sft)"]
    )
    for field, path in files:
        if not Path(path).is_file():
            problems.append(f"{field}: {path} does not exist (megarl-preprocess sft writes one from JSONL)")
            continue
        try:
            names = pq.ParquetFile(path).schema_arrow.names
        except (pa.ArrowException, OSError) as err:
            problems.append(f"{field}: {path} is not a readable parquet file ({err})")
            continue
        if cfg.sft.messages_key not in names:
            problems.append(
                f"{field}: {path} has no {cfg.sft.messages_key!r} column (columns: {', '.join(names)}); set "
                "sft.messages_key to the column of chat messages"
            )
    return problems


def sft_length_problems(cfg: MegarlConfig, context: int) -> list[str]:
    """`sft.max_length` is positive and within the model's context."""
    if 0 < cfg.sft.max_length <= context:
        return []
    return [f"sft.max_length={cfg.sft.max_length} must be in 1..{context} (the model's context; model.max_model_len)"]
