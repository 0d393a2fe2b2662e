"""``--fully-async``: a persistent generation pool on every engine.

Data flow (one engine rank's pool; trainer rank 0 joins the pools' parts)::

    admit      admits_live? ─▶ a ticket from the shared queue (or a recycled draw) ─▶ a thread
    generate   the rollout function on the group's prompt, through the engine's front (the
               requests of every group in flight join the same forwards)
    harvest    filter (dynamic sampling) ─▶ stamp versions ─▶ ready
    ("batch", k)  drain: fresh enough ─▶ a slot of batch k; too stale ─▶ recycled to the queue
               ─▶ ("part", k, groups, counts, resume point) once all B slots are claimed
               ─▶ trainer rank 0: join_pool_parts, in draw order (pool_parts.py)
               with parts kept here (keeps_parts): ("held", k, keys, ...) ─▶ rank 0 places
               the groups in draw order ─▶ ("exchange", k, places) ─▶ this pool's groups,
               a chunk per run of consecutive places, join the step's exchange
    ("weights", v) between two engine calls: [--partial-rollout: cut the requests in flight]
               load ─▶ [probe on the new weights]

Several engine ranks (``--rollout-num-gpus N``) share **one queue of draws** (work stealing):
every pool takes the next prompt nobody has taken, so a fast rank takes prompts a slow one
has not started, and a slow rank holds no batch back. The prompt source is deterministic and
identical on every rank, so the only shared state is *which draws are taken*, kept in the
job's torch.distributed store (no coordinator process, no message to the trainer):

- ``tickets``: ``store.add`` returns each claim a unique ticket, read as ``(block, index)`` in
  draw order (``vime_pure.pool_ranks.draw_of``); a group's seeds and ids come from that
  place, never from who claimed it;
- ``live``: the groups started over all pools, minus those recycled or filtered; a pool
  starts one more only if ``admits_live`` says it can still be fresh enough, so with
  ``K = 0`` exactly one block's ``B`` groups run beyond the trained ones: the synchronous
  batches, whoever generated them;
- ``batch/<k>``: the slots of batch ``k``; a pool with a fresh group claims one (a number up
  to ``B`` wins it) and sends its part once all ``B`` are claimed: the parts of a batch hold
  exactly ``B`` groups, however many each pool gave;
- ``recycled``: groups too stale to train go back to the shared queue (their draw, not their
  tokens), and the first pool with room regenerates them with their original seeds.

An engine over several ranks (``--rollout-num-gpus-per-engine g``) runs its pool on its
leader; its other ranks, each holding a replica (the HF engine; an engine whose ranks shard
the model, vLLM with tensor parallelism, is a launch error), follow it: they claim nothing and
answer empty parts, but load every sync, generate their probe on their own replica and join
the evaluations, so ``N`` below counts engines. Each pool keeps at most ``ceil(B / N)`` groups
in flight (``pool_capacity``: as many as a
static slice holds, so a healthy job batches as before), or its share of
``--async-max-concurrent-samples`` (miles' flag: more in flight lets a long tail overlap);
``admits_live`` keeps every group fresh enough and the groups queued over the pools (in
flight or done, not yet sent) under those in flight plus one batch ready. With ``K >= 1`` a pool that finished
its groups runs ahead into the next draws while a slow one still generates; with ``K = 0`` a
rank takes over the draws of a block that another has not claimed when it was late (a slow
weight load, a busy loop). The store's keys are named per run by the bridge's command count
(the same on every engine rank), on a store connection of the pool's own whose every call is
bounded (``engines.health.monitor_store``). ``GroupPool.static_slices`` switches back to the
old static contiguous slices (``vime_pure.pool_ranks.pool_share``: the same code over a store
of the pool's own and its slice's indices), kept as the benchmarks' baseline
(``benchmarks/work_stealing.py``). Below, ``B`` is the batch the claims fill (a static
slice's ``len(share)``); every trainer command reaches every pool, each answers its part and
trainer rank 0 joins them (:mod:`vime_shell.sources.pool_parts`).

Each group in flight is a task on a thread that runs the rollout function on its prompt
alone. The engine is shared through its
per-request front (:class:`FrontEngine`: the requests of all groups in flight are batched at
each forward, while rewards, tool calls or sleeps of other groups overlap), or under a lock
for an engine without one. A
completed group waits, tagged with the engine version its generation started with. For the
trainer's ``("batch", k)`` the pool offers its completed groups whose staleness at trainer
version ``k`` is within ``K = --max-weight-staleness`` to batch ``k``'s slots, in completion
order, and sends staler ones back to the queue, to be generated again with their original
seeds (the split is the core's :func:`vime_pure.async_pool.drain`). A group starts only when
``admits_live`` says it can still be fresh enough, so with ``K = 0`` nothing runs ahead of the
weights and the batches are the synchronous loop's. Weights arrive as a ``("weights", v)`` command, taken
between two engine calls (in-flight groups continue on the new weights; their version stays
the one they started with, so staleness is never under-counted). An ``("evaluate", k)``
command (``--eval-interval``) runs the eval sets the same way, between two engine calls, on
the weights synced last; it is collective over the engine ranks (each engine takes its share
of the eval prompts) and engine rank 0 answers. After a sync every pool generates the probe on
its own weights (group ids apart), so the trainer checks every engine rank's sync.

Per-sample rollouts (``--custom-generate-function-path``): a group's executions run on the
front's event loop (``FrontEngine.submit`` as the round's ``PerSample.runner``), beside every
other group's, through one shared front (:class:`GroupsFront`), so their requests join the
same forwards; the group's rewards are computed on its own thread. The probe and evaluation
run the same function the same way. Under ``--partial-rollout`` each weight sync first cuts
every request in flight (:meth:`GroupPool._load`); the cut executions continue at once on the
new weights, one weight version per segment (``rollout.per_sample``), and their samples keep
those versions (not the start/end stamp below).

Deadlines: every plugin call of a group is bounded on the pool's threads as in the synchronous
loop: a reward by ``--reward-timeout`` (on a worker thread, ``rollout.plugins.run_within``), a
per-sample execution by ``--generate-timeout`` (the pool thread waiting for its round watches
its executions on the front's loop, ``rollout.per_sample``; a weight load waiting for that
loop fails the same way when a generate function blocks it); a plugin given up on fails the
pool, which answers the trainer's next request with the error. At the stop the in-flight groups
end first; after a failure the front's loop thread is not waited for (a generate function
given up on may still block it; it is a daemon thread).

Prompts and seeds: the pool draws prompts in whole blocks of ``--rollout-batch-size``
exactly as the synchronous loop draws rollout ``r``'s (``PromptSource.take``), and the
``i``-th prompt of block ``r`` is generated as prompt ``i`` of rollout ``r`` there (its seeds
and group ids), so a group's samples do not depend on the mode; a batch lists its groups in
draw order (trainer rank 0 sorts the parts, ``vime_pure.pool_ranks.merge_order``). Every
group is counted (:class:`~vime_pure.async_pool.PoolCounts`, per pool, summed over the pools):
``started = trained + recycled + filtered + pending`` (a group one pool recycles and another
regenerates is started twice, recycled once). Dynamic sampling filters per group; a filtered
group leaves ``live``, so another is drawn in its place.

Resuming (``--load``): every part carries the pool's resume point (:meth:`GroupPool.
resume_state`: the groups it trained or filtered from the block the trainer names in each
request, below which all are done, and where the prompt source stood at each block it drew);
trainer rank 0 merges the pools' points into one exact point, the first block with a group
no pool reports done (``vime_pure.pool_ranks.merge_resume_states``), saved in the
checkpoint's data state; every resumed pool redraws from there and skips the done groups, so
groups in flight or queued are generated again (same seeds) and no group trains twice, with
any ``N`` and whoever held them.

Health (:mod:`vime_shell.engines.health`): the pool's loop raises the job's health verdict
between two looks at the trainer's commands, so a pool whose trainer or sibling engine rank
stopped answering ends with the error naming that rank; trainer rank 0 bounds its wait for
each rollout's parts by the slowest parts so far (a group stuck in a call that never returns
ends the job, naming its engine rank).
"""

