"""An agent session as an append-only tree of token paths, and its leaves as training samples.

An agent talks to the engine in requests (:class:`Turn`): the whole context it sends (the
rendered messages, as token ids) and what the model answered. Usually each request extends the
last one: same tokens, plus the answer, plus new messages (a tool result, the user). When the
agent rewrites its history (compaction), retries, or starts a sub-agent in the same session, a
request no longer extends anything; it shares only a prefix with what came before. A session
keeps every full context it reached as a *path*; its leaves are the paths no request extended.

Data flow::

    add_turn(session, turn)   the path whose tokens are the longest prefix of turn.prompt:
                              extended in place when the prompt holds all of it, else a new
                              path that branches where the tokens differ (or where the shorter
                              one ends); prompt tokens past the match are context, the
                              answer is generated
    leaf_samples(session)     one Sample per path, in creation order: loss mask 1 on the
                              generated tokens the path owns, 0 elsewhere; the engine's log-probs
                              and one weight version per owned turn

Ownership: a generated token shared by several paths (a branch kept it in its prefix) trains in
one sample only, the path that generated it; every path after it holds it as context (mask
0). So the leaves of one execution count each generated token exactly once, and the group's
loss denominator (the sum of its samples' masks, ``vime_pure.denominators``) is the number of
tokens the model generated in the execution, however many samples it emitted.

Invariants the tests assert (``tests/property/test_sessions.py``): every generated token has
mask 1 in exactly one leaf, and mask 1 only ever marks a generated token; a leaf's tokens are
the last context a request sent along it plus the model's answer; a branch starts exactly where
its tokens leave the path it came from; the leaves' mask total is the number of generated
tokens.

Example: turns ``prompt [1, 2] -> [7, 8]`` and ``prompt [1, 2, 7, 8, 3] -> [9]`` give one leaf
``[1, 2, 7, 8, 3, 9]`` (response ``[7, 8, 3, 9]``, mask ``[1, 1, 0, 1]``); a third turn
``prompt [1, 2, 5] -> [6]`` (a rewritten history) adds a second leaf ``[1, 2, 5, 6]`` with
response ``[6]`` (its context, the shared ``[1, 2]`` included, is its prompt).
"""

from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from vime_pure.data.sample import Sample, Status
from vime_pure.errors import RolloutValidationError, field_error
from vime_pure.token_versions import NO_VERSION, version_runs

CONTEXT = -1  # a token's origin when no turn of the session generated it


def _token_ids(field: str):
    def check(_: object, __: attrs.Attribute, value: tuple[int, ...]) -> None:
        if any(not isinstance(t, (int, np.integer)) or isinstance(t, bool) or t < 0
               for t in value):
            raise field_error(RolloutValidationError, field, value,
                              "holds a value that is not a token id (an int >= 0)",
                              "pass the engine's token ids")
    return check


def _tuple(values: Iterable[Any]) -> tuple[Any, ...]:
    return tuple(values)


@attrs.frozen(kw_only=True)
class Turn:
    """One request of a session: ``prompt``, every token the engine read; ``output``, the
    tokens the model generated, with their ``log_probs`` (one each) under weight version
    ``weight_version``; ``status``, how the generation ended. Checked at construction."""

    prompt: tuple[int, ...] = attrs.field(converter=_tuple, validator=_token_ids("prompt"))
    output: tuple[int, ...] = attrs.field(converter=_tuple, validator=_token_ids("output"))
    log_probs: tuple[float, ...] = attrs.field(converter=_tuple)
    weight_version: int = 0
    status: Status = Status.COMPLETED
    # the version that sampled each output token, where a sync landed inside the request
    # (``Generation.token_versions``); None: all ``weight_version``
    token_versions: tuple[int, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(_tuple))

    def __attrs_post_init__(self) -> None:
        if len(self.log_probs) != len(self.output):
            raise field_error(RolloutValidationError, "log_probs", len(self.log_probs),
                              f"must hold one value per output token ({len(self.output)})",
                              "pass the engine's log-probs of the generated tokens")
        if not self.prompt:
            raise field_error(RolloutValidationError, "prompt", self.prompt,
                              "is empty: the engine reads at least one token",
                              "pass the rendered context's token ids")
        if self.token_versions is not None and len(self.token_versions) != len(self.output):
            raise field_error(RolloutValidationError, "token_versions", len(self.token_versions),
                              f"must hold one version per output token ({len(self.output)})",
                              "pass the engine's token_versions, or None")
        if isinstance(self.weight_version, bool) or not isinstance(
                self.weight_version, (int, np.integer)) or self.weight_version < 0:
            raise field_error(RolloutValidationError, "weight_version", self.weight_version,
                              "is not a weight version (an int >= 0)",
                              "pass the engine's weight_version of the request")


@attrs.frozen
class Path:
    """One full context of a session: its ``tokens``, each token's ``origin`` (the index of
    the turn that generated it, or ``CONTEXT``), and ``owned_from``: the first position this
    path owns (the tokens before it are another path's, which trains their generated ones).
    ``last_turn``: the turn whose answer ends the path."""

    tokens: tuple[int, ...]
    origin: tuple[int, ...]
    owned_from: int
    last_turn: int


