"""Which ``metrics.jsonl`` keys two runs of the same data may be compared on exactly, and which
only within a stated tolerance: the one place tests take that split from.

- ``TIMING_KEYS``: wall-clock seconds and rates. Never compared.
- ``ENGINE_LOGPROB_KEYS`` (and every ``mis_*`` key of ``--tis-function mis``): computed from
  the engine's log-probs (``rollout_log_probs``). An
  engine's forward rounds differently for every batch composition (which prompts share a
  ``generate`` call, how far they are left-padded, which requests a continuous batch holds at
  each step), and that composition follows the work queue's chunks, the pool's timing or the
  engine count; so these keys are float noise of about 1e-7 whatever the data.
  ``ENGINE_LOGPROB_ATOL`` (1e-5) sits 20x above the largest noise measured (4.8e-7, the
  fixture's ``logprob_gap_max``) and 10x below the loop's own fp32 gap tolerance (1e-4); a
  broken weight sync moves them by 1e-2 and more.
- ``TRAINER_FLOAT_KEYS``: the trainer's own arithmetic on the batch. The trainer recomputes old
  log-probs (and takes step 0's from its own forward) and never reads the engine's, so on one
  machine and layout these are a pure function of the data: bit-identical for any engine
  placement (measured: the queued dp2 run equals main's funnel recorded on the same machine in
  every one of these keys, with different claims per run). Across machines torch's CPU
  kernels round differently (ISA dispatch): a fixture recorded elsewhere differs by up to
  1.2e-6 relative (``loss`` at rollout 1 of ``share_fixture.json``); ``TRAINER_FLOAT_RTOL``
  (1e-5) and ``TRAINER_FLOAT_ATOL`` (1e-7, for losses that are 0 up to rounding) cover that,
  while a sample trained twice or dropped moves them by 1e-3 and more.
  With ``--use-tis`` or ``--use-rs`` (or the MIS weights) the loss reads the engine's log-probs: compare such runs
  with ``engine_logprobs_in_loss=True`` (the same rtol, and ``ENGINE_LOGPROB_ATOL`` near 0).
- Every other key (token, sample, group and prompt counts, lengths, rewards and their
  statistics, fractions of counts, the LR, staleness, pool counters) is a function of the
  tokens, rewards and masks alone: compared exactly.

Why tokens (and so rewards, masks and the keys above) may be compared exactly although the
logits carry the same noise: a request's draw compares its seeded uniform ``u`` with the CDF of
its logits (``vime_shell.engines.hf.choose_tokens``; vLLM alike), and a log-prob noise of
``d`` moves each CDF edge by about ``d`` at most. So noise changes a token only where ``u`` lies
within ``d`` (~1e-6) of an edge; seeds fix every ``u``, so that margin is a property of the
test's data, not of a run: a test whose draws all clear it (over ~100-300 draws on a 20-token
vocabulary, all but ~1e-3 of data sets) gives the same tokens for every batch composition.
A test that ever fails on a token after a change of batching has met such a draw: change its
seed, never add a tolerance.

Example: ``assert_metrics_match(got, json.loads(FIXTURE.read_text())["dp2"])``.
"""

import math
from collections.abc import Mapping, Sequence

TIMING_KEYS = frozenset({"rollout_s", "train_s", "sync_s", "old_logprob_s", "tokens_per_s",
                         "eval_s"})
ENGINE_LOGPROB_KEYS = frozenset({"logprob_gap", "logprob_gap_max", "probe_gap", "mismatch_abs",
                                 "mismatch_kl", "tis", "tis_clipfrac", "rejected_token_frac"})
ENGINE_LOGPROB_ATOL = 1e-5
MIS_PREFIX = "mis_"  # slime's mis.py metrics (--tis-function mis): engine log-probs too
TRAINER_FLOAT_KEYS = frozenset({"loss", "pg_loss", "kl", "entropy", "clipfrac", "ratio",
                                "log_prob", "grad_norm", "grad_norm_max"})
TRAINER_FLOAT_RTOL = 1e-5
TRAINER_FLOAT_ATOL = 1e-7


def without_timing(record: Mapping) -> dict:
    """``record`` less its ``TIMING_KEYS``."""
    return {k: v for k, v in record.items() if k not in TIMING_KEYS}


def metric_mismatches(got: Mapping, want: Mapping, *,
                      engine_logprobs_in_loss: bool = False) -> list[str]:
    """Every way one record differs from another beyond its keys' tolerance (see the module
    docstring); timing keys are skipped. ``engine_logprobs_in_loss``: the run trained with
    ``--use-tis`` / ``--use-rs``, so the trainer's keys carry engine noise too.

    Example: ``metric_mismatches({"loss": 1.0, "logprob_gap": 2e-7},
    {"loss": 1.0, "logprob_gap": 1e-7}) == []``.
    """
    got, want = without_timing(got), without_timing(want)
    out = [f"{k}: only in {'got' if k in got else 'want'}"
           for k in sorted(got.keys() ^ want.keys())]
    for k in sorted(got.keys() & want.keys()):
        a, b = got[k], want[k]
        if not _close(k, a, b, engine_logprobs_in_loss):
            rule = ("measured in one run only" if (a is None) != (b is None)
                    else _rule(k, engine_logprobs_in_loss))
            out.append(f"{k}: got {a!r}, want {b!r} ({rule})")
    return out


def assert_metrics_match(got: Sequence[Mapping], want: Sequence[Mapping], *,
                         engine_logprobs_in_loss: bool = False) -> None:
    """Each record of ``got`` matches ``want``'s (``metric_mismatches``), in order."""
    assert len(got) == len(want), (len(got), len(want))
    problems = [f"record {i}: {p}" for i, (a, b) in enumerate(zip(got, want))
                for p in metric_mismatches(a, b, engine_logprobs_in_loss=engine_logprobs_in_loss)]
    assert not problems, "\n".join(problems)


def is_engine_key(key: str) -> bool:
    """``ENGINE_LOGPROB_KEYS``, and every ``mis_*`` key."""
    return key in ENGINE_LOGPROB_KEYS or key.startswith(MIS_PREFIX)


def _close(key: str, a, b, engine_logprobs_in_loss: bool) -> bool:
    if a is None or b is None or isinstance(a, (str, bool)) or isinstance(b, (str, bool)):
        return a == b
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if is_engine_key(key):
        return abs(a - b) <= ENGINE_LOGPROB_ATOL
    if key in TRAINER_FLOAT_KEYS:  # engine noise in the loss is relative: rtol for both
        atol = ENGINE_LOGPROB_ATOL if engine_logprobs_in_loss else TRAINER_FLOAT_ATOL
        return math.isclose(a, b, rel_tol=TRAINER_FLOAT_RTOL, abs_tol=atol)
    return a == b


def _rule(key: str, engine_logprobs_in_loss: bool) -> str:
    if is_engine_key(key):
        return f"engine log-prob noise, atol {ENGINE_LOGPROB_ATOL}"
    if key in TRAINER_FLOAT_KEYS:
        atol = ENGINE_LOGPROB_ATOL if engine_logprobs_in_loss else TRAINER_FLOAT_ATOL
        return f"trainer rounding, rtol {TRAINER_FLOAT_RTOL}, atol {atol}"
    return "data: exact"
