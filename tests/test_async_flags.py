"""Separate rollout ranks and the asynchronous modes at launch: which rank does what, and every
bad combination of flags is one typed error naming the flag, before anything is built."""

import pytest

from vime_pure.async_pool import Asynchrony, SyncMode
from vime_shell.engines.roles import RankRolesError, resolve_rank_roles
from vime_shell.run.launch_checks import rank_roles
from vime_shell.settings.train_config import ConfigError, TrainConfig

ONE_STEP_OFF = Asynchrony(mode=SyncMode.ONE_STEP_OFF)
FULLY_ASYNC = Asynchrony(mode=SyncMode.FULLY_ASYNC)


def test_roles_put_trainers_first_and_engines_on_the_bridge():
    roles = resolve_rank_roles(world_size=4, rollout_num_gpus=1, colocate=False)
    assert (roles.num_trainers, roles.num_engine_ranks, roles.mode) == (3, 1, "sync")
    assert [roles.is_trainer(r) for r in range(4)] == [True, True, True, False]
    assert [roles.bridge_rank(r) for r in range(4)] == [0, None, None, 1]
    assert roles.side_rank(3) == 0 and roles.bridge_size == 2
    # Colocation not switched off, no async mode: engines stay inside the trainer ranks.
    assert resolve_rank_roles(world_size=4, rollout_num_gpus=1, colocate=None) is None
    assert resolve_rank_roles(world_size=2, rollout_num_gpus=1, colocate=None,
                              asynchrony=ONE_STEP_OFF).mode == "one_step_off"


@pytest.mark.parametrize("kwargs, flag", [
    (dict(world_size=2, rollout_num_gpus=None, colocate=None, asynchrony=ONE_STEP_OFF),
     "--rollout-num-gpus"),
    (dict(world_size=2, rollout_num_gpus=2, colocate=None, asynchrony=FULLY_ASYNC),
     "--rollout-num-gpus"),
    (dict(world_size=2, rollout_num_gpus=1, colocate=True, asynchrony=ONE_STEP_OFF),
     "--colocate"),
])
def test_bad_role_flags_name_the_flag(kwargs, flag):
    with pytest.raises(RankRolesError, match=flag):
        resolve_rank_roles(**kwargs)


def test_train_async_with_fully_async_is_one_config_error_at_launch(monkeypatch):
    """The mode is one resolved value (``cfg.asynchrony``): both flags cannot resolve."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"--fully-async=True: excludes --train-async\. Fix:"):
        rank_roles(TrainConfig(train_async=True, fully_async=True, rollout_num_gpus=1))


def test_roles_carry_the_jobs_one_resolved_asynchrony(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = TrainConfig(train_async=True, rollout_num_gpus=1, max_weight_staleness=2,
                      update_weights_interval=2)
    roles = rank_roles(cfg)
    assert roles.asynchrony == cfg.asynchrony
    assert (roles.asynchrony.lag, roles.asynchrony.flag) == (1, "--train-async")


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_weight_staleness=1), "max_weight_staleness"),  # without an async mode
    (dict(update_weights_interval=0), "update_weights_interval"),
])
def test_bad_async_settings_are_config_errors(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(update_weights_interval=2), "--update-weights-interval"),  # colocated loop
    (dict(fully_async=True, rollout_num_gpus=1, max_weight_staleness=0,
          update_weights_interval=2), "--max-weight-staleness"),
    (dict(train_async=True, rollout_num_gpus=1, partial_rollout=True,
          over_sampling_batch_size=24), "--max-weight-staleness"),
])
def test_launch_checks_refuse_what_cannot_run(monkeypatch, kwargs, field):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=field):
        rank_roles(TrainConfig(**kwargs))


def test_partial_rollouts_run_in_the_fully_async_pool_without_over_sampling(monkeypatch):
    """The pool cuts the requests in flight at every sync, so it needs no over-sampled round
    (one step off still refuses --partial-rollout; synchronously it needs over-sampling)."""
    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = TrainConfig(fully_async=True, rollout_num_gpus=2, partial_rollout=True,
                      mask_offpolicy_in_partial_rollout=True)
    assert rank_roles(cfg).asynchrony.pooled
    with pytest.raises(ConfigError, match="over-sampling-batch-size"):
        TrainConfig(rollout_num_gpus=1, partial_rollout=True)


def test_partial_rollouts_one_step_off_need_one_more_version_of_staleness(monkeypatch):
    """A group carried into the next rollout trains one version later than its batch: one
    step off with --partial-rollout needs K >= 2 (the default 1 is a launch error naming the
    value to pass)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    flags = dict(train_async=True, rollout_num_gpus=1, partial_rollout=True,
                 over_sampling_batch_size=24)
    with pytest.raises(ConfigError, match="pass --max-weight-staleness 2"):
        rank_roles(TrainConfig(**flags))
    assert rank_roles(TrainConfig(**flags, max_weight_staleness=2)).asynchrony.lag == 1


