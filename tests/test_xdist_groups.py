"""The suite's own machinery: the check that pytest-xdist's groups hold (tests/conftest.py)."""

import pytest

from tests.xdist_groups import ungrouped


class Item:
    """What ``ungrouped`` reads of a collected test: its node id and its marks."""

    def __init__(self, nodeid, *groups):
        self.nodeid = nodeid
        self.marks = [pytest.mark.xdist_group(g).mark for g in groups]

    def get_closest_marker(self, name):
        return next((m for m in self.marks if m.name == name), None)


def test_a_group_without_its_suffix_is_found():
    items = [
        Item("t.py::a@x64", "x64"),  # the suffix pytest-xdist writes
        Item("t.py::b", "x64"),  # the suffix pytest 9.2 drops
        Item("t.py::c"),  # no group: nothing to keep
        Item("t.py::d[x]@a_b", "b", "a"),  # two groups, joined
        Item("t@p.py::e", "x64"),  # an @ elsewhere in the id is no suffix
    ]
    assert ungrouped(items) == ["t.py::b", "t@p.py::e"]
