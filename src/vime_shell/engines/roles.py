"""Separate rollout ranks: which ranks of the ``torchrun`` job train and which only generate
(torch-free, resolved at launch).

With ``--rollout-num-gpus N`` below the world size ``W`` and colocation off (``--no-colocate``,
or either asynchronous mode, which imply it), ranks ``[0, W - N)`` train (global rank 0 is the
trainer's rank 0, which writes every file) and ranks ``[W - N, W)`` run engines only. Each side
gets its own default process group (Megatron sizes its parallel state from the default group;
vLLM must not see the trainer's: an engine alone on a 2-rank default group hangs in init, stack
facts; on its own one-rank group an in-process ``vllm.LLM`` starts and serves,
``tests/vllm/test_vllm_async_ranks.py``), and trainer rank 0 talks to every engine rank over a
separate *bridge* group: ``bridge rank 0`` = trainer rank 0, ``bridge rank 1 + i`` = engine rank
``i`` (:mod:`vime_shell.engines.remote`).

Rules (each a :class:`RankRolesError` naming the flag and the fix): ``1 <= N < W``;
``--colocate`` is not on with an asynchronous mode (the mode arrives resolved, as one
``vime_pure.async_pool.Asynchrony``: ``--train-async`` and ``--fully-async`` already exclude
each other there). With ``--fully-async`` every engine runs a pool of its own on its leader,
the pools sharing one queue of draws (:mod:`vime_pure.pool_ranks`,
:mod:`vime_shell.sources.pool`); an engine over several ranks needs a replica on each
(the HF engine; a tensor-parallel one is a launch check).

Example: ``resolve_rank_roles(world_size=4, rollout_num_gpus=1, colocate=False)``
(synchronous) gives 3 trainer ranks (0-2) and engine rank 3 (bridge rank 1).
"""

import attrs

from vime_pure.async_pool import Asynchrony, SyncMode
from vime_pure.errors import VimeError, field_error

_SYNC = Asynchrony(mode=SyncMode.SYNC)


class RankRolesError(VimeError):
    """Flags that cannot split the launched ranks into trainers and engines."""


@attrs.frozen(kw_only=True)
class RankRoles:
    """``num_trainers`` trainer ranks first, then the engine ranks; ``asynchrony``: how far
    the engine ranks run ahead (the job's one resolved mode)."""

    world_size: int
    num_trainers: int
    asynchrony: Asynchrony = _SYNC

    @property
    def mode(self) -> SyncMode:
        return self.asynchrony.mode

    @property
    def num_engine_ranks(self) -> int:
        return self.world_size - self.num_trainers

    def is_trainer(self, rank: int) -> bool:
        return rank < self.num_trainers

    def side_rank(self, rank: int) -> int:
        """The rank within its side's own process group. Example: W=4, N=1: rank 3 -> 0."""
        return rank if self.is_trainer(rank) else rank - self.num_trainers

    def bridge_rank(self, rank: int) -> int | None:
        """Trainer rank 0 -> 0, engine rank ``i`` -> ``1 + i``, other trainers -> None."""
        if rank == 0:
            return 0
        return None if self.is_trainer(rank) else 1 + rank - self.num_trainers

    @property
    def bridge_size(self) -> int:
        return 1 + self.num_engine_ranks


def resolve_rank_roles(*, world_size: int, rollout_num_gpus: int | None,
                       colocate: bool | None, asynchrony: Asynchrony = _SYNC
                       ) -> RankRoles | None:
    """The split of the module docstring, or None when engines live inside the trainer ranks."""
    separate = asynchrony.bounded or (colocate is False and rollout_num_gpus is not None
                                      and rollout_num_gpus < world_size)
    if not separate:
        return None
    if asynchrony.bounded and colocate:
        raise field_error(RankRolesError, "--colocate", True, f"excludes {asynchrony.flag}: "
                          "engines must generate while the trainer trains", "drop --colocate")
    if rollout_num_gpus is None or not 1 <= rollout_num_gpus < world_size:
        raise field_error(RankRolesError, "--rollout-num-gpus", rollout_num_gpus,
                          f"must leave trainer ranks among the {world_size} launched "
                          f"({asynchrony.flag or '--no-colocate'} runs engines on ranks of "
                          "their own)",
                          (f"pass --rollout-num-gpus between 1 and {world_size - 1}"
                           if world_size > 1 else "launch 2 processes or more (torchrun "
                           "--nproc-per-node 2 -m vime_shell.cli train ...) with "
                           "--rollout-num-gpus 1"))
    return RankRoles(world_size=world_size, num_trainers=world_size - rollout_num_gpus,
                     asynchrony=asynchrony)
