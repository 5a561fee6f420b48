"""What is wrong with `algorithm.loss_params` for the chosen policy loss, one sentence each, naming the key and the
fix: `megarl-plan` and `megarl-train` refuse such a config before any worker starts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megarl.algo.rollout_correction import LEVELS

if TYPE_CHECKING:  # megarl.config imports this package for validation
    from megarl.config.algorithm import AlgorithmConfig, PolicyLossParams

KEY = "algorithm.loss_params"
BYPASS_LEVELS = tuple(level for level in LEVELS if level != "none")


def loss_param_problems(cfg: AlgorithmConfig) -> list[str]:
    """Problems of the hyperparameters the chosen `algorithm.policy_loss` reads (empty: fine)."""
    params = cfg.loss_params
    checks = {
        "dro": _dro,
        "gmpo": lambda p: _positive(p, "gmpo_log_clip", "gmpo_log_clip_low", "gmpo_log_clip_high"),
        "dppo_tv": lambda p: _positive(p, "dppo_tv_delta", "dppo_tv_delta_low", "dppo_tv_delta_high"),
        "dppo_kl": lambda p: _positive(p, "dppo_kl_delta", "dppo_kl_delta_low", "dppo_kl_delta_high"),
        "bypass": _bypass,
    }
    check = checks.get(cfg.policy_loss)
    return check(params) if check is not None else []


def _positive(params: PolicyLossParams, *names: str) -> list[str]:
    """Each of `names` that is set must be > 0."""
    values = {name: getattr(params, name) for name in names}
    return [f"{KEY}.{name}={value} must be > 0" for name, value in values.items() if value is not None and value <= 0]


def _dro(params: PolicyLossParams) -> list[str]:
    if params.dro_beta is None or params.dro_beta <= 0:
        return [f"algorithm.policy_loss=dro needs {KEY}.dro_beta > 0 (got {params.dro_beta}), e.g. 0.05"]
    return []


def _bypass(params: PolicyLossParams) -> list[str]:
    cap, lower = params.bypass_is_cap, params.bypass_is_lower
    checks = [
        (
            params.bypass_is_level in BYPASS_LEVELS,
            f"{KEY}.bypass_is_level={params.bypass_is_level!r} is unknown; choose one of {', '.join(BYPASS_LEVELS)}",
        ),
        (cap is None or cap > 0, f"{KEY}.bypass_is_cap={cap} must be > 0 (null: no IS weight)"),
        (
            lower is None or cap is not None,
            f"{KEY}.bypass_is_lower={lower} sets IcePop's band [lower, bypass_is_cap] but bypass_is_cap is null; "
            "set both, or bypass_is_lower=null",
        ),
        (
            lower is None or cap is None or 0 <= lower < cap,
            f"{KEY}.bypass_is_lower={lower} must be in [0, bypass_is_cap={cap})",
        ),
    ]
    return [message for ok, message in checks if not ok]