@pytest.mark.parametrize("mode", [dict(fully_async=True), dict(train_async=True),
                                  dict(colocate=False)])
def test_debug_rollout_only_with_engine_ranks_of_their_own_fails_at_launch(monkeypatch, mode):
    """It has no trainer: issue 31 saw it fail 30 s in, naming an internal function."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"debug_rollout_only=True: runs no trainer.*Fix: "
                       r"drop --(fully-async|train-async|no-colocate)"):
        rank_roles(TrainConfig(debug_rollout_only=True, rollout_num_gpus=1, **mode))


def test_the_pool_takes_a_custom_generate_function(monkeypatch):
    """Per-sample (multi-turn, tool) functions run in the fully-async pool, as with slime's
    and miles' async rollouts (tests/shell/test_async_ranks.py trains with one)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    roles = rank_roles(TrainConfig(
        fully_async=True, rollout_num_gpus=1,
        custom_generate_function_path="vime_shell.rollout.tool_example:generate"))
    assert roles.mode == "fully_async" and roles.num_engine_ranks == 1


def test_the_pool_runs_over_several_engine_ranks(monkeypatch):
    """--fully-async with --rollout-num-gpus 2 of 4 ranks: one pool per engine
    (tests/shell/test_fully_async_ranks.py trains with two)."""
    roles = resolve_rank_roles(world_size=4, rollout_num_gpus=2, colocate=None,
                               asynchrony=FULLY_ASYNC)
    assert (roles.mode, roles.num_trainers, roles.num_engine_ranks) == ("fully_async", 2, 2)
    assert [roles.bridge_rank(r) for r in range(4)] == [0, None, 1, 2]
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert rank_roles(TrainConfig(fully_async=True, rollout_num_gpus=2)).num_engine_ranks == 2
    # An engine over several ranks runs its pool on its leader when each rank holds a
    # replica (HF; tests/shell/test_fully_async_tp.py trains it); a tensor-parallel engine,
    # whose ranks run every call together, is still refused, with the reason.
    assert rank_roles(TrainConfig(fully_async=True, rollout_num_gpus=2,
                                  rollout_num_gpus_per_engine=2)).num_engine_ranks == 2
    with pytest.raises(ConfigError, match="--rollout-num-gpus-per-engine.*tensor-parallel"):
        rank_roles(TrainConfig(fully_async=True, rollout_num_gpus=2, rollout_engine="vllm",
                               rollout_num_gpus_per_engine=2))


def test_pause_generation_mode_defaults_and_conflicts(monkeypatch):
    """--pause-generation-mode (miles' values): default in_place, retract under
    --partial-rollout (its cut); in_place or abort beside --partial-rollout in the pools is an
    error naming the flag."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert TrainConfig().effective_pause_generation_mode == "in_place"
    pool = dict(fully_async=True, rollout_num_gpus=1)
    partial = dict(pool, partial_rollout=True)
    assert TrainConfig(**partial).effective_pause_generation_mode == "retract"
    assert TrainConfig(**partial, pause_generation_mode="retract").pause_generation_mode
    with pytest.raises(ConfigError, match=r"^pause_generation_mode='abort': conflicts with "
                                          r"--partial-rollout"):
        TrainConfig(**partial, pause_generation_mode="abort")
    with pytest.raises(ConfigError, match=r"^pause_generation_mode='drain': is not a valid"):
        TrainConfig(pause_generation_mode="drain")
    assert rank_roles(TrainConfig(**pool, pause_generation_mode="retract")).asynchrony.pooled


def test_async_max_concurrent_samples_sets_the_groups_in_flight():
    """miles' --async-max-concurrent-samples: samples in flight over the pools, a group's
    samples together (default: one batch's groups); it bounds the pools only."""
    pool = dict(fully_async=True, rollout_num_gpus=1, rollout_batch_size=16,
                n_samples_per_prompt=8)
    assert TrainConfig(**pool).groups_in_flight == 16
    assert TrainConfig(**pool, async_max_concurrent_samples=300).groups_in_flight == 38
    with pytest.raises(ConfigError, match=r"^async_max_concurrent_samples=64: bounds the "
                                          r"fully-async pools only"):
        TrainConfig(async_max_concurrent_samples=64)
    with pytest.raises(ConfigError, match="async_max_concurrent_samples"):
        TrainConfig(**pool, async_max_concurrent_samples=0)
