"""``NoEngine``: the engine of a run whose rollout function generates nothing.

Supervised fine-tuning (``vime_shell.rollout.sft:sft_rollout``) reads whole conversations from
the dataset, so its run builds no model for generation: each engine place of the layout holds
a ``NoEngine``, which keeps the work queue and the producer's rounds as they are (prompts are
still claimed and turned into samples on every engine leader) and takes no weights
(``takes_weights``: the trainer exports nothing at a sync). A rollout function that asks it to
generate gets an :class:`EngineError` naming the fix.

Example: ``EngineGroup.build(hf_dir, layout, options, factory=no_engine)`` gives every rank of
``layout`` a ``NoEngine``.
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vime_shell.engines.base import EngineError, Generation, NamedTensors, SamplingParams


class NoEngine:
    """See the module docstring."""

    name = "none"
    takes_weights = False

    def __init__(self) -> None:
        self.weight_version = 0

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams
                 ) -> list[Generation]:
        raise EngineError("this run builds no engine (its rollout function, the SFT rollout, "
                          "generates nothing), and a rollout function asked it to generate. "
                          "Fix: train a generating rollout function without --loss-type "
                          "sft_loss's sft_rollout, or generate nothing in it")

    def update_weights_from_tensors(self, named_tensors: NamedTensors) -> None:
        """Nothing to load (never called: ``takes_weights`` is False)."""

    def update_weights_from_path(self, path: str | Path) -> None:
        """Nothing to load."""

    def sleep(self, level: int = 1) -> None:
        """Nothing to release."""

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Nothing to restore."""

    def close(self) -> None:
        """Nothing to stop."""


def no_engine(hf_dir: Any, layout: Any, options: Any, rank: int) -> NoEngine | None:
    """``EngineGroup.build``'s factory for a run that generates nothing: a ``NoEngine`` on each
    rank of the layout's engines (None outside them, as the real factory)."""
    return None if layout.engine_of(rank) is None else NoEngine()
