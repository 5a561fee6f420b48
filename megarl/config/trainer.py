"""Trainer: devices, placement, run length, validation, checkpoints and logging."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOGGERS = ("console", "wandb", "tensorboard")
DEVICES = ("cuda", "cpu")
PLACEMENTS = ("colocated", "separate")
DRIVERS = ("sync", "one_step_off", "fully_async", "rollout_only", "train_only")
ASYNC_DRIVERS = ("one_step_off", "fully_async")
CHECKPOINT_ERROR_POLICIES = ("stop", "continue")
TRAINER_STATE_FILE = "trainer_state.pt"
"""The file every trainer checkpoint directory holds (`megarl.trainer.checkpoint` writes it last)."""


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    function: str | None = None
    """`package.module:function` used for every row; None = the function registered for the row's data_source."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for the reward function (e.g. method: flexible)."""
    overlap: bool = True
    """Score each trajectory as it finishes, while the rest of the batch still generates (off: score a batch's
    trajectories after all of them finished; `bench/reward_overlap.py` compares the two)."""
    num_workers: int = 1
    """Processes per agent worker that run the reward function (a slow one cannot block the event loop); 0 = a
    thread of the agent worker."""


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    project_name: str = "megarl"
    """Groups runs in wandb/tensorboard."""
    experiment_name: str = "gsm8k_grpo"
    """Name of this run."""
    run_dir: str = "runs/${trainer.project_name}/${trainer.experiment_name}"
    """Where the resolved config, metrics, logs, plots and checkpoints go."""
    logger: list[str] = field(default_factory=lambda: ["console"])
    """Metric sinks: console | wandb | tensorboard (wandb honours WANDB_MODE=offline)."""
    device: str = "cuda"
    """cuda (NCCL) | cpu (gloo; each device is a CPU slot)."""
    nnodes: int = 1
    """Nodes in the Ray cluster used by this job."""
    devices_per_node: int = 8
    """Devices (GPUs, or CPU slots) per node."""
    placement: str = "colocated"
    """colocated: trainer roles and rollout replicas share every device (the engines sleep while Megatron
    trains) | separate: the replicas get `rollout_devices` devices of their own, the trainer roles the rest."""
    rollout_devices: int = 0
    """separate placement only: devices (GPUs, or CPU slots) for the rollout replicas, taken from
    nnodes × devices_per_node; the trainer roles get the others. Whole nodes are a multiple of
    devices_per_node (16 = two nodes of 8 GPUs); one machine splits too (1 of a 2-slot CPU machine)."""
    total_epochs: int = 1
    """Passes over the training data."""
    total_training_steps: int | None = None
    """Stop after this many steps; None = total_epochs × steps per epoch."""
    critic_warmup: int = 0
    """Steps that train only the critic before the actor starts updating."""
    test_freq: int = 0
    """Validate every N steps; 0 = never (except val_before_train)."""
    val_before_train: bool = False
    """Validate once before the first step."""
    val_pass_threshold: float = 1.0
    """Validation's pass@k counts a sample as passing when its score is at least this (1.0: the built-in
    rewards' score for a right answer; their partial credit stays below it)."""
    save_freq: int = 0
    """Checkpoint every N steps; 0 = only at the end."""
    save_hf_weights: bool = False
    """Also write the actor of every checkpoint as HF safetensors (global_step_<k>/actor/hf; a LoRA actor merged
    into model.path's weights), off the critical path like the rest of the save."""
    async_save: bool = True
    """Write checkpoints while training goes on: the step waits only while each rank stages its state (megatron-core's
    asynchronous torch_dist save, a writer process per rank); `latest` names a checkpoint once every rank has written
    it, so a kill mid-save resumes from the previous one. false: the step waits for the whole save."""
    max_checkpoints_to_keep: int | None = None
    """Delete older checkpoints beyond this count; None = keep all."""
    resume_mode: str = "auto"
    """auto (latest checkpoint in run_dir if any) | disable | a checkpoint directory path."""
    seed: int = 42
    """Seed of model init, sampling and shuffles."""
    mode: str = "rl"
    """rl (reinforcement learning: rollouts, rewards, the policy update) | sft (supervised fine-tuning of the actor
    on a chat dataset's assistant tokens: `sft.*`, no engines)."""
    driver: str = "sync"
    """What runs the steps (megarl/trainer/drivers/): sync (rollout, then training, each step) | one_step_off (step
    k+1's rollout runs while step k trains) | fully_async (a producer keeps trajectories in flight; the trainer
    takes finished groups) | rollout_only (generate, score and save rollouts; no training) | train_only (train on
    saved rollouts, no engines). The asynchronous two need trainer.placement=separate (async_training.*)."""
    rollout_data_dir: str = "${trainer.run_dir}/rollout_data"
    """Where the rollout_only driver saves each step's rollout batch and train_only reads them."""
    dump_rollouts: bool = False
    """Write each step's (prompt, response, score) as JSONL under <run_dir>/rollout_dumps/."""
    log_prob_gap_warning: float = 0.05
    """Warn when max |p_rollout − p_trainer| over a step's tokens exceeds this (an engine/trainer mismatch)."""
    log_prob_gap_limit: float | None = None
    """Stop the run when max |p_rollout − p_trainer| over a step's tokens exceeds this; None = never stop."""
    max_skipped_steps: int = 3
    """Stop the run when a role skipped this many optimizer steps in a row for a non-finite loss or gradient
    norm (the weights are left as they were at each skip); 0 = never stop."""
    on_checkpoint_error: str = "stop"
    """A checkpoint that cannot be written (disk full, permission denied): stop | continue (log it and train on;
    `latest` keeps naming the previous checkpoint either way)."""
    max_restarts: int = 3
    """After a rank or engine failure (a process died, raised, hung, or engines ran out of restarts) the run starts
    again from its latest checkpoint, at most this many times, waiting restart_backoff_s (doubled each time) before
    each; 0 = stop at the first failure. Bad config, data errors, divergence guards and checkpoint I/O errors stop at
    once."""
    restart_backoff_s: float = 10.0
    """Seconds before the first restart; each later restart waits twice as long as the one before."""
    failure_timeout_s: float = 600.0
    """Once a rank of a role has finished a call, seconds its peers may take to finish it too before the run stops
    naming them (a hung collective); a rank that dies or raises stops the run at once."""
    progress_bar: bool = True
    """Show a tqdm progress bar on stderr when stderr is a terminal (log lines print above it)."""


