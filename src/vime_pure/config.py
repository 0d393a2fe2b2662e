"""Launch-time configuration records: the parallel layout and the batching policy.

Both are frozen ``attrs`` records validated at construction, so a record that exists is valid.
``check_feasible`` validates what can be known before any data arrives.

Example: ``ParallelLayout(dp=8, cp=2, pp=2, vpp=2, microbatch_group=4)`` needs every rank's
micro-batch count in a step to be a multiple of 4, so a step holds a multiple of
``dp * 4 = 32`` micro-batches in total (``align_multiple == 32``).
"""

from typing import Any, Literal, get_args

import attrs
import numpy as np

from vime_pure.errors import ScheduleError, VimeError, field_error, one_line, type_tag

# The one definition of each choice list: CLIs, config files and checks all read these.
Packing = Literal["ffd", "first_fit", "flops"]
Balance = Literal["strided", "tokens", "flops", "straggler"]
PACKINGS: tuple[str, ...] = get_args(Packing)
BALANCES: tuple[str, ...] = get_args(Balance)
Optimizer = Literal["adam", "muon"]  # --optimizer (muon: vime_shell.megatron.muon)
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)


def _plain_int(value: object) -> object:
    """numpy integers become ints (so records compare and serialise as ints); the rest is
    left for the validators, which reject it with the field's name."""
    return int(value) if isinstance(value, np.integer) else value


def as_int(field: str, value: object, lo: int, error: type[VimeError], fix: str) -> int:
    """``value`` as a Python int ``>= lo``: ints and numpy integers pass, bools never do.

    Example: ``as_int("dp", np.int64(2), 1, ScheduleError, "...") == 2``; ``True`` raises.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise field_error(error, field, value, f"must be an integer >= {lo}", fix)
    if value < lo:
        raise field_error(error, field, value, f"must be an integer >= {lo}", fix)
    return int(value)


def _positive_int(field: str, value: object, fix: str) -> None:
    as_int(field, value, 1, ScheduleError, fix)


def _plain_bool(value: object) -> object:
    """numpy bools become bools; the rest is left for the validator."""
    return bool(value) if isinstance(value, np.bool_) else value


def as_bool(field: str, value: object, error: type[VimeError]) -> bool:
    """``value`` as a bool: ``True``/``False`` and numpy bools; 0, 1, "yes" or None never.

    Example: ``as_bool("balance_data", np.True_, ScheduleError) is True``.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise field_error(error, field, value, "must be a bool", "pass True or False")
    return bool(value)


def _choice(field: str, value: object, choices: tuple[str, ...], what: str) -> None:
    # isinstance first: `array in choices` would compare element-wise and raise.
    if not isinstance(value, str) or value not in choices:
        raise field_error(ScheduleError, field, value, f"is not a {what}",
                          f"use one of {choices}")


@attrs.frozen(kw_only=False)
class ParallelLayout:
    """Model-parallel layout of the trainer, as the scheduler needs it.

    ``dp``: data-parallel ranks that each receive their own micro-batches.
    ``cp``: context-parallel size; a micro-batch is shared by ``cp`` GPUs, so its token
    budget is ``max_tokens_per_gpu * cp``.
    ``pp`` / ``vpp``: pipeline stages and virtual stages per rank (informational for ``pp``).
    ``microbatch_group``: Megatron's ``microbatch_group_size_per_vp_stage``; required when
    ``vpp > 1``, because the interleaved schedule needs every rank's micro-batch count to be a
    multiple of it.
    """

    dp: int = attrs.field(converter=_plain_int)
    cp: int = attrs.field(default=1, converter=_plain_int)
    pp: int = attrs.field(default=1, converter=_plain_int)
    vpp: int = attrs.field(default=1, converter=_plain_int)
    microbatch_group: int | None = attrs.field(default=None, converter=_plain_int)

    def __attrs_post_init__(self) -> None:
        _positive_int("dp", self.dp, "pass the data-parallel size, e.g. dp=8")
        _positive_int("cp", self.cp, "pass cp=1 when context parallelism is off")
        _positive_int("pp", self.pp, "pass pp=1 when pipeline parallelism is off")
        _positive_int("vpp", self.vpp, "pass vpp=1 when virtual pipeline stages are off")
        if self.vpp > 1:
            if self.microbatch_group is None:
                raise field_error(
                    ScheduleError, "microbatch_group", None,
                    f"is required when vpp={self.vpp} > 1 (Megatron's "
                    "microbatch_group_size_per_vp_stage)",
                    "pass microbatch_group=pp (Megatron's default) or the value your trainer uses",
                )
            _positive_int("microbatch_group", self.microbatch_group,
                          "pass a positive microbatch_group, usually equal to pp")
        elif self.microbatch_group is not None:
            _positive_int("microbatch_group", self.microbatch_group,
                          "omit microbatch_group or pass a positive integer")

    @property
    def microbatch_multiple(self) -> int:
        """Every rank's micro-batch count in a step is a multiple of this."""
        return self.microbatch_group if self.vpp > 1 and self.microbatch_group else 1

    @property
    def align_multiple(self) -> int:
        """The total micro-batch count of a step is a multiple of this: ``dp * microbatch_multiple``."""
        return self.dp * self.microbatch_multiple


