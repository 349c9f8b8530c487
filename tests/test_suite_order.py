"""The suite's own order (tests/conftest.py): the longest files first, each of them a file here."""
import os

from conftest import LONGEST_FIRST

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_the_files_run_first_are_this_suites_files_each_named_once():
    missing = [name for name in LONGEST_FIRST if not os.path.isfile(os.path.join(TESTS, name))]
    assert not missing, f"LONGEST_FIRST names files that are gone: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_collection_starts_with_them(request):
    collected = list(dict.fromkeys(item.path.name for item in request.session.items))
    present = [name for name in LONGEST_FIRST if name in collected]
    assert collected[:len(present)] == present
