"""The engines' work queue of prompts, kept in the job's own ``torch.distributed`` store.

The core says what a claim is (:mod:`vime_pure.data.work_queue`: claim ``k`` is a chunk of
``queue_chunk_size(P, E, per_engine=chunks_per_engine(...))`` whole prompts: 4 claims per
engine for the HF engine on CPU, 1 for vLLM and on GPUs); this module moves the claims. Per generation round
(one call of ``EngineGroup.run_local`` / ``run_shares``; the key prefix names the engine group
and the call, so a second round, an evaluation or a dynamic-sampling round never reads another
round's counter):

- each engine **leader** claims with one atomic ``store.add(<round>/next, 1)`` (served by rank
  0's TCPStore, no extra thread or service) until its claim is past the last prompt;
- an engine's **TP peers** (its other ranks: vLLM needs every TP rank in each ``generate``)
  generate the same chunks: the leader publishes its ``j``-th claim under
  ``<round>/e<engine>/<j>`` and peers wait for it (polled in slices between health checks,
  within the round's bound: :func:`vime_shell.engines.health.wait_until`), until the leader
  publishes ``end``;
- a **failure** on any engine rank (``abort``) adds 2**40 to the counter, so every other
  engine's next claim is past the end and it stops claiming (it finishes the chunk it holds,
  then meets the failure in the exchange, which names the failed engine); a failed leader also
  publishes ``abort`` to its peers, so none waits for a claim that never comes.

A round's keys are deleted ``KEPT_ROUNDS`` rounds later (rank 0's store stays small over
thousands of rollouts): vLLM's TP peers run in lockstep with their leader, and no peer lags
its leader by 8 rounds (most rounds end in a collective over the world: the exchange, a
dynamic-sampling verdict, an evaluation's result).

Example (2 engines of 1 rank, 10 prompts, chunks of 2): engine 0 claims 0 -> prompts 0-1,
engine 1 claims 1 -> prompts 2-3, engine 0 claims 2, 3, 4 while engine 1 is slow; engine 1's
next claim (5) is past the end: engine 0 generated 8 prompts, engine 1 2.
"""

from collections.abc import Iterator
from itertools import count
from typing import Any

import torch.distributed as dist

from vime_pure.data.work_queue import CHUNKS_PER_ENGINE, chunk_range, queue_chunk_size
from vime_shell.engines.health import WaitBound, keys_done, wait_until

_ABORT = 1 << 40  # added to a round's counter on failure: every later claim is past the end
KEPT_ROUNDS = 8  # a round's keys are deleted this many rounds later
_GROUPS = count()  # engine groups built in this process (built collectively: same on all ranks)


def job_store() -> Any:
    """The job's rendezvous store (torchrun's or ``spawn``'s TCPStore, behind the default
    group's prefix): the store every rank of the world shares."""
    return dist.distributed_c10d._get_default_store()  # noqa: SLF001 - no public accessor


class PromptQueue:
    """One rank's claims of one round (``iter`` yields its engine's chunks, in claim order).
    ``bound``: how long a TP peer may wait for its leader's claims (None: as long as the
    leader answers the health checks); ``leader_name`` names the leader in that bound's
    message."""

    def __init__(self, store: Any, prefix: str, *, engine: int, leader: bool, peers: bool,
                 num_prompts: int, num_engines: int, bound: WaitBound | None = None,
                 per_engine: int = CHUNKS_PER_ENGINE, leader_name: str = "its engine's leader"):
        self.store, self.prefix, self.engine = store, prefix, engine
        self.leader, self.peers = leader, peers
        self.num_prompts = num_prompts
        self.chunk = queue_chunk_size(num_prompts, num_engines, per_engine=per_engine)
        self.bound, self.leader_name = bound, leader_name
        self.claimed = 0  # claims this engine made (published ones, on a leader)

    def _key(self, j: int) -> str:
        return f"{self.prefix}/e{self.engine}/{j}"

    def __iter__(self) -> Iterator[range]:
        for j in count():
            if self.leader:
                claim = int(self.store.add(f"{self.prefix}/next", 1)) - 1
                share = chunk_range(claim, self.chunk, self.num_prompts)
                if self.peers:
                    self.store.set(self._key(j), str(claim) if share else "end")
            else:
                wait_until(keys_done(self.store, [self._key(j)]),
                           f"claim {j} of {self.leader_name} (engine {self.engine})", self.bound)
                value = self.store.get(self._key(j)).decode()
                if value in ("end", "abort"):
                    return
                share = chunk_range(int(value), self.chunk, self.num_prompts)
            if not share:
                return
            self.claimed = j + 1
            yield share

    def abort(self) -> None:
        """This rank failed: the other engines stop claiming, this engine's peers stop
        waiting."""
        self.store.add(f"{self.prefix}/next", _ABORT)
        if self.leader and self.peers:
            self.store.set(self._key(self.claimed), "abort")


def new_group_prefix() -> str:
    """The key prefix of a newly built engine group (``vime/queue/<n>``)."""
    return f"vime/queue/{next(_GROUPS)}"


def forget_round(store: Any, prefix: str, *, engine: int, leader: bool, first_rank: bool,
                 published: int) -> None:
    """Delete a finished round's keys: the leader its published claims (and the end marker),
    rank 0 the counter."""
    keys = [f"{prefix}/e{engine}/{j}" for j in range(published + 1)] if leader else []
    if first_rank:
        keys.append(f"{prefix}/next")
    for key in keys:
        store.delete_key(key)
