"""Test-wide settings: Hypothesis profiles and single-threaded torch.

Profiles: ``ci`` (derandomised, a few hundred examples, no deadline; Hypothesis loads it when
``CI=true``), ``default`` (local runs, 100 examples) and ``dev`` (heavier: 2000 examples).
Select one with ``HYPOTHESIS_PROFILE=dev``.
"""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=200, derandomize=True, database=None, **_COMMON)
settings.register_profile("default", max_examples=100, **_COMMON)
settings.register_profile("dev", max_examples=2000, **_COMMON)
if os.environ.get("HYPOTHESIS_PROFILE"):
    settings.load_profile(os.environ["HYPOTHESIS_PROFILE"])
else:
    settings.load_profile("ci" if os.environ.get("CI", "").lower() == "true" else "default")


# -- fuzz harness summary ---------------------------------------------------------------------
# How many inputs each entry point tried (tests/fuzz/harness.py counts them). The hooks live in
# this root conftest because under xdist only it is loaded by the controller, which merges the
# workers' counts (sent back in ``workeroutput``) and prints them once.
from tests.fuzz.harness import COUNTS, REJECTIONS  # noqa: E402

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
    if config.cache is not None:  # recorded too: .pytest_cache/v/vime/fuzz_counts
        config.cache.set("vime/fuzz_counts", _MERGED)
