"""The sharded rollout path at 8 / 64 / 512 DP ranks, per rank and for rank 0, against the funnel
it replaced (``docs/scaling.md``); called by ``benchmarks/scale.py``.

**Simulated in one process** (labelled so in the output): ``dp`` holders (one engine leader
per rank, ``--rollout-num-gpus-per-engine 1``), each holding the work-queue chunks of the batch
the engines would claim in turn (``vime_pure.data.work_queue``: ``queue_chunk_size(P, dp)``
prompts per chunk, about 4 per holder; holder ``h`` holds chunks ``h, h + dp, ...``) joined as
its part (``vime_pure.data.held_parts.join_chunks``), then per phase:

- **gather** (rank 0): every holder's chunk metadata (``part_meta`` per chunk) pickled,
  unpickled on rank 0 and merged in prompt order (``merge_meta``): bytes rank 0 receives, its
  CPU seconds;
- **schedule** (rank 0): ``plan_shares`` (advantages + ``Schedule``); the plan's bytes, which
  every rank receives (broadcast);
- **all-to-all**: the pieces of DP rank 0 (and of the rank with the largest share) cut by every
  holder, packed, unpacked and assembled: bytes received, CPU seconds of the receiving side
  (the cutting is the holders', timed for one holder: its pieces for every rank);
- **rank_batch**: ``share_batch`` of that rank's share;
- **memory**: ``tracemalloc`` peak of rank 0's gather + schedule and of a rank's unpacking
  and assembling, in a second, traced pass (numpy allocations are traced; tracing slows
  them, so CPU seconds come from the untraced pass), and the bytes of the rank's records.

The funnel (**before**): rank 0 unpickled every ``Sample``, converted and pickled the batch,
every rank unpickled the whole batch; its per-token CPU costs are measured on 512 samples of the
workload (``funnel_rates``) and scaled, bytes are exact (13.7 B/token pickled samples in,
``columns_bytes`` out to every rank). ``rank_batch`` before is the base commit's own benchmark
(``benchmarks/results/scale_before*.json``).

``--token-scale k`` (lengths divided by ``k``, to fit the machine) scales measured per-token
work; the ``*_unscaled`` byte counts are computed exactly for the real lengths (the packing
format is fixed: 24 B per sample, 4 B per token, 5 B per response token, 32 B per piece).
"""

import pickle
import resource
import time
import tracemalloc

import attrs
import numpy as np

from benchmarks.scale_batch import PROMPT_TOKENS, columnar_batch, response_lengths
from vime_pure import RolloutBatch, Sample
from vime_pure.data.microbatch import share_batch
from vime_pure.data.held_parts import join_chunks
from vime_pure.data.shares import (assemble_share, merge_meta, part_meta, plan_shares,
                                   share_piece)
from vime_pure.data.work_queue import queue_chunk_size
from vime_shell.sources.exchange import pack_piece, unpack_piece


def _cpu(fn):
    c0 = time.process_time()
    out = fn()
    return out, time.process_time() - c0


