"""Top-k on-policy distillation (miles' ``--opd-log-prob-top-k K``, after "Rethinking On-Policy
Distillation"): one reverse-KL estimate per response token, from the student's and the
teacher's log-probs over a few tokens of each position, computed once after the rollout.

At response position ``t`` the student engine reported its ``K`` most likely tokens ``S_t``
with their log-probs; the teacher server reported its log-probs of the tokens it was asked
about (``S_t``) and, where the strategy asks, its own ``K`` most likely tokens ``T_t``.

- The token set ``X_t`` (``strategy``): ``only-student``: ``S_t``; ``intersection``: the tokens
  of ``S_t`` that are also in ``T_t``, in ``S_t``'s order. miles' ``only-teacher``, ``union``
  and ``xor`` also need the *student's* log-probs of the teacher's tokens, which only a
  scoring call to the student's server gives (SGLang's ``token_ids_logprob``): vime's engines
  do not take that call, so those three are refused at launch (``STUDENT_SCORED``).
- The weights ``w`` over ``X_t`` (``weight_mode``): the softmax over ``X_t`` of the student's
  log-probs (``student_p``), of the teacher's (``teacher_p``), or uniform (``none``); miles
  normalises them for every strategy but ``xor``.
- The estimate: ``sum_{y in X_t} w_y (log pi_s(y) - log pi_t(y))``; 0 where ``X_t`` is empty
  (a disjoint intersection; a token the engine did not sample, such as a tool's output).

Invariants the tests assert: with ``X_t`` the whole vocabulary and ``student_p`` weights the
estimate is the exact ``KL(pi_s || pi_t)`` (>= 0); a teacher equal to the student gives 0 for
every mode; a token of ``X_t`` the teacher did not score is a :class:`DistillationError`, never
a silent 0.

Example: student ``{5: log 0.6, 7: log 0.4}``, teacher ``{5: log 0.5, 7: log 0.5}``,
``only-student``, ``student_p``: ``0.6 log(0.6/0.5) + 0.4 log(0.4/0.5)`` = 0.0201.
"""

from collections.abc import Mapping, Sequence

import numpy as np
from jaxtyping import Float32

from vime_pure.errors import VimeError

TOP_K_STRATEGIES = ("only-student", "only-teacher", "intersection", "union", "xor")  # miles'
STUDENT_SCORED = ("only-student", "intersection")  # the strategies vime computes (docstring)
TEACHER_TOP = ("intersection",)  # the ones that ask the teacher for its own top-k as well
WEIGHT_MODES = ("student_p", "teacher_p", "none")

LogProbs = Mapping[int, float]  # token id -> log-prob, at one position


class DistillationError(VimeError):
    """A top-k distillation input lacks a log-prob the estimate needs."""


def token_set(strategy: str, student: LogProbs, teacher_top: LogProbs) -> list[int]:
    """``X_t`` of one position (module docstring). Example: ``intersection`` of student
    ``{5, 7, 9}`` and teacher top ``{9, 5, 2}`` is ``[5, 9]``."""
    if strategy == "only-student":
        return list(student)
    if strategy == "intersection":
        return [y for y in student if y in teacher_top]
    raise DistillationError(f"--opd-top-k-strategy={strategy}: vime computes only "
                            f"{list(STUDENT_SCORED)}. Fix: pick one of them.")


def weights(student: np.ndarray, teacher: np.ndarray, mode: str) -> np.ndarray:
    """``w`` over ``X_t``: the softmax of the chosen log-probs (uniform for ``none``)."""
    if mode not in WEIGHT_MODES:
        raise DistillationError(f"--opd-reward-weight-mode={mode}: is not one of "
                                f"{list(WEIGHT_MODES)}. Fix: pick one of them.")
    logits = {"student_p": student, "teacher_p": teacher}.get(mode, np.zeros_like(student))
    exp = np.exp(logits - logits.max())
    return exp / exp.sum()


def top_k_reverse_kl(student: Sequence[LogProbs], teacher_top: Sequence[LogProbs],
                     teacher_scored: Sequence[LogProbs], *, strategy: str, weight_mode: str
                     ) -> Float32[np.ndarray, " r"]:
    """One estimate per position (module docstring). ``student[t]``: the student's top-k;
    ``teacher_top[t]``: the teacher's own top-k (empty unless asked); ``teacher_scored[t]``:
    the teacher's log-probs of the ids it was asked about. The teacher's value of a token is
    its top-k entry, else its scored one."""
    if not len(student) == len(teacher_top) == len(teacher_scored):
        raise DistillationError(f"top-k distillation got {len(student)} student, "
                                f"{len(teacher_top)} teacher top-k and {len(teacher_scored)} "
                                "teacher-scored positions. Fix: give one entry per response "
                                "token in each.")
    out = np.zeros(len(student), dtype=np.float32)
    for t, (s, top, scored) in enumerate(zip(student, teacher_top, teacher_scored)):
        ids = token_set(strategy, s, top)
        if not ids:
            continue
        missing = [y for y in ids if y not in top and y not in scored]
        if missing:
            raise DistillationError(f"response token {t}: the teacher gave no log-prob of the "
                                    f"token ids {missing[:4]}. Fix: serve the teacher with "
                                    "SGLang's /generate, which scores token_ids_logprob.")
        ls = np.array([s[y] for y in ids], dtype=np.float64)
        lt = np.array([top[y] if y in top else scored[y] for y in ids], dtype=np.float64)
        if not (np.isfinite(ls).all() and np.isfinite(lt).all()):
            raise DistillationError(f"response token {t}: a log-prob of the tokens {ids[:4]} "
                                    "is not finite. Fix: report raw, finite log-probs.")
        out[t] = float(np.dot(weights(ls, lt, weight_mode), ls - lt))
    return out

