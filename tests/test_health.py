"""Health checks without processes or timing: the core's decisions on a fake clock
(``vime_pure.health``), the monitor on one in-process store (``HashStore``) ticked by hand with
its own clock, and bounded waits whose awaited thing never happens.

Named examples: a rank whose heartbeat stays still past the timeout has stopped (none is judged
during the first wait; one that never beat only after the first wait's bound); rank 0 publishes
the stopped rank and every watcher raises the same verdict; a rank that left is never judged; a
store that stops answering is a verdict of its own; the bound of each wait follows the slowest
wait of its kind seen so far (trainer rank 0's wait for a rollout's reply included); a wait
ends with the job's verdict, or past its bound with an error naming what it waited for; the
flags take slime's defaults and refuse what is not a number of seconds.
"""

import pickle
import threading

import pytest
import torch
import torch.distributed as dist

from vime_pure.health import (FIRST_WAIT_TIMEOUTS, SLACK_TIMEOUTS, HealthPolicy, WaitHistory,
                              liveness_from, observe, stopped_ranks)
from vime_shell.engines import group as group_module
from vime_shell.engines import health
from vime_shell.engines.group import EngineGroup, EngineOptions
from vime_shell.engines.health import (VERDICT_KEY, WaitBound, HealthCheckError, HealthMonitor,
                                       thread_done, wait_until)
from vime_shell.engines.layout import EngineLayout
from vime_shell.engines.remote import Bridge, Sides
from vime_shell.engines.roles import RankRoles
from vime_shell.engines.work_queue import PromptQueue
from vime_shell.settings import megatron_args
from vime_shell.settings.train_config import ConfigError, TrainConfig

POLICY = HealthPolicy(interval_s=1.0, timeout_s=5.0, first_wait_s=0.0)


# -- the core's decisions -------------------------------------------------------------------
def test_a_rank_whose_heartbeat_stays_still_past_the_timeout_has_stopped():
    seen = observe(liveness_from([1, 2], 0.0), {1: 1, 2: 4}, 0.0)
    seen = observe(seen, {1: 2, 2: 4}, 3.0)  # rank 1 beat again, rank 2 did not
    assert stopped_ranks(seen, 5.0, POLICY) == ()
    assert stopped_ranks(seen, 6.0, POLICY) == ((2, 6.0),)
    assert stopped_ranks(seen, 8.5, POLICY) == ((1, 5.5), (2, 8.5))


def test_no_rank_is_judged_during_the_first_wait():
    policy = HealthPolicy(interval_s=1.0, timeout_s=5.0, first_wait_s=10.0)
    seen = observe(liveness_from([1], 0.0), {1: 3}, 0.0)  # then silent
    assert stopped_ranks(seen, 14.0, policy) == ()  # silence counts from the first wait's end
    assert stopped_ranks(seen, 15.5, policy) == ((1, 15.5),)


def test_a_rank_that_never_beat_is_judged_only_after_the_first_waits_bound():
    seen = observe(liveness_from([1], 0.0), {1: 0}, 100.0)  # still importing, building ...
    bound = FIRST_WAIT_TIMEOUTS * POLICY.timeout_s
    assert stopped_ranks(seen, bound, POLICY) == ()
    assert stopped_ranks(seen, bound + 1, POLICY) == ((1, bound + 1),)


def test_the_bound_of_a_wait_follows_the_slowest_wait_of_its_kind_seen():
    first = WaitHistory()
    assert first.bound_s(POLICY) == FIRST_WAIT_TIMEOUTS * 5.0
    assert "the first wait of its kind" in first.explain(POLICY)
    history = first.seen(2.0).seen(1.0)  # a faster wait leaves the slowest
    assert history.slowest_s == 2.0
    assert history.bound_s(POLICY) == 2.0 + SLACK_TIMEOUTS * 5.0
    assert history.explain(POLICY) == ("the slowest such wait so far (2.0 s) plus 10 x "
                                       "--rollout-health-check-timeout=5 (52.0 s)")
    assert history.seen(7.0).bound_s(POLICY) == 57.0


