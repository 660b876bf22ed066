"""``dew plan``'s table read back cell by cell: each number sits under the header that names it
(``dew.planning.format_table``). A row built by hand, its figures all different, so that two
swapped cells cannot read the same; nothing is compiled."""

from dew.planning import COLUMNS, PlanRow, format_table
from dew.targets import GIB

MIB = 2**20


def cells_of(table: str) -> dict:
    """``{header: cell}`` of a table of one row: the cells split where the dashes under the
    headers split (the columns are aligned)."""
    header, dashes, row = table.splitlines()[:3]
    out, start = {}, 0
    for dash in dashes.split("  "):
        end = start + len(dash)
        out[header[start:end].strip()] = row[start:end].strip()
        start = end + 2
    return out


def test_each_plan_cell_sits_under_its_header():
    row = PlanRow(
        target="v5e-8",
        mesh="fsdp=8",
        axis_sizes={"fsdp": 8},
        engine="shard_map",
        options="",
        hbm_bytes=16 * GIB,
        remat="dots",
        state_bytes=100 * MIB,
        argument_bytes=110 * MIB,
        temp_bytes=300 * MIB,
        total_bytes=2 * GIB,
        wire_bytes=700 * MIB,
        overlapped_wire_bytes=500 * MIB,
        exposed_wire_bytes=200 * MIB,
        collectives={"all_gather": 4, "psum_scatter": 2},
        compile_s=3.0,
    )
    cells = cells_of(format_table([row]))
    assert list(cells) == list(COLUMNS)
    expected = {
        "layout": "fsdp=8",
        "engine": "shard_map",
        "remat": "dots",
        "state": "100.0 MiB",
        "temp": "300.0 MiB",
        "total": "2.0 GiB",
        "hbm": "16.0 GiB",
        "verdict": "fits",
        "wire/step": "700.0 MiB",
        "overlapped/exposed": "500.0 MiB / 200.0 MiB",  # beside compute, then alone
        "ops": "all_gather:4 psum_scatter:2",
        "compile": "3 s",
    }
    assert {name: cells[name] for name in expected} == expected
