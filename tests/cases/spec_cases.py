"""A ModelSpec from a transformers config of a model type, for the bridge tests."""

import transformers

from megarl.models.spec import model_spec


def spec_of(model_type: str, **extra: object):
    config = transformers.AutoConfig.for_model(
        model_type,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        intermediate_size=128,
        vocab_size=250,
        **extra,
    )
    return model_spec(config)
