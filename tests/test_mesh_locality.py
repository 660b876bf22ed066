"""Host-aware meshes: on 2 processes x 4 devices, ``build_mesh`` keeps every fsdp, tensor,
sequence and expert group inside one process where the sizes allow, so only ``data`` crosses
processes. One process of 8 devices cannot show this: the processes here are started by
``dew launch`` and report, from ``device.process_index``, which processes each group spans."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.helpers import child_env

ROOT = Path(__file__).resolve().parents[1]
INSIDE_ONE_PROCESS = ("expert", "fsdp", "tensor", "sequence")


def test_model_axes_stay_inside_one_process():
    env = child_env()
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run(
        [sys.executable, "-m", "dew", "launch", "--processes", "2", "--devices-per-process", "4"]
        + ["--", sys.executable, str(ROOT / "tests" / "mesh_locality_worker.py")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports = {line[:3]: json.loads(line[4:]) for line in done.stdout.splitlines()}
    assert sorted(reports) == ["[0]", "[1]"], done.stdout
    assert reports["[0]"] == reports["[1]"]
    spans = reports["[0]"]

    for mesh in ("fsdp=4", "tensor=2,fsdp=2", "sequence=2,tensor=2", "expert=2,fsdp=2"):
        for axis in INSIDE_ONE_PROCESS:
            for group in spans[mesh][axis]:
                assert len(group) == 1, (mesh, axis, spans[mesh][axis])
        # What is left, data 2, is what crosses: each data group holds one device of each.
        assert spans[mesh]["data"] == [[0, 1]] * 4, (mesh, spans[mesh]["data"])
    # fsdp=8 cannot stay in a process of 4 devices: its one group spans both.
    assert spans["fsdp=8"]["fsdp"] == [[0, 1]]
