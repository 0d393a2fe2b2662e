"""Sample: dict round trip, the write-only deprecated ``rollout_id`` alias, slotted layout."""

import json
import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from vime_pure import RolloutValidationError, Sample, Status
from tests.property.data_strategies import samples

ids = st.none() | st.integers(-5, 10**6) | st.text(max_size=8)
metadata = st.dictionaries(st.text(max_size=5), st.integers() | st.text(max_size=5)
                           | st.lists(st.integers(), max_size=3), max_size=3)


@st.composite
def any_sample(draw) -> Sample:
    s = draw(samples())
    s.group_id = draw(ids)
    s.prompt_group = draw(ids)
    s.metadata = draw(metadata)
    if draw(st.booleans()):
        s.reward = {"acc": draw(st.floats(allow_nan=False)), "len": draw(st.integers())}
    return s


@given(any_sample())
def test_dict_round_trip_keeps_every_field(s):
    """``to_dict`` writes every slot as plain JSON values (never the alias) and ``from_dict``
    reads each back unchanged."""
    d = s.to_dict()
    assert "rollout_id" not in d
    assert Sample.from_dict(d) == s
    assert Sample.from_dict(json.loads(json.dumps(d))) == s  # plain, JSON-ready values
    assert set(d) == {f for f in Sample.__slots__ if f != "__weakref__"}


@given(any_sample(), ids)
def test_legacy_rollout_id_read_only_without_group_id(s, legacy):
    """``from_dict`` reads the legacy ``rollout_id`` key as ``group_id`` only when ``group_id``
    is absent, warns as setting the attribute does, and never writes it back."""
    d = s.to_dict()
    both = {**d, "rollout_id": legacy}
    with pytest.warns(DeprecationWarning, match="Sample.rollout_id is deprecated"):
        assert Sample.from_dict(both).group_id == s.group_id  # group_id wins
    del both["group_id"]
    with pytest.warns(DeprecationWarning):
        back = Sample.from_dict(both)
    assert back.group_id == legacy
    assert "rollout_id" not in back.to_dict()


def test_legacy_rollout_id_key_warns_with_the_seeds_text():
    """The seed's tests match "Sample.rollout_id is deprecated" for a legacy dump key too."""
    legacy = {**Sample(tokens=[1, 2], response_length=1).to_dict(), "rollout_id": 7}
    legacy.pop("group_id")
    with pytest.warns(DeprecationWarning, match=r"^Sample\.rollout_id is deprecated"):
        assert Sample.from_dict(legacy).group_id == 7


@given(any_sample(), st.text(max_size=8), st.text(max_size=8))
def test_slime_text_fields_are_views_of_metadata(s, response, label):
    """slime plugins read and write ``sample.response`` / ``.label`` / ``.prompt``: one copy,
    in ``metadata``, so the two spellings can never disagree."""
    s.response, s.label = response, label
    assert (s.metadata["response"], s.metadata["label"]) == (response, label)
    s.metadata["prompt"] = "p"
    assert s.prompt == "p" and s.response == response and s.label == label
    assert Sample.from_dict(s.to_dict()).response == response  # no second field to serialise


def test_rollout_id_is_write_only_and_deprecated():
    s = Sample(tokens=[1, 2], response_length=1)
    with pytest.warns(DeprecationWarning, match="set sample.group_id instead"):
        s.rollout_id = 7
    assert s.group_id == 7
    with pytest.raises(AttributeError, match="write-only alias of group_id"):
        _ = s.rollout_id
    with pytest.raises(TypeError, match="rollout_id"):
        Sample(rollout_id=3)  # type: ignore[call-arg]


def test_alias_adds_no_per_access_hook():
    # Reads stay plain slot lookups: no __getattribute__/__getattr__/__setattr__ overrides.
    assert Sample.__getattribute__ is object.__getattribute__
    assert Sample.__setattr__ is object.__setattr__
    assert not hasattr(Sample, "__getattr__")
    assert not hasattr(Sample(tokens=[1]), "__dict__")


def test_numpy_fields_compare_and_serialise_as_lists():
    a = Sample(tokens=np.array([3, 4, 5]), response_length=2, loss_mask=np.array([1, 0]))
    b = Sample(tokens=[3, 4, 5], response_length=2, loss_mask=[1, 0])
    assert a == b and a != Sample(tokens=[3, 4, 6], response_length=2, loss_mask=[1, 0])
    assert a.to_dict()["tokens"] == [3, 4, 5] and a.to_dict()["loss_mask"] == [1, 0]


def test_to_dict_does_not_alias_the_live_sample():
    s = Sample(tokens=[1, 2], metadata={"turns": [1, 2]})
    d = s.to_dict()
    d["tokens"].append(9)
    d["metadata"]["turns"].append(3)
    assert s.tokens == [1, 2] and s.metadata == {"turns": [1, 2]}


def test_status_string_and_enum_are_interchangeable():
    assert Sample.from_dict({"status": "truncated"}).status is Status.TRUNCATED
    assert Sample(status="aborted").to_dict()["status"] == "aborted"


def test_from_dict_rejects_unknown_keys_and_bad_status():
    with pytest.raises(RolloutValidationError, match=r"keys=\['reward_model'\].*metadata"):
        Sample.from_dict({"tokens": [1], "reward_model": "x"})
    with pytest.raises(RolloutValidationError, match="status='done'.*completed"):
        Sample.from_dict({"status": "done"})
    with pytest.raises(RolloutValidationError, match="not a mapping"):
        Sample.from_dict([("tokens", [1])])  # type: ignore[arg-type]


def test_setting_alias_on_many_samples_warns_each_time():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for k in range(3):
            Sample().rollout_id = k
    assert [w.category for w in caught] == [DeprecationWarning] * 3


def test_dicts_without_weight_versions_are_on_policy():
    """A dict written before weight versions existed reads as on-policy (an empty list), and
    versions round-trip as plain ints."""
    old = {k: v for k, v in Sample(tokens=[1, 2], response_length=1).to_dict().items()
           if k != "weight_versions"}
    assert Sample.from_dict(old).weight_versions == []
    s = Sample(tokens=[1, 2], response_length=1, weight_versions=np.array([3, 5]))
    assert s.to_dict()["weight_versions"] == [3, 5] and Sample.from_dict(s.to_dict()) == s
