"""The check that pytest-xdist's ``--dist loadgroup`` groups hold (used by tests/conftest.py)."""


def ungrouped(items) -> list[str]:
    """The node ids of ``items`` that carry an ``xdist_group`` mark but not the ``@group``
    suffix by which ``--dist loadgroup`` sends a group to one worker: pytest 9.2 ignores the
    suffix pytest-xdist 3.8 writes (pytest-dev/pytest-xdist#1386), and every worker that draws a
    test of a group then runs that group's shared setup again, silently (measured: the suite's
    CPU time +17%, the subprocess groups 2x)."""
    return [
        item.nodeid
        for item in items
        if item.get_closest_marker("xdist_group") and "@" not in item.nodeid.rpartition("::")[2]
    ]