@attrs.frozen
class Session:
    """The session's turns in arrival order and its paths in creation order (a new branch is
    appended; an extended path keeps its place). Build it with :func:`add_turn`."""

    turns: tuple[Turn, ...] = ()
    paths: tuple[Path, ...] = ()


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def attach_point(session: Session, prompt: Sequence[int]) -> tuple[int | None, int]:
    """``(path index, matched tokens)``: the path sharing the longest prefix with ``prompt``
    (ties: a path the prompt holds whole, then the first created); ``(None, 0)`` when no path
    shares a token."""
    best, best_len, best_whole = None, 0, False
    for i, path in enumerate(session.paths):
        n = _common_prefix(path.tokens, prompt)
        whole = n == len(path.tokens)
        if n > best_len or (n == best_len and n > 0 and whole and not best_whole):
            best, best_len, best_whole = i, n, whole
    return best, best_len


def add_turn(session: Session, turn: Turn) -> Session:
    """``session`` with ``turn`` attached (module docstring); pure."""
    index = len(session.turns)
    at, matched = attach_point(session, turn.prompt)
    prefix = session.paths[at] if at is not None else None
    shared_origin = prefix.origin[:matched] if prefix is not None else ()
    tokens = tuple(turn.prompt) + turn.output
    origin = (shared_origin + (CONTEXT,) * (len(turn.prompt) - matched)
              + (index,) * len(turn.output))
    paths = list(session.paths)
    if at is not None and prefix is not None and matched == len(prefix.tokens):  # extends it
        paths[at] = Path(tokens, origin, owned_from=prefix.owned_from, last_turn=index)
    else:  # a branch: owns only what it adds
        paths.append(Path(tokens, origin, owned_from=matched, last_turn=index))
    return Session(turns=session.turns + (turn,), paths=tuple(paths))


def session_of(turns: Sequence[Turn]) -> Session:
    """Every turn added in order. Example: ``session_of([])`` has no paths."""
    session = Session()
    for turn in turns:
        session = add_turn(session, turn)
    return session


def leaf_samples(session: Session, *, group_id: int | str | None = None) -> list[Sample]:
    """One :class:`Sample` per path that owns a generated token (module docstring), all in
    ``group_id``: the prompt runs up to the first owned generated token; the response's loss
    mask is 1 exactly on the owned generated tokens, its log-probs the engine's there (0
    elsewhere); ``weight_versions`` one per owned turn, in order; the status is the last
    turn's. A path that owns no generated token (an answer of no tokens) trains nothing and
    gives no sample; :func:`untrained_paths` counts them."""
    out = []
    for path in session.paths:
        owned = _owned_generated(path)
        if not owned:
            continue
        start = owned[0]  # past owned_from: every generated token of the response is owned
        mask = [int(path.origin[p] != CONTEXT) for p in range(start, len(path.tokens))]
        log_probs = [_log_prob(session, path, p) if m else 0.0
                     for p, m in zip(range(start, len(path.tokens)), mask)]
        turns = sorted({path.origin[p] for p in owned})
        token_versions = [_version(session, path, p) if m else NO_VERSION
                          for p, m in zip(range(start, len(path.tokens)), mask)]
        versions = (version_runs(token_versions)[0]  # a sync may have landed inside a turn
                    if any(session.turns[t].token_versions is not None for t in turns)
                    else sorted(session.turns[t].weight_version for t in turns))
        out.append(Sample(tokens=list(path.tokens), response_length=len(path.tokens) - start,
                          loss_mask=mask, rollout_log_probs=log_probs, group_id=group_id,
                          status=session.turns[path.last_turn].status,
                          weight_versions=versions, token_versions=token_versions))
    return out


def untrained_paths(session: Session) -> int:
    """Paths that own no generated token (no sample from :func:`leaf_samples`)."""
    return sum(not _owned_generated(p) for p in session.paths)


def _owned_generated(path: Path) -> list[int]:
    """The positions of the generated tokens ``path`` owns (module docstring: ownership)."""
    return [p for p in range(path.owned_from, len(path.tokens)) if path.origin[p] != CONTEXT]


def _log_prob(session: Session, path: Path, position: int) -> float:
    """The engine's log-prob of the generated token at ``position``: its turn's output holds
    it at ``position`` minus where that turn's answer starts on this path."""
    turn = session.turns[path.origin[position]]
    start = len(turn.prompt)  # a turn's answer follows its prompt on every path holding it
    return float(turn.log_probs[position - start])


def _version(session: Session, path: Path, position: int) -> int:
    """The weight version that sampled the generated token at ``position`` (its turn's, or
    the turn's per-token record)."""
    turn = session.turns[path.origin[position]]
    if turn.token_versions is None:
        return int(turn.weight_version)
    return int(turn.token_versions[position - len(turn.prompt)])
