"""TPU slices by name (``dew.targets``), the model presets' published sizes, and the ``--model``
flag. The device tests need ``libtpu`` (the test extra brings it) but no TPU."""

import math
import re

import jax
import numpy as np
import pytest

import dew
from dew import targets
from dew.mesh import AXES, build_mesh
from dew.models.presets import PRESETS, PUBLISHED_PARAMETERS, preset
from dew.planning import weight_count

# Cloud TPU's names, read off its v4, v5e, v5p and v6e pages: (type, topology, chips, hosts).
SLICES = [
    ("v4-8", "v4:2x2x1", 4, 1),
    ("v4-32", "v4:2x2x4", 16, 4),
    ("v4-128", "v4:4x4x4", 64, 16),
    ("v5e-1", "v5e:1x1", 1, 1),
    ("v5e-8", "v5e:2x4", 8, 1),
    ("v5litepod-16", "v5e:4x4", 16, 4),
    ("v5e-256", "v5e:16x16", 256, 64),
    ("v5p-8", "v5p:2x2x1", 4, 1),
    ("v5p-16", "v5p:2x2x2", 8, 2),
    ("v5p-64", "v5p:2x4x4", 32, 8),
    ("v5p-640", "v5p:4x4x20", 320, 80),
    ("v5p-2048", "v5p:8x8x16", 1024, 256),
    ("v5p-12288", "v5p:16x16x24", 6144, 1536),
    ("v6e-8", "v6e:2x4", 8, 1),
    ("v6e-64", "v6e:8x8", 64, 16),
    ("v5p:4x4x4", "v5p:4x4x4", 64, 16),
    ("v5e:4x8", "v5e:4x8", 32, 8),
]


@pytest.mark.parametrize("name, topology, chips, hosts", SLICES)
def test_cloud_names_give_the_slice_cloud_documents(name, topology, chips, hosts):
    t = targets.target(name)
    assert (t.topology, t.chips, t.hosts) == (topology, chips, hosts)
    cores = 2 if t.generation.name in ("v4", "v5p") else 1
    assert t.cloud_type.endswith(f"-{chips * cores}")


def test_v5e_is_v5litepod_in_cloud_names():
    assert targets.target("v5e-8").cloud_type == "v5litepod-8"
    assert targets.target("v5litepod-8").topology == "v5e:2x4"


