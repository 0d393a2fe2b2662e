"""Test-wide settings: Hypothesis profiles and single-threaded torch.

Profiles (pick one with ``HYPOTHESIS_PROFILE=<name>``; without it, ``ci`` when ``CI=true``, else
``default``; ``HYPOTHESIS_PROFILE`` always wins over ``CI``):

- ``ci``: derandomised, 200 examples, no example database: ``make test`` in CI, the same
  examples on every run.
- ``default``: local runs, 100 random examples; failures are saved in ``.hypothesis/``
  (gitignored) and replayed first on the next run.
- ``dev``: like ``default`` with 2000 examples.
- ``deep``: what ``make test-deep`` runs: ``dev``'s 2000 random examples (or
  ``VIME_DEEP_EXAMPLES``), never derandomised, and no example database, so a run depends only on
  the code and the seed that ``make test-deep`` prints (``--hypothesis-seed``): a failure is
  reproduced by passing the same seed, and nothing is written next to the checkout.
"""

import os
import random

from beartype._check.code import codemain as _beartype_codemain

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported anywhere
# Under the jaxtyping import hook beartype checks one random item of each container, drawn with
# the global ``random`` (``getrandbits`` bound into every wrapper it generates). Core objects
# built inside Hypothesis strategies would then move the global state, which Hypothesis flags
# ("Do not use the random module inside strategies"). A private generator, installed before any
# vime_pure module is imported and wrapped, keeps the global state untouched.
_beartype_codemain.getrandbits = random.Random(0).getrandbits

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from tests.fuzz.harness import COUNTS, REJECTIONS  # noqa: E402

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
# CI's make test: derandomized, as many examples as a local run (its make test-deep right after
# explores 2000 per property with a fresh seed); 200 here cost a minute of make test.
settings.register_profile("ci", max_examples=100, derandomize=True, database=None, **_COMMON)
settings.register_profile("default", max_examples=100, **_COMMON)
settings.register_profile("dev", max_examples=2000, **_COMMON)
settings.register_profile(
    "deep", max_examples=int(os.environ.get("VIME_DEEP_EXAMPLES", "2000")), derandomize=False,
    database=None, print_blob=True, **_COMMON)
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


# -- fuzz harness summary ---------------------------------------------------------------------
# How many inputs each entry point tried (tests/fuzz/harness.py counts them). The hooks live in
# this root conftest because under xdist only it is loaded by the controller, which merges the
# workers' counts (sent back in ``workeroutput``) and prints them once.
_MERGED: dict[str, list[int]] = {}


def pytest_sessionfinish(session) -> None:
    counts = {k: [COUNTS[k], REJECTIONS[k]] for k in COUNTS}
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand them to the controller
        session.config.workeroutput["fuzz_counts"] = counts
    else:
        _merge(counts)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    _merge(getattr(node, "workeroutput", {}).get("fuzz_counts", {}))


def _merge(counts: dict) -> None:
    for entry, (tried, rejected) in counts.items():
        total = _MERGED.setdefault(entry, [0, 0])
        total[0] += tried
        total[1] += rejected


def pytest_terminal_summary(terminalreporter, config) -> None:
    if not _MERGED:
        return
    terminalreporter.section("fuzz inputs per entry point (tried / rejected with a VimeError)")
    for entry in sorted(_MERGED):
        tried, rejected = _MERGED[entry]
        terminalreporter.write_line(f"{entry:32s} {tried:6d} / {rejected:6d}")
    # Recorded in .pytest_cache/v/vime/fuzz_counts; no cache under -p no:cacheprovider.
    if getattr(config, "cache", None) is not None:
        config.cache.set("vime/fuzz_counts", _MERGED)
