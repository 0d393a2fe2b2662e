"""Rewards and advantages (section ``reward``): the reward function (built-in, remote or a
plugin), and how rewards become advantages.

Example: ``RewardArgs(advantage_estimator="gspo").reward_normalization().method`` is
``"gspo"``; ``RewardArgs(reward_timeout=0)`` raises ``reward_timeout=0: must be in [0.001,
1000000.0] ...``.
"""

import attrs

from vime_pure.data.rewards import RewardNormalization
from vime_shell.rollout.rewards import RM_CHOICES
from vime_shell.rollout.teacher import ANCHOR_OPD_POST_PROCESS
from vime_shell.settings.common import Record, in_range, setting

SECTION = "reward"
# What each --advantage-estimator means, in one place: how rewards become advantages (the
# core's RewardNormalization method) and which surrogate trains on them (LossConfig's).
# CISPO (MiniMax-M1) takes GRPO's group-normalised advantages, as slime's does.
ESTIMATOR_METHOD = {"grpo": "grpo", "gspo": "gspo", "cispo": "grpo",
                    "reinforce_plus_plus_baseline": "reinforce_pp_baseline"}
ESTIMATOR_SURROGATE = {"grpo": "ppo", "gspo": "gspo", "cispo": "cispo",
                       "reinforce_plus_plus_baseline": "ppo"}
ESTIMATORS: tuple[str, ...] = tuple(ESTIMATOR_METHOD)


def _f(default, help, choices=None):
    return setting(default, help, SECTION, choices)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class RewardArgs(Record):
    """What scores a response, and how scores become advantages."""

    rm_type: str | None = _f(None, "built-in reward (slime's rule rewards by name; boxed_X "
                             "grades the last \\boxed{} with X); default exact, or remote_rm "
                             "with --rm-url", RM_CHOICES)
    rm_url: str | None = _f(None, "reward server: POST {prompt, response, label} JSON per "
                            "sample, concurrently, retried with backoff")
    reward_key: str | None = _f(None, "the trained entry of a dict reward (dapo: score)")
    custom_rm_path: str | None = _f(None, "reward function 'pkg.mod:fn': fn(sample), or "
                                    "slime's [async] fn(args, sample) / with --group-rm "
                                    "fn(args, samples)")
    custom_reward_post_process_path: str | None = _f(
        None, "slime's reward post-process; the one vime runs is on-policy distillation's "
        "(slime's and miles' on_policy_distillation.post_process_rewards: the teacher's "
        "log-probs onto the samples, rewards 0), which --use-opd --opd-type sglang does",
        ANCHOR_OPD_POST_PROCESS)
    group_rm: bool = _f(False, "--custom-rm-path takes all samples of one prompt and returns "
                        "their rewards")
    reward_timeout: float | None = _f(None, "seconds one reward call may take; over it the "
                                      "run stops naming the sample, in every mode (the call "
                                      "runs on a worker thread; vime only)")
    advantage_estimator: str = _f("grpo", "rewards to advantages; gspo also trains with "
                                  "GSPO's sequence-level importance ratio, cispo (MiniMax-M1) "
                                  "with GRPO's advantages and the clipped ratio, detached, "
                                  "weighting each token's log-prob (canonical band: --eps-clip "
                                  "1 --eps-clip-high 4)", ESTIMATORS)
    disable_grpo_std_normalization: bool = _f(False, "GRPO/GSPO advantages without the "
                                              "division by the group's std (Dr. GRPO)")
    disable_rewards_normalization: bool = _f(False, "advantages are the raw rewards (no "
                                             "per-prompt centring or scaling)")
    normalize_advantages: bool = _f(False, "whiten advantages over the batch's rollout groups "
                                    "(slime: over tokens)")

    def reward_normalization(self) -> RewardNormalization:
        """How rewards become advantages (the core's record)."""
        return RewardNormalization(method=ESTIMATOR_METHOD[self.advantage_estimator],
                                   normalize_std=not self.disable_grpo_std_normalization,
                                   center=not self.disable_rewards_normalization,
                                   whiten=self.normalize_advantages)

    def _check(self) -> None:
        in_range("reward_timeout", self.reward_timeout, 1e-3, 1e6, "pass seconds, e.g. 30")
