"""Batching (section ``batching``): groups per optimizer step and how a step's samples become
micro-batches. The rules live in the core's ``BatchingPolicy`` (``vime_pure.config``): this
record only spells them as slime's flags. ``global_batch_size`` counts groups (rollout
executions), never samples.

Example: ``BatchingArgs(micro_batch_size=4).effective_max_tokens_per_gpu`` is None (static
micro-batches, slime's rule); ``BatchingArgs(max_tokens_per_gpu=0)`` raises the policy's
``max_tokens_per_gpu=0`` error.
"""

import attrs

from vime_pure.config import BALANCES, PACKINGS, BatchingPolicy, policy_from_flags
from vime_pure.errors import VimeError, field_error
from vime_shell.settings.common import ConfigError, Record, at_least, setting

SECTION = "batching"
DEFAULT_GLOBAL_BATCH_SIZE = 128


def _f(default, help, choices=None):
    return setting(default, help, SECTION, choices)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class BatchingArgs(Record):
    """The flags of the core's ``BatchingPolicy``."""

    global_batch_size: int | None = _f(None, f"groups (rollout executions) per optimizer step; "
                                       f"default {DEFAULT_GLOBAL_BATCH_SIZE}, or the rollout's "
                                       "groups / --num-steps-per-rollout; slime counts samples, "
                                       "the same for single-turn rollouts")
    num_steps_per_rollout: int | None = _f(None, "optimizer steps per rollout; sets "
                                           "--global-batch-size (which, if given too, must "
                                           "agree)")
    max_tokens_per_gpu: int | None = _f(1024, "token budget of a packed micro-batch")
    micro_batch_size: int | None = _f(None, "samples per static micro-batch (with "
                                      "--max-tokens-per-gpu none, or slime's way: without "
                                      "--use-dynamic-batch-size)")
    use_dynamic_batch_size: bool | None = _f(None, "slime's switch for --max-tokens-per-gpu "
                                             "packing (vime's default); off with "
                                             "--micro-batch-size: static micro-batches")
    packing: str = _f("ffd", "bin-packing algorithm", PACKINGS)
    balance: str | None = _f(None, "DP balance; overrides the two below. Default (vime differs "
                             "from slime, which deals micro-batches round-robin: here "
                             "'strided'): 'straggler' under --max-tokens-per-gpu packing when "
                             "neither of the two below is given, else 'strided'", BALANCES)
    balance_data: bool = _f(False, "balance tokens across DP ranks (balance=tokens)")
    balance_by_flops: bool = _f(False, "balance estimated FLOPs across DP ranks (balance=flops)")
    allow_partial_train_step: bool = _f(False, "train a short last step instead of dropping; "
                                        "implied by --dynamic-sampling-filter-path (without "
                                        "--dynamic-sampling-fill-filtered)")
    use_dynamic_global_batch_size: bool = _f(
        False, "miles' switch: one optimizer step per rollout, of all the groups it kept "
        "(--num-steps-per-rollout 1 with --allow-partial-train-step; --global-batch-size is "
        "then unused, as in miles). miles rounds a step down to a multiple of the DP size and "
        "drops the rest; vime's schedule spreads whole groups over the ranks and trains them "
        "all")

    @property
    def effective_max_tokens_per_gpu(self) -> int | None:
        """The packing budget, or None for static micro-batches: slime's rule, where
        ``--micro-batch-size`` without ``--use-dynamic-batch-size`` is static (its
        ``--max-tokens-per-gpu`` then bounds nothing). Example: ``--micro-batch-size 4`` ->
        None; with ``--use-dynamic-batch-size`` the budget stays and the two conflict."""
        if self.micro_batch_size is not None and not self.use_dynamic_batch_size:
            return None
        return self.max_tokens_per_gpu

    def policy(self, *, global_batch_size: int, allow_partial_train_step: bool) -> BatchingPolicy:
        """The scheduler's policy, from the one builder ``vime_pure.policy_from_flags``, for the
        step size and partial-step rule ``TrainConfig`` resolves (they depend on the rollout)."""
        try:
            return policy_from_flags(
                global_batch_size=global_batch_size,
                max_tokens_per_gpu=self.effective_max_tokens_per_gpu,
                micro_batch_size=self.micro_batch_size, packing=self.packing,
                balance=self.balance, balance_data=self.balance_data,
                balance_by_flops=self.balance_by_flops,
                allow_partial_train_step=allow_partial_train_step)
        except VimeError as exc:
            raise ConfigError(str(exc)) from exc

    def _check(self) -> None:
        at_least("num_steps_per_rollout", self.num_steps_per_rollout, 1)
        if self.use_dynamic_batch_size and self.max_tokens_per_gpu is None:
            raise field_error(ConfigError, "--use-dynamic-batch-size", True,
                              "packs to --max-tokens-per-gpu, which is none",
                              "pass --max-tokens-per-gpu, e.g. 9216")
        # the policy's own checks (max_tokens_per_gpu / micro_batch_size / global_batch_size)
        self.policy(global_batch_size=DEFAULT_GLOBAL_BATCH_SIZE if self.global_batch_size
                    is None else self.global_batch_size,
                    allow_partial_train_step=self.allow_partial_train_step)
