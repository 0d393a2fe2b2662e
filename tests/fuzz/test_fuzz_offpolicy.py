"""Fuzz: weight-version staleness and the off-policy correction settings, on valid and invalid
inputs (junk types, versions newer than the trainer, negative or bool versions, bands out of
order). Success gives the documented values; failure a ``VimeError``."""

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.harness import REJECTED, outcome
from tests.fuzz.strategies import BAD_REALS, JUNK, good_reals, mostly, one_bad
from vime_pure.policy_config import RejectionConfig
from vime_pure.staleness import group_staleness, sample_staleness
from vime_pure.torch_ops.offpolicy import rejection_keep

VERSIONS = st.lists(st.integers(-2, 8), max_size=6)


@given(mostly(VERSIONS.map(lambda v: np.asarray(v, dtype=np.int64)), JUNK),
       mostly(st.integers(0, 8), st.one_of(st.integers(-3, -1), JUNK)))
def test_sample_staleness(versions, trainer):
    out = outcome("sample_staleness", sample_staleness, versions, trainer)
    if out is not REJECTED:
        expected = [0 if v == -1 else trainer - v for v in np.asarray(versions).tolist()]
        assert out.tolist() == expected and all(x >= 0 for x in expected)


@given(st.data())
def test_group_staleness(data):
    n = data.draw(st.integers(0, 6))
    versions = np.asarray(data.draw(st.lists(st.integers(-1, 4), min_size=n, max_size=n)),
                          dtype=np.int64)
    groups = data.draw(mostly(st.lists(st.integers(0, 3), min_size=n, max_size=n).map(
        lambda g: np.asarray(g, dtype=np.int64)), JUNK))
    out = outcome("group_staleness", group_staleness, groups, versions, 4)
    if out is not REJECTED:
        for i, g in enumerate(np.asarray(groups).tolist()):
            siblings = [4 if v == -1 else v for v, h in zip(versions.tolist(), groups) if h == g]
            assert out[i] == 4 - min(siblings)


@given(one_bad({"level": st.sampled_from(["token", "sequence", "geometric"]),
                "lower": good_reals(0, 1), "upper": good_reals(1, 5),
                "denominator": st.sampled_from(["original", "surviving"])},
               {"lower": BAD_REALS, "upper": BAD_REALS}))
def test_rejection_config_and_keep(kwargs):
    config = outcome("RejectionConfig", lambda: RejectionConfig(**kwargs))
    if config is REJECTED:
        return
    log_ratio = torch.tensor([0.0, 2.0, -2.0, 0.1], dtype=torch.float64)
    keep = outcome("rejection_keep", rejection_keep, log_ratio, torch.zeros(4, dtype=torch.float64),
                   torch.ones(4, dtype=torch.float64), torch.tensor([0, 0, 1, 1]), config)
    assert keep is not REJECTED and set(keep.tolist()) <= {0.0, 1.0}