def pool_sizes(t: TrainerConfig, reward_devices: int = 0) -> tuple[int, int]:
    """(training, rollout) devices of the nnodes × devices_per_node less `reward_devices` (the reward models' own
    pools): colocated, both are all of those; separate splits them by `rollout_devices`."""
    total = t.nnodes * t.devices_per_node - reward_devices
    return (total - t.rollout_devices, t.rollout_devices) if t.placement == "separate" else (total, total)


def placement_problems(t: TrainerConfig) -> list[str]:
    """separate: the rollout replicas take some of the devices, not none or all; colocated: they share all."""
    total = t.nnodes * t.devices_per_node
    if t.placement == "separate" and not 0 < t.rollout_devices < total:
        return [
            f"trainer.placement=separate needs 0 < trainer.rollout_devices < the {total} devices "
            f"(trainer.nnodes × trainer.devices_per_node), got {t.rollout_devices}: set trainer.rollout_devices "
            "to the rollout replicas' share (the trainer roles get the rest), or use trainer.placement=colocated"
        ]
    if t.placement == "colocated" and t.rollout_devices:
        return [
            f"trainer.rollout_devices={t.rollout_devices} sizes the rollout pool of trainer.placement=separate; "
            "colocated replicas share every device: remove it or set trainer.placement=separate"
        ]
    return []


def guard_problems(t: TrainerConfig) -> list[str]:
    """The divergence guards and the checkpoint error policy."""
    problems = []
    if t.log_prob_gap_limit is not None and not 0 < t.log_prob_gap_limit <= 1:
        problems.append(
            f"trainer.log_prob_gap_limit={t.log_prob_gap_limit} must be in (0, 1] (a probability gap), "
            "or null to never stop on it"
        )
    if t.max_skipped_steps < 0:
        problems.append(f"trainer.max_skipped_steps={t.max_skipped_steps} must be >= 0 (0 = never stop)")
    if t.max_restarts < 0 or t.restart_backoff_s < 0:
        problems.append(
            f"trainer.max_restarts={t.max_restarts} and trainer.restart_backoff_s={t.restart_backoff_s} must be >= 0 "
            "(0 restarts = stop at the first failure)"
        )
    if t.on_checkpoint_error not in CHECKPOINT_ERROR_POLICIES:
        problems.append(
            f"trainer.on_checkpoint_error={t.on_checkpoint_error!r} is unknown; choose one of "
            f"{', '.join(CHECKPOINT_ERROR_POLICIES)}"
        )
    return problems


def resume_problems(t: TrainerConfig) -> list[str]:
    """`trainer.resume_mode` is auto, disable or a checkpoint directory that holds the trainer state."""
    resume = t.resume_mode
    if resume in ("auto", "disable") or (Path(resume) / TRAINER_STATE_FILE).is_file():
        return []
    return [
        f"trainer.resume_mode={resume!r} is neither auto, disable nor a checkpoint directory "
        f"(a global_step_<k> directory with {TRAINER_STATE_FILE})"
    ]