# -- the monitor on one store, ticked by hand -----------------------------------------------
def _name(rank: int) -> str:
    return "trainer rank 0 (global rank 0)" if rank == 0 else \
        f"engine rank {rank - 1} (global rank {rank})"


def _monitors(store, world: int = 3) -> list[HealthMonitor]:
    monitors = [HealthMonitor(store, r, world, clock=lambda: 0.0, reap=False)
                for r in range(world)]
    for m in monitors:
        m.watch(POLICY, _name)
    return monitors


def _tick(monitors, start: float, stop: float, step: float = 0.5) -> None:
    t = start
    while t <= stop:
        for m in monitors:
            m.tick(t)
        t += step


def test_rank_0_publishes_a_stopped_rank_and_every_watcher_raises_the_same_verdict():
    store = dist.HashStore()
    trainer, healthy, stopped = _monitors(store)
    _tick([trainer, healthy, stopped], 0.0, 3.0)
    _tick([trainer, healthy], 3.5, 8.5)  # global rank 2 stops beating after t=3 ...
    assert trainer.verdict is None  # ... rank 0 saw its t=3 beat at its t=4 check
    _tick([trainer], 9.0, 10.0)
    assert trainer.verdict is not None
    message = str(trainer.verdict)
    assert message.startswith("engine rank 1 (global rank 2) stopped answering: no "
                              "heartbeat for")
    assert "--rollout-health-check-timeout=5, checked every 1 s by trainer rank 0" in message
    assert message.count("Fix:") == 1
    assert store.get(VERDICT_KEY).decode() == message
    _tick([healthy], 9.0, 10.0)  # its next check reads the verdict
    with pytest.raises(HealthCheckError) as raised:
        healthy.check()
    assert str(raised.value) == message


def test_a_rank_beats_as_soon_as_its_monitor_starts():
    """Known to its watchers however soon it stops (a rank frozen a moment after it started
    would otherwise count as never started, judged only after the first wait's bound)."""
    store = dist.HashStore()
    monitor = HealthMonitor(store, 2, 3, reap=False).start()
    try:
        assert int(store.add(health.beat_key(2), 0)) >= 1
    finally:
        monitor.leave()  # its thread ends; watchers stop judging it
    assert store.check([health.left_key(2)])


def test_a_rank_that_left_is_never_judged():
    store = dist.HashStore()
    trainer, healthy, finished = _monitors(store)
    _tick([trainer, healthy, finished], 0.0, 2.0)
    finished.leave()  # its process ended normally
    _tick([trainer, healthy], 2.5, 30.0)
    assert trainer.verdict is None and healthy.verdict is None


def test_nobody_is_judged_between_runs():
    store = dist.HashStore()
    trainer, healthy, stopped = _monitors(store)
    _tick([trainer, healthy, stopped], 0.0, 1.0)
    trainer.unwatch()
    _tick([trainer, healthy], 1.5, 30.0)
    assert trainer.verdict is None


class _GoneStore:
    """A store whose server went away."""

    def add(self, key, value):
        raise RuntimeError("Connection reset by peer")


def test_a_store_that_stops_answering_is_a_verdict_of_its_own():
    monitor = HealthMonitor(_GoneStore(), 1, 3, reap=False)
    monitor.watch(POLICY, _name)
    _tick([monitor], 0.0, 4.0)
    assert monitor.verdict is None  # not yet a timeout
    _tick([monitor], 4.5, 12.0)
    assert "the job's store" in str(monitor.verdict)
    assert "stopped answering engine rank 0 (global rank 1)" in str(monitor.verdict)