import asyncio
import concurrent.futures as futures
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

import attrs

import torch.distributed as dist

from vime_pure.async_pool import PoolCounts, drain
from vime_pure.data.held_parts import claimed_part
from vime_pure.data.sample import Status, as_status
from vime_pure.data.shares import BatchMeta
from vime_pure.pool_ranks import (admits_live, draw_of, place_runs, pool_capacity,
                                  pool_share)
from vime_pure.token_versions import (NO_VERSION, mask_stale_tokens, token_staleness_counts,
                                      version_runs)
from vime_shell.engines.async_engine import async_front, has_per_request_api
from vime_shell.engines.health import current, monitor_store
from vime_shell.settings.train_config import TrainConfig
from vime_shell.sources.exchange import ShareExchange
from vime_shell.sources.replay import holder_dumps
from vime_shell.sources.pool_parts import partial_sums
from vime_shell.sources.probe import generate_probe
from vime_shell.sources.rollouts import (RolloutProducer, keeps_parts, prompt_samples,
                                         sample_annotations)
from vime_shell.rollout.functions import rollout_sampling_seed, share_context
from vime_shell.rollout.generate import GenerateRuntime
from vime_shell.rollout.per_sample import GenerateTimeoutError, check_loop
from vime_shell.rollout.plugins import call_plugin

