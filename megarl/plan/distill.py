"""The distillation teacher (`algorithm.distillation.teacher`) against the rest of the run (`megarl.plan.gate`).

Its own settings (`megarl.config.distill.distillation_problems`), its checkpoint (a family megarl builds), its
Megatron layout against the trainer's devices, and the one thing distillation cannot do without: the teacher's
tokenizer must be the student's (both log-probs are of the same token ids).
"""

from pathlib import Path

from megarl.config.distill import distillation_problems
from megarl.config.layout import ConfigError, check_layout, read_model_facts
from megarl.config.root import MegarlConfig
from megarl.plan.facts import training_devices

TEACHER = "algorithm.distillation.teacher"


def distill_gate_problems(cfg: MegarlConfig, check_files: bool) -> list[str]:
    """Named problems of `algorithm.distillation`; with `check_files`, the checkpoint and tokenizer too."""
    d = cfg.algorithm.distillation
    problems = distillation_problems(d)
    t, path = d.teacher, d.teacher.path
    if not d.enable or path is None or problems:
        return problems
    if not (Path(path) / "config.json").is_file():
        return [f"{TEACHER}.path: {Path(path) / 'config.json'} does not exist; point it at a HF model directory"]
    try:
        facts = read_model_facts(path)
    except ConfigError as err:
        return [f"{TEACHER}.path: {err}"]
    if t.backend == "megatron":
        problems += check_layout(f"{TEACHER}.megatron", t.megatron, facts, training_devices(cfg))
        if t.offload and cfg.trainer.placement != "colocated":
            problems.append(f"{TEACHER}.offload frees devices for colocated engines; with separate pools unset it")
    if t.backend == "engine" and cfg.rollout.temperature != 1.0:
        problems.append(
            f"{TEACHER}.backend=engine scores with the raw logits (SGLang's input log-probs take no temperature) but "
            f"the student samples at rollout.temperature={cfg.rollout.temperature}: set rollout.temperature=1.0 or "
            f"{TEACHER}.backend=megatron (which scores at the rollout's temperature)"
        )
    if check_files:
        student = cfg.model.tokenizer_path or cfg.model.path
        problems += tokenizer_problems(student, t.tokenizer_path or path)
    return problems


def tokenizer_problems(student: str, teacher: str) -> list[str]:
    """The teacher's tokenizer maps every token to the student's id (the same vocabulary and special tokens)."""
    from transformers import AutoTokenizer

    try:
        ours, theirs = (AutoTokenizer.from_pretrained(path) for path in (student, teacher))
    except (OSError, ValueError) as err:
        return [f"{TEACHER}.tokenizer_path: cannot load the teacher's or the student's tokenizer ({err})"]
    mine, other = ours.get_vocab(), theirs.get_vocab()
    if mine == other:
        return []
    differ = sorted(set(mine.items()) ^ set(other.items()), key=lambda item: item[1])[:3]
    return [
        f"{TEACHER}: its tokenizer ({teacher}, {len(other)} tokens) differs from the student's ({student}, "
        f"{len(mine)} tokens), e.g. {differ}; distillation compares log-probs of the same token ids, so the teacher "
        f"must share the student's tokenizer: pick a teacher of the same tokenizer family ({TEACHER}.tokenizer_path)"
    ]
