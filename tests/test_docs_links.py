"""The documents cite only what the repository holds: every relative link (and its ``#heading`` in a
Markdown file), and every path into the repository written in README.md, CHANGELOG.md and
docs/*.md, exists; none cites an issue tracker
that is not in the repository ("issue 12"). External URLs are not checked (no network in tests).

The rule for a path mention (``a/b.py`` in text or code): it is checked when its first folder is
one of the repository's own top-level folders (``hpctrain/``, ``tests/``, ``docs/`` ...), or, for a
``.py`` file, one of hpctrain's packages (``launch/rank.py`` means ``hpctrain/launch/rank.py``).
Any other path (``runs/a/summary.json``, ``RUN_DIR/model.pt``, ``/usr/share/...``) is something a
run writes or the machine holds, not a citation. Globs (``tests/*/x.py``) are not paths.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.dist_utils import ROOT

DOCS = sorted([ROOT / "README.md", *ROOT.glob("CHANGELOG.md"), *(ROOT / "docs").glob("*.md")])
URL = re.compile(r"[a-z][a-z0-9+.-]*://\S+|mailto:\S+", re.IGNORECASE)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# a relative path of two or more parts with a file extension, not inside a longer word or path
PATH = re.compile(r"(?<![\w/.~$*{-])((?:[\w.-]+/)+[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{1,5})(?![\w/*{])")
TRACKER = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


def _top_level() -> set[str]:
    return {p.name for p in ROOT.iterdir() if not p.name.startswith(".git")} - {"hpctrain.egg-info"}


def _subpackages() -> set[str]:
    return {p.name for p in (ROOT / "hpctrain").iterdir() if p.is_dir() and not p.name.startswith("__")}


def anchors(doc: Path) -> set[str]:
    """The heading anchors of a Markdown file, as GitHub makes them (lower case, punctuation
    dropped, spaces to hyphens)."""
    titles = re.findall(r"^#{1,6}\s+(.+?)\s*$", doc.read_text(), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for title in titles}


def missing_links(doc: Path) -> list[str]:
    """Relative link targets that name no file or folder, or no heading of a Markdown file."""
    text = doc.read_text()
    out = []
    for target in LINK.findall(text):
        if URL.match(target):
            continue
        path, _, anchor = target.partition("#")
        file = doc.parent / path if path else doc
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            out.append(target)
    return out


def missing_paths(doc: Path) -> list[str]:
    """Paths into the repository (the module's rule) that do not exist."""
    text = URL.sub(" ", doc.read_text())
    roots, packages = _top_level(), _subpackages()
    out = []
    for path in sorted(set(PATH.findall(text))):
        first = path.split("/", 1)[0]
        if first in roots:
            found = (ROOT / path).exists()
        elif first in packages and path.endswith(".py"):
            found = (ROOT / "hpctrain" / path).exists()
        else:
            continue
        if not found:
            out.append(path)
    return out


def test_the_rule_on_a_made_up_document(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("# Top `x` (y)\nSee [the data doc](data.md#the-format), [gone](nothere.md), [web](https://example.org/a.md),\n"
                   "[here](#top-x-y), [no heading](data.md#nosuch), [nor here](#nosuch) and\n"
                   "`hpctrain/cli/bench.py`, launch/rank.py, `hpctrain/nosuch.py`, parallel/gone.py,\n"
                   "runs/a/summary.json, /usr/share/datasets/x.py, tests/*/test_x.py, https://h.org/docs/y.md\n")
    (tmp_path / "data.md").write_text("## The format\n")
    assert missing_links(doc) == ["nothere.md", "data.md#nosuch", "#nosuch"]
    assert missing_paths(doc) == ["hpctrain/nosuch.py", "parallel/gone.py"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_path_exists(doc: Path) -> None:
    links, paths = missing_links(doc), missing_paths(doc)
    assert not links and not paths, f"relative links to nothing: {links}; paths not in the repository: {paths}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_issue_tracker_is_cited(doc: Path) -> None:
    cited = TRACKER.findall(doc.read_text())
    assert not cited, f"the tracker is not in the repository (say what, not which issue): {cited}"
