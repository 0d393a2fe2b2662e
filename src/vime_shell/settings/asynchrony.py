"""Asynchronous training on separate rollout ranks (section ``rollout``; slime's and miles'
names): one step off, the fully asynchronous pool, the staleness bound, the sync interval.

Example: ``AsyncArgs(max_weight_staleness=2)`` raises ``max_weight_staleness=2: bounds
asynchronous training only. Fix: add --train-async or --fully-async, or drop it.``
"""

import attrs

from vime_pure.async_pool import Asynchrony, resolve_asynchrony
from vime_pure.errors import field_error
from vime_pure.token_versions import PAUSE_MODES
from vime_shell.settings.common import ConfigError, Record, at_least, setting

SECTION = "rollout"


def _f(default, help):
    return setting(default, help, SECTION)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class AsyncArgs(Record):
    """How far generation may run ahead of training."""

    train_async: bool = _f(False, "one step off (slime's train_async.py): engines on "
                           "--rollout-num-gpus ranks of their own generate rollout k+1 while "
                           "the trainer trains rollout k")
    fully_async: bool = _f(False, "a persistent pool on every engine rank "
                           "(--rollout-num-gpus N, one engine per rank) keeps its slice of "
                           "--rollout-batch-size groups in flight; each step trains the "
                           "first completed groups within --max-weight-staleness, joined "
                           "in draw order (batches do not depend on N)")
    max_weight_staleness: int | None = _f(None, "max versions between a group's weights and "
                                          "the trainer's (staler groups are regenerated, "
                                          "counted); default 1")
    update_weights_interval: int = _f(1, "rollouts between weight syncs to the engines")
    async_max_concurrent_samples: int | None = _f(
        None, "samples in flight over the fully-async pools (miles' flag; a group's samples "
        "count together): default one batch, --rollout-batch-size x --n-samples-per-prompt. "
        "More lets a long tail overlap, still within --max-weight-staleness; the pools also "
        "keep one batch of finished groups ready beside them")
    pause_generation_mode: str | None = setting(
        None, "what a weight sync does to the requests in flight under --fully-async (the "
        "only mode where a sync meets them): in_place (they continue on the new weights with "
        "their KV), retract (requeued with their tokens, their KV recomputed on the new "
        "weights) or abort (ended; their groups are generated again). Each token records the "
        "version that sampled it and --max-weight-staleness masks the tokens staler than it. "
        "Default in_place, retract under --partial-rollout (its cut continues each sample as a "
        "new segment); miles' default is retract", SECTION, PAUSE_MODES)

    @property
    def effective_max_weight_staleness(self) -> int:
        """``--max-weight-staleness``, default 1 (one step off's own staleness)."""
        return 1 if self.max_weight_staleness is None else self.max_weight_staleness

    @property
    def groups_in_flight(self) -> int:
        """Prompt groups the fully-async pools keep in flight together: ``ceil(S / n)`` for
        ``--async-max-concurrent-samples S`` (at least 1), else one batch's groups."""
        n = getattr(self, "n_samples_per_prompt", 1)
        if self.async_max_concurrent_samples is None:
            return getattr(self, "rollout_batch_size", 1)
        return max(-(-self.async_max_concurrent_samples // n), 1)

    @property
    def effective_pause_generation_mode(self) -> str:
        """``--pause-generation-mode``, default ``in_place`` (``retract`` under
        ``--partial-rollout``: its cut continues every sample as a new segment)."""
        if self.pause_generation_mode is not None:
            return self.pause_generation_mode
        return "retract" if getattr(self, "partial_rollout", False) else "in_place"

    @property
    def asynchrony(self) -> Asynchrony:
        """The mode, ``K`` and ``I`` as one resolved value (``vime_pure.async_pool``): what
        every reader of the mode asks, instead of the two flags. Raises ``AsyncPoolError``
        for ``--train-async`` with ``--fully-async`` and for a ``K`` below ``lag + I - 1``
        (launch checks turn it into a ``ConfigError``). Example: ``AsyncArgs(train_async=True)
        .asynchrony.lag == 1``."""
        return resolve_asynchrony(train_async=self.train_async, fully_async=self.fully_async,
                                  max_weight_staleness=self.max_weight_staleness,
                                  update_weights_interval=self.update_weights_interval)

    def _check(self) -> None:
        at_least("update_weights_interval", self.update_weights_interval, 1)
        if self.async_max_concurrent_samples is not None:
            at_least("async_max_concurrent_samples", self.async_max_concurrent_samples, 1)
            if not self.fully_async:
                raise field_error(ConfigError, "async_max_concurrent_samples",
                                  self.async_max_concurrent_samples,
                                  "bounds the fully-async pools only",
                                  "add --fully-async, or drop it")
        mode = self.pause_generation_mode
        if mode not in (None, "retract") and getattr(self, "partial_rollout", False) \
                and self.fully_async:
            raise field_error(ConfigError, "pause_generation_mode", mode,
                              "conflicts with --partial-rollout, which cuts the requests in "
                              "flight at every sync and continues them on the new weights "
                              "(retract)", "drop --pause-generation-mode, or pass retract")
        if self.max_weight_staleness is None:
            return
        at_least("max_weight_staleness", self.max_weight_staleness, 0)
        if not (self.train_async or self.fully_async):
            raise field_error(ConfigError, "max_weight_staleness", self.max_weight_staleness,
                              "bounds asynchronous training only",
                              "add --train-async or --fully-async, or drop it")
