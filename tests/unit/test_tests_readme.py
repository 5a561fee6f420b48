"""tests/README.md maps every test file of every tier to its scenario, and every tier folder is in it."""

import re

from conftest import SLOWEST_FILES, TESTS, TIERS


def listed() -> set[str]:
    """The files tests/README.md's tables name, as paths under tests/."""
    tier = None
    names = set()
    for line in (TESTS / "README.md").read_text().splitlines():
        if heading := re.fullmatch(r"### tests/(\w+)/", line):
            tier = heading.group(1)
        elif tier and (row := re.match(r"\| `([\w/]+\.py)` \|", line)):
            names.add(f"{tier}/{row.group(1)}")
    return names


def test_every_test_file_has_a_row() -> None:
    files = {str(p.relative_to(TESTS)) for tier in TIERS for p in (TESTS / tier).rglob("test_*.py")}
    assert files - listed() == set(), "add a row to tests/README.md for each new test file"
    assert {name for name in listed() if not (TESTS / name).is_file()} == set(), "a row names a file that is gone"


def test_the_slowest_files_conftest_runs_first_exist() -> None:
    """A renamed slow file would silently lose its early start (tests/conftest.py `SLOWEST_FILES`)."""
    assert [name for name in SLOWEST_FILES if not (TESTS / name).is_file()] == []
