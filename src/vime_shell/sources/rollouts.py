"""The rollout side of the loop: prompts, generation rounds with dynamic sampling, rewards, the
``RolloutBatch``, and evaluation, over the run's engines (:class:`EngineGroup`: engines claim a
round's prompts in chunks from a work queue).

Data flow of one rollout::

    every rank ─ draw the round's prompts (the same everywhere) ─▶ engines claim chunks ─▶
      rollout function ─▶ rewards
    parts (produce_part, keeps_parts): each leader judges its groups (the filter) ─▶
      verdicts to every rank ─▶ rounds, cut, counts decided alike everywhere ─▶ each leader
      keeps its groups of the cut as its part
    whole (produce: slime's rollout-log hook): rank 0 merges the round's output, judges it,
      builds the RolloutBatch

One rollout batch (``produce`` or ``produce_part``): draw ``--over-sampling-batch-size`` prompts (default
``--rollout-batch-size``), generate ``--n-samples-per-prompt`` responses each through the
rollout function, reward them, and keep a prompt's group when ``--dynamic-sampling-filter-path``
accepts it; repeat until ``--rollout-batch-size`` groups are kept or
``--dynamic-sampling-max-rounds`` rounds ran, and train on what was kept (the batch's group
count then varies from rollout to rollout: what the data model exists for). Surplus groups of
the last round are discarded. Every round numbers its groups after the previous round's, so
group ids stay unique, and draws its own sampling seeds.

Evaluation (``evaluate``) runs every ``--eval-prompt-data`` set through the same engine and
rollout function, without training: ``eval/<name>/reward_mean`` (over rollout groups) and
``eval/<name>/pass@k`` for ``k`` = 1 and ``--n-samples-per-eval-prompt`` (a sample counts as
solved when its reward is positive; unbiased estimator over each prompt's samples).

Example: rollout batch size 16, over-sampling 32, the built-in filter: round 0 keeps 11 of 32
prompts, round 1 keeps 5 more and discards 27; the record says ``prompts_generated 64,
prompts_kept 16, prompts_filtered 42``.
"""

import concurrent.futures as futures
import logging
import math
import re
import time
from collections.abc import Callable, Coroutine, Sequence
from itertools import chain
from typing import Any

import attrs
import numpy as np
import torch.distributed as dist

from vime_pure.data.batch import RolloutBatch
from vime_pure.data.rollout_output import flatten_rollout_output
from vime_pure.data.held_parts import claimed_part
from vime_pure.data.shards import (GroupVerdict, PartialShare, cut_rounds, deal_groups,
                                   partial_shares)
from vime_pure.pool_ranks import place_runs
from vime_pure.errors import RolloutValidationError, VimeError, field_error, one_line
from vime_shell.engines import SamplingParams
from vime_shell.engines.async_engine import async_front
from vime_shell.engines.byte_counts import pickled_size
from vime_shell.engines.group import EngineGroup, EngineGroupError
from vime_shell.megatron.collectives import rank0_result
from vime_shell.megatron.cuda_compat import native_torch
from vime_shell.models.hf_config import read_config_summary
from vime_shell.models.tokenizer import default_stop_token_ids, load_tokenizer
from vime_shell.rollout.data import DataError, PromptSource
from vime_shell.rollout.filters import load_filter
from vime_shell.rollout.functions import (DEFAULT_GENERATE_FUNCTION,
                                          PER_SAMPLE_ROLLOUT_FUNCTION, RolloutContext,
                                          encode_prompt,
                                          load_rollout_function, rollout_sampling_seed,
                                          share_context)
from vime_shell.rollout.generate import GenerateRuntime
from vime_shell.rollout.per_sample import PartialBuffer, PerSample
from vime_shell.rollout.plugins import call_plugin, load_callable
from vime_shell.rollout.plugins import load_generate_function
from vime_shell.rollout.rewards import Rewarder
from vime_shell.rollout.tasks import TaskExample
from vime_shell.rollout.teacher import Teacher
from vime_shell.settings.launch_plan import LaunchPlan
from vime_shell.settings.train_config import TrainConfig
from vime_shell.sources.base import Produced

# Evaluation draws its own seeds (the same prompts score the same way at every evaluation):
# the base of a rollout id no training run reaches.
_EVAL_ROLLOUT_ID = 0xE7A1E7A1
log = logging.getLogger("vime.train")


@attrs.frozen(kw_only=True)
class PartialStats:
    """Partial rollouts in one rollout: groups resumed from the buffer, groups left in it,
    samples of cut-off fan-outs restarted so far (never trained), and the batch's response
    tokens with those generated under older weights (``offpolicy_prefix``)."""

    resumed_groups: int
    buffered_groups: int
    restarted_samples: int
    tokens: int
    offpolicy_tokens: int

    def as_record(self) -> dict[str, float]:
        return {"partial/resumed_groups": self.resumed_groups,
                "partial/buffered_groups": self.buffered_groups,
                "partial/restarted_samples": self.restarted_samples,
                "partial/offpolicy_token_frac": self.offpolicy_tokens / max(self.tokens, 1)}


