"""The discriminative reward model (`reward_model.discriminative`, backend=megatron): one score per trajectory.

An HF `*ForSequenceClassification` checkpoint (num_labels=1) built as a frozen value model on its own layout
(`reward_model.discriminative.megatron`: TP/PP, DP the rest): the causal LM's weights, the value head from
`score.weight` (`megarl.convert.classifier`). A row's score is the head's output at its last real token, as
transformers' classifier reads it; the engine's value forward gives it (`megarl.megatron.model.last_token_inputs`),
on the last pipeline stage, broadcast to every stage as critic values are.

With `offload` the weights leave the device through `RankWorker.release` and come back through
`RankWorker.restore`, as the reference's do.
"""

import torch

from megarl.batch import Batch
from megarl.convert.classifier import SCORE, require_classifier
from megarl.megatron.model import last_token_inputs, load_value_head
from megarl.megatron.offload import Offloader
from megarl.megatron.weights import SafetensorsReader
from megarl.workers.base import RankWorker, build_role_from
from megarl.workers.settings import RewardModelSettings

RM_COLUMNS = ("rm_input_ids", "rm_attention_mask")
"""The batch columns the RM reads: `[b, L]` token ids in the RM's tokenizer, left-padded, and their mask."""


class RewardModelWorker(RankWorker):
    def setup(self, settings: RewardModelSettings) -> None:
        """Build the RM from `model.weights_path` (a one-label sequence classifier) with its score head."""
        path = settings.model.weights_path
        assert path is not None, "the reward model is always loaded from reward_model.discriminative.path"
        require_classifier(path, "reward_model.discriminative.path")
        self.settings = settings
        self.role = build_role_from(settings.model)
        load_value_head(self.role.model, SafetensorsReader(path).get(SCORE))
        if settings.offload:
            self.offloader = Offloader(self.role.model, grads=False, optimizer=False)

    def compute_rm_scores(self, batch: Batch) -> Batch:
        """`rm_scores` float32 `[b]` of this DP shard's rows (`RM_COLUMNS`), each read at its last real token;
        rows longer than `max_length` keep their last `max_length` tokens."""
        width = self.settings.max_length
        ids, mask = (batch[key][:, -width:] for key in RM_COLUMNS)
        out = self._role().engine.forward(last_token_inputs(ids, mask), self.settings.micro)
        return Batch.from_dict({"rm_scores": out["values"][:, 0].to(torch.float32)})