_POLL_S = 0.002  # between two looks at the trainer's commands and the finished groups
_CHECK_S = 1.0  # between two checks of the front's loop while a weight load waits for it
_STORE_POLL_S = 0.01  # between two looks at a batch's claimed slots in the job's store


@attrs.frozen
class Draw:
    """Prompt ``index`` of block ``block`` (the synchronous loop's rollout ``block``)."""

    block: int
    index: int
    prompts: tuple  # the whole block (seeds and ids come from the prompt's place in it)


class LocalStore:
    """The store calls of :class:`Claims` on a dict: a pool alone over its static slice (or
    the only pool), no other rank asking."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def add(self, key: str, amount: int) -> int:
        value = int(self.values.get(key, b"0")) + amount
        self.values[key] = str(value).encode()
        return value

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def get(self, key: str) -> bytes:
        return self.values[key]

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        current = self.values.get(key)
        if current is None and expected == "" or current == expected.encode():
            self.values[key] = desired.encode()
        return self.values.get(key, b"")


class Claims:
    """Which draws are taken, in a ``store`` shared by the pools (or a pool's own): the keys of
    the module docstring. ``indices``: the prompt indices the tickets number (a whole block,
    or a static slice); ``batch_size``: the slots of a batch; ``me``: this pool's name in the
    store (who took a recycled draw); ``in_flight``: the groups the pools sharing the store
    keep in flight together (default ``batch_size``)."""

    def __init__(self, store: Any, indices: range, batch_size: int, me: str,
                 in_flight: int | None = None):
        self.store, self.indices, self.batch_size, self.me = store, indices, batch_size, me
        self.in_flight = batch_size if in_flight is None else in_flight
        self.seen = 0  # recycled draws looked at: all up to it are taken by some pool

    def live(self, amount: int) -> int:
        """Add ``amount`` to the live groups over all pools; the new count."""
        return int(self.store.add("live", amount))

    def ticket(self, base_block: int) -> tuple[int, int]:
        """The next draw nobody has claimed, from ``base_block`` on."""
        return draw_of(int(self.store.add("tickets", 1)) - 1, base_block, self.indices)

    def give_back(self, draw: tuple[int, int]) -> None:
        """A recycled draw, for the first pool with room to regenerate."""
        n = int(self.store.add("recycled", 1))
        self.store.set(f"recycled/{n}", f"{draw[0]},{draw[1]}")

    def take_back(self) -> tuple[int, int] | None:
        """A recycled draw no pool has taken yet, now this pool's (the first taker of its
        owner key wins it), or None."""
        posted = int(self.store.add("recycled", 0))
        while self.seen < posted:
            self.seen += 1
            owner = self.store.compare_set(f"recycled/{self.seen}/owner", "", self.me)
            if owner == self.me.encode():
                block, index = self.store.get(f"recycled/{self.seen}").decode().split(",")
                return int(block), int(index)
        return None

    def slot(self, k: int) -> bool:
        """Claim one of batch ``k``'s slots; False: the batch is full."""
        return int(self.store.add(f"batch/{k}", 1)) <= self.batch_size

    def full(self, k: int) -> bool:
        """Whether all of batch ``k``'s slots are claimed."""
        return int(self.store.add(f"batch/{k}", 0)) >= self.batch_size


def _newest(output: list, default: int) -> int:
    """The newest version that sampled a token of the group (``default`` when none is
    recorded): under in-flight updates a group is recycled for staleness only when even its
    newest token is too stale (then nothing of it would train)."""
    return max((int(v) for sample in prompt_samples(output)
                if sample.token_versions is not None
                for v in sample.token_versions if int(v) != NO_VERSION), default=default)


def pool_claims(bridge: Any, batch_size: int, layout: Any, rank: int,
                static: bool, in_flight: int | None = None) -> tuple[Claims, int]:
    """Engine rank ``rank``'s claims and how many groups it keeps in flight (its share of
    ``in_flight`` over the pools, ``--async-max-concurrent-samples``; default one batch: its
    slice's size): an engine's leader runs its pool, on the job's store shared by every
    engine's pool, its keys under this run's name (the bridge's command count, the same on
    every engine rank); or, one engine alone or ``static``, over its own slice on a store of
    its own. An engine's other ranks (each holding a replica: the HF engine) follow its leader
    and claim nothing."""
    if not layout.is_leader(rank):
        return Claims(LocalStore(), range(0), 0, str(rank)), 0
    engine, num_pools = layout.engine_of(rank), layout.num_engines
    wide = in_flight is not None and in_flight != batch_size
    if static or num_pools == 1:
        share = pool_share(batch_size, num_pools, engine)
        capacity = pool_capacity(in_flight, num_pools) if wide else len(share)
        return Claims(LocalStore(), share, len(share), str(engine), capacity), capacity
    store = dist.PrefixStore(f"vime/pool/{bridge.commands}", monitor_store(bridge.store))
    together = in_flight if wide else batch_size
    return (Claims(store, range(batch_size), batch_size, str(engine), together),
            pool_capacity(together, num_pools))