def funnel_rates(lengths: np.ndarray, count: int = 512, seed: int = 0) -> dict[str, float]:
    """Per-token CPU seconds of the funnel's rank-0 work (unpickle the gathered samples,
    convert them, pickle the batch) and of every rank's unpickling of the batch."""
    rng = np.random.default_rng(seed)
    samples, tokens = [], 0
    for n in lengths[:count]:
        resp = int(max(1, n - PROMPT_TOKENS))
        samples.append([Sample(tokens=rng.integers(0, 150_000, int(n)).tolist(),
                               response_length=resp, loss_mask=[1] * resp,
                               rollout_log_probs=(-rng.random(resp)).tolist(), reward=1.0,
                               group_id=len(samples))])
        tokens += int(n)
    blob = pickle.dumps(samples, protocol=pickle.HIGHEST_PROTOCOL)
    out, unpickle = _cpu(lambda: pickle.loads(blob))
    batch, convert = _cpu(lambda: RolloutBatch.from_samples(out))
    packed, dump = _cpu(lambda: pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
    _, load = _cpu(lambda: pickle.loads(packed))
    return {"unpickle_samples": unpickle / tokens, "convert": convert / tokens,
            "pickle_batch": dump / tokens, "unpickle_batch": load / tokens,
            "pickled_samples_bytes": len(blob) / tokens}


@attrs.frozen
class Holder:
    """One simulated holder: its part (its chunks joined) and each chunk's metadata."""

    part: RolloutBatch
    metas: tuple
    starts: np.ndarray


def holders_of(lengths: np.ndarray, group_ids: np.ndarray, prompt_ids: np.ndarray,
               holders: int, columnar_batch) -> list[Holder]:
    """``holders`` holders of the product's work-queue chunks (``queue_chunk_size`` prompts
    each), dealt in turn (module doc); a chunk's first prompt is its global prompt index."""
    firsts = np.flatnonzero(np.r_[True, prompt_ids[1:] != prompt_ids[:-1]])  # prompt starts
    chunk = queue_chunk_size(len(firsts), holders)
    bounds = np.r_[firsts[::chunk], len(lengths)]
    out = []
    for h in range(holders):
        ks = list(range(h, len(bounds) - 1, holders))
        chunks = [_columns(lengths, group_ids, prompt_ids, bounds[k], bounds[k + 1],
                           columnar_batch) for k in ks]
        metas = tuple(part_meta(c, start=k * chunk) for c, k in zip(chunks, ks))
        if ks:
            out.append(Holder(part=join_chunks(chunks, metas), metas=metas,
                              starts=np.array([k * chunk for k in ks], dtype=np.int64)))
    return out


def _columns(lengths, group_ids, prompt_ids, a: int, b: int, columnar_batch) -> RolloutBatch:
    """Samples ``[a, b)`` as a part whose ids keep their global values (the engines' ids come
    from the global prompt index)."""
    part = columnar_batch(lengths[a:b], group_ids[a:b], prompt_ids[a:b])
    return attrs.evolve(part, group_id_values=tuple(np.unique(group_ids[a:b]).tolist()),
                        prompt_group_values=tuple(np.unique(prompt_ids[a:b]).tolist()))


def packed_bytes(n: int, tokens: int, response: int, pieces: int) -> int:
    """Bytes of ``pieces`` packed pieces holding ``n`` samples (``exchange.pack_piece``)."""
    return 24 * n + 4 * tokens + 5 * response + 32 * pieces


def _merged(blobs: list[bytes]):
    return merge_meta([m for b in blobs for m in pickle.loads(b)[1]])


def share_row(holders: list[Holder], layout, policy, unscaled: np.ndarray,
              response: callable) -> dict:
    """One (samples, dp) point of the sharded path (module docstring)."""
    dp = layout.dp
    parts = [h.part for h in holders]
    blobs = [pickle.dumps(("ok", h.metas), protocol=5) for h in holders]
    # CPU untraced, then the same phases again under tracemalloc for rank 0's peak
    (merged, c_gather) = _cpu(lambda: _merged(blobs))
    (meta, plan), c_plan = _cpu(lambda: plan_shares(merged, layout, policy))
    del merged, meta, plan
    tracemalloc.start()
    merged = _merged(blobs)
    meta, plan = plan_shares(merged, layout, policy)
    plan_blob = pickle.dumps(plan, protocol=5)
    _, rank0_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    sched = plan.schedule
    sizes = [len(sched.rank_sample_ids(r)) for r in range(dp)]
    ranks = sorted({0, int(np.argmax(sizes))})
    out = {"dp": dp, "holders": len(parts), "chunks": len(plan.part_starts),
           "simulated": f"one process, {len(parts)} holders, {len(plan.part_starts)} chunks",
           "rank0_gather_bytes_received": sum(len(b) for b in blobs),
           "meta_bytes_per_sample": sum(len(b) for b in blobs) / merged.num_samples,
           "rank0_gather_cpu_s": c_gather, "rank0_schedule_cpu_s": c_plan,
           "rank0_gather_schedule_peak_bytes": rank0_peak,
           "plan_bytes_every_rank": len(plan_blob), "ranks": []}
    # One holder's sending side: its pieces for every DP rank (holder 0).
    (_, c_cut) = _cpu(lambda: [pack_piece(share_piece(parts[0], plan, r,
                                                      starts=holders[0].starts))
                               for r in range(dp)])
    out["holder0_cut_and_pack_cpu_s"] = c_cut
    lengths_unscaled = unscaled
    for r in ranks:
        packed = [pack_piece(share_piece(h.part, plan, r, starts=h.starts)) for h in holders]
        received = [b for b, p in zip(packed, parts) if len(b) > 32]
        share, c_a2a = _cpu(lambda: assemble_share(
            [unpack_piece(b, plan) for b in received], plan, r))
        tracemalloc.start()  # the receiver's side again, traced (its buffer on top)
        assemble_share([unpack_piece(b, plan) for b in received], plan, r)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        records, c_rb = _cpu(lambda: share_batch(share, sched, plan.mask_sums, dp_rank=r))
        records_bytes = sum(v.nbytes for mb in records.microbatches
                            for v in attrs.asdict(mb, recurse=False).values()
                            if isinstance(v, np.ndarray))
        ids = sched.rank_sample_ids(r)
        true_tokens = int(lengths_unscaled[ids].sum())
        true_resp = int(response(lengths_unscaled[ids]).sum())
        got_unscaled = packed_bytes(len(ids), true_tokens, true_resp, len(received))
        share_unscaled = 52 * len(ids) + 16 + 4 * true_tokens + 5 * true_resp  # RankShare
        out["ranks"].append({
            "dp_rank": r, "samples": len(ids), "pieces": len(received),
            "share_bytes_received": sum(len(b) for b in received),
            "share_nbytes": share.nbytes,
            "share_bytes_received_unscaled": got_unscaled,
            "share_nbytes_unscaled": share_unscaled,
            "received_over_share_unscaled": (got_unscaled + len(plan_blob)) / share_unscaled,
            "all_to_all_cpu_s": c_a2a, "rank_batch_cpu_s": c_rb,
            "all_to_all_peak_bytes": peak, "records_bytes": records_bytes,
            "microbatches": len(records.microbatches)})
    return out


def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gloo_worker(rank: int, samples: int, dp: int) -> dict:
    """One rank of the real gloo run: hold part ``rank`` of the workload, distribute it with
    ``ShareExchange`` (the loop's code), report the bytes moved and the ones predicted."""
    import torch.distributed as dist

    from vime_pure import BatchingPolicy, ParallelLayout
    from vime_pure.scheduling.workloads import synthetic_workload
    from vime_shell.sources.exchange import ShareExchange

    dist.init_process_group("gloo")
    work = synthetic_workload(num_groups=samples, fanout="grpo16", seed=0)
    world = dist.get_world_size()
    holders = holders_of(work.lengths, work.group_ids, work.prompt_ids, world, columnar_batch)
    mine = holders[rank]
    layout = ParallelLayout(dp=dp)
    policy = BatchingPolicy(global_batch_size=max(1, samples // 16), max_tokens_per_gpu=32768,
                            allow_partial_step=True)
    exchange = ShareExchange(dp_rank=rank % dp)
    plan, share, _ = exchange.distribute(
        mine.part, mine.metas,
        lambda merged: (plan_shares(merged, layout, policy)[1], None),
        what="benchmark")
    ids = plan.schedule.rank_sample_ids(rank % dp)
    lengths = work.lengths[ids]
    pieces = sum(1 for h in holders
                 if len(share_piece(h.part, plan, rank % dp, starts=h.starts).sample_ids))
    predicted = packed_bytes(len(ids), int(lengths.sum()), int(response_lengths(lengths).sum()),
                             pieces)
    dist.destroy_process_group()
    return {"rank": rank, **exchange.stats.as_dict(), "predicted_share_bytes": predicted,
            "share_nbytes": share.nbytes,
            "batch_token_bytes": sum(h.part.tokens.nbytes + 5 * len(h.part.loss_masks)
                                     for h in holders)}


def gloo_check(samples: int = 16384, world: int = 4) -> list[dict]:
    """The real gloo run at ``world`` ranks on CPU (dp = world): per-rank bytes measured by
    the exchange against the simulation's prediction."""
    from vime_shell.megatron.spawn import spawn

    return spawn(gloo_worker, world, samples, world)
