"""Test-wide settings: Hypothesis profiles and single-threaded torch.

Profiles: ``ci`` (derandomised, a few hundred examples, no deadline; Hypothesis loads it when
``CI=true``), ``default`` (local runs, 100 examples) and ``dev`` (heavier: 2000 examples).
Select one with ``HYPOTHESIS_PROFILE=dev``.
"""

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")

from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=200, derandomize=True, database=None, **_COMMON)
settings.register_profile("default", max_examples=100, **_COMMON)
settings.register_profile("dev", max_examples=2000, **_COMMON)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
else:
    settings.load_profile("ci" if os.environ.get("CI", "").lower() == "true" else "default")


@pytest.fixture(scope="session")
def embedded_pair(tmp_path_factory):
    """Two embedded models (seeds 0 and 1): same shapes, different weights, for weight syncs."""
    from vime_shell.models.embedded import EmbeddedSpec, build_embedded

    cache = tmp_path_factory.mktemp("embedded")
    return build_embedded(cache, EmbeddedSpec(seed=0)), build_embedded(cache, EmbeddedSpec(seed=1))