@attrs.frozen(kw_only=True)
class GenerationStats:
    """What one rollout's generation did (logged with its record)."""

    rounds: int
    prompts_generated: int
    prompts_kept: int
    prompts_filtered: int
    partial: PartialStats | None = None
    prompts_filled: int = 0  # filtered prompts put back by --dynamic-sampling-fill-filtered
    filtered_reward_mean: float | None = None  # over the filtered prompts' rollout groups
    weight_version: int | None = None  # the engine's, where it runs on ranks of its own
    # Per sample of the batch, in its order: label and metadata (the dump's annotations).
    annotations: tuple = attrs.field(default=(), eq=False, repr=False)

    def as_record(self) -> dict[str, float]:
        generated = max(self.prompts_generated, 1)
        return {"generation_rounds": self.rounds, "prompts_generated": self.prompts_generated,
                "prompts_kept": self.prompts_kept, "prompts_filtered": self.prompts_filtered,
                "prompts_filled": self.prompts_filled,
                "filtered_frac": self.prompts_filtered / generated,
                **(self.partial.as_record() if self.partial is not None else {}),
                **({} if self.weight_version is None else
                   {"weight_version": self.weight_version})}


def _prompt_source(plan: LaunchPlan, *, shuffle: bool, seed: int) -> PromptSource:
    """The run's prompts: the dataset's rows, else the built-in task's generator (the launch
    checks set exactly one of the two)."""
    if plan.prompts is not None:
        return PromptSource.from_dataset(plan.prompts, shuffle=shuffle, seed=seed)
    if plan.task is None:
        raise field_error(DataError, "--prompt-data", None,
                          "and the launch plan names no built-in task: nothing supplies prompts",
                          "pass --prompt-data PATH, or --task NAME")
    return PromptSource.from_task(plan.task, seed=seed)


def _per_sample(cfg: TrainConfig, engines: EngineGroup, tokenizer: Any,
                context_len: int | None) -> PerSample | None:
    """How this rank runs per-sample ``generate`` functions (None when the rollout function
    is a batched one, or this rank has no engine): the engine's per-request front, the
    function (``--custom-generate-function-path``, else the built-in one) and its deadline
    (``--generate-timeout``), the run's config as ``args``, and the partial-rollout buffer
    under ``--partial-rollout``; ``context_len``: the model's context, which caps a function's
    ``max_new_tokens``."""
    if cfg.effective_rollout_function_path != PER_SAMPLE_ROLLOUT_FUNCTION \
            or engines.engine is None:
        return None
    front = async_front(engines.engine, max_concurrency=cfg.sglang_server_concurrency,
                        decode=tokenizer.decode)
    runtime = GenerateRuntime(
        engine=front, tokenizer=tokenizer,
        encode=lambda example: encode_prompt(tokenizer, example, cfg.apply_chat_template),
        mask_offpolicy=cfg.mask_offpolicy_in_partial_rollout, context_len=context_len)
    path = cfg.generate_function_path or DEFAULT_GENERATE_FUNCTION
    return PerSample(runtime=runtime, generate_fn=load_generate_function(path), args=cfg,
                     buffer=PartialBuffer() if cfg.partial_rollout else None, name=path,
                     timeout=cfg.generate_timeout)