@attrs.frozen
class BatchingPolicy:
    """How a rollout batch becomes steps and micro-batches.

    ``global_batch_size`` counts **groups** (rollout executions), never samples.
    Dynamic packing is on when ``max_tokens_per_gpu`` is set; otherwise static chunks of
    ``micro_batch_size`` samples. ``packing`` picks the bin-packing algorithm of dynamic
    packing, ``balance`` how packed micro-batches are spread over DP ranks: ``"strided"``
    (round-robin), ``"tokens"`` / ``"flops"`` (equal-count Karmarkar-Karp on micro-batch loads),
    or ``"straggler"`` (samples dealt to ranks by FLOPs before packing: the best per-step balance,
    sometimes at more micro-batches per rank than FFD: see ``vime_pure.scheduling.schedule``).
    ``allow_partial_step``: trailing groups that do not fill a step form one smaller final step
    (when feasible) instead of being dropped and reported.
    """

    global_batch_size: int = attrs.field(converter=_plain_int)
    max_tokens_per_gpu: int | None = attrs.field(default=None, converter=_plain_int)
    micro_batch_size: int | None = attrs.field(default=None, converter=_plain_int)
    packing: str = "ffd"
    balance: str = "strided"
    allow_partial_step: bool = attrs.field(default=False, converter=_plain_bool)

    def __attrs_post_init__(self) -> None:
        _positive_int("global_batch_size", self.global_batch_size,
                      "pass the number of groups (rollout executions) per optimizer step")
        if self.max_tokens_per_gpu is None and self.micro_batch_size is None:
            raise field_error(
                ScheduleError, "max_tokens_per_gpu", None,
                "and micro_batch_size=None: one of them is needed",
                "set max_tokens_per_gpu for dynamic packing, or micro_batch_size for static chunks",
            )
        if self.max_tokens_per_gpu is not None:
            _positive_int("max_tokens_per_gpu", self.max_tokens_per_gpu,
                          "pass the per-GPU token budget of one micro-batch, e.g. 16384")
        if self.micro_batch_size is not None:
            _positive_int("micro_batch_size", self.micro_batch_size,
                          "pass the number of samples per static micro-batch, e.g. 1")
        _choice("packing", self.packing, PACKINGS, "packing algorithm")
        _choice("balance", self.balance, BALANCES, "balance mode")
        as_bool("allow_partial_step", self.allow_partial_step, ScheduleError)

    @property
    def dynamic(self) -> bool:
        """True when micro-batches are packed under a token budget."""
        return self.max_tokens_per_gpu is not None

    def token_cap(self, layout: ParallelLayout) -> int | None:
        """Token budget of one micro-batch: ``max_tokens_per_gpu * cp`` (None when static)."""
        return None if self.max_tokens_per_gpu is None else self.max_tokens_per_gpu * layout.cp


def check_feasible(layout: Any, policy: Any) -> None:
    """Reject at launch what can be known to fail before any data arrives.

    ``layout`` / ``policy``: a ``ParallelLayout`` and a ``BatchingPolicy`` (typed loosely: this
    is a user boundary, and a wrong type is a ``ScheduleError`` naming it).

    Static packing forms exactly ``global_batch_size * samples_per_group / micro_batch_size``
    micro-batches and cannot split them further, so with one sample per group a full step needs
    ``global_batch_size / micro_batch_size`` to be a multiple of ``layout.align_multiple``.
    Example: gbs=64, mbs=4, dp=8 gives 16 micro-batches, 2 per rank: fine; dp=8 with vpp=2 and
    microbatch_group=4 needs a multiple of 32: rejected, with the fix.
    Dynamic packing can always split micro-batches, provided a step has enough samples; we only
    require ``global_batch_size >= align_multiple`` (each group yields at least one sample).
    """
    if not isinstance(layout, ParallelLayout):
        raise field_error(ScheduleError, "layout", type_tag(layout),
                          "is not a ParallelLayout", "pass ParallelLayout(dp=...)")
    if not isinstance(policy, BatchingPolicy):
        raise field_error(ScheduleError, "policy", type_tag(policy),
                          "is not a BatchingPolicy", "pass BatchingPolicy(global_batch_size=...)")
    multiple = layout.align_multiple
    if policy.dynamic:
        if policy.global_batch_size < multiple:
            raise ScheduleError(
                f"global_batch_size={policy.global_batch_size} groups cannot fill the "
                f"{multiple} micro-batches of a step ({alignment_terms(layout)}) when a group "
                f"has one sample. Fix: raise global_batch_size to at least {multiple}, or use "
                f"fewer {alignment_terms(layout, fewer=True)}."
            )
        return
    mbs = policy.micro_batch_size
    assert mbs is not None  # invariant of BatchingPolicy: static implies micro_batch_size
    if policy.global_batch_size % mbs:
        raise ScheduleError(
            f"global_batch_size={policy.global_batch_size} is not a multiple of "
            f"micro_batch_size={mbs}: the last static micro-batch of every step would be short. "
            f"Fix: use a global_batch_size that is a multiple of {mbs}."
        )
    count = policy.global_batch_size // mbs
    if count % multiple:
        raise ScheduleError(static_misalignment_message(count, policy, layout))


