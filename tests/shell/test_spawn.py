"""``spawn``'s timeout is a real deadline: a rank that never returns (a hang in a collective,
say) is killed and the caller gets ``TimeoutError``, so a "no hang" test fails instead of
blocking the suite."""

import time

import pytest

from vime_shell.megatron.spawn import spawn


def hanging_worker(rank: int) -> int:
    """Rank 0 returns; rank 1 waits far past the deadline (a rank stuck in a collective)."""
    if rank == 1:
        time.sleep(600)
    return rank


def test_a_hung_rank_is_killed_at_the_deadline():
    # Rank 0 may still be importing on a loaded machine: rank 1 is named either way.
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] still running after 5 s"):
        spawn(hanging_worker, 2, timeout=5)
