"""Role worker groups on a Ray placement group: dispatch, DP order, colocated roles, updates."""

import math
import os
from collections.abc import Callable, Iterator

import pytest
import ray
import torch
from cases.megatron_cases import sample_batch
from conftest import compose_config

from megarl.batch import Batch
from megarl.config.training import MegatronConfig
from megarl.models.spec import load_hf_config, model_spec
from megarl.plan.params import count_params, device_shard
from megarl.trainer.steps import balanced
from megarl.workers.actor import ActorWorker
from megarl.workers.critic import CriticWorker
from megarl.workers.group import WorkerGroup
from megarl.workers.placement import create_pool
from megarl.workers.reference import ReferenceWorker
from megarl.workers.settings import ActorSettings, CriticSettings, ReferenceSettings


@pytest.fixture(scope="module")
def pool(local_ray: None) -> Iterator:
    pool = create_pool("test", num_devices=2, devices_per_node=2, device="cpu")
    yield pool
    pool.remove()


def _batch(rows: int = 8) -> Batch:
    tensors = sample_batch(4096, num_rows=rows, prompt_len=6, response_len=5, seed=3)
    tensors["prompts"] = tensors["input_ids"][:, :6]
    return Batch.from_dict(tensors)


def _forward(group: WorkerGroup, method: Callable[..., Batch], batch: Batch) -> Batch:
    ordered, inverse = balanced(batch, group.dp_size)
    return group.from_dp_leaders(group.split_dp(method, ordered))[inverse]


def test_roles_share_a_pool_and_dp_dispatch_keeps_row_order(pool: object) -> None:
    """Actor DP=2 (TP=1) and reference TP=2 on the same two bundles; the reference is the actor's
    seeded initial policy, so both give the same log-probs row by row after the balanced split."""
    cfg = compose_config("trainer=cpu", "actor.ppo_mini_batch_size=8", "data.train_batch_size=8", "rollout.n=2")
    actor = WorkerGroup(ActorWorker, pool, "actor-dp2")  # type: ignore[arg-type]
    actor.broadcast(ActorWorker.setup, ActorSettings.from_config(cfg, 4), [])
    ref_cfg = compose_config("trainer=cpu")
    ref_cfg.ref.megatron = MegatronConfig(tensor_model_parallel_size=2)
    ref = WorkerGroup(ReferenceWorker, pool, "ref-tp2", env={"NCCL_CUMEM_ENABLE": "0"})  # type: ignore[arg-type]
    ref.broadcast(ReferenceWorker.setup, ReferenceSettings.from_config(ref_cfg))
    try:
        seen = ray.get([w.__ray_call__.remote(lambda _: os.environ.get("NCCL_CUMEM_ENABLE")) for w in ref.workers])
        assert seen == ["0", "0"]
        assert actor.dp_size == 2 and ref.dp_size == 1
        assert [c.leader for c in ref.coords()] == [True, False]
        batch = _batch()
        old = _forward(actor, ActorWorker.compute_log_prob, batch)
        reference = _forward(ref, ReferenceWorker.compute_ref_log_prob, batch)
        mask = batch["response_mask"].bool()
        assert old["old_log_probs"].shape == batch["responses"].shape
        assert (old["old_log_probs"][~mask] == 0).all() and (old["old_log_probs"][mask] < 0).all()
        torch.testing.assert_close(old["old_log_probs"], reference["ref_log_probs"], atol=2e-5, rtol=0)
        assert (old["entropy"][mask] > 0).all()

        train = batch.select()
        train.set("old_log_probs", old["old_log_probs"])
        train.set("ref_log_probs", reference["ref_log_probs"])  # grpo's KL loss reads them
        train.set("advantages", torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask)
        metrics = actor.split_dp(ActorWorker.update, balanced(train, actor.dp_size)[0], 1)
        assert metrics[0] == metrics[1]  # reduced over DP: every rank returns the same numbers
        assert metrics[0]["actor/packing/micro_batches_per_rank"] == 1 and math.isfinite(metrics[0]["actor/pg_loss"])
        assert metrics[0]["actor/kl_loss"] == pytest.approx(0.0, abs=1e-6)  # the policy still is the reference
        assert metrics[0]["actor/grad_norm"] > 0
        after = _forward(actor, ActorWorker.compute_log_prob, batch)
        assert (after["old_log_probs"] - old["old_log_probs"]).abs().max() > 1e-4  # the update changed the policy
    finally:
        actor.shutdown()
        ref.shutdown()


def test_reference_and_critic_leave_the_device_while_engines_generate(pool: object) -> None:
    """`ref.offload` / `critic.offload`: release() frees every byte of their state, restore() brings
    back the same numbers (what the driver calls around each colocated rollout)."""
    cfg = compose_config(
        "trainer=cpu",
        "algorithm=ppo",
        "ref.offload=true",
        "critic.offload=true",
        "data.train_batch_size=8",
        "rollout.n=2",
        "critic.ppo_mini_batch_size=8",
    )
    ref = WorkerGroup(ReferenceWorker, pool, "ref-offload")  # type: ignore[arg-type]
    ref.broadcast(ReferenceWorker.setup, ReferenceSettings.from_config(cfg))
    critic = WorkerGroup(CriticWorker, pool, "critic-offload")  # type: ignore[arg-type]
    critic.broadcast(CriticWorker.setup, CriticSettings.from_config(cfg, 4))
    try:
        batch = _batch(16)
        before = _forward(ref, ReferenceWorker.compute_ref_log_prob, batch)
        counts = count_params(model_spec(load_hf_config(cfg.model.path)))
        params = device_shard(counts, cfg.actor.megatron).total
        released = ref.broadcast(ReferenceWorker.release)
        assert [r["offload/bytes"] for r in released] == [params * 4, params * 4]  # fp32, every parameter of each
        # DP replica; the device memory reserved around it is reported (0 without CUDA)
        assert all(r["handover/reserved_before_bytes"] == r["handover/reserved_after_bytes"] == 0 for r in released)
        assert [r["offload/bytes"] for r in ref.broadcast(ReferenceWorker.release)] == [0, 0]  # already on the host
        ref.broadcast(ReferenceWorker.restore)
        assert torch.equal(
            _forward(ref, ReferenceWorker.compute_ref_log_prob, batch)["ref_log_probs"], before["ref_log_probs"]
        )

        train = batch.select()
        train.set("values", _forward(critic, CriticWorker.compute_values, batch)["values"])
        train.set("returns", torch.randn(train["values"].shape, generator=torch.Generator().manual_seed(1)))
        critic.split_dp(CriticWorker.update, balanced(train, critic.dp_size)[0], 1)
        values = _forward(critic, CriticWorker.compute_values, batch)["values"]
        critic_params = device_shard(counts, cfg.critic.megatron, value_head=True).total
        released = critic.broadcast(CriticWorker.release)
        # fp32 parameters + fp32 gradient buffers + Adam's two moments split over DP=2 (buffers are padded)
        assert released[0]["offload/bytes"] == pytest.approx(critic_params * (4 + 4 + 8 / 2), rel=0.03)
        assert released[0]["handover/reserved_after_bytes"] == 0
        critic.broadcast(CriticWorker.restore)
        assert torch.equal(_forward(critic, CriticWorker.compute_values, batch)["values"], values)
    finally:
        ref.shutdown()
        critic.shutdown()