def static_misalignment_message(count: int, policy: BatchingPolicy, layout: ParallelLayout) -> str:
    """Explain why ``count`` static micro-batches cannot be spread evenly, and how to fix it."""
    multiple = layout.align_multiple
    mbs = int(policy.micro_batch_size or 1)  # static packing: micro_batch_size is set
    need = (count + multiple - 1) // multiple * multiple
    return (
        f"static packing forms {count} micro-batches of micro_batch_size={mbs}, which is not a "
        f"multiple of {alignment_terms(layout)} = {multiple}. Fix: make the step's sample count "
        f"a multiple of {mbs} x {multiple} = {mbs * multiple} (e.g. {need * mbs} samples), "
        f"change micro_batch_size, use fewer {alignment_terms(layout, fewer=True)}, or use "
        "dynamic packing (max_tokens_per_gpu), which can split micro-batches to align"
    )


def alignment_terms(layout: ParallelLayout, fewer: bool = False) -> str:
    """What ``layout.align_multiple`` is made of, in words a user of any front end reads:
    ``"dp=2 x a virtual-pipeline group of 2"``; ``fewer``: what to have less of."""
    if fewer:
        return "DP ranks" + (" or no virtual pipeline stages" if layout.vpp > 1 else "")
    group = (f" x a virtual-pipeline group of {layout.microbatch_group}" if layout.vpp > 1
             else "")
    return f"dp={layout.dp}{group}"


# The balance of ``vime train`` / ``vime schedule`` when no balance flag is given and packing is
# dynamic: per-step FLOPs imbalance 1.003-1.017 against 1.10-1.60 for FFD with token balance
# on the standard layouts of benchmarks/schedule.py, for 0-5.8% more micro-batches (README).
DEFAULT_BALANCE = "straggler"


def policy_from_flags(*, global_batch_size: Any, max_tokens_per_gpu: Any = None,
                      micro_batch_size: Any = None, packing: Any = None, balance: Any = None,
                      balance_data: Any = False, balance_by_flops: Any = False,
                      allow_partial_train_step: Any = False) -> BatchingPolicy:
    """The one ``BatchingPolicy`` builder behind ``vime train``, ``vime schedule`` and config
    files, from flags named as in slime. Each flag means the same thing everywhere:

    - ``--max-tokens-per-gpu N``: dynamic packing under ``N * cp`` tokens per micro-batch;
      ``--micro-batch-size M``: static micro-batches of ``M`` samples. Exactly one of them:
      dynamic packing would ignore ``M``, so both is an error, never a silent choice.
    - ``--balance-data``: ``balance="tokens"``; ``--balance-by-flops``: ``balance="flops"``
      (DP ranks balanced by estimated FLOPs; packing stays FFD); it wins over ``--balance-data``.
    - ``--packing`` / ``--balance``: any of ``PACKINGS`` / ``BALANCES`` (``straggler``
      included); an explicit ``--balance`` wins over the two shortcuts.
    - No balance flag: ``DEFAULT_BALANCE`` (``"straggler"``) under dynamic packing, where vime
      differs from slime (whose default deals micro-batches round-robin: ``--balance
      strided``); ``"strided"`` under static packing.

    Example: ``policy_from_flags(global_batch_size=64, max_tokens_per_gpu=8192,
    balance_by_flops=True)`` is ``BatchingPolicy(64, 8192, packing="ffd", balance="flops")``.
    Flags are typed loosely (a user boundary): each is checked with a ``ScheduleError``.
    """
    if max_tokens_per_gpu is not None and micro_batch_size is not None:
        raise ScheduleError(
            f"micro_batch_size={one_line(repr(micro_batch_size))} and max_tokens_per_gpu="
            f"{one_line(repr(max_tokens_per_gpu))} are both set, but dynamic packing "
            "(max_tokens_per_gpu) "
            "ignores micro_batch_size. Fix: drop --micro-batch-size to pack by tokens, or pass "
            "--max-tokens-per-gpu none for static micro-batches of micro_batch_size samples.")
    by_flops = as_bool("balance_by_flops", balance_by_flops, ScheduleError)
    by_tokens = as_bool("balance_data", balance_data, ScheduleError)
    if balance is None:
        balance = ("flops" if by_flops else "tokens" if by_tokens else
                   DEFAULT_BALANCE if max_tokens_per_gpu is not None else "strided")
    return BatchingPolicy(global_batch_size=global_batch_size,
                          max_tokens_per_gpu=max_tokens_per_gpu,
                          micro_batch_size=micro_batch_size,
                          packing="ffd" if packing is None else packing,
                          balance=balance, allow_partial_step=allow_partial_train_step)
