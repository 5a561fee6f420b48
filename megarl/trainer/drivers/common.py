"""What every training driver does first: resume, push the weights the engines should serve, validate before
training when asked."""

from megarl.trainer.collect import evaluate
from megarl.trainer.handover import to_rollout
from megarl.trainer.job import Job
from megarl.trainer.saving import resume
from megarl.trainer.tracking import ProgressBar


def begin(job: Job) -> tuple[int, ProgressBar]:
    """The step to continue from (0: fresh) and the progress bar, once the engines serve its weights."""
    step = resume(job)
    to_rollout(job, step)  # colocated engines were released at start-up (trainer/job.py)
    if job.cfg.trainer.val_before_train and step == 0 and job.rollout.val_loader is not None:
        job.tracker.log(evaluate(job.rollout, step), step)
    return step, ProgressBar(job.total_steps, step, disable=not job.cfg.trainer.progress_bar)
