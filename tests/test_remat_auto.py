"""``remat="auto"`` and the compiler's heap (``dew.training.remat_choice``,
``dew.training.step_memory``; the search's candidates in ``dew.planning``), on CPU devices: the
least recomputation whose compiled step fits a memory limit, the Trainer's hook, the heap read
from a buffer assignment (a choice's figures held to an independent compile's, summed by hand,
for two trainers that differ only in their options), and how ``plan_choices`` walks the
candidates (stood in by rows: no compile).

The TPU side (the heap against libtpu's own log, ``dew plan --search`` naming its choices) is in
tests/test_plan.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import optax
import pytest

import dew
from dew import planning
from dew.objectives.lm import LMObjective
from dew.targets import GIB
from dew.training import remat_choice, step_memory

SEQ = 64
ROWS = 8
# One optimizer for every trainer here: choose_remat keeps its compiles per step, and a step's
# optimizer is part of what it is.
OPTIMIZER = optax.adamw(1e-3)


def objective(remat: str) -> LMObjective:
    model = dew.models.build(
        "causal_transformer",
        vocab_size=256,
        emb_features=64,
        num_layers=2,
        num_heads=4,
        max_seq_len=SEQ,
        remat=remat,
    )
    return LMObjective(model, SEQ)


def trainer(remat: str, **settings) -> dew.Trainer:
    settings = {"devices": jax.devices()[:1], **settings}  # one device unless told
    return dew.Trainer(objective(remat), OPTIMIZER, jax.random.key(0), **settings)


def by_hand(memory, temp_bytes: int) -> int:
    """What a program needs of a device, summed here from its ``memory_analysis()`` (not by
    ``step_memory``, the code under test): arguments and outputs, less what they share (the
    donated state), the temporaries ``temp_bytes`` and the code."""
    return (
        memory.argument_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
        + temp_bytes
        + memory.generated_code_size_in_bytes
    )


@pytest.fixture(scope="module")
def needs():
    """Each policy's compiled need on one CPU device, from an independent compile of its own
    trainer's step (``memory_analysis``: on CPU its temporaries are the buffer assignment's
    ``preallocated-temp``; the heap adds a few hundred bytes of thread-local scratch). The run's
    persistent compilation cache may then serve ``choose_remat`` the same programs, which it
    reads without a buffer assignment: their totals are then these, to the byte."""
    out = {}
    for policy in remat_choice.REMAT_ORDER:
        memory = trainer(policy).compiled_step(ROWS).memory_analysis()
        out[policy] = by_hand(memory, memory.temp_size_in_bytes)
    print("needs:", out)
    return out


@pytest.fixture
def fresh_compiles(monkeypatch):
    """Every compile of the test compiled here (no persistent cache, nothing kept by an earlier
    choice), so that the compiler writes the buffer assignment ``choose_remat`` reads its heap
    from."""
    from jax.experimental.compilation_cache import compilation_cache

    enabled = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    monkeypatch.setattr(remat_choice, "_MEASURED", {})
    yield
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


def first_fit(needs, limit):
    """The least recomputation (first of ``REMAT_ORDER``) whose need is within ``limit``."""
    return next((p for p in remat_choice.REMAT_ORDER if needs[p] <= limit), None)


# Limits are set 64 KiB clear of every policy's need: choose_remat's own figures are within 4 KiB.
CLEAR = 2**16


def test_auto_takes_the_least_recomputation_that_fits_and_follows_the_limit(needs):
    auto = trainer("auto")
    # "none" keeps the most for the backward and "full" the least. The two between need less
    # than "none" and more than "full", in an order that depends on what XLA fuses ("attention"
    # keeps more than "dots", and here spares the backward more of its temporaries).
    order = remat_choice.REMAT_ORDER
    assert needs["none"] == max(needs.values()) and needs["full"] == min(needs.values()), needs
    assert len(set(needs.values())) == len(order), needs
    limits = sorted({needs[p] + CLEAR for p in order}, reverse=True)
    chosen = []
    for limit in limits:
        expected = first_fit(needs, limit)
        choice = remat_choice.choose_remat(auto, ROWS, memory_limit_bytes=limit)
        assert choice.policy == expected, (limit, choice.reason())
        assert choice.objective.model.remat == expected
        tried = [policy for policy, _ in choice.tried]
        assert tried == list(order[: order.index(expected) + 1])  # compiled in order, no further
        for policy, memory in choice.tried:
            # The choice's own figures: within 4 KiB of the independent compile's.
            assert 0 <= memory.total_bytes - needs[policy] < 4096, (policy, memory, needs)
        assert f"remat auto: {expected}" in choice.reason()
        chosen.append(expected)
    # Tighter limits recompute more: "none" with room for it, "full" at the least.
    assert chosen[0] == "none" and chosen[-1] == "full", chosen
    assert [order.index(p) for p in chosen] == sorted(order.index(p) for p in chosen), chosen
    # Below "full" nothing fits: a ValueError naming each policy's need, before any real step.
    with pytest.raises(ValueError, match=r"no recompute policy's step fits .* full "):
        remat_choice.choose_remat(auto, ROWS, memory_limit_bytes=needs["full"] // 2)


def test_a_second_choice_compiles_nothing(needs, monkeypatch):
    # The compiles are kept per step, batch and policy: a first choice (here, or an earlier
    # test's in this process) fills the cache, and the second compiles nothing.
    limit = (needs["none"] + needs["attention"]) // 2
    first = remat_choice.choose_remat(trainer("auto"), ROWS, memory_limit_bytes=limit)
    assert first.policy == "attention"

    def no_compile(*args, **kwargs):
        raise AssertionError("choose_remat compiled a step it had compiled before")

    monkeypatch.setattr(step_memory, "measure_step", no_compile)
    choice = remat_choice.choose_remat(trainer("auto"), ROWS, memory_limit_bytes=limit)
    assert choice.policy == "attention"


def test_a_choice_at_another_batch_compiles_that_batch(needs):
    # The compiles are kept per batch too: at twice the rows, the step's own figures (more
    # activations, a batch argument twice as large), not those kept for ROWS.
    roomy = 1 << 40
    at = {
        rows: remat_choice.choose_remat(
            trainer("auto"), rows, memory_limit_bytes=roomy, policies=("none",)
        ).tried
        for rows in (ROWS, 2 * ROWS)
    }
    ((_, small),), ((_, large),) = at[ROWS], at[2 * ROWS]
    assert 0 <= small.total_bytes - needs["none"] < 4096, (small, needs)
    assert large.total_bytes > small.total_bytes, (small, large)


def test_a_choice_is_kept_per_options_and_counts_the_heap(fresh_compiles):
    # Two trainers on fsdp=2 that differ only in their options: the fsdp gathers, then the rings
    # (whose pieces in flight need another heap). Each choice's figures are its own step's, not
    # those kept for the other: the arguments, outputs and code of an independent compile, and
    # the compiler's heap, memory_analysis's temporaries and the few hundred bytes of
    # thread-local scratch the buffer assignment adds on CPU (not memory_analysis's count).
    totals = {}
    for scheme in ("gather", "ring"):

        def with_options(remat):
            return trainer(
                remat,
                devices=jax.devices()[:2],
                mesh=dew.MeshSpec(fsdp=2),
                options=dew.StepOptions(fsdp_scheme=scheme),
            )

        choice = remat_choice.choose_remat(
            with_options("auto"), ROWS, memory_limit_bytes=1 << 40, policies=("full",)
        )
        ((_, memory),) = choice.tried
        analysis = with_options("full").compiled_step(ROWS).memory_analysis()
        where = (scheme, memory, analysis)
        assert memory.analysis_temp_bytes == analysis.temp_size_in_bytes, where
        assert 0 < memory.temp_bytes - analysis.temp_size_in_bytes < 4096, where
        assert memory.total_bytes == by_hand(analysis, memory.temp_bytes), where
        totals[scheme] = memory.total_bytes
    assert totals["ring"] - totals["gather"] > 4096, totals


def test_the_trainer_resolves_auto_before_building_its_step(needs, capsys):
    limit = needs["full"] + CLEAR  # only "full" fits
    auto = trainer("auto", memory_limit_bytes=limit)
    assert auto.objective.model.remat == "auto"  # nothing compiled before a batch is known
    auto.train_step(ROWS)
    assert auto.objective.model.remat == "full"
    assert "remat auto: full, the least recomputation" in capsys.readouterr().out
    # CPU devices report no memory limit: without one given, a clear error, before compiling.
    with pytest.raises(ValueError, match="does not report it: give memory_limit_bytes"):
        trainer("auto").train_step(ROWS)
    with pytest.raises(ValueError, match="memory_limit_bytes must be a positive int, got -1"):
        trainer("auto", memory_limit_bytes=-1).train_step(ROWS)


def test_an_unresolved_auto_is_refused_where_the_model_is_traced():
    model = objective("auto").model
    params = jax.eval_shape(model.init, jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((1, SEQ), jax.numpy.int32)
    with pytest.raises(ValueError, match="remat='auto' is chosen by compiling the step"):
        jax.eval_shape(model.apply, params, tokens)
    with pytest.raises(ValueError, match="unknown remat policy 'most'"):
        objective("most")


BUFFER_ASSIGNMENT = """BufferAssignment:
allocation 0: size 512, thread-local:
 value: <2 reduce_sum.5 @0> (size=512,offset=0): f32[]{:T(128)}