# -- bounded waits ------------------------------------------------------------------------
@pytest.fixture
def monitor(monkeypatch):
    """This process's monitor: rank 0 of 2 on an in-process store, ending nothing."""
    m = HealthMonitor(dist.HashStore(), 0, 2, reap=False)
    m.watch(POLICY, _name)
    monkeypatch.setattr(health, "_MONITOR", m)
    return m


def _never(slice_s: float) -> bool:
    threading.Event().wait(slice_s)
    return False


def test_a_wait_ends_with_the_jobs_verdict(monitor):
    monitor.fail(HealthCheckError("engine rank 1 (global rank 2) stopped answering"))
    with pytest.raises(HealthCheckError, match="engine rank 1 .global rank 2. stopped"):
        wait_until(_never, "a reply")


def test_a_wait_past_its_bound_names_what_it_waited_for_and_publishes_it(monitor):
    bound = WaitBound(start=0.0, limit_s=0.0, why="the slowest such wait so far (0.0 s)")
    with pytest.raises(HealthCheckError) as raised:
        wait_until(_never, "engine rank 0 (global rank 1)'s reply to rollout 3", bound)
    message = str(raised.value)
    assert message.startswith("trainer rank 0 (global rank 0) waited ")
    assert "for engine rank 0 (global rank 1)'s reply to rollout 3, longer than the slowest" \
        in message
    assert monitor.store.get(VERDICT_KEY).decode() == message  # every rank will end


def test_a_point_to_point_wait_in_its_thread_raises_its_failure(monitor):
    def closed():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="Connection closed"):
        wait_until(thread_done(closed), "a result")


def test_a_tp_peer_waiting_for_its_leaders_claim_stops_at_the_rounds_bound(monitor):
    queue = PromptQueue(dist.HashStore(), "vime/queue/0/0", engine=1, leader=False,
                        peers=True, num_prompts=4, num_engines=2, leader_name="rank 2",
                        bound=WaitBound(start=0.0, limit_s=0.0, why="its bound"))
    with pytest.raises(HealthCheckError, match="for claim 0 of rank 2 .engine 1., longer "
                                               "than its bound"):
        next(iter(queue))


def test_a_colocated_engine_that_never_finishes_its_round_is_named_past_the_rounds_bound(
        monitor, monkeypatch):
    """Rank 0 of two colocated engines generates its chunks (the work queue gives it all 4
    prompts: engine 1 never claims), marks its round done, then waits for engine 1's mark
    before the exchange: past the first round's bound it names engine 1."""
    store = dist.HashStore()
    monkeypatch.setattr(group_module, "job_store", lambda: store)
    options = EngineOptions(health=HealthPolicy(timeout_s=0.001))  # first bound: 0.12 s
    group = EngineGroup(EngineLayout(world_size=2, num_engines=2, gpus_per_engine=1), 0,
                        object(), options)
    with pytest.raises(HealthCheckError, match=r"for engine 1 \(rank 1\) to finish generation "
                                               r"round 0 \(4 prompts\), longer than the first "
                                               r"wait of its kind"):
        group.run_local(lambda share: [[share.start]] * len(share), 4)
    assert store.check([f"{group._prefix}/0/done/0"])  # noqa: SLF001 - rank 0's own mark


# -- trainer rank 0's waits for separate engine ranks -----------------------------------------
class _Done:
    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class _Never:
    """A reply that never comes (its waiting thread is released at the test's end)."""

    def __init__(self, release: threading.Event):
        self.release = release

    def wait(self, timeout=None):
        self.release.wait()
        return True


class _Group:
    """Bridge rank 0's gloo group with engine rank 0: commands go out at once, the queued
    replies come back (size, then bytes), nothing after them."""

    def __init__(self, replies: list[tuple]):
        self.data = [pickle.dumps(r) for r in replies]
        self.release = threading.Event()

    def broadcast(self, tensor, root):
        return _Done()

    def recv(self, tensors, src, tag):
        if not self.data:
            return _Never(self.release)
        data = self.data[0] if tag == 0 else self.data.pop(0)
        if tag == 0:
            tensors[0][0] = len(data)
        else:
            tensors[0].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        return _Done()