class RolloutProducer:
    """Prompts, rounds, rewards and evaluation for one run (see the module docstring).

    Built on every rank of a run with engines: the prompt draws and the round count are the
    same everywhere (seeded, and rank 0's filter verdict is broadcast), each engine generates
    the chunks of a round it claims, and only rank 0 holds the merged output, the batch and the metrics.
    """

    def __init__(self, cfg: TrainConfig, plan: LaunchPlan, engines: EngineGroup):
        self.cfg, self.engines = cfg, engines
        self.is_rank0 = dist.get_rank() == 0
        self.tokenizer = load_tokenizer(plan.hf_dir)
        self.hf_dir = plan.hf_dir  # the tokenizer a dump records
        seed = cfg.rollout_seed if cfg.rollout_seed is not None else cfg.seed
        self.source = _prompt_source(plan, shuffle=cfg.rollout_shuffle, seed=seed)
        self.seed = seed
        self.task = plan.task
        self.eval_sets = plan.eval_sets
        self.rollout_fn = load_rollout_function(cfg.effective_rollout_function_path)
        # miles' --eval-function-path: evaluation's own rollout function, else the training one.
        self.eval_fn = self.rollout_fn if cfg.eval_function_path is None else \
            load_rollout_function(cfg.eval_function_path, flag="--eval-function-path")
        self.per_sample = _per_sample(cfg, engines, self.tokenizer, read_config_summary(
            plan.hf_dir).max_position_embeddings)
        self.rewarder = Rewarder.build(rm_type=cfg.rm_type, custom_rm_path=cfg.custom_rm_path,
                                       group_rm=cfg.group_rm, reward_timeout=cfg.reward_timeout,
                                       args=cfg, reward_key=cfg.reward_key, rm_url=cfg.reward_url)
        self.teacher = Teacher.build(cfg)  # --opd-type sglang: a teacher server, else None
        self.keep = load_filter(cfg.dynamic_sampling_filter_path, args=cfg)
        self.log_fn = (None if cfg.custom_rollout_log_function_path is None else load_callable(
            cfg.custom_rollout_log_function_path, flag="--custom-rollout-log-function-path"))
        self.normalization = cfg.reward_normalization()
        self.stop = default_stop_token_ids(self.tokenizer, plan.hf_dir,
                                           chat_template=cfg.apply_chat_template)
        if self.is_rank0:
            log.info("generation stops at token ids %s %s%s", list(self.stop),
                     self.tokenizer.convert_ids_to_tokens(list(self.stop)),
                     f" and strings {list(cfg.rollout_stop)}" if cfg.rollout_stop else "")

    # -- training batches ---------------------------------------------------------------------
    @property
    def queue(self) -> bool:
        """Whether engines claim a round's prompts from the work queue (``EngineGroup``):
        always, except under ``--partial-rollout``, where each engine's buffer resumes its
        own unfinished groups once per round, so each engine keeps its contiguous block."""
        return self.per_sample is None or self.per_sample.buffer is None

    @property
    def sharded(self) -> bool:
        """Whether each engine leader keeps its output as its part (:func:`keeps_parts`)."""
        return keeps_parts(self.cfg)

    def produce_part(self, rid: int) -> Produced:
        """Collective over the engines, no sample gathered: each leader keeps its prompt
        groups of every round as its part (``output_part``: validated columns). With a
        dynamic-sampling filter each leader judges its own groups and the leaders exchange
        only verdicts (``GroupVerdict``: a group's place in the rollout, kept or not, its id and
        rewards): the rounds, the cut to the batch's groups in round and prompt order,
        ``--dynamic-sampling-fill-filtered`` and every count are decided from them
        (``cut_rounds``), as rank 0 decides them over the whole batch (``produce``), and each
        leader keeps the groups it holds of the cut, a chunk per run of places. Over-sampling
        is the same cut, every group kept. Raises this rank's own failure (the caller reports
        it to every rank); the statistics on rank 0."""
        cfg = self.cfg
        before = self._buffer_totals()
        mine: dict[tuple[int, int], Any] = {}  # (round, prompt) -> this leader's group output
        verdicts, rounds, error = self._judged_rounds(rid, mine)
        partial = _partial_stats(before, self._buffer_totals())
        if error is not None:
            raise error
        cut = cut_rounds(verdicts, cfg.rollout_batch_size,
                         fill=cfg.dynamic_sampling_fill_filtered)
        places = {key: place for place, key in enumerate(cut.keys)}
        held = [(places[key], out) for key, out in mine.items() if key in places]
        chunks = [(first, [held[i][1] for i in run])
                  for first, run in place_runs([p for p, _ in held])]
        try:
            part, meta = claimed_part(chunks, normalization=self.normalization)
        except RolloutValidationError as exc:
            raise chunk_output_error(exc, chunks, rid, output_source(cfg)) from None
        stats = None
        if self.is_rank0:
            stats = GenerationStats(
                rounds=rounds, prompts_generated=len(verdicts),
                prompts_kept=len(cut.keys), prompts_filtered=cut.filtered,
                prompts_filled=cut.filled, partial=partial,
                filtered_reward_mean=_mean(cut.filtered_rewards))
        notes = (sample_annotations([o for _, outs in chunks for o in outs])
                 if cfg.save_rollout_data is not None else ())
        return Produced(part=part, meta=meta, stats=stats, annotations=notes)

    def _judged_rounds(self, rid: int, mine: dict[tuple[int, int], Any]
                       ) -> tuple[list[GroupVerdict], int, BaseException | None]:
        """Rounds until the verdicts keep ``--rollout-batch-size`` groups (one round without
        a filter), each leader's outputs in ``mine``: ``(every leader's verdicts, rounds,
        this rank's failure)``. A failure ends the rounds on every rank together."""
        cfg = self.cfg
        need = cfg.rollout_batch_size
        per_round = cfg.over_sampling_batch_size or need
        verdicts: list[GroupVerdict] = []  # every leader's, every round
        rounds = next_group = 0
        while rounds < cfg.dynamic_sampling_max_rounds:
            prompts, shares, target = self._round_prompts(
                per_round, need - sum(v.kept for v in verdicts))
            sampling = self.sampling(cfg.max_response_len,
                                     rollout_sampling_seed(self.seed, rid, rounds))
            runner = self._share_runner(rid, prompts, sampling, first_group_id=next_group,
                                        target_groups=target)
            mine_now: list[GroupVerdict] = []
            error: BaseException | None = None
            try:
                with native_torch():  # generation names no CUDA device
                    chunks = self.engines.run_local(runner, len(prompts), queue=self.queue,
                                                    shares=shares)
                mine_now = self._judge_chunks(rid, rounds, chunks or (), mine)
            except Exception as exc:  # noqa: BLE001 - every rank leaves the rounds below
                error = exc
            seen = self._verdicts_of_all((error is not None, mine_now))
            rounds += 1
            verdicts += [v for _, vs in seen for v in vs]
            if any(failed for failed, _ in seen):
                return verdicts, rounds, error  # the exchange tells every rank
            next_group = max([next_group, *(v.next_group for v in verdicts)])
            kept = sum(v.kept for v in verdicts)
            if self.keep is None or kept >= need:
                break
            if self.is_rank0 and rounds < cfg.dynamic_sampling_max_rounds:
                log.info("dynamic sampling: rollout %d has %d of the %d prompt groups it "
                         "needs after round %d; generating another round", rid, kept, need,
                         rounds - 1)
        return verdicts, rounds, None

    def _verdicts_of_all(self, mine: Any) -> list[Any]:
        """Collective over the engines' world: every rank's round verdicts, in rank order,
        counted as batch bytes (``engines.byte_counts``: what a filter at the holders costs
        instead of the samples)."""
        out = _gathered(mine)
        size = pickled_size(mine)
        self.engines.bytes.add_sent("batch", size * (len(out) - 1))
        self.engines.bytes.add_received("batch", sum(pickled_size(o) for o in out) - size)
        return out

    def _judge_chunks(self, rid: int, round_: int, chunks: Sequence[tuple[int, list]],
                      mine: dict[tuple[int, int], Any]) -> list[GroupVerdict]:
        """This leader's verdict on each prompt group of its chunks (the filter, or keep
        all), its outputs kept in ``mine`` by ``(round, prompt)``."""
        out = []
        for start, output in chunks:
            for i, prompt_output in enumerate(output):
                key = (round_, start + i)
                mine[key] = prompt_output
                kept = self._keeps(prompt_output, f"rollout {rid}, round {round_}, "
                                                  f"prompt {start + i}")
                out.append(GroupVerdict(
                    key=key, kept=kept, next_group=_next_group_id([prompt_output], 0),
                    rewards=() if kept else _first_rewards([prompt_output])))
        return out

    def _keeps(self, prompt_output: Any, where: str) -> bool:
        """The dynamic-sampling filter's verdict on one prompt group (kept without one)."""
        return self.keep is None or bool(call_plugin(
            self.keep, prompt_samples(prompt_output),
            what=f"filter {self.cfg.dynamic_sampling_filter_path}",
            flag="--dynamic-sampling-filter-path", where=where))

    def produce(self, rid: int) -> tuple[RolloutBatch | None, GenerationStats] | None:
        """Collective over the world: this rollout's batch and statistics on rank 0, None on
        the other ranks. The batch is None when the filter removed every prompt group (the
        loop skips that rollout)."""
        cfg = self.cfg
        started = time.perf_counter()
        need = cfg.rollout_batch_size
        per_round = cfg.over_sampling_batch_size or need
        kept: list[Any] = []
        dropped: list[Any] = []
        generated = filtered = rounds = next_group = 0
        before = self._buffer_totals()
        while rounds < cfg.dynamic_sampling_max_rounds:
            # Partial rollouts: the buffered groups come back first, within the round's size.
            prompts, shares, target = self._round_prompts(per_round, need - len(kept))
            sampling = self.sampling(cfg.max_response_len,
                                     rollout_sampling_seed(self.seed, rid, rounds))
            output, error = self._generate(rid, prompts, sampling, first_group_id=next_group,
                                           target_groups=target, shares=shares)
            rounds += 1
            if output is not None:  # rank 0: judge the round
                next_group = _next_group_id(output, next_group)
                generated += len(output)
                try:
                    filtered += self._judge(output, kept, dropped, need,
                                            f"rollout {rid}, round {rounds - 1}")
                except VimeError as exc:  # a failed filter: every rank leaves via rank0_result
                    error = error or exc
            if self.keep is None:
                if error is not None:
                    raise error
                break
            done, next_group = rank0_result(
                f"rollout {rid}, generation round {rounds - 1}",
                lambda: (len(kept) >= need, next_group), pending=error)
            if done:
                break
            if self.is_rank0 and rounds < cfg.dynamic_sampling_max_rounds:  # a long rollout
                log.info("dynamic sampling: rollout %d has %d of the %d prompt groups it "
                         "needs after round %d (%.1f s); generating another round", rid,
                         len(kept), need, rounds - 1, time.perf_counter() - started)
        partial = _partial_stats(before, self._buffer_totals())
        if not self.is_rank0:
            return None
        filled = dropped[:need - len(kept)] if cfg.dynamic_sampling_fill_filtered else []
        stats = GenerationStats(rounds=rounds, prompts_generated=generated,
                                prompts_kept=len(kept) + len(filled), prompts_filtered=filtered,
                                prompts_filled=len(filled),
                                filtered_reward_mean=_mean(_first_rewards(dropped)),
                                partial=partial)
        kept += filled
        if not kept:
            return None, stats
        if self.log_fn is not None:  # slime's custom rollout log; vime's own log still runs
            call_plugin(self.log_fn, rid, cfg, [s for p in kept for s in prompt_samples(p)],
                        stats.as_record(), time.perf_counter() - started,
                        what=f"rollout log {cfg.custom_rollout_log_function_path}",
                        flag="--custom-rollout-log-function-path", where=f"rollout {rid}")
        batch = batch_of(kept, self.normalization, rid, output_source(cfg))
        return batch, attrs.evolve(stats, annotations=sample_annotations(kept))

    def _judge(self, output: list[Any], kept: list[Any], dropped_out: list[Any], need: int,
               where: str) -> int:
        """Rank 0: append the prompt groups the filter keeps to ``kept`` (up to ``need``) and
        the ones it drops to ``dropped_out``; returns how many it dropped. The surplus of the
        last round is discarded unjudged."""
        dropped = 0
        for p, prompt_output in enumerate(output):
            if len(kept) == need:
                break
            if self._keeps(prompt_output, f"{where}, prompt {p}"):
                kept.append(prompt_output)
            else:
                dropped += 1
                dropped_out.append(prompt_output)
        return dropped

    def sampling(self, max_new_tokens: int, seed: int, *, for_eval: bool = False
                  ) -> SamplingParams:
        """The run's sampling settings; for evaluation each ``--eval-*`` one that is set
        replaces its ``--rollout-*`` one."""
        cfg = self.cfg

        def pick(name: str):
            rollout = getattr(cfg, f"rollout_{name}")
            if not for_eval:
                return rollout
            override = getattr(cfg, f"eval_{name}")
            return rollout if override is None else override

        extra = pick("stop_token_ids") or ()
        return SamplingParams(max_new_tokens=max_new_tokens, temperature=pick("temperature"),
                              top_p=pick("top_p"), top_k=pick("top_k"),
                              stop_token_ids=tuple(dict.fromkeys((*self.stop, *extra))),
                              stop=pick("stop") or (), max_context_len=pick("max_context_len"),
                              seed=seed, top_log_probs=0 if for_eval else cfg.opd_engine_top_k)

    def partial_state(self) -> dict[str, Any]:
        """For the checkpoint's data state: ``{"partial_buffer": ...}`` under
        ``--partial-rollout`` (the groups waiting for the next rollout: every engine's, in
        engine order, with ``engine_groups`` counting each one's; collective over the engines'
        world then) and ``{"carried": [...]}`` while the prompt source still holds prompts
        put back (see :meth:`restore_partial_state`); ``{}`` when neither. Call it on every
        rank: rank 0's holds every engine's groups (gathered there only)."""
        out: dict[str, Any] = {}
        if self._engine_buffers:  # collective: every engine's buffer, in engine order
            out["partial_buffer"] = _merged_buffers(self._from_engines(PartialBuffer.to_state,
                                                                       rank0=True))
        elif self.per_sample is not None and self.per_sample.buffer is not None:
            out["partial_buffer"] = self.per_sample.buffer.to_state()
        if self.source.carried:
            out["carried"] = [attrs.asdict(e) for e in self.source.carried]
        return out

    def restore_partial_state(self, state: dict[str, Any]) -> None:
        """Put a checkpoint's waiting groups back (see :meth:`partial_state`). Under
        ``--partial-rollout`` the buffer continues them; without it their prompts go back to
        the prompt source, first in line (``PromptSource.carried``), and are generated from
        scratch as fresh prompts of the next rollout: they were drawn but never trained, so
        nothing is lost and nothing trains twice (their unfinished samples were never
        trained either)."""
        carried = tuple(TaskExample(**e) for e in state.get("carried") or ())
        saved = state.get("partial_buffer")
        if saved is None:
            self.source.carried = carried
            return
        buffer = PartialBuffer.from_state(saved)
        if self.per_sample is not None and self.per_sample.buffer is not None:
            self.per_sample.buffer = self._own_share(saved, buffer)
        else:
            carried += tuple(g.example for g in buffer.groups)
            if buffer.groups and self.is_rank0:
                log.info("the checkpoint's %d prompt groups left unfinished by "
                         "--partial-rollout are generated again from scratch in the next "
                         "rollout (this run has no --partial-rollout)", len(buffer.groups))
        self.source.carried = carried

    def _own_share(self, saved: dict[str, Any], buffer: PartialBuffer) -> PartialBuffer:
        """This engine's part of a checkpoint's buffered groups: its own when the engine
        count is the one saved, else dealt round robin (``deal_groups``); the run's counters
        continue on engine 0 (their sums are what the log reports)."""
        engines, mine = self.engines.layout.num_engines, self.engines.engine_index or 0
        counts = saved.get("engine_groups") or [len(buffer.groups)]
        held = [buffer.groups[a:b] for a, b in zip(np.cumsum([0, *counts[:-1]]).tolist(),
                                                  np.cumsum(counts).tolist())]
        groups = deal_groups(held, engines)[mine]
        if mine:
            return PartialBuffer(groups=groups)
        return attrs.evolve(buffer, groups=groups)

    def run_per_sample_on(self, front: Any,
                          runner: Callable[[Coroutine[Any, Any, Any]], futures.Future], *,
                          continue_after_cut: bool = False) -> None:
        """Per-sample generation (``--custom-generate-function-path``) through ``front``, its
        rounds run by ``runner`` (``PerSample``): the fully-async pool's groups, probes and
        evaluations then share one engine front and one event loop; ``continue_after_cut``:
        executions a weight sync cuts continue at once (``--partial-rollout`` there)."""
        if self.per_sample is None:
            return
        old = self.per_sample.runtime  # a fresh runtime: none of the old one's task sets
        runtime = GenerateRuntime(engine=front, tokenizer=old.tokenizer, encode=old.encode,
                                  mask_offpolicy=old.mask_offpolicy,
                                  context_len=old.context_len, warned=old.warned)
        self.per_sample = attrs.evolve(self.per_sample, runtime=runtime, runner=runner,
                                       continue_after_cut=continue_after_cut)

    @property
    def _eval_per_sample(self) -> PerSample | None:
        """The run's per-sample setup without the partial-rollout buffer: evaluation, probes
        and the pool's groups never buffer."""
        return None if self.per_sample is None else attrs.evolve(self.per_sample, buffer=None)

    @property
    def buffered_groups(self) -> int:
        """Unfinished prompt groups waiting in this engine's buffer (``--partial-rollout``)."""
        if self.per_sample is None or self.per_sample.buffer is None:
            return 0
        return len(self.per_sample.buffer)

    @property
    def _engine_buffers(self) -> bool:
        """``--partial-rollout`` over several engines: each keeps a buffer of its own."""
        return (self.cfg.partial_rollout and self.per_sample is not None
                and self.engines.layout.num_engines > 1)

    def _own_buffer(self) -> PartialBuffer | None:
        if self.engines.engine_index is None or self.per_sample is None:
            return None
        return self.per_sample.buffer

    def _from_engines(self, value: Callable[[PartialBuffer], Any], *,
                      rank0: bool = False) -> list[Any]:
        """Collective over the engines' world: ``value(buffer)`` of every engine's buffer, in
        engine order (engines of one rank each, the launch checks say), on every rank (or,
        ``rank0``, on rank 0 only: ``[]`` elsewhere)."""
        buffer = self._own_buffer()
        mine = None if buffer is None else (self.engines.engine_index, value(buffer))
        out = _gathered(mine, rank0=rank0)
        return [v for _, v in sorted((o for o in out if o is not None), key=lambda o: o[0])]

    def _buffer_totals(self) -> tuple[int, int, int, int] | None:
        """``(groups, restarted samples, tokens, off-policy tokens)`` over every engine's
        buffer (collective with several engines); None without ``--partial-rollout``."""
        if self.per_sample is None or self.per_sample.buffer is None:
            return None
        counts = (self._from_engines(_buffer_counts) if self._engine_buffers
                  else [_buffer_counts(self.per_sample.buffer)])
        groups, restarted, tokens, offpolicy = (sum(c[i] for c in counts) for i in range(4))
        return groups, restarted, tokens, offpolicy

    def _round_prompts(self, per_round: int, need: int
                       ) -> tuple[tuple[TaskExample, ...], tuple[PartialShare, ...] | None, int]:
        """A round's new prompts, each engine's share of them (``--partial-rollout`` over
        several engines, ``partial_shares``: from every engine's buffered count, collective;
        else None) and the prompt groups this rank's engine completes (``need``, or its share's
        target)."""
        if not self._engine_buffers:
            return self.source.take(max(per_round - self.buffered_groups, 0)), None, need
        counts = [c[0] for c in self._from_engines(_buffer_counts)]
        shares = partial_shares(counts, per_round, need)
        engine = self.engines.engine_index
        target = need if engine is None else shares[engine].target
        return self.source.take(shares[-1].new.stop), shares, target

    def context(self, rid: int, prompts: tuple[TaskExample, ...], sampling: SamplingParams, *,
                first_group_id: int, n: int | None = None, target_groups: int | None = None,
                engine: Any = None) -> RolloutContext:
        """The rollout function's context for one generation round (``engine``: this rank's
        engine unless given, e.g. the fully-async pool's shared one; ``target_groups=None``
        is an evaluation round). Built only where an engine generates: a rank without one
        raises :class:`EngineGroupError`."""
        cfg = self.cfg
        engine = engine or self.engines.engine
        if engine is None:
            raise field_error(EngineGroupError, "engine", None,
                              f"rollout {rid} asked a rank without a rollout engine to generate",
                              "run rollout functions where EngineGroup.run_local / run_shares "
                              "call them (the ranks with an engine)")
        return RolloutContext(
            rollout_id=rid, engine=engine, tokenizer=self.tokenizer,
            prompts=prompts, n_samples_per_prompt=n or cfg.n_samples_per_prompt,
            sampling=sampling, rewarder=self.rewarder,
            apply_chat_template=cfg.apply_chat_template, first_group_id=first_group_id,
            task=self.task, num_turns=cfg.rollout_num_turns, turn_reward=cfg.rollout_turn_reward,
            per_sample=self.per_sample if target_groups is not None else self._eval_per_sample,
            target_groups=target_groups, loss_mask_type=cfg.loss_mask_type)

    def _generate(self, rid: int, prompts: tuple[TaskExample, ...], sampling: SamplingParams, *,
                  first_group_id: int, n: int | None = None, target_groups: int | None = None,
                  shares: Sequence[PartialShare] | None = None
                  ) -> tuple[list[Any] | None, Exception | None]:
        """Collective: every engine runs the rollout function on its share of ``prompts``;
        ``(merged output on rank 0 else None, this rank's error or None)``. The error is
        returned, not raised, so the caller still meets the other ranks in the next
        broadcast (``rank0_result``) and all leave together."""
        runner = self._share_runner(rid, prompts, sampling, first_group_id=first_group_id,
                                    n=n, target_groups=target_groups)
        try:
            with native_torch():  # generation names no CUDA device: skip the CPU device mode
                output = self.engines.run_shares(runner, len(prompts),
                                                 queue=self.queue or target_groups is None,
                                                 shares=shares)
        except Exception as exc:  # noqa: BLE001 - handed to rank0_result by the caller
            return None, exc
        return output, None

    def _share_runner(self, rid: int, prompts: tuple[TaskExample, ...],
                      sampling: SamplingParams, *, first_group_id: int, n: int | None = None,
                      target_groups: int | None = None) -> Callable[[range], list]:
        """``share -> output``: the rollout function on one engine's share of the round's
        ``prompts`` (the context is built there: only a rank with an engine runs a share)."""
        evaluation = target_groups is None
        own_eval = evaluation and self.cfg.eval_function_path is not None
        fn = self.eval_fn if own_eval else self.rollout_fn
        flag = "--eval-function-path" if own_eval else "--rollout-function-path"
        path = self.cfg.eval_function_path if own_eval else \
            self.cfg.effective_rollout_function_path

        def run(share: range) -> list:
            ctx = self.context(rid, prompts, sampling, first_group_id=first_group_id, n=n,
                               target_groups=target_groups)
            output = call_plugin(lambda c: list(fn(c)), share_context(ctx, share),
                                 what=f"rollout function {path}", flag=flag,
                                 where=f"rollout {rid}")
            return output if evaluation else self.with_teacher(output)

        return run

    def with_teacher(self, output: list) -> list:
        """``output`` (a training round's rollout output) with the teacher server's log-probs
        on every sample (``--opd-type sglang``, :mod:`vime_shell.rollout.teacher`); asked on
        the engine rank that generated it, before the output travels."""
        if self.teacher is not None:
            self.teacher.score(output)
        return output

    # -- evaluation ---------------------------------------------------------------------------
    def evaluate(self, rid: int) -> dict[str, float]:
        """Collective: ``eval/<name>/reward_mean`` and ``pass@k`` of every eval set on the
        current weights, on every rank."""
        cfg = self.cfg
        n = cfg.n_samples_per_eval_prompt
        max_new = cfg.eval_max_response_len or cfg.max_response_len
        outputs: dict[str, list[Any]] = {}  # rank 0's (the other ranks' outputs are None)
        for name, rows in self.eval_sets:
            sampling = self.sampling(max_new, seed=rollout_sampling_seed(0, _EVAL_ROLLOUT_ID),
                                     for_eval=True)
            output, error = self._generate(rid, rows, sampling, first_group_id=0, n=n)
            if output is not None:
                outputs[name] = output
            # Every rank learns of a failed engine before the next set's collective generation.
            rank0_result(f"evaluation of {name} at rollout {rid}", lambda: None, pending=error)
        return rank0_result(f"evaluation at rollout {rid}",
                            lambda: {k: v for name, output in outputs.items()
                                     for k, v in eval_metrics(name, output, n).items()})


