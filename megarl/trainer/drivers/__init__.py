"""The drivers, one per `trainer.driver`; each assembles the job it needs (`megarl.trainer.job`) and runs it:

sync           rollout, then training, each step (`sync.fit`)
one_step_off   step s trains what was rolled out while step s − 1 trained
fully_async    a producer keeps groups in flight; steps take finished ones within max_staleness
rollout_only   engines only: generate, score and save each step's batch
train_only     Megatron roles only: train on the saved batches

trainer.mode=sft runs `sft.fit_sft` instead: the actor alone on a chat dataset.
"""

from megarl.config.root import MegarlConfig
from megarl.trainer.drivers.debug import rollout_only, train_only
from megarl.trainer.drivers.fully_async import fully_async
from megarl.trainer.drivers.one_step_off import one_step_off
from megarl.trainer.drivers.sft import fit_sft
from megarl.trainer.drivers.sync import fit
from megarl.trainer.job import full_job, rollout_job, sft_job, training_job
from megarl.trainer.prepare import PreparedData

FULL_JOB_DRIVERS = {"sync": fit, "one_step_off": one_step_off, "fully_async": fully_async}


def run(cfg: MegarlConfig, data: PreparedData) -> None:
    """Start what `trainer.driver` needs, run it, stop everything (also on errors)."""
    driver = cfg.trainer.driver
    if cfg.trainer.mode == "sft":
        with sft_job(cfg, data) as sft:
            fit_sft(sft)
    elif driver == "rollout_only":
        with rollout_job(cfg, data) as rollout:
            rollout_only(rollout)
    elif driver == "train_only":
        with training_job(cfg, data) as training:
            train_only(training)
    else:
        with full_job(cfg, data) as job:
            FULL_JOB_DRIVERS[driver](job)