class LockedEngine:
    """One engine shared by the pool's threads: one call at a time (engines without a
    per-request front)."""

    def __init__(self, engine: Any):
        self.engine, self.lock = engine, threading.Lock()

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        with self.lock:
            return self.engine.generate(*args, **kwargs)

    def between_calls(self, fn: Callable[[], Any],
                      check: Callable[[], None] | None = None) -> Any:
        """``fn()`` while no generation runs (weight loads); while it waits for the engine,
        ``check()`` every ``_CHECK_S`` may raise. The same call as ``FrontEngine``'s: the pool
        does not know which of the two it holds."""
        while not self.lock.acquire(timeout=_CHECK_S):
            if check is not None:
                check()
        try:
            return fn()
        finally:
            self.lock.release()

    def close(self, wait: bool = True) -> None:
        pass


class FrontEngine:
    """The batched ``generate(prompts, params)`` of rollout functions, served by the engine's
    per-request front (``vime_shell.engines.async_engine``) on an event-loop thread of its
    own: the requests of every group in flight join the same forwards (continuous batching),
    instead of one engine call per group. Request ``i`` of a call keeps seed ``seed + i``,
    so a group samples as in a batched call."""

    def __init__(self, engine: Any, max_concurrency: int,
                 decode: Callable[[list[int]], str] | None = None):
        self.engine = engine
        self.front = async_front(engine, max_concurrency=max_concurrency, decode=decode)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="vime-pool-front")
        self.thread.start()

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def generate(self, prompts: Any, params: Any) -> list:
        async def requests() -> list:
            return list(await asyncio.gather(*(
                self.front.generate(p, attrs.evolve(params, seed=params.request_seed(i)))
                for i, p in enumerate(prompts))))

        return asyncio.run_coroutine_threadsafe(requests(), self.loop).result()

    def pause(self, mode: str) -> int:
        """Ready the requests in flight for a weight load on this loop (``--pause-generation-
        mode``; call it from ``between_calls``, then :meth:`resume` after the load): the
        front's own policy (``engines.async_engine``)."""
        return int(self.front.pause(mode))

    def resume(self) -> None:
        """After the load: a front paused for it generates again."""
        self.front.resume()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> futures.Future:
        """Start ``coro`` on the front's loop; a pool thread waits for the returned future
        (with the executions' deadline, ``per_sample``): how a per-sample round's executions
        run (``PerSample.runner``), beside every other group's."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def between_calls(self, fn: Callable[[], Any],
                      check: Callable[[], None] | None = None) -> Any:
        """``fn()`` on the front's loop, between two forwards (weight loads); while it waits,
        ``check()`` every ``_CHECK_S`` may raise (a generate function blocks the loop)."""
        async def call() -> Any:
            return fn()

        future = asyncio.run_coroutine_threadsafe(call(), self.loop)
        while not futures.wait([future], timeout=_CHECK_S)[0]:
            if check is not None:
                check()
        return future.result()

    def close(self, wait: bool = True) -> None:
        """Stop the front's loop; ``wait``: for its thread to end (a daemon: without the wait,
        a loop a generate function blocks never holds the process)."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        if wait:
            self.thread.join(timeout=60)


class GroupsFront:
    """The per-request front as per-sample rounds see it in the pool: every round shares it,
    so one round's end must not abort the others' requests (``abort_all`` ends nothing here;
    under ``--partial-rollout`` the pool itself cuts every request at a sync,
    :meth:`GroupPool._load`)."""

    def __init__(self, front: Any):
        self.front = front
        self.name = front.name

    @property
    def weight_version(self) -> int:
        return self.front.weight_version

    @property
    def in_flight(self) -> int:
        return self.front.in_flight

    async def generate(self, prompt_ids: Any, params: Any) -> Any:
        return await self.front.generate(prompt_ids, params)

    def abort_all(self) -> int:
        return 0


def shared_engine(engine: Any, max_concurrency: int,
                  decode: Callable[[list[int]], str] | None = None
                  ) -> "FrontEngine | LockedEngine":
    """The pool's engine: the per-request front when the engine has one (or is one, as
    vLLM's ``AsyncLLM`` engine is), else a lock."""
    if has_per_request_api(engine):
        return FrontEngine(engine, max_concurrency, decode)
    return LockedEngine(engine)