def _merged_buffers(states: list[dict[str, Any]]) -> dict[str, Any]:
    """Every engine's ``PartialBuffer.to_state`` as one, its groups in engine order and
    ``engine_groups`` counting each engine's (what ``deal_groups`` splits on resume)."""
    return {"groups": [g for st in states for g in st["groups"]],
            **{k: sum(int(st[k]) for st in states)
               for k in ("restarted", "tokens", "offpolicy_tokens")},
            "engine_groups": [len(st["groups"]) for st in states]}


def _gathered(value: Any, *, rank0: bool = False) -> list[Any]:
    """Collective over the engines' world (the default group): every rank's ``value`` in
    rank order, on every rank (or, ``rank0``, on rank 0 only: ``[]`` elsewhere)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    if not rank0:
        dist.all_gather_object(out, value)
        return out
    dist.gather_object(value, out if dist.get_rank() == 0 else None, dst=0)
    return out if dist.get_rank() == 0 else []


def _buffer_counts(buffer: PartialBuffer) -> tuple[int, int, int, int]:
    return len(buffer), buffer.restarted, buffer.tokens, buffer.offpolicy_tokens


def _partial_stats(before: tuple[int, int, int, int] | None,
                   after: tuple[int, int, int, int] | None) -> PartialStats | None:
    """One rollout's ``PartialStats`` from the buffers' totals before and after it."""
    if before is None or after is None:
        return None
    return PartialStats(resumed_groups=before[0], buffered_groups=after[0],
                        restarted_samples=after[1], tokens=after[2] - before[2],
                        offpolicy_tokens=after[3] - before[3])


def keeps_parts(cfg: TrainConfig) -> bool:
    """Whether each engine leader keeps its output as its part (no sample reaches trainer
    rank 0). The dynamic-sampling filter and over-sampling judge each prompt group on the
    leader that holds it (``RolloutProducer.produce_part``: only verdicts travel),
    ``--use-rs`` judges each sample on the DP rank that trains it and ``--save-rollout-data``
    writes each part where it is (``storage.dump``: a dump of parts). Rank 0 needs the samples
    themselves only for slime's ``--custom-rollout-log-function-path``, whose hook receives
    them."""
    return cfg.custom_rollout_log_function_path is None


def eval_metrics(name: str, output: list[Any], n: int) -> dict[str, float]:
    """``eval/<name>/reward_mean`` (over rollout groups) and ``pass@1`` / ``pass@n`` of one
    eval set's rollout output. Example: 2 prompts x 4 samples, 1 and 0 solved -> pass@1 0.125,
    pass@4 0.5."""
    flat = flatten_rollout_output(output)
    rewards = np.array([s.reward for s in flat.samples], dtype=np.float64)
    groups = np.unique(flat.group_dense, return_index=True)[1]
    out = {f"eval/{name}/reward_mean": float(rewards[groups].mean())}
    solved = [int(sum(s.reward > 0 for s in prompt_samples(p))) for p in output]
    for k in sorted({1, n}):
        out[f"eval/{name}/pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for c in solved]))
    return out


def empty_rollout_message(rid: int, stats: GenerationStats) -> str:
    """The log line of a rollout whose every prompt group the filter removed (skipped)."""
    return (f"rollout {rid}: all {stats.prompts_generated} prompts of {stats.rounds} "
            f"generation rounds were filtered out by --dynamic-sampling-filter-path (their "
            f"mean reward {_shown(stats.filtered_reward_mean)}): skipped, no optimizer step, the "
            "LR does not move. If this repeats, raise --dynamic-sampling-max-rounds or "
            "--over-sampling-batch-size, pass --dynamic-sampling-fill-filtered, or check the "
            "reward (groups scoring alike cannot be told apart)")


def _shown(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def output_source(cfg: TrainConfig) -> str:
    """The plugin that writes a rollout's samples, as the user named it: ``--custom-generate-
    function-path my.mod:fn`` under per-sample generation, else ``--rollout-function-path``."""
    if cfg.custom_agent_function_path is not None:
        return f"--custom-agent-function-path {cfg.custom_agent_function_path}"
    if cfg.effective_rollout_function_path == PER_SAMPLE_ROLLOUT_FUNCTION:
        return ("--custom-generate-function-path "
                f"{cfg.custom_generate_function_path or DEFAULT_GENERATE_FUNCTION}")
    return f"--rollout-function-path {cfg.rollout_function_path}"


def batch_of(output: list[Any], normalization: Any, rid: int, source: str) -> RolloutBatch:
    """``RolloutBatch.from_samples``; a malformed sample's error names the plugin that wrote
    it and its prompt (:func:`output_error`)."""
    try:
        return RolloutBatch.from_samples(output, normalization=normalization)
    except RolloutValidationError as exc:
        raise output_error(exc, output, rid, source) from None


_PATH = re.compile(r"output((?:\[\d+\])+): (.*)")


def output_error(exc: RolloutValidationError, output: Any, rid: int, source: str
                 ) -> RolloutValidationError:
    """The core's error about the rollout output (``output[0][1][0]: len(loss_mask)=5 but
    ...``) naming the plugin that returned it (``source``) and the sample's prompt.
    Example: ``rollout 3, prompt '47>' (output[0][1][0]): the sample --custom-generate-
    function-path my.mod:fn returned: len(loss_mask)=5 but response_length=2. Fix: ...``."""
    found = _PATH.fullmatch(str(exc))
    if found is None:
        return RolloutValidationError(f"rollout {rid}: the samples {source} returned: {exc}")
    node = output
    for k in map(int, re.findall(r"\d+", found.group(1))):
        node = node[k] if isinstance(node, (list, tuple)) and k < len(node) else None
    prompt = getattr(node, "metadata", None)
    prompt = prompt.get("prompt") if isinstance(prompt, dict) else None
    where = (f"prompt {one_line(repr(prompt), 40)} (output{found.group(1)})"
             if prompt is not None else f"output{found.group(1)}")
    return RolloutValidationError(f"rollout {rid}, {where}: the sample {source} returned: "
                                  f"{found.group(2)}")


def chunk_output_error(exc: RolloutValidationError, chunks: Sequence[tuple[int, Any]] | None,
                       rid: int, source: str) -> RolloutValidationError:
    """:func:`output_error` for a holder's work-queue chunks (``claimed_part``): the chunk at
    fault is found again by converting each alone."""
    for _, out in chunks or ():
        try:
            RolloutBatch.from_samples(out)
        except RolloutValidationError as own:
            return output_error(own, out, rid, source)
    return output_error(exc, None, rid, source)


def sample_annotations(output: list[Any]) -> tuple[dict, ...]:
    """Label and metadata of every sample of ``output``, in the batch's order (the flattened
    output's): what ``vime inspect`` prints beside the decoded tokens."""
    hidden = ("prompt", "response", "label")
    return tuple({"label": (s.metadata or {}).get("label"),
                  "metadata": {k: v for k, v in (s.metadata or {}).items() if k not in hidden}}
                 for s in flatten_rollout_output(output).samples)


