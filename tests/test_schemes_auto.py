"""The communication schemes chosen by default (``StepOptions(fsdp_scheme="auto")``, the
default): the rule ``StepOptions.resolve`` applies, the ``Trainer`` and ``dew plan`` taking it
alike, a CPU step unchanged by it, and the choice ``dew plan --search`` makes by compiling each
scheme (``planning.plan_schemes``, read here from rows built by hand: nothing compiles but the
CPU step and one TPU ``Trainer``'s devices)."""

import dataclasses

import jax
import optax
import pytest

import dew
from dew import MeshSpec, StepOptions, planning
from dew.objectives.lm import LMObjective
from dew.parallel import fsdp
from dew.targets import GIB, target

AUTO = StepOptions()


@pytest.mark.parametrize(
    "sizes, platform, scheme",
    [
        ({"fsdp": 8}, "tpu", "ring"),  # v5e-8 / v5p-16 fsdp=8: the rings
        ({"fsdp": 2, "tensor": 4}, "tpu", "ring"),
        ({"fsdp": fsdp.RING_MAX}, "tpu", "ring"),  # the largest ring
        ({"fsdp": 2 * fsdp.RING_MAX}, "tpu", "gather"),  # past it: n - 1 ppermutes too many
        ({"fsdp": 8, "stage": 2}, "tpu", "gather"),  # no ring inside a pipeline stage
        ({"data": 8}, "tpu", "gather"),  # no fsdp axis: nothing to gather
        ({"fsdp": 8}, "cpu", "gather"),  # off TPU: the programs of the tests, unchanged
        ({"fsdp": 8}, "gpu", "gather"),  # nothing measured on GPU says otherwise
    ],
)
def test_auto_is_the_fsdp_rings_on_tpu_wherever_a_ring_runs(sizes, platform, scheme):
    assert AUTO.fsdp_scheme == "auto"
    assert AUTO.resolve(sizes, platform).fsdp_scheme == scheme
    # What a user asks for is kept, on every platform.
    for asked in ("gather", "ring"):
        assert StepOptions(fsdp_scheme=asked).resolve(sizes, platform).fsdp_scheme == asked


@pytest.mark.parametrize(
    "sizes, platform, seq_len, scheme",
    [
        ({"fsdp": 2, "tensor": 4}, "tpu", 512, "ring"),  # v5e-8 fsdp=2,tensor=4: the rings
        ({"tensor": 8}, "tpu", None, "ring"),
        ({"tensor": 4}, "tpu", 510, "plain"),  # 510 positions are not 4 whole blocks
        ({"tensor": 4, "sequence": 2}, "tpu", 1024, "ring"),  # 512 a device: blocks of 128
        ({"tensor": 4, "sequence": 2}, "tpu", 1020, "plain"),  # 510 a device
        ({"tensor": 4, "stage": 2}, "tpu", 512, "plain"),  # no ring inside a pipeline stage
        ({"fsdp": 8}, "tpu", 512, "plain"),  # no tensor axis
        ({"tensor": 4}, "cpu", 512, "plain"),  # off TPU: the tests' programs, unchanged
        ({"tensor": 4}, "gpu", 512, "plain"),
    ],
)
def test_auto_is_the_tensor_rings_on_tpu_wherever_they_run(sizes, platform, seq_len, scheme):
    assert AUTO.tensor_scheme == "auto"
    assert AUTO.resolve(sizes, platform, seq_len).tensor_scheme == scheme
    for asked in ("plain", "ring"):
        given = StepOptions(tensor_scheme=asked).resolve(sizes, platform, seq_len)
        assert given.tensor_scheme == asked


def test_a_search_compiles_the_rule_s_choice_then_each_scheme_plain_alone():
    objective = tiny_objective()  # rows of 8 positions: two blocks of tensor 4
    variants = planning.scheme_variants(AUTO, {"fsdp": 2, "tensor": 4}, objective)
    assert [(v.fsdp_scheme, v.tensor_scheme) for v in variants] == [
        ("ring", "ring"),
        ("gather", "ring"),
        ("ring", "plain"),
    ]
    named = StepOptions(tensor_scheme="plain")
    variants = planning.scheme_variants(named, {"fsdp": 2, "tensor": 4}, objective)
    assert [(v.fsdp_scheme, v.tensor_scheme) for v in variants] == [
        ("ring", "plain"),
        ("gather", "plain"),
    ]


def tiny_objective() -> LMObjective:
    model = dew.models.build(
        "causal_transformer",
        vocab_size=64,
        emb_features=32,
        num_layers=1,
        num_heads=2,
        max_seq_len=8,
    )
    return LMObjective(model, 8)


def trainer(options=AUTO, devices=None) -> dew.Trainer:
    return dew.Trainer(
        tiny_objective(),
        optax.adamw(1e-3),
        jax.random.key(0),
        mesh=MeshSpec(fsdp=8),
        layout=dew.Layout(min_shard=1),
        devices=devices,
        options=options,
    )


