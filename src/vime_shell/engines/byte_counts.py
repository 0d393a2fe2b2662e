"""Bytes a rank sent and received outside the share exchange, per kind of message.

Two channels move a rollout's data besides the exchange (:mod:`vime_shell.sources.exchange`,
which keeps its own ``ExchangeStats``): the **bridge** between trainer rank 0 and engine ranks
of their own (:class:`vime_shell.engines.remote.Bridge`: batch replies and fully-async parts,
weights, probes, commands) and, colocated, the engine leaders' **gather** of their outputs on
rank 0 when rank 0 holds the whole batch (:meth:`vime_shell.engines.group.EngineGroup.
run_shares`). Each keeps one :class:`ByteCounts`; the loop takes it after every rollout
(``take``: the counts since the last take) and hands it to ``on_rollout``
(``RolloutEvent.transfers``), so a test or benchmark reads, per rank and per rollout, what
reached the rank.

Kinds (``KINDS``): ``batch`` (a rollout's samples: batch replies, fully-async parts, gathered
rollout outputs; and the dynamic-sampling verdicts the holders exchange instead of samples), ``weights`` (buckets and their names), ``probe`` (weight-sync probes),
``control`` (commands, evaluation results, errors). The bridge counts the pickled payload it
builds anyway (plus its 8-byte length), so counting costs no copy; a gather of Python objects
is counted by pickling into a sink that keeps no byte (:func:`pickled_size`).

Example: an engine rank's ``("batch", 0, batch, ...)`` reply of 9 000 pickled bytes counts
``sent["batch"] += 9008`` there and ``received["batch"] += 9008`` on trainer rank 0.
"""

import pickle
from typing import Any

import attrs

KINDS = ("batch", "weights", "probe", "control")
LENGTH_BYTES = 8  # the int64 length that precedes every bridge message
_TAGS = {"batch": "batch", "part": "batch", "probe": "probe"}  # a reply's first item -> kind


def _zeros() -> dict[str, int]:
    return dict.fromkeys(KINDS, 0)


@attrs.define
class ByteCounts:
    """Bytes sent and received per kind (``KINDS``) since the last :meth:`take`."""

    sent: dict[str, int] = attrs.field(factory=_zeros)
    received: dict[str, int] = attrs.field(factory=_zeros)

    def add_sent(self, kind: str, nbytes: int) -> None:
        self.sent[kind] += nbytes

    def add_received(self, kind: str, nbytes: int) -> None:
        self.received[kind] += nbytes

    def take(self) -> "ByteCounts":
        """The counts so far; this counter starts again from zero."""
        taken = ByteCounts(sent=self.sent, received=self.received)
        self.sent, self.received = _zeros(), _zeros()
        return taken

    def plus(self, other: "ByteCounts") -> "ByteCounts":
        return ByteCounts(sent={k: self.sent[k] + other.sent[k] for k in KINDS},
                          received={k: self.received[k] + other.received[k] for k in KINDS})

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {"sent": dict(self.sent), "received": dict(self.received)}


def message_kind(message: Any) -> str:
    """The kind of a bridge reply, from its tag. Example: ``("part", 3, ...)`` -> ``"batch"``;
    ``("eval", {...})`` -> ``"control"``."""
    tag = message[0] if isinstance(message, tuple) and message else None
    return _TAGS.get(tag, "control") if isinstance(tag, str) else "control"


class _Sink:
    """A file that only counts what is written to it."""

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: Any) -> int:
        n = memoryview(data).nbytes
        self.size += n
        return n


def pickled_size(obj: Any) -> int:
    """Bytes of ``obj`` pickled as ``gather_object`` pickles it, without keeping them."""
    sink = _Sink()
    pickle.Pickler(sink).dump(obj)
    return sink.size