allocation 1: size 4194304, parameter 1, shape |f32[4096,256]| at ShapeIndex {}, maybe-live-out:
allocation 38: size 1024, maybe-live-out:
allocation 39: size 512, output shape is |(s32[], f32[256])|, maybe-live-out:
allocation 40: size 6656, constant:
allocation 100: size 281166336, preallocated-temp:
 value: <2910 wide.arg_tuple.13{1} (phi) @1> (size=2097152,offset=0): bf16[8,512,256]
allocation 101: size 116, color 2, preallocated-temp:
allocation 102: size 1536, color 6, preallocated-temp:
allocation 103: size 117440512, color 1, preallocated-temp:
allocation 104: size 24064, thread-local:
"""


def test_the_heap_is_the_main_memory_temporaries_of_a_buffer_assignment():
    # The excerpt's shapes are a v5e step's: its temporaries in HBM (memory space 0) and the
    # per-thread scratch count; parameters, outputs, constants and VMEM (color 1) do not.
    assert step_memory.heap_bytes(BUFFER_ASSIGNMENT) == 281166336 + 512 + 24064
    assert step_memory.heap_bytes("BufferAssignment:\n") == 0


def test_compile_measured_reads_the_heap_of_the_program_it_compiled():
    # On CPU the buffer assignment's preallocated-temp is memory_analysis's temporaries, so the
    # heap is those plus any thread-local scratch, a few bytes a thread. The gradient of 4 steps
    # of a scan keeps each step's [256, 256] float32 input for the backward.
    def loss(a):
        def body(carry, _):
            return jax.numpy.tanh(carry @ carry.T) @ carry, None

        return jax.numpy.sum(jax.lax.scan(body, a, None, length=4)[0])

    lowered = jax.jit(jax.grad(loss)).lower(jax.ShapeDtypeStruct((256, 256), jax.numpy.float32))
    compiled, heap = step_memory.compile_measured(lowered)
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert temp >= 4 * 256 * 256 * 4, temp
    assert 0 <= heap - temp < 4096, (heap, temp)


ROW = dict(target="v5e-1", mesh="data", axis_sizes={}, engine="shard_map", options="")


def test_the_verdict_is_the_heap_s_and_the_compiler_s_not_memory_analysis_s():
    # GPT-2 small at 20 x 1024 on one v5e, as the compiler gave it (commit 35a8a03): 13.27 GiB of
    # heap, 18.68 GiB by memory_analysis, 14.67 GiB in all. The chip runs it.
    row = planning.PlanRow(
        **ROW,
        hbm_bytes=16 * GIB,
        usable_bytes=int(15.75 * GIB),
        temp_bytes=int(13.27 * GIB),
        analysis_temp_bytes=int(18.68 * GIB),
        total_bytes=int(14.67 * GIB),
    )
    assert row.fits and row.verdict == "fits"
    assert row.spare_bytes == int(15.75 * GIB) - int(14.67 * GIB)
    # Past what the compiler lets a program use (not the chip's 16 GiB): over.
    tight = dataclasses.replace(row, total_bytes=int(15.9 * GIB))
    assert not tight.fits and tight.verdict == "over by 0.15 GiB" and tight.spare_bytes is None
    # Without the compiler's figure, the chip's memory is the limit.
    unknown = dataclasses.replace(row, usable_bytes=None)
    assert unknown.limit_bytes == 16 * GIB and unknown.fits
    refused = dataclasses.replace(row, total_bytes=int(17.28 * GIB), refused="RESOURCE_EXHAUSTED")
    assert not refused.fits and refused.verdict == "over by 1.53 GiB"


def test_plan_choices_compiles_in_order_until_one_fits_and_says_why(monkeypatch):
    compiled = []

    def fake_layout(target, objective_, mesh, batch, *, chosen, **settings):
        remat = objective_.model.remat
        compiled.append(remat)
        # "none" and "attention" need more than the chip; "dots" fits.
        total = {"none": 17 * GIB, "attention": 16 * GIB, "dots": 12 * GIB}[remat]
        refused = "RESOURCE_EXHAUSTED" if remat == "none" else None
        return planning.PlanRow(
            **ROW,
            hbm_bytes=16 * GIB,
            usable_bytes=15 * GIB,
            remat=remat,
            choices=chosen,
            total_bytes=total,
            refused=refused,
        )

    monkeypatch.setattr(planning, "plan_layout", fake_layout)
    seen = []
    rows = planning.plan(None, objective("auto"), ["data"], 16, on_choice=seen.append)
    assert compiled == ["none", "attention", "dots"]  # least recomputation first, no further
    assert [r.choices for r in rows] == [{"remat": p} for p in compiled]
    assert [r.fits for r in rows] == [False, False, True]
    (explained,) = seen
    text = planning.choice_text(explained)
    assert text.startswith("data (shard_map): remat dots, the first that fits"), text
    assert "least recomputation first: remat none over by 2.00 GiB" in text
    assert "remat attention over by 1.00 GiB" in text and "3.0 GiB to spare" in text
    assert "search chose data (shard_map, remat dots)" in planning.search_summary(rows)
    # A model that fixes its policy is one compile, and nothing to explain.
    compiled.clear()
    seen.clear()
    rows = planning.plan(None, objective("attention"), ["data"], 16, on_choice=seen.append)
    assert compiled == ["attention"] and not seen
    # plan_layout itself compiles one step: an unresolved choice is refused.
    monkeypatch.undo()
    with pytest.raises(ValueError, match="leaves remat to choose"):
        planning.plan_layout(None, objective("auto"), "data", 16)


def test_the_state_s_precision_is_searched_float32_first(monkeypatch):
    """With ``states``, each precision is tried with every recompute policy, float32 first, and
    the candidate's weights and AdamW moments are in that precision."""
    compiled = []

    def fake_layout(target, objective_, mesh, batch, *, chosen, optimizer, **settings):
        model = objective_.model
        state = optimizer.init({"w": jnp.zeros((4, 4), model.param_dtype)})
        moments = {str(leaf.dtype) for leaf in jax.tree_util.tree_leaves(state) if leaf.ndim}
        compiled.append((model.param_dtype, model.remat, moments))
        # Only bfloat16 state with full recompute fits.
        fits = model.param_dtype == "bfloat16" and model.remat == "full"
        return planning.PlanRow(
            **ROW,
            hbm_bytes=16 * GIB,
            usable_bytes=15 * GIB,
            remat=model.remat,
            choices=chosen,
            total_bytes=(12 if fits else 20) * GIB,
        )

    monkeypatch.setattr(planning, "plan_layout", fake_layout)
    seen = []
    rows = planning.plan(
        None, objective("auto"), ["data"], 16, on_choice=seen.append, states=planning.STATE_ORDER
    )
    order = remat_choice.REMAT_ORDER
    assert compiled == [("float32", p, {"float32"}) for p in order] + [
        ("bfloat16", p, {"bfloat16"}) for p in order
    ]
    assert rows[-1].fits and rows[-1].choices == {"state": "bfloat16", "remat": "full"}
    (explained,) = seen
    text = planning.choice_text(explained)
    assert text.startswith("data (shard_map): state bfloat16, remat full, the first that fits")
    assert "state float32 weights and moments first" in text, text


def test_the_search_order_is_the_model_s_policies_least_recomputation_first():
    from dew.models.causal_transformer import REMAT_CHOICES

    assert sorted(remat_choice.REMAT_ORDER) == sorted(REMAT_CHOICES)
    (remat,) = planning.SEARCH_DIMENSIONS
    assert remat.values(objective("auto")) == remat_choice.REMAT_ORDER
    assert remat.values(objective("dots")) == ("dots",)
    assert [v for v, _ in planning.choices(objective("auto"))] == [
        {"remat": p} for p in remat_choice.REMAT_ORDER
    ]