def test_on_cpu_auto_builds_the_gather_step_itself():
    chosen = trainer()
    assert chosen.options == StepOptions(fsdp_scheme="gather", tensor_scheme="plain")
    assert not chosen.shards.fsdp_ring and not chosen.shards.tensor_ring
    # The same program as asking for the gathers: no compile and no step of its own.
    asked = trainer(StepOptions(fsdp_scheme="gather"))
    lowered = [t.train_step(8).lower(*t.step_arguments(8)).as_text() for t in (chosen, asked)]
    assert lowered[0] == lowered[1]
    # and another program than the rings', so the comparison can tell them apart.
    rings = trainer(StepOptions(fsdp_scheme="ring"))
    assert rings.train_step(8).lower(*rings.step_arguments(8)).as_text() != lowered[0]


@pytest.mark.xdist_group("tpu")
def test_on_a_tpu_slice_the_trainer_and_plan_take_the_rings():
    tpu = trainer(devices=target("v5e-8").devices())
    assert tpu.options.fsdp_scheme == "ring" and tpu.shards.fsdp_ring
    # dew plan names the step it compiles by the same rule (its rows say what ran).
    assert planning.options_text(AUTO.resolve(dict(tpu.mesh.shape), "tpu"), {"fsdp": 8}) == (
        "fsdp_scheme=ring"
    )


def row(options: str, *, exposed: int, total: int = 3 * GIB, fits: bool = True, sums=None):
    """A compiled shard_map row of fsdp=8 on v5e-8, ``exposed`` bytes exposed."""
    return planning.PlanRow(
        target="v5e-8",
        mesh="fsdp=8",
        axis_sizes={"fsdp": 8},
        engine="shard_map",
        options=options,
        hbm_bytes=16 * GIB,
        usable_bytes=int(15.75 * GIB),
        total_bytes=total if fits else 20 * GIB,
        wire_bytes=6 * GIB,
        overlapped_wire_bytes=6 * GIB - exposed,
        exposed_wire_bytes=exposed,
        ici_send_bytes_per_s=200e9,
        choices={} if sums is None else {"sums": sums},
    )


def fake_plan(outcomes: dict, calls: list):
    """``planning.plan`` answering each (fsdp scheme, sum dtype) as a model with ``remat="auto"``
    does (``planning.plan_choices``): a row for each recompute policy compiled, in order, the
    first (``remat none``) over the chip and ``outcomes``' row, the last, the one to judge the
    scheme by; the same for GSPMD. Records what it was asked to compile."""

    def plan(target_, objective, meshes, batch, *, engines, options, **settings):
        calls.append((options.fsdp_scheme, options.gradient_sum_dtype, tuple(engines)))
        last = outcomes[(options.fsdp_scheme, options.gradient_sum_dtype)]
        # Less exposed than any outcome, and over the chip: judged by it, a scheme never fits.
        over = dataclasses.replace(
            row(last.options, exposed=1, fits=False), choices={"remat": "none"}
        )
        out = [over, last] * ("shard_map" in engines)
        if "gspmd" in engines:
            out += [dataclasses.replace(r, engine="gspmd", options="") for r in (over, last)]
        return out

    return plan


def choose(monkeypatch, outcomes) -> tuple[list, list, list]:
    calls, choices = [], []
    monkeypatch.setattr(planning, "plan", fake_plan(outcomes, calls))
    rows = planning.plan_schemes(
        target("v5e-8"),
        None,
        "fsdp=8",
        16,
        options=AUTO,
        engines=("shard_map", "gspmd"),
        sum_dtypes=planning.SUM_DTYPE_ORDER,
        on_scheme=choices.append,
    )
    return rows, calls, choices


def test_the_search_takes_the_scheme_that_fits_with_the_least_exposed_bytes(monkeypatch):
    # The rings expose less but do not fit: the gathers are the choice, and float32 sums fit.
    outcomes = {
        ("ring", None): row("fsdp_scheme=ring", exposed=100, fits=False),
        ("gather", None): row("", exposed=3 * GIB),
    }
    rows, calls, (choice,) = choose(monkeypatch, outcomes)
    assert calls == [("ring", None, ("shard_map", "gspmd")), ("gather", None, ("shard_map",))]
    assert choice.chosen is outcomes[("gather", None)]
    assert choice.reason().startswith("fsdp=8: fsdp gather, the least exposed communication of")
    assert [r.engine for r in rows].count("gspmd") == 2  # the baseline once a layout (2 remats)
    # Both fit: the one that exposes less, whatever the memory.
    outcomes[("ring", None)] = row("fsdp_scheme=ring", exposed=100, total=4 * GIB)
    _, _, (choice,) = choose(monkeypatch, outcomes)
    assert choice.chosen is outcomes[("ring", None)]
    assert "(fsdp ring: 100 B exposed, 0.0 ms; fsdp gather: 3.0 GiB exposed, 16.1 ms)" in (
        choice.reason()
    )


