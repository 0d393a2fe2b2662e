"""Which rollout source a run trains from (:func:`open_source`), decided once, at build time.

    --load-rollout-data            ─▶ ReplayedRollouts (its engine, if any, only takes syncs)
    sft_rollout (generates nothing) ─▶ ColocatedSource over NoEngines (no model, no syncs)
    engine ranks of their own      ─▶ RemoteRollouts (sync, one step off or fully async: the
                                      job's Asynchrony, on ``plan.roles``)
    otherwise                      ─▶ ColocatedSource (the trainer ranks' own engines)

Example: ``open_source(cfg, plan, options, sides=None)`` with ``cfg.load_rollout_data=None``
builds the engines of ``plan.engine_layout`` on the trainer ranks and returns a
``ColocatedSource``.
"""

import logging
import time

from vime_shell.engines.group import EngineGroup, EngineOptions
from vime_shell.engines.none import no_engine
from vime_shell.engines.remote import Sides
from vime_shell.rollout.functions import SFT_ROLLOUT_FUNCTION
from vime_shell.settings.launch_plan import LaunchPlan
from vime_shell.settings.train_config import TrainConfig
from vime_shell.sources.base import RolloutSource
from vime_shell.sources.colocated import ColocatedSource
from vime_shell.sources.remote import RemoteRollouts
from vime_shell.sources.replay import ReplaySource
from vime_shell.sources.replayed import ReplayedRollouts

log = logging.getLogger("vime.train")


def open_source(cfg: TrainConfig, plan: LaunchPlan, options: EngineOptions | None,
                sides: Sides | None = None) -> RolloutSource:
    """The run's rollout source (module docstring); collective over the trainer ranks (the
    engines are built here). ``options``: the engines' options, None for a train-only replay
    (``plan.engine_layout`` is None); ``sides``: the bridge to engine ranks of their own."""
    if sides is not None:
        return RemoteRollouts(cfg, sides, plan.num_rollout)
    engines = None
    if plan.engine_layout is not None and options is not None and not cfg.generates:
        engines = EngineGroup.build(plan.hf_dir, plan.engine_layout, options, factory=no_engine)
        log.info("startup: no engine: %s generates nothing", SFT_ROLLOUT_FUNCTION)
    elif plan.engine_layout is not None and options is not None:
        started = time.perf_counter()
        engines = EngineGroup.build(plan.hf_dir, plan.engine_layout, options)
        log.info("startup: %s engine(s) started in %.1f s", options.engine,
                 time.perf_counter() - started)
    if cfg.load_rollout_data is not None:
        return ReplayedRollouts(ReplaySource(template=cfg.load_rollout_data,
                                             fallback=cfg.load_rollout_data_fallback), engines)
    if engines is None:
        raise ValueError("a run that generates needs engines: launch checks give every run "
                         "but a train-only replay an engine layout")
    return ColocatedSource(cfg, plan, engines)
