"""Supervised fine-tuning (`trainer.mode=sft`): the actor trained with cross-entropy on the assistant tokens of a
chat dataset (`data.train_files`, a `messages` column), on the same Megatron layouts as RL.

Batch sizes reuse the RL vocabulary with one sample per conversation: `data.train_batch_size` conversations per
step, `actor.ppo_mini_batch_size` conversations per optimizer step, `actor.ppo_micro_batch_size_per_device` or the
token budget (`actor.use_dynamic_bsz`, `actor.ppo_max_token_len_per_device`) per micro-batch. Validation loss on
`data.val_files` every `trainer.test_freq` steps; checkpoints and resume as in RL.
"""

from dataclasses import dataclass

TRAINER_MODES = ("rl", "sft")


@dataclass(kw_only=True, slots=True)
class SFTConfig:
    messages_key: str = "messages"
    """The parquet column of OpenAI-style chat messages (system, user, assistant, tool)."""
    tools_key: str = "tools"
    """The optional column of tool schemas the chat template renders (a list or its JSON string)."""
    max_length: int = 2048
    """Tokens of a conversation; longer ones are dropped (and counted)."""
    hf_output: str | None = "${trainer.run_dir}/hf"
    """At the end of the run the actor is written here as an HF checkpoint (megarl-convert's mcore-to-hf on the
    last checkpoint); null = no export."""