class GroupPool:
    """The engine rank's pool and command loop (module docstring)."""

    static_slices = False  # True: the old static slices (the benchmarks' baseline)

    def __init__(self, cfg: TrainConfig, producer: RolloutProducer, sides: Any):
        bridge = sides.bridge
        self.cfg, self.producer, self.bridge = cfg, producer, bridge
        # The groups of a batch stay here until the step's exchange (``keeps_parts``).
        self.exchange = (ShareExchange(None, group=sides.span) if keeps_parts(cfg) else None)
        self.dumps = holder_dumps(producer, self.exchange)
        self.held: dict[int, list] = {}  # batch -> the outputs of this pool's part
        self.rank = bridge.rank - 1  # this engine rank
        self.lead = self.rank == 0  # answers evaluations (collective over the engine ranks)
        self.block = cfg.rollout_batch_size  # prompts per block (one synchronous rollout)
        self.claims, self.capacity = pool_claims(bridge, self.block, producer.engines.layout,
                                                 self.rank, self.static_slices,
                                                 cfg.groups_in_flight)
        self.bound = cfg.effective_max_weight_staleness
        # in-flight updates: a group's staleness is its tokens' (the bound masks per token)
        self.per_token = (cfg.effective_pause_generation_mode != "abort"
                          and not cfg.partial_rollout)
        engine = producer.engines.engine
        concurrency, decode = cfg.sglang_server_concurrency, producer.tokenizer.decode
        # Per-sample rounds (--custom-generate-function-path): every group's executions run
        # on the front's loop, beside the other groups', so their requests batch together.
        # Such a producer found the engine's per-request front already (``async_front``).
        self.per_sample = producer.per_sample is not None
        # --partial-rollout: each sync cuts the requests in flight, continued on the new
        # weights (per-sample only: the settings refuse it without a generate function);
        # ``cuts`` is (front, runtime) then, None otherwise.
        self.cut_requests = 0  # engine requests the syncs cut
        self.pause_mode = cfg.effective_pause_generation_mode
        self.paused_requests = 0  # requests in flight at a sync (retracted or aborted)
        # this batch's: tokens --max-weight-staleness masked, trained tokens per staleness
        self.stale_tokens = 0
        self.token_staleness: dict[int, int] = {}
        self.cuts: tuple[Any, GenerateRuntime] | None = None
        self.engine: FrontEngine | LockedEngine
        if producer.per_sample is not None:
            self.engine = front = FrontEngine(engine, concurrency, decode)
            producer.run_per_sample_on(GroupsFront(front.front), front.submit,
                                       continue_after_cut=cfg.partial_rollout)
            if cfg.partial_rollout:
                self.cuts = (front.front, producer.per_sample.runtime)
        else:
            self.engine = shared_engine(engine, concurrency, decode=decode)
        self.version = 0
        self.start: int | None = None  # the trainer's version at its first request
        self.sent = 0  # batches handed to the trainer
        self.demand: int | None = None
        self.part: list[tuple[Draw, list, int]] = []  # groups holding a slot of ``demand``
        self.looked = 0.0  # when the pool last looked whether ``demand`` is full
        self.base = 0  # the block the first ticket names (a resumed run's first open block)
        self.low = 0  # every group before this block is done (the trainer says, per request)
        self.blocks = 0  # blocks drawn from the prompt source
        self.prompts: dict[int, tuple] = {}  # the drawn blocks from ``low`` on
        self.block_starts: dict[int, tuple[int, int]] = {}  # source (offset, draws) per block
        self.running: dict[futures.Future, tuple[Draw, int]] = {}
        self.ready: list[tuple[Draw, list, int]] = []
        self.counts = PoolCounts()
        self.failure: Exception | None = None  # answered to the next request, raised at stop
        self.done: set[tuple[int, int]] = set()  # (block, index) trained or filtered
        self.threads = futures.ThreadPoolExecutor(max_workers=max(self.capacity, 1),
                                                  thread_name_prefix="vime-pool")

    def run(self) -> None:
        posted = self.bridge.post_command()
        monitor = current()
        try:
            while True:
                monitor.check()  # the job's health verdict ends the pool (engines.health)
                if posted[1].is_completed():
                    command = self.bridge.finish_command(posted)
                    if command[0] == "stop":
                        break
                    self._handle(command)
                    posted = self.bridge.post_command()
                try:
                    self._harvest()
                except Exception as exc:  # noqa: BLE001 - sent to the trainer, raised at stop
                    self.failure = self.failure or exc
                if self.failure is not None:
                    if self.demand is not None:
                        self.bridge.send(("error", f"{type(self.failure).__name__}: "
                                                   f"{self.failure}"))
                        self.demand = None
                elif self.demand is not None:
                    self._serve(self.demand)
                if self.failure is None:
                    self._admit()
                if self.running:
                    futures.wait(self.running, timeout=_POLL_S,
                                 return_when=futures.FIRST_COMPLETED)
                else:
                    threading.Event().wait(_POLL_S)
        finally:  # in-flight groups end first (their plugin calls are bounded); after a
            # failure the front's loop is not waited for: a generate function given up on may
            # still block it
            self.threads.shutdown(wait=True, cancel_futures=True)
            self.engine.close(wait=self.failure is None)
        if self.failure is not None:
            raise self.failure

    def _handle(self, command: tuple) -> None:
        if command[0] == "weights":
            try:
                self.engine.between_calls(lambda: self._load(command[1]), check=self._check_loop)
            except GenerateTimeoutError as exc:  # the loop is blocked: nothing more runs
                self.failure = exc  # on it; ending this rank ends the trainer's send
                raise
            self.version = command[1]
            if command[2]:  # the trainer checks the sync on a probe of these weights
                try:  # every engine rank's sync is checked: probe ids apart per pool
                    self.bridge.send(("probe", generate_probe(
                        self.producer, self.engine,
                        first_group_id=self.rank * self.cfg.n_samples_per_prompt)))
                except Exception as exc:  # noqa: BLE001 - the trainer waits for this reply
                    self.bridge.send(("error", f"{type(exc).__name__}: {exc}"))
                    self.failure = self.failure or exc
        elif command[0] == "evaluate":  # on the weights just synced, no group generating
            try:
                # Per-sample rounds run on the front's loop: evaluate from here (no weights
                # arrive meanwhile, this thread takes them); batched ones between two calls.
                # Collective over the engine ranks (each engine takes its share of the
                # eval prompts); engine rank 0 answers, as the synchronous server does.
                metrics = (self.producer.evaluate(command[1]) if self.per_sample else
                           self.engine.between_calls(lambda: self.producer.evaluate(command[1])))
                if self.lead:
                    self.bridge.send(("eval", metrics))
            except Exception as exc:  # noqa: BLE001 - the trainer waits for this reply
                if self.lead:
                    self.bridge.send(("error", f"{type(exc).__name__}: {exc}"))
                self.failure = self.failure or exc
        elif command[0] == "exchange":  # ("exchange", k, places): parts kept here (places
            self._exchange(command[1], None if command[2] is None  # None: the batch failed)
                           else command[2][self.rank])
        elif command[0] == "batch":  # ("batch", k, restore, low)
            self.demand = command[1]
            if self.start is None:
                self.start = command[1]
                if command[2] is not None:
                    self._resume(command[2])
            self._forget_before(command[3])

    def _exchange(self, k: int, places: list[int] | None) -> None:
        """Join the step's exchange of batch ``k`` with this pool's groups as one part, a
        chunk per run of consecutive places in the batch (``pool_parts.place_pool_parts``,
        ``vime_pure.pool_ranks.place_runs``; None:
        the batch failed, this pool joins with its failure or nothing); a failure is reported
        there and ends the pool at the trainer's stop."""
        assert self.exchange is not None  # the trainer sends "exchange" only with parts
        outputs = self.held.pop(k, [])
        part, error = None, self.failure
        metas: tuple[BatchMeta, ...] = ()
        chunks: list = []
        try:
            if places is not None and error is None:  # a chunk per run of places
                chunks = [(first, [outputs[i] for i in run])
                          for first, run in place_runs(places)]
                part, metas = claimed_part(chunks, normalization=self.producer.normalization)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the exchange
            error = exc
        try:
            plan, _, _ = self.exchange.distribute(part, metas, None, what=f"rollout {k}",
                                                  error=error)
        except Exception as exc:  # noqa: BLE001 - this pool's own failure is raised at the
            if error is not None:  # stop; another member's ends the run: the trainer's stop
                self.failure = self.failure or exc  # comes next, and this pool leaves cleanly
            return
        if plan is not None and part is not None and self.dumps is not None:
            try:
                self.dumps.write_part(k, self.exchange.rank, part, list(sample_annotations(
                    [o for _, outs in chunks for o in outs])))
            except Exception as exc:  # noqa: BLE001 - reported with the next batch
                self.failure = self.failure or exc

    def _load(self, version: int) -> None:
        """Receive and load the trainer's weights, between two engine calls (on the front's
        loop, so no request runs during the load), the requests in flight readied by the sync
        policy first (``--pause-generation-mode``): ``in_place`` and ``retract`` continue them
        on the new weights, each token stamped with its version; ``abort`` ends them and their
        groups are generated again (recycled at harvest: a group with an aborted sample). Under ``--partial-rollout`` the
        requests are cut and continued as new segments (``per_sample.PerSample.
        continue_after_cut``): one weight version per segment."""
        weights = self.bridge.receive_weights()
        paused = self.engine if self.cuts is None and isinstance(self.engine, FrontEngine) \
            else None  # a lock-held engine ends its call before the load: nothing to pause
        if self.cuts is not None:
            front, runtime = self.cuts
            self.cut_requests += front.abort_all()
            runtime.cuts += 1
        elif paused is not None:
            self.paused_requests += paused.pause(self.pause_mode)
        try:
            self.producer.engines.sync_weights(weights, version=version)
        finally:  # a front paused for the load generates again, whatever the load did
            if paused is not None:
                paused.resume()

    def _bound_tokens(self, output: list, k: int) -> None:
        """The staleness bound per token for batch ``k``: each sample's generated tokens
        staler than ``K`` get loss mask 0 (``vime_pure.token_versions``; the core's
        denominators then count what is left), its versions become those of the tokens it
        trains, and the trained tokens are counted per staleness for the record."""
        for sample in prompt_samples(output):
            if sample.token_versions is None:
                continue
            n = sample.response_length
            mask = [1] * n if sample.loss_mask is None else list(sample.loss_mask)
            mask, removed = mask_stale_tokens(mask, sample.token_versions, k, self.bound)
            sample.loss_mask = mask
            self.stale_tokens += removed
            kept = [v if m else NO_VERSION for v, m in zip(sample.token_versions, mask)]
            sample.weight_versions = version_runs(kept)[0] or sample.weight_versions[-1:]
            for s, count in token_staleness_counts(sample.token_versions, mask, k).items():
                self.token_staleness[s] = self.token_staleness.get(s, 0) + count

    def _check_loop(self) -> None:
        """While a weight load waits for the front's loop: a generate function blocking the
        loop past ``--generate-timeout`` fails the pool (``per_sample.check_loop``)."""
        setup = self.producer.per_sample
        if setup is not None and isinstance(self.engine, FrontEngine):
            check_loop(setup, self.engine.loop)

    # -- resuming -----------------------------------------------------------------------------
    def resume_state(self) -> dict:
        """Plain JSON for the checkpoint, merged over the pools by trainer rank 0
        (``merge_resume_states``): the block ``low`` before which every group is done, where
        the prompt source stood before each block drawn since (and the next one), and the
        groups this pool trained or filtered from ``low`` on. Example: ``{"block": 3,
        "starts": [[3, 48, 3], [4, 64, 4]], "done": [[3, 0], [3, 2]]}``."""
        source = self.producer.source
        starts = [[b, *self.block_starts[b]] for b in sorted(self.block_starts)]
        return {"block": self.low, "starts": [*starts, [self.blocks, source.offset,
                                                        source.draws]],
                "done": sorted([b, i] for b, i in self.done)}

    def _resume(self, state: dict) -> None:
        source = self.producer.source
        source.offset, source.draws = state["offset"], state["draws"]
        pool = state.get("pool")
        if pool is not None:
            self.blocks = self.base = self.low = pool["block"]
            self.done = {(b, i) for b, i in pool["done"]}

    def _forget_before(self, low: int) -> None:
        """Every group before block ``low`` is done (the trainer's last merged resume point):
        what this pool keeps about them goes."""
        self.low = max(self.low, low)
        self.done = {d for d in self.done if d[0] >= self.low}
        for kept in (self.prompts, self.block_starts):
            for b in [b for b in kept if b < self.low]:
                del kept[b]

    # -- groups -------------------------------------------------------------------------------
    def _next_draw(self) -> Draw:
        """A recycled draw nobody has taken, else the next unclaimed one not done yet."""
        key = self.claims.take_back()
        while key is None:
            key = self.claims.ticket(self.base)
            if key in self.done:  # trained before the resume
                key = None
        block, index = key
        while self.blocks <= block:  # every block before it too, as every engine rank does
            source = self.producer.source
            self.block_starts[self.blocks] = (source.offset, source.draws)
            self.prompts[self.blocks] = source.take(self.block)
            self.blocks += 1
        return Draw(block=block, index=index, prompts=self.prompts[block])

    def _admit(self) -> None:
        while self.start is not None and len(self.running) < self.capacity:
            if not admits_live(live_before=self.claims.live(1) - 1, batches_sent=self.sent,
                               start_version=self.start, engine_version=self.version,
                               batch_size=self.claims.batch_size, max_staleness=self.bound,
                               in_flight=self.claims.in_flight):
                self.claims.live(-1)
                return
            draw = self._next_draw()
            self.running[self.threads.submit(self._generate, draw)] = (draw, self.version)
            self.counts = self.counts.add(started=1)

    def _generate(self, draw: Draw) -> list:
        """One prompt group, generated as prompt ``index`` of rollout ``block`` would be."""
        p = self.producer
        cfg = self.cfg
        sampling = p.sampling(cfg.max_response_len, rollout_sampling_seed(p.seed, draw.block, 0))
        ctx = p.context(draw.block, draw.prompts, sampling, engine=self.engine,
                        first_group_id=draw.block * len(draw.prompts) * cfg.n_samples_per_prompt)
        return p.with_teacher(call_plugin(
            lambda c: list(p.rollout_fn(c)),
            share_context(ctx, range(draw.index, draw.index + 1)),
            what=f"rollout function {cfg.rollout_function_path}",
            flag="--rollout-function-path", where=f"rollout {draw.block}, prompt {draw.index}"))

    def _harvest(self) -> None:
        for future in [f for f in self.running if f.done()]:
            draw, version = self.running.pop(future)
            output = future.result()  # a failing rollout function stops the pool here
            if self.pause_mode == "abort" and self.cuts is None and any(
                    as_status(s.status) is Status.ABORTED for s in prompt_samples(output[0])):
                # a sync aborted its requests: the group is generated again with its seeds
                self.claims.give_back((draw.block, draw.index))
                self.claims.live(-1)
                self.counts = self.counts.add(recycled=1)
                continue
            # Stamped with the versions that sampled its tokens where the engine records them,
            # else the version it started under and, if a sync came in between, the one it
            # ended under (oldest first, as Sample.weight_versions are); cut at every sync,
            # its segments carry their own versions already.
            if self.cuts is None:
                for sample in prompt_samples(output[0]):
                    runs = (None if sample.token_versions is None
                            else version_runs(sample.token_versions)[0])
                    sample.weight_versions = runs or sorted({version, self.version})
            version = _newest(output[0], version) if self.per_token else version
            if self.producer.keep is not None and not call_plugin(
                    self.producer.keep, prompt_samples(output[0]),
                    what=f"filter {self.cfg.dynamic_sampling_filter_path}",
                    flag="--dynamic-sampling-filter-path",
                    where=f"rollout {draw.block}, prompt {draw.index}"):
                self.counts = self.counts.add(filtered=1)
                self.claims.live(-1)  # another group is drawn in its place
                self.done.add((draw.block, draw.index))
                continue
            self.ready.append((draw, output[0], version))

    def _serve(self, k: int) -> None:
        """Offer the fresh-enough ready groups to batch ``k``'s slots; hand this pool's part
        over once every slot is claimed (at once when it owns none); trainer rank 0 joins the
        parts (:func:`vime_shell.sources.pool_parts.join_pool_parts`)."""
        split = drain(versions=tuple(v for _, _, v in self.ready), trainer_version=k,
                      max_staleness=self.bound, batch_size=max(self.claims.batch_size, 1))
        for i in sorted(split.recycle, key=lambda i: (self.ready[i][0].block,
                                                       self.ready[i][0].index)):
            draw = self.ready[i][0]  # regenerated by the first pool with room, in draw order
            self.claims.give_back((draw.block, draw.index))
            self.claims.live(-1)
        self.counts = self.counts.add(recycled=len(split.recycle))
        offered: list[int] = []
        for i in split.take:
            if not self.claims.slot(k):
                break  # batch k is full: the rest wait for the next one
            offered.append(i)
        self.part += [self.ready[i] for i in offered]
        self.ready = [self.ready[i] for i in (*split.take, *split.keep) if i not in offered]
        now = time.monotonic()
        if not offered and now - self.looked < _STORE_POLL_S:
            return
        self.looked = now
        if self.claims.full(k):
            self._send_part(k)

    def _send_part(self, k: int) -> None:
        """``("part", k, groups, record, resume point)``: each group as ``((block, index),
        output, version)``; the record holds this pool's counts. With parts kept here
        (``keeps_parts``): ``("held", ...)``, each group's output None until the exchange."""
        taken, self.part = self.part, []
        if self.per_token:
            for _, out, _ in taken:
                self._bound_tokens(out, k)
        self.counts = self.counts.add(trained=len(taken))
        self.done.update((d.block, d.index) for d, _, _ in taken)
        c = self.counts
        record: dict[str, Any] = {"pool_started": c.started, "pool_trained": c.trained,
                                  "pool_recycled": c.recycled, "pool_filtered": c.filtered}
        if self.cuts is None:
            record["pool_paused_requests"] = self.paused_requests
        if self.per_token:
            record |= {"pool_stale_tokens_masked": self.stale_tokens,
                       "pool_token_staleness": dict(self.token_staleness)}
            self.token_staleness, self.stale_tokens = {}, 0
        if self.cuts is not None:
            record |= {"pool_cut_requests": self.cut_requests,
                       "pool_restarted_samples": self.cuts[1].restarted,
                       **partial_sums([out for _, out, _ in taken])}
        groups: list[tuple[tuple[int, int], list | None, int]] = [
            ((d.block, d.index), out, v) for d, out, v in taken]
        tag = "part"
        if self.exchange is not None:  # the outputs stay here until the exchange: "held"
            self.held[k] = [out for _, out, _ in taken]  # sends keys and versions only
            groups, tag = [(key, None, v) for key, _, v in groups], "held"
        self.bridge.send((tag, k, groups, record, self.resume_state()))
        self.sent += 1
        self.demand = None
