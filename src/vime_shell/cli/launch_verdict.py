"""One launch outcome per job: under ``torchrun`` every rank runs the same launch checks, and the
job reports what they found once.

Each rank posts its verdict (passed or failed) to the job's rendezvous store: torchrun's agent
store at ``MASTER_ADDR:MASTER_PORT``, which exists before any process group. Once every rank
has posted:

- all passed: rank 0 prints the notes and the ``--dry-run`` report; the other ranks stay quiet
  (a dry run exits 0 on every rank);
- some failed: the lowest failing rank prints its one line and every rank exits with status 2
  at once. That is rank 0 whenever rank 0 failed: the same flags and, on one node, the same
  files give every rank the same error. A rank that alone found the problem (a file missing on
  its node, a plugin that fails to import there) prefixes its line with ``rank R (host):``.

torchrun then exits with status 1 (any failed worker) and prints its own ``ChildFailedError``
block: one entry per rank, ``exitcode: 2`` (or -15 for a rank still exiting when torchrun saw
the first one end and stopped the rest), and no message of vime's.

Every wait is bounded: a rank that has not posted within ``AGREEMENT_TIMEOUT_S`` (a hung file
system, a rank stuck in a check) fails the launch on the others, naming the missing ranks.

A failure during the run (after launch) reaches every rank of the collective step it happened
in, and each rank raises its own account of it; the first rank to claim the job's report in the
same store prints its line (``first_to_report``), the others exit 2 quietly.

Without torchrun's agent store (a plain ``python`` run, ``vime_shell.megatron.spawn``, a
launcher that sets only ``RANK`` / ``WORLD_SIZE`` / ``MASTER_*``) nothing can be posted before
the process group exists: every failing rank reports its own error, and only rank 0 prints the
notes and the ``--dry-run`` report.

Example: ``torchrun --nproc-per-node 8 -m vime_shell.cli train --tensor-model-parallel-size 3``
prints ``vime train: error: --tensor-model-parallel-size=3: does not divide ...`` once.
"""

import os
import re
import socket
from datetime import timedelta

import attrs

from vime_pure.errors import VimeError

# Launch checks take about as long on every rank (each reads and tokenizes the same datasets);
# local rank 0 alone verifies a --load checkpoint's manifest, minutes for a large model.
AGREEMENT_TIMEOUT_S = 1800.0


class LaunchAgreementError(VimeError):
    """The ranks of a job could not agree on the launch checks' outcome (a rank missing)."""


class OnRank(VimeError):
    """A launch error that one non-zero rank alone found, with the rank and host it names."""


class ReportedElsewhere(Exception):
    """This rank stays quiet: another rank reports the job's failure (exit with ``status``)."""

    def __init__(self, status: int = 2) -> None:
        super().__init__(f"reported by another rank (exit status {status})")
        self.status = status


@attrs.frozen
class Verdict:
    """What the ranks posted: the failed ranks, and the ranks that never posted."""

    rank: int
    world: int
    failed: tuple[int, ...] = ()
    missing: tuple[int, ...] = ()

    @property
    def passed(self) -> bool:
        return not self.failed and not self.missing

    @property
    def speaker(self) -> int:
        """The one rank that prints: the lowest failed rank, else (ranks missing) the lowest
        rank that posted, else rank 0."""
        if self.failed:
            return self.failed[0]
        return next(r for r in range(self.world) if r not in self.missing)


def job_rank() -> int:
    return int(os.environ.get("RANK", "0"))


