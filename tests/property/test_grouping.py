"""The numpy grouping of integer ids equals the plain definition (dict, first occurrence).

``group_samples`` groups integer ids with one sort (none when they never decrease) and gathers
the groups' members without sorting again; the dict path and ``Grouping.from_dense`` define
the result: dense numbers in first-occurrence order, members in index order.
"""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from vime_pure.grouping import Grouping, dense_first_occurrence, group_samples


@st.composite
def int_ids(draw):
    """Few distinct ids (many siblings), sometimes sorted, as a list or an int array."""
    ids = draw(st.lists(st.integers(-3, 6), max_size=40))
    if draw(st.booleans()):
        ids.sort()
    return np.array(ids, dtype=np.int64) if draw(st.booleans()) else ids


@given(int_ids())
def test_int_grouping_equals_first_occurrence_definition(ids):
    """Sorted fast path and sorted-runs gather both number groups by first occurrence and keep
    siblings in index order, as the dict path and ``from_dense`` do."""
    got = group_samples(ids)
    dense, values = dense_first_occurrence(list(np.asarray(ids, dtype=np.int64).tolist()))
    want = Grouping.from_dense(dense, values)
    assert got.ids == want.ids
    for name in ("dense", "order", "offsets"):
        assert np.array_equal(getattr(got, name), getattr(want, name)), name
        assert getattr(got, name).dtype == np.int64, name