@pytest.mark.parametrize(
    "name, says",
    [
        ("v5p-24", "the N in v5p-N counts TensorCores, two per chip; valid: v5p-8, v5p-16"),
        ("v5p-7", "not a v5p slice"),
        ("v5e-12", "valid: v5e-1, v5e-4, v5e-8, v5e-16, v5e-32, v5e-64, v5e-128, v5e-256"),
        ("v6e-512", "valid: v6e-1"),
        ("v7-8", "unknown TPU generation 'v7' in 'v7-8'; known: v4, v5e, v5p, v6e"),
        ("v5p:3x3x3", "multiple of 4"),
        ("v5e:2x3", "one of 1x1, 2x2, 2x4"),
        ("a100-8", "not a TPU target"),
    ],
)
def test_a_slice_that_does_not_exist_is_refused_naming_the_valid_ones(name, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        targets.target(name)


# What one chip sends over its inter-chip links a second (GB/s), written here from the vendors'
# figures, not from dew.targets: half the "bidirectional inter-chip interconnect (ICI) bandwidth
# (per chip)" of Cloud TPU's system architecture pages (https://cloud.google.com/tpu/docs/v5e:
# 400 GBps; .../v5p: 1200 GBps; .../v6e: 800 GBps), and for v4, whose page gives no per-chip
# figure, six links of 400 Gb/s each way ("TPU v4: An Optically Reconfigurable Supercomputer",
# Jouppi et al., ISCA 2023): 6 x 50 GB/s. A rate doubled (the bidirectional figure taken for
# what one chip sends) halves `dew plan`'s exposed time.
SENT_GB_PER_S = {"v4": 6 * 50, "v5e": 400 / 2, "v5p": 1200 / 2, "v6e": 800 / 2}
# Each chip's HBM, from the same pages ("GB" there; the stacks are binary sizes, so GiB).
HBM_GIB = {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}


@pytest.mark.parametrize("generation", sorted(targets.GENERATIONS))
def test_each_generation_has_its_published_link_bandwidth_and_memory(generation):
    assert set(SENT_GB_PER_S) == set(HBM_GIB) == set(targets.GENERATIONS), "a figure missing"
    slice_ = targets.target(targets.valid_types(generation)[0])
    assert slice_.ici_send_bytes_per_s == SENT_GB_PER_S[generation] * 1e9, generation
    assert slice_.hbm_bytes == HBM_GIB[generation] * targets.GIB, generation


def test_without_libtpu_the_error_names_the_extra(monkeypatch):
    real = targets.importlib.util.find_spec
    monkeypatch.setattr(
        targets.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "libtpu" else real(name, *a),
    )
    with pytest.raises(targets.MissingExtra, match=r"pip install -e '\.\[tpu\]'"):
        targets.target("v5e-4").devices()


@pytest.mark.parametrize(
    "name, kind", [("v5e-8", "TPU v5 lite"), ("v5p-16", "TPU v5"), ("v4-8", "TPU v4")]
)
def test_a_slice_has_one_device_per_chip_listed_host_by_host(name, kind):
    t = targets.target(name)
    devices = t.devices()
    assert len(devices) == t.chips  # megacore: v4-8 is 4 chips, 4 devices
    assert {d.device_kind for d in devices} == {kind}
    hosts = [d.process_index for d in devices]
    assert hosts == sorted(hosts) and len(set(hosts)) == t.hosts


@pytest.mark.parametrize(
    "name, spec, inside_a_host",
    [
        ("v5p-64", dew.MeshSpec(fsdp=4), ("fsdp",)),  # 8 hosts of 4 chips
        ("v5p-64", dew.MeshSpec(fsdp=2, tensor=2), ("fsdp", "tensor")),
        ("v5p-64", dew.MeshSpec(fsdp=4, tensor=2), ("tensor",)),  # 8 > 4: fsdp crosses hosts
        ("v5p-64", dew.MeshSpec(expert=2, sequence=2), ("expert", "sequence")),
        ("v5e-16", dew.MeshSpec(tensor=4), ("tensor",)),  # 4 hosts of 4 chips
        ("v5e-16", dew.MeshSpec(fsdp=2, sequence=2), ("fsdp", "sequence")),
    ],
)
def test_model_axes_stay_inside_a_host_of_a_pod_topology(name, spec, inside_a_host):
    mesh = build_mesh(spec, targets.target(name).devices())
    hosts = np.vectorize(lambda d: d.process_index)(mesh.devices)
    model = tuple(AXES.index(a) for a in inside_a_host)
    rest = tuple(i for i in range(len(AXES)) if i not in model)
    groups = np.transpose(hosts, rest + model).reshape(-1, math.prod(hosts.shape[i] for i in model))
    # Every group of the model axes together sits on one host; data spans hosts.
    assert all(len(set(g)) == 1 for g in groups), (name, spec)
    assert len(set(hosts[(slice(None),) + (0,) * (len(AXES) - 1)])) == dict(mesh.shape)["data"]


@pytest.mark.parametrize("name", ["v5p:4x4x4", "v5e-16"])
def test_a_plan_builds_the_mesh_a_real_pod_builds(name, monkeypatch):
    # A pod's jax.devices() come by id, which runs over the chips' coordinates, not host by host
    # (on these slices ids 0, 1 are on host 0 and ids 2, 3 on host 1). build_mesh orders them by
    # host itself, so the pod's default mesh is the one a plan compiles for.
    t = targets.target(name)
    by_id = sorted(t.devices(), key=lambda d: d.id)
    assert [d.process_index for d in by_id[:4]] != [by_id[0].process_index] * 4
    monkeypatch.setattr(jax, "devices", lambda *args: list(by_id))
    for spec in (dew.MeshSpec(tensor=4), dew.MeshSpec(fsdp=2, sequence=2), dew.MeshSpec(fsdp=8)):
        pod = build_mesh(spec)
        planned = build_mesh(spec, t.devices())
        assert (pod.devices == planned.devices).all(), spec
        hosts = np.vectorize(lambda d: d.process_index)(pod.devices)
        if spec.model_devices == 4:  # one host's 4 chips
            assert all(len(set(g.flat)) == 1 for g in hosts.reshape(-1, 4)), spec


# ------------------------------------------------------------------------------------ presets


@pytest.mark.parametrize("name", list(PRESETS))
def test_each_preset_has_its_published_weight_count_within_one_percent(name):
    model = dew.models.build("causal_transformer", **PRESETS[name])
    count = weight_count(model)
    published = PUBLISHED_PARAMETERS[name]
    print(f"{name}: {count:,} weights, published {published:,}")
    assert abs(count - published) <= 0.01 * published


def test_llama_presets_are_the_published_shapes_exactly():
    # Dew's block is Llama's: the count is the model card's, to the weight.
    for name in ("llama-3.2-1b", "llama-3.2-3b", "llama-3.1-8b", "llama-3.1-70b"):
        model = dew.models.build("causal_transformer", **PRESETS[name])
        assert weight_count(model) == PUBLISHED_PARAMETERS[name], name


def test_unknown_preset_lists_the_known():
    with pytest.raises(ValueError, match="unknown model preset 'llama-9'; available: gpt2-small"):
        preset("llama-9")


def test_model_flag_takes_a_preset_and_the_size_flags_override_it():
    from dew.cli.main import build_parser
    from dew.cli.model_flags import model_config

    args = build_parser().parse_args(
        ["train", "--model", "llama-3.1-8b", "--layers", "2", "--seq-len", "64"]
    )
    config = model_config(args)
    # The preset keeps its context: --seq-len is the rows' length, not the model's limit.
    expected = {**PRESETS["llama-3.1-8b"], "num_layers": 2, "max_seq_len": 8192}
    assert config == expected
    plain = model_config(build_parser().parse_args(["train"]))
    assert (plain["vocab_size"], plain["num_layers"], plain["emb_features"]) == (256, 2, 64)
    for command in ("collectives", "bench", "plan"):
        extra = ["--target", "v5e-8"] if command == "plan" else []
        args = build_parser().parse_args([command, "--model", "gpt2-small", *extra])
        assert model_config(args)["vocab_size"] == 50304, command


def test_jax_is_still_on_the_simulated_cpu_devices():
    # Asking libtpu for a topology must not move the suite's own devices.
    assert jax.device_count() == 8 and jax.devices()[0].platform == "cpu"