def job_world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def has_agent_store() -> bool:
    """torchrun's workers share its agent's store from the start
    (``TORCHELASTIC_USE_AGENT_STORE``)."""
    return (job_world() > 1 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            and "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ)


def agree(failed: bool, *, timeout_s: float = AGREEMENT_TIMEOUT_S) -> Verdict:
    """Post this rank's verdict and wait for every rank's (module docstring); a single rank,
    or a launch without torchrun's agent store, decides alone."""
    rank = job_rank()
    if not has_agent_store():
        return Verdict(rank=rank, world=job_world(), failed=(rank,) if failed else ())
    # torch only here: a single-process launch check stays torch-free and fast.
    import torch.distributed as dist

    prefix = f"vime/launch/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    world, timeout = job_world(), timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timeout)
    except (RuntimeError, ValueError) as exc:
        raise LaunchAgreementError(
            f"rank {rank}: cannot reach torchrun's store at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']} ({exc}). Fix: check that every node's torchrun "
            "uses the same --rdzv-endpoint and can reach it.") from exc
    # The posted list first, then the count: when the count reaches the world, the list is whole.
    # Store.append is a torch binding its type stubs leave out (torch/_C/_distributed_c10d.pyi).
    store.append(prefix + "posted", f"{rank}{'!' if failed else ''},")  # type: ignore[attr-defined]
    if int(store.add(prefix + "count", 1)) == world:
        store.set(prefix + "all", "1")
    try:
        store.wait([prefix + "all"], timeout)
    except RuntimeError:  # DistStoreError: a rank never posted
        pass
    posted = {int(p.rstrip("!")): p.endswith("!")
              for p in store.get(prefix + "posted").decode().split(",") if p}
    failed_ranks = tuple(sorted(r for r, bad in posted.items() if bad))
    return Verdict(rank=rank, world=world, failed=failed_ranks,
                   missing=tuple(r for r in range(world) if r not in posted))


def settle(error: BaseException | None, *, timeout_s: float = AGREEMENT_TIMEOUT_S) -> None:
    """The end of a launch: returns when every rank passed; otherwise raises the error to
    report on the rank that speaks (this rank's own, with ``rank R (host):`` when R is not 0)
    and :class:`ReportedElsewhere` on every other rank."""
    verdict = agree(error is not None, timeout_s=timeout_s)
    if verdict.passed:
        return
    if verdict.rank != verdict.speaker:
        raise ReportedElsewhere(2) from error
    if error is None:  # only ranks missing: this rank names them
        raise LaunchAgreementError(
            f"ranks {list(verdict.missing)} of {verdict.world} did not finish the launch checks "
            f"within {timeout_s:g} s. Fix: see what those ranks' nodes are doing (a hung file "
            "system, a slow dataset or checkpoint read), then launch again.")
    if where(verdict):
        raise OnRank(where(verdict) + describe(error)) from error
    raise error


def where(verdict: Verdict) -> str:
    """``"rank R (host): "`` when a non-zero rank speaks for ranks that agreed (rank 0 passed:
    the problem is this rank's alone); ``""`` otherwise."""
    if verdict.rank == 0 or not has_agent_store():
        return ""
    return f"rank {verdict.rank} ({socket.gethostname()}): "


def describe(exc: BaseException) -> str:
    """A ``VimeError``'s message as it is; other errors prefixed by their type."""
    text = re.sub(r"\s*\n\s*", " ", str(exc)).strip()
    return text if isinstance(exc, VimeError) else f"{type(exc).__name__}: {text}"


def first_to_report(*, timeout_s: float = 30.0) -> bool:
    """After launch, whether this rank prints the error it met: under torchrun the first rank
    to claim the job's report does (a failure reaches every rank of a collective step, each
    raising its own account of it: the failing rank its error, the others a line quoting
    it); the others stay quiet. Without torchrun's agent store, or when the store cannot be
    reached, every rank reports its own."""
    if not has_agent_store():
        return True
    import torch.distributed as dist  # loaded already: the run is past its launch

    key = f"vime/run/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/reporter"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timedelta(seconds=timeout_s))
        claimed = store.compare_set(key, "", str(job_rank()))
    except (RuntimeError, ValueError):  # no store: better twice than never
        return True
    return claimed.decode() == str(job_rank())


def speaks_for_job() -> bool:
    """Whether this rank prints what every rank would print alike (the notes, the dry-run
    report, an interrupt): global rank 0."""
    return job_rank() == 0
