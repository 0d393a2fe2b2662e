"""``Sample``: one trajectory as a rollout function produces it (mutable, slotted).

Rollout functions fill samples in step by step, so ``Sample`` is a mutable ``attrs`` class. It
is slotted and has no validators or converters, so attribute reads and writes are plain slot
accesses (attrs generates no ``__setattr__`` hook). Validation happens once, at the boundary, in
``vime_pure.data.rollout_output`` and ``RolloutBatch.from_samples``, where errors can name the sample's path.

``rollout_id`` is the deprecated name of ``group_id``. It is a **write-only** property: setting
it warns ``DeprecationWarning`` and sets ``group_id``; reading it raises ``AttributeError``;
``Sample(rollout_id=...)`` is a ``TypeError`` (it is not a field). A property is one more class
descriptor, so reads of other attributes cost exactly what they did
(``benchmarks/sample_access.py`` measures it).

Invariants the tests assert: ``Sample.from_dict(s.to_dict()) == s`` for every sample; ``to_dict``
never writes ``rollout_id``; ``from_dict`` reads a legacy ``rollout_id`` only when ``group_id`` is
absent; unknown keys are an error, never dropped.

slime's plugin view: ``sample.prompt``, ``sample.response`` and ``sample.label`` read and write
``metadata["prompt"]``, ``["response"]`` and ``["label"]`` (the one copy; ``None`` when absent),
so a slime reward function reading ``sample.response`` works unchanged; ``status`` and
``metadata`` are fields already.

Example::

    s = Sample(tokens=[5, 6, 7, 8], response_length=2, reward=1.0, group_id=3)
    s.to_dict()["loss_mask"]                      # None: normalised to [1, 1] later
    Sample.from_dict({"tokens": [5], "rollout_id": 9}).group_id   # 9
"""

import enum
import warnings
from collections.abc import Hashable, Mapping
from typing import Any

import attrs
import numpy as np

from vime_pure.errors import RolloutValidationError, field_error


class Status(str, enum.Enum):
    """How generation ended. The batch stores ``list(Status).index(status)`` as a uint8 code."""

    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"


STATUSES: tuple[Status, ...] = tuple(Status)


def as_status(value: object, where: str = "status") -> Status:
    """``Status`` from a ``Status`` or its string value; anything else is a typed error."""
    try:
        return Status(value)
    except ValueError:
        raise field_error(RolloutValidationError, where, value, "is not a sample status",
                          f"use one of {[s.value for s in STATUSES]}") from None


def _same(a: object, b: object) -> bool:
    """Equality that also works for numpy token / mask / log-prob arrays."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if a is None or b is None:
            return False
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    return bool(a == b)


_ARRAY_EQ = attrs.cmp_using(eq=_same, require_same_type=False)


@attrs.define(slots=True)
class Sample:
    """One trajectory: prompt + response tokens and what the trainer needs about it.

    ``tokens``: prompt followed by response token ids (list of ints or 1-D integer array).
    ``response_length``: how many trailing tokens are the response (the trained part).
    ``loss_mask``: one 0/1 per response token; ``None`` means all ones.
    ``reward``: a float, or a dict of named rewards read through ``reward_key`` at batch time.
    ``group_id``: the rollout execution that produced it; siblings share it (int or str).
    ``prompt_group``: the prompt's id, the unit of reward normalisation (int or str).
    ``index``: the caller's sample index (informational). ``rollout_log_probs``: one log-prob
    per response token from the engine. ``remove_sample``: keep the sample but zero its mask.
    Example: ``Sample(tokens=[1, 2, 3], response_length=1, reward=0.5)``.
    """

    tokens: list[int] | np.ndarray = attrs.field(factory=list, eq=_ARRAY_EQ)
    response_length: int = 0
    loss_mask: list[int] | np.ndarray | None = attrs.field(default=None, eq=_ARRAY_EQ)
    reward: float | dict[str, float] | None = None
    status: Status | str = Status.COMPLETED
    group_id: Hashable | None = None
    index: int | None = None
    prompt_group: Hashable | None = None
    rollout_log_probs: list[float] | np.ndarray | None = attrs.field(default=None, eq=_ARRAY_EQ)
    remove_sample: bool = False
    metadata: dict[str, Any] = attrs.field(factory=dict)

    def _read_rollout_id(self) -> Any:
        raise AttributeError("Sample.rollout_id is a deprecated write-only alias of group_id. "
                             "Fix: read sample.group_id instead.")

    def _write_rollout_id(self, value: Hashable | None) -> None:
        warnings.warn("Sample.rollout_id is deprecated; set sample.group_id instead.",
                      DeprecationWarning, stacklevel=2)
        self.group_id = value

    rollout_id = property(_read_rollout_id, _write_rollout_id,
                          doc="Deprecated write-only alias of ``group_id``.")

    # slime's plugin-visible text fields, as views onto ``metadata`` (module docstring).
    prompt = property(lambda self: self.metadata.get("prompt"),
                      lambda self, v: self.metadata.__setitem__("prompt", v),
                      doc="The prompt text: a view of ``metadata['prompt']``.")
    response = property(lambda self: self.metadata.get("response"),
                        lambda self, v: self.metadata.__setitem__("response", v),
                        doc="The decoded response: a view of ``metadata['response']``.")
    label = property(lambda self: self.metadata.get("label"),
                     lambda self, v: self.metadata.__setitem__("label", v),
                     doc="The reference answer: a view of ``metadata['label']``.")

    def to_dict(self) -> dict[str, Any]:
        """Every field as plain Python (arrays become lists, ``status`` its string value)."""
        out: dict[str, Any] = {}
        for f in FIELD_NAMES:
            value = getattr(self, f)
            if isinstance(value, np.ndarray):
                value = value.tolist()
            elif isinstance(value, (list, dict)):
                value = _copy_plain(value)
            out[f] = value
        out["status"] = as_status(self.status).value
        return out

    @classmethod
    def from_dict(cls, data: object) -> "Sample":
        """Inverse of ``to_dict``. A legacy ``rollout_id`` key is read only when ``group_id`` is
        absent (``group_id`` wins when both are present); unknown keys are an error."""
        if not isinstance(data, Mapping):
            raise field_error(RolloutValidationError, "data", type(data).__name__,
                              "is not a mapping", "pass the dict produced by Sample.to_dict()")
        fields = dict(data)
        legacy = fields.pop("rollout_id", None)
        if "rollout_id" in data:
            warnings.warn("Sample dict key 'rollout_id' is deprecated; write 'group_id'.",
                          DeprecationWarning, stacklevel=2)
            if "group_id" not in fields:
                fields["group_id"] = legacy
        unknown = sorted(set(fields) - set(FIELD_NAMES), key=repr)  # keys may mix types
        if unknown:
            raise field_error(RolloutValidationError, "keys", unknown, "are not Sample fields",
                              f"remove them or move them under 'metadata'; fields are "
                              f"{list(FIELD_NAMES)}")
        if "status" in fields:
            fields["status"] = as_status(fields["status"])
        return cls(**{k: _copy_plain(v) for k, v in fields.items()})


FIELD_NAMES: tuple[str, ...] = tuple(f.name for f in attrs.fields(Sample))
setattr(Sample, "Status", Status)  # slime's spelling in plugins: Sample.Status.TRUNCATED


def _copy_plain(value: Any) -> Any:
    """Copy lists and dicts one level deep per nesting, so dicts never alias a live sample."""
    if isinstance(value, list):
        return [_copy_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy_plain(v) for k, v in value.items()}
    return value
