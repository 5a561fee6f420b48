"""Hugging Face sequence classifiers (`*ForSequenceClassification`, one label) as megatron value models.

Such a checkpoint holds the causal LM's `model.*` tensors and `score.weight` `[num_labels, hidden]` in place of
`lm_head.weight`. transformers scores a sequence with that head at its last non-pad token (modeling_layers.py
`GenericForSequenceClassification.forward`). megarl builds it with a value head (`megarl.megatron.model.ValueHead`,
saved as `output_layer.weight` `[1, hidden]` in a dist checkpoint, like a critic's) and reads the head's output
at each row's last real token (`megarl.megatron.model.last_token_inputs`).

Usage::

    classifier = is_classifier(hf_dir)          # raises for num_labels != 1
    plan = checkpoint_plan(spec, padded_vocab, classifier)
    plan["output_layer.weight"].hf_names        # ('score.weight',)
"""

from pathlib import Path

from megarl.models.param_mapping import ParamMapping
from megarl.models.spec import ModelSpec, load_hf_config
from megarl.models.weight_map import weight_plan

SCORE = "score.weight"
HEAD = "output_layer.weight"
CLASSIFIER_SUFFIX = "ForSequenceClassification"


class ClassifierError(ValueError):
    """A sequence classifier megarl cannot score with; the message names the file and the field."""


def is_classifier(hf_dir: str | Path) -> bool:
    """Whether `hf_dir`'s config.json names a `*ForSequenceClassification` architecture; raises
    `ClassifierError` when it does with other than one label."""
    config = load_hf_config(hf_dir)
    if not any(name.endswith(CLASSIFIER_SUFFIX) for name in config.architectures or ()):
        return False
    if config.num_labels != 1:
        raise ClassifierError(
            f"{Path(hf_dir) / 'config.json'}: num_labels is {config.num_labels} (its id2label has "
            f"{config.num_labels} entries); a reward model reads one score: use a classifier with num_labels=1"
        )
    return True


def require_classifier(hf_dir: str | Path, field: str) -> None:
    """Raise `ClassifierError` unless `hf_dir` is a one-label sequence classifier; `field`: the setting that named
    it (for the message)."""
    if not is_classifier(hf_dir):
        architectures = load_hf_config(hf_dir).architectures
        raise ClassifierError(
            f"{field}={hf_dir}: {Path(hf_dir) / 'config.json'} has architectures {architectures}; a reward model is "
            f"a *{CLASSIFIER_SUFFIX} checkpoint (num_labels=1, a score head)"
        )


def head_mapping(spec: ModelSpec) -> ParamMapping:
    """The value head `output_layer.weight` ← `score.weight` `[1, hidden]`, replicated across TP."""
    return ParamMapping(HEAD, (SCORE,), hf_shapes=((1, spec.hidden_size),))


def checkpoint_plan(spec: ModelSpec, padded_vocab_size: int, classifier: bool) -> dict[str, ParamMapping]:
    """The weight plan of a checkpoint: `weight_plan`'s, with a classifier's score head in place of the LM head."""
    plan = weight_plan(spec, padded_vocab_size)
    if not classifier:
        return plan
    plan.pop(HEAD, None)
    return plan | {HEAD: head_mapping(spec)}
