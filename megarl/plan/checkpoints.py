"""The HF checkpoints the Megatron roles load, checked for what megarl cannot load (`megarl.models.quantized`).

The actor (and the reference, and a critic without `critic.model_path`) load `model.path`; a critic may load
`critic.model_path`; `reward_model.discriminative.path` and `algorithm.distillation.teacher.path` load into Megatron
with `backend=megatron`. Engines alone (a judge, a teacher with `backend=engine`) may serve a quantised checkpoint.
"""

from megarl.config.root import MegarlConfig
from megarl.models.quantized import quantization_problem
from megarl.plan.facts import critic_enabled


def megatron_checkpoints(cfg: MegarlConfig) -> dict[str, str]:
    """Config field → the HF directory a Megatron role loads from it."""
    rm, teacher = cfg.reward_model.discriminative, cfg.algorithm.distillation.teacher
    paths = {"model.path": cfg.model.path}
    if critic_enabled(cfg) and cfg.critic.model_path:
        paths["critic.model_path"] = cfg.critic.model_path
    if rm.enable and rm.backend == "megatron" and rm.path:
        paths["reward_model.discriminative.path"] = rm.path
    if cfg.algorithm.distillation.enable and teacher.backend == "megatron" and teacher.path:
        paths["algorithm.distillation.teacher.path"] = teacher.path
    return paths


def quantized_checkpoint_problems(cfg: MegarlConfig) -> list[str]:
    """One problem per Megatron-loaded checkpoint with a `quantization_config` (fp8 and others), naming the field."""
    found = {field: quantization_problem(path) for field, path in megatron_checkpoints(cfg).items()}
    return [f"{field}: {problem}" for field, problem in found.items() if problem]
