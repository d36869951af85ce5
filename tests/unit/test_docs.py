"""The README and the pages under docs/ point at things that exist: every link's file and
heading, and every repository path they quote (`pipeline/storage/output.py`,
`tests/integration/run/test_resume.py::test_...`). A page that outlives a move fails here."""

import re
from pathlib import Path

import pytest

from tests.helpers import REPO

PAGES = [REPO / "README.md", REPO / "bench" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
QUOTED = re.compile(r"`((?:pipeline|tests|bench|conf|jobs|docs|dashboards|constraints)/[^`\s*<>{}]+)`")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#{1,6} (.+)", line)):
            found.add(slug(m.group(1)))
    return found


def prose(page: Path) -> str:
    """The page without its fenced blocks (examples of output, not claims about the tree)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_reaches_a_file_and_a_heading(page):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"^[a-z]+:", target):
            continue  # http(s), mailto: outside the repository
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_quoted_repository_path_exists(page):
    missing = sorted({q for q in QUOTED.findall(prose(page))
                      if not (REPO / q.split("::")[0].rstrip(".,:;)")).exists()})
    assert missing == []


def test_the_slugs_are_githubs():
    assert slug("Object stores (S3, MinIO)") == "object-stores-s3-minio"
    assert slug("Tuning: `pipeline tune`") == "tuning-pipeline-tune"