@pytest.fixture
def remote(monkeypatch):
    """A synchronous trainer rank 0 whose engine rank answers rollout 0 only."""
    from vime_shell.sources.remote import RemoteRollouts

    monkeypatch.setattr(health, "_MONITOR", None)
    group = _Group([("batch", 0, None, {"prompts_generated": 4}, None)])
    bridge = Bridge(0, 2, group, group, torch.device("cpu"))
    sides = Sides(roles=RankRoles(world_size=2, num_trainers=1), rank=0, bridge=bridge)
    cfg = TrainConfig(rollout_num_gpus=1, colocate=False, rollout_health_check_timeout=0.01,
                      rollout_health_check_first_wait=0.1)
    yield RemoteRollouts(cfg, sides, total=3)
    group.release.set()


def test_trainer_rank_0s_wait_for_a_rollout_is_bounded_by_the_slowest_seen(remote):
    remote.next(0, 0)
    assert remote.waits["rollout"].slowest_s is not None  # rollout 0's reply was timed
    remote.waits["rollout"] = WaitHistory(slowest_s=0.2)  # as if it had taken 0.2 s
    with pytest.raises(HealthCheckError) as raised:
        remote.next(1, 0)
    message = str(raised.value)
    assert "for engine rank 0 (global rank 1)'s reply to rollout 1, longer than the slowest " \
           "such wait so far (0.2 s) plus 10 x --rollout-health-check-timeout=0.01 (0.3 s)" \
        in message
    assert "Fix: raise --rollout-health-check-timeout" in message


def test_trainer_rank_0s_first_wait_of_a_kind_is_bounded_by_the_first_wait(remote):
    remote.bridge.control.data.clear()  # rollout 0 never comes
    with pytest.raises(HealthCheckError, match=r"the first wait of its kind: "
                       r"--rollout-health-check-first-wait=0.1 plus 120 x "
                       r"--rollout-health-check-timeout=0.01 \(1.3 s\)"):
        remote.next(0, 0)


# -- the flags ----------------------------------------------------------------------------
def test_the_health_flags_take_slimes_defaults():
    assert TrainConfig().health_policy() == HealthPolicy(30.0, 30.0, 0.0)


@pytest.mark.parametrize("name, value", [("rollout_health_check_timeout", 0),
                                         ("rollout_health_check_interval", -1.0),
                                         ("rollout_health_check_first_wait", float("inf"))])
def test_a_health_flag_that_is_not_a_number_of_seconds_is_refused(name, value):
    with pytest.raises(ConfigError, match=f"{name}={value!r}: must be a"):
        TrainConfig(**{name: value})


def test_use_fault_tolerance_is_accepted_with_a_note_saying_vime_ends_the_job():
    cfg = TrainConfig(use_fault_tolerance=True)
    note = next(n for n in megatron_args.notes(cfg) if n.startswith("--use-fault-tolerance"))
    assert "cannot restart" in note and "--load" in note


class _Work:
    """A gloo work whose timed wait runs out just as the operation ends (``fails``: it ends
    with its own error)."""

    def __init__(self, fails: bool = False):
        self.fails, self.waits = fails, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        if timeout is not None:
            raise RuntimeError("Operation timed out!")
        if self.fails:
            raise RuntimeError("Connection closed by peer")

    def is_completed(self):
        return True


def test_a_collective_that_completes_as_its_slice_runs_out_is_done_not_failed():
    """A slice's timeout raced with the operation's end: the work is done, not a failure (it
    was raised as one, failing a healthy bridge and desynchronising its peer)."""
    work = _Work()
    assert health.collective_done(work)(0.25) is True
    assert work.waits[-1] is None  # waited for again, untimed, to learn how it ended
    with pytest.raises(RuntimeError, match="Connection closed"):
        health.collective_done(_Work(fails=True))(0.25)