def _mean(rewards: Sequence[float]) -> float | None:
    """The mean of the filtered rollout groups' rewards (None when there are none: a mean
    over nothing, never NaN), the same whether rank 0 or the holders judged them."""
    return float(np.mean(rewards)) if rewards else None


def _first_rewards(outputs: list[Any]) -> tuple[float, ...]:
    """The first reward of every rollout group of ``outputs``, in order."""
    firsts: dict[int, dict[Any, Any]] = {}  # prompt output -> group id -> its first reward
    for prompt_output in outputs:
        for s in prompt_samples(prompt_output):
            firsts.setdefault(id(prompt_output), {}).setdefault(s.group_id, s.reward)
    return tuple(float(r) for groups in firsts.values() for r in groups.values()
                 if isinstance(r, (int, float)))




def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of a prompt with ``c`` solved among ``n`` samples:
    ``1 - C(n-c, k) / C(n, k)``. Example: ``pass_at_k(4, 1, 1) == 0.25``, ``(4, 1, 4) == 1``."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def prompt_samples(prompt_output: Any) -> list[Any]:
    """All samples of one prompt's output, whatever its nesting (lists/tuples of Samples)."""
    if isinstance(prompt_output, (list, tuple)):
        return list(chain.from_iterable(prompt_samples(x) for x in prompt_output))
    return [prompt_output]


def _next_group_id(output: Sequence[Any], current: int) -> int:
    """One past the largest int group id the round used (fallback ids are resolved later)."""
    ids = [s.group_id for p in output for s in prompt_samples(p) if type(s.group_id) is int]
    return max([current, *(i + 1 for i in ids)])