def test_bfloat16_sums_are_tried_only_where_nothing_fits_in_float32(monkeypatch):
    outcomes = {
        ("ring", None): row("fsdp_scheme=ring", exposed=100, fits=False),
        ("gather", None): row("", exposed=3 * GIB, fits=False),
        ("ring", "bfloat16"): row("fsdp_scheme=ring, gradient_sum_dtype=bfloat16", exposed=50),
        ("gather", "bfloat16"): row("gradient_sum_dtype=bfloat16", exposed=GIB),
    }
    _, calls, (choice,) = choose(monkeypatch, outcomes)
    assert [c[:2] for c in calls] == [
        ("ring", None),
        ("gather", None),
        ("ring", "bfloat16"),
        ("gather", "bfloat16"),
    ]
    assert choice.chosen is outcomes[("ring", "bfloat16")]


def test_a_scheme_the_user_names_is_the_only_one_compiled(monkeypatch):
    calls = []
    monkeypatch.setattr(
        planning, "plan", fake_plan({("gather", None): row("", exposed=GIB)}, calls)
    )
    choices = []
    planning.plan_schemes(
        target("v5e-8"),
        None,
        "fsdp=8",
        16,
        options=StepOptions(fsdp_scheme="gather"),
        on_scheme=choices.append,
    )
    assert calls == [("gather", None, ("shard_map",))] and choices == []


def test_exposed_time_is_the_exposed_bytes_over_the_chip_s_link_bandwidth():
    # v5e: 400 GB/s both ways a chip (Cloud TPU's page), 200 GB/s sent.
    assert target("v5e-8").ici_send_bytes_per_s == 200e9
    assert target("v5p-16").ici_send_bytes_per_s == 600e9
    assert row("", exposed=2 * 10**9).exposed_s == pytest.approx(0.01)
    assert planning.seconds_text(0.0123) == "12.3 ms"


def test_the_search_ranks_steps_that_fit_by_exposed_bytes_before_wire_bytes():
    # Fewer wire bytes, but more of them exposed: the other step ranks first, and the summary
    # names it with its scheme.
    quiet = dataclasses.replace(row("fsdp_scheme=ring", exposed=GIB), wire_bytes=7 * GIB)
    loud = row("", exposed=2 * GIB)
    assert sorted([loud, quiet], key=planning._rank) == [quiet, loud]
    assert planning.search_summary([loud, quiet]).startswith(
        "search chose fsdp=8 (shard_map, fsdp_scheme=ring): of the 2 steps that fit, the fewest "
        "exposed wire bytes per step (1.0 GiB, 5.4 ms)"
    )


def test_plan_search_of_the_layouts_given_weighs_their_schemes(monkeypatch, capsys):
    from dew.cli.main import build_parser
    from dew.cli.plan import run

    asked = []

    def plan_schemes(target_, objective, mesh, batch, *, options, sum_dtypes, on_scheme, **kw):
        asked.append((planning.mesh_text(mesh), options, sum_dtypes))
        tried = (row("fsdp_scheme=ring", exposed=100), row("", exposed=3 * GIB))
        on_scheme(planning.SchemeChoice(tried[0], tried))
        return list(tried)

    monkeypatch.setattr(planning, "plan_schemes", plan_schemes)
    args = build_parser().parse_args(
        ["plan", "--target", "v5e-8", "--search", "--mesh", "fsdp=8", "fsdp=2,tensor=4"]
        + ["--layers", "1", "--width", "64", "--heads", "2"]
    )
    assert run(args) == 0
    # Each layout given, no other, with the schemes and the sums' dtype left to choose.
    assert [(m, o.fsdp_scheme, o.tensor_scheme, s) for m, o, s in asked] == [
        ("fsdp=8", "auto", "auto", planning.SUM_DTYPE_ORDER),
        ("fsdp=2,tensor=4", "auto", "auto", planning.SUM_DTYPE_ORDER),
    ]
    out = capsys.readouterr().out
    assert "  chose fsdp=8: fsdp ring, the least exposed communication of the steps" in out
    assert "search chose fsdp=8 (shard_map, fsdp_scheme=ring)" in out


def test_lora_keeps_the_tensor_pairs_where_adapters_cover_every_region():
    from dew.models.lora import Lora, some_region_unadapted

    # The tensor ring runs only plain weights: an adapted or int8 projection keeps its pair.
    assert not some_region_unadapted(Lora(rank=4))  # the seven projections: no region left
    assert not some_region_unadapted(Lora(rank=4, targets=("q_proj",), base_dtype="int8"))
    assert some_region_unadapted(Lora(rank=4, targets=("q_proj", "v_proj")))  # o, the MLP
    tpu = {"fsdp": 2, "tensor": 4}
    assert AUTO.resolve(tpu, "tpu", 512, tensor_ringable=False).tensor_scheme == "plain"
    assert AUTO.resolve(tpu, "tpu", 512, tensor_ringable=False).fsdp_scheme == "ring"
    # A scheme the user names is theirs (the ring then keeps the pairs weight by weight).
    named = StepOptions(tensor_scheme="ring").resolve(tpu, "tpu", 512, tensor_ringable=False)
    assert named.tensor_scheme == "ring"
