"""The documentation points at things that exist: every relative link of the README, the
``docs/`` pages and ``tests/README.md`` reaches a file (and a heading, for ``#anchor`` links),
every test file a page names exists, and ``tests/README.md`` maps every test file."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "tests" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
TEST_PATH = re.compile(r"`((?:tests/)?(?:\w+/)*test_\w+\.py)`")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in page.read_text().splitlines()
            if line.startswith("#")}


def test_every_relative_link_reaches_a_file_and_its_heading():
    broken = []
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or (anchor and anchor not in _anchors(dest)):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_every_test_file_a_page_names_exists():
    missing = []
    for page in PAGES:
        base = REPO / "tests" if page.parent.name == "tests" else REPO
        for name in TEST_PATH.findall(page.read_text()):
            if "/" in name and not (base / name).exists() and not (REPO / name).exists():
                missing.append(f"{page.relative_to(REPO)}: {name}")
    assert not missing, missing


def test_the_test_map_names_every_test_file():
    """A new test file gets its line in tests/README.md, under the behaviour it asserts."""
    text = (REPO / "tests" / "README.md").read_text()
    files = sorted(p.relative_to(REPO / "tests").as_posix()
                   for p in (REPO / "tests").rglob("test_*.py"))
    unmapped = [f for f in files if f"`{f}`" not in text]
    assert not unmapped, f"add these to tests/README.md: {unmapped}"
