"""``dew generate`` and ``dew.generate``: the cached decode against the full forward, layouts
against one device, greedy generation against transformers (tests/data/generate/, written by
scripts/make_generate_reference.py), sampling against its formulas, and the command line."""

import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from dew.generation import Generator, sample
from dew.mesh import MeshSpec
from dew.models import decode, hf
from dew.models.causal_transformer import CausalTransformer

DATA = Path(__file__).resolve().parent / "data"
REFERENCE = DATA / "generate"
ONE_DEVICE = MeshSpec(data=1)


def tiny(**fields) -> CausalTransformer:
    sizes = dict(vocab_size=96, emb_features=48, num_layers=2, num_heads=4, max_seq_len=64)
    return CausalTransformer(**{**sizes, **fields})


# --- The cached decode against the full forward --------------------------------------------------

CASES = {
    "tied": dict(num_kv_heads=2, rope_theta=2345.5),
    "untied_window": dict(num_heads=6, num_kv_heads=2, tie_embeddings=False, attention_window=3),
}


@pytest.mark.parametrize("case", CASES)
def test_cached_logits_equal_the_full_forward_at_every_position(case, seed):
    """Rows left-padded by 0, 2 and 5 slots of 16; 6 slots prefilled (a row's prompt of one real
    token among them), the other 10 decoded one at a time: the logits after every real token
    equal the model's full forward of that row alone (no padding), float32 within 1e-5."""
    model = tiny(**CASES[case])
    params = model.init(jax.random.key(seed))
    slots, prefilled, pads = 16, 6, np.array([0, 2, 5], np.int32)
    tokens = np.random.default_rng(seed).integers(0, model.vocab_size, (3, slots), np.int32)
    prefill = jax.jit(functools.partial(decode.prefill, model))
    step = jax.jit(functools.partial(decode.decode, model))
    cache = decode.empty_cache(model, 3, slots, jnp.asarray(pads))
    logits, cache = prefill(params, jnp.asarray(tokens[:, :prefilled]), cache)
    cached = [logits]
    for slot in range(prefilled, slots):
        logits, cache = step(params, jnp.asarray(tokens[:, slot]), slot, cache)
        cached.append(logits)
    cached = np.stack(cached, axis=1)  # after slots prefilled - 1 ... slots - 1
    apply = jax.jit(model.apply)
    for row, pad in enumerate(pads):
        full = np.asarray(apply(params, jnp.asarray(tokens[row : row + 1, pad:])))[0]
        after = np.arange(prefilled - 1, slots) - pad  # the token each cached logit follows
        np.testing.assert_allclose(cached[row], full[after], atol=1e-5, rtol=0, err_msg=f"{row}")


def test_a_pallas_prefill_gives_the_xla_prefills_logits_and_cache(seed):
    """attention_impl="pallas" (the Pallas interpreter on CPU) prefills with the kernels, the
    padding masked by segment ids: the same next-token logits and cache as XLA's, and the
    padded row's logits those of its tokens alone, 1e-5."""
    fields = dict(vocab_size=96, emb_features=64, num_layers=1, num_heads=4, num_kv_heads=2)
    xla = CausalTransformer(**fields, max_seq_len=64)
    pallas = CausalTransformer(**fields, max_seq_len=64, attention_impl="pallas")
    params = xla.init(jax.random.key(seed))
    tokens = jnp.asarray(np.random.default_rng(seed).integers(0, 96, (2, 16), np.int32))
    pads = jnp.asarray([0, 9], jnp.int32)
    out = [
        jax.jit(functools.partial(decode.prefill, model))(
            params, tokens, decode.empty_cache(model, 2, 32, pads)
        )
        for model in (xla, pallas)
    ]
    for a, b in zip(jax.tree_util.tree_leaves(out[0]), jax.tree_util.tree_leaves(out[1])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    alone = xla.apply(params, tokens[1:, 9:])[0, -1]  # the padded row's 7 tokens, no padding
    np.testing.assert_allclose(np.asarray(out[1][0][1]), np.asarray(alone), atol=1e-5, rtol=0)


# --- Layouts against one device ------------------------------------------------------------------

PROMPTS = [[5, 17, 3, 44, 90, 1, 8], [61, 2], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


def test_fsdp_8_and_fsdp_2_tensor_4_sample_what_one_device_samples(seed):
    """Sampled (temperature 0.9, top-k 40, top-p 0.95) and so drawn from the whole distribution:
    12 tokens after three prompts of 7, 2 and 11 tokens, the same ids on one device, fsdp=8
    (rows padded to 8, each layer's weights gathered) and fsdp=2 x tensor=4 (two kv heads shared
    by four devices, the vocabulary split and gathered)."""
    model = tiny(num_kv_heads=2, tie_embeddings=False, mlp_features=64)
    params = model.init(jax.random.key(seed))
    settings = dict(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.95, seed=seed)
    one = Generator(model, params, mesh=ONE_DEVICE)(PROMPTS, **settings)
    assert [len(c) for c in one] == [12, 12, 12]
    for mesh in (MeshSpec(fsdp=8), MeshSpec(fsdp=2, tensor=4)):
        assert Generator(model, params, mesh=mesh)(PROMPTS, **settings) == one, mesh


# --- Greedy generation against transformers ------------------------------------------------------


def reference(name: str) -> dict:
    return json.loads((REFERENCE / f"{name}.json").read_text())


@pytest.mark.parametrize("name", ["llama3_tied", "llama3_untied"])
def test_greedy_generation_equals_transformers(name):
    """40 new tokens after each of three prompts (5, 11 and 2 ids) batched, left-padded, on one
    device: transformers' greedy generate of each prompt alone, id for id."""
    model, params = hf.load(DATA / "hf" / name)
    ref = reference(name)
    got = Generator(model, params, mesh=ONE_DEVICE)(ref["prompts"], max_new_tokens=40)
    assert got == ref["completions"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """The LoRA run of tests/lora_reference.write_run (its adapters are the PEFT adapter of
    tests/data/lora/adapter): rank 4, alpha 6, all seven projections of llama3_untied."""
    from tests.lora_reference import write_run

    run = tmp_path_factory.mktemp("generate") / "run"
    write_run(run)
    return run


def test_greedy_generation_with_lora_adapters_equals_peft(lora_run):
    """The run's adapters unmerged beside the base, on fsdp=4 x tensor=2: PEFT's greedy
    generate, 40 ids after each prompt. Then a stop id: each row ends at its first occurrence,
    the stop id kept, the other rows as before."""
    from dew.models.checkpoint import load_lora

    model, base, adapters = load_lora(lora_run)
    ref = reference("lora")
    generator = Generator(model, base, adapters, mesh=MeshSpec(fsdp=4, tensor=2))
    assert generator(ref["prompts"], max_new_tokens=40) == ref["completions"]
    stop = ref["completions"][0][3]
    ended = [c[: c.index(stop) + 1] if stop in c else c for c in ref["completions"]]
    assert len(ended[0]) == 4
    assert generator(ref["prompts"], max_new_tokens=40, stop_ids=[stop]) == ended


def test_dew_generate_runs_a_lora_runs_step_with_its_adapters(lora_run, tmp_path, dew_here):
    """dew generate RUN --step 0 on a LoRA run (bytes: the run kept no tokenizer): the ids
    dew.generate gives with the run's base and adapters."""
    import dew
    from dew.models.checkpoint import load_lora

    out = tmp_path / "out.jsonl"
    run = dew_here(
        "generate", str(lora_run), "--step", "0", "--prompt", "ab", "--max-new-tokens", "12",
        "--mesh", "fsdp=4,tensor=2", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    model, base, adapters = load_lora(lora_run)
    api = dew.generate(
        model, base, ["ab"], adapters=adapters, tokenizer="bytes", max_new_tokens=12,
        mesh=MeshSpec(fsdp=4, tensor=2),
    )  # fmt: skip
    record = json.loads(out.read_text())
    assert record["completion_ids"] == api[0].completion_ids and len(api[0].completion_ids) == 12
    missing = dew_here("generate", str(lora_run), "--step", "3", "--prompt", "ab", cwd=tmp_path)
    assert missing.returncode == 2 and "has no step 3; its steps are 0" in missing.stderr


def test_an_int8_lora_base_generates_as_its_full_forward(seed):
    """A LoRA model on an int8 base (its layer matrices int8, a scale per output channel),
    drawn adapters: greedy ids on fsdp=4 x tensor=2 are those of a greedy loop over the full
    forward of the same int8 tree (lora.combine) on one device, 10 tokens."""
    from dew.models import lora

    model = tiny(num_kv_heads=2, lora=lora.Lora(rank=2, alpha=3.0, base_dtype="int8"))
    frozen = jax.jit(lambda key: lora.frozen_of(model, model.init(key)))(jax.random.key(seed))
    fresh = jax.eval_shape(lambda: lora.init_adapters(model, jax.random.key(0)))
    rng = np.random.default_rng(seed)
    adapters = jax.tree_util.tree_map(
        lambda x: jnp.asarray(0.3 * rng.standard_normal(x.shape), jnp.float32), fresh
    )
    apply = jax.jit(lambda t: model.apply(lora.combine(model, frozen, adapters), t))
    prompt, new = [3, 14, 15, 92, 65], 10
    ids = list(prompt)
    for _ in range(new):  # right-padded to 32: causal, so the padding changes nothing before it
        logits = apply(jnp.asarray([ids + [0] * (32 - len(ids))]))
        ids.append(int(jnp.argmax(logits[0, len(ids) - 1])))
    generator = Generator(model, frozen, adapters, mesh=MeshSpec(fsdp=4, tensor=2))
    assert generator([prompt], max_new_tokens=new) == [ids[len(prompt) :]]


# --- Sampling against its formulas ---------------------------------------------------------------

LOGITS = np.array([2.0, 1.6, 0.9, 0.4, -0.3, -1.2], np.float32)
SAMPLING_SEED = 20261207
DRAWS = 20000


def expected(temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The distribution by the formulas: softmax of logits / T over the top k, renormalized,
    then the fewest most likely whose probability reaches p (HF's top-k then top-p)."""
    logits = LOGITS.astype(np.float64)
    order = np.argsort(-logits, kind="stable")
    z = logits[order] / temperature
    z = z - z.max()
    p = np.exp(z)
    if top_k:
        p[top_k:] = 0
    p = p / p.sum()
    kept = np.searchsorted(np.cumsum(p), top_p) + 1  # the fewest whose sum reaches top_p
    p[kept:] = 0
    out = np.zeros_like(p)
    out[order] = p / p.sum()
    return out


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(0.7, 0, 1.0), (1.6, 3, 1.0), (1.0, 0, 0.8), (1.3, 5, 0.75)],
)
def test_sampling_follows_temperature_top_k_and_top_p(temperature, top_k, top_p):
    """20000 draws on a vocabulary of 6: the counts fit the formulas' distribution by a
    chi-square test (p > 1e-4), and no token outside the kept set is ever drawn."""
    print(f"sampling seed {SAMPLING_SEED}")
    want = expected(temperature, top_k, top_p)
    keys = jax.random.split(jax.random.key(SAMPLING_SEED), DRAWS)
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (DRAWS, LOGITS.size))
    drawn = jax.jit(sample)(logits, keys, temperature, top_k, top_p)
    counts = np.bincount(np.asarray(drawn), minlength=LOGITS.size)
    kept = want > 0
    assert counts[~kept].sum() == 0, (counts, want)
    assert kept.sum() >= 3, want  # the test tells the cut-off apart from a token more or less
    test = stats.chisquare(counts[kept], DRAWS * want[kept] / want[kept].sum())
    assert test.pvalue > 1e-4, (counts, DRAWS * want, test)


# --- The command line ----------------------------------------------------------------------------


def test_dew_generate_writes_the_completions_of_a_hf_folder(tmp_path, dew_here):
    """Two prompts of a --prompts file (texts through the folder's byte-level tokenizer.json),
    greedy: one JSON line each, the prompt, the new ids (as dew.generate gives them) and their
    text; printed too."""
    folder = DATA / "hf" / "llama3_tied"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Once upon"}\n"a time, there"\n')
    out = tmp_path / "out.jsonl"
    run = dew_here(
        "generate", str(folder), "--prompts", str(prompts), "--max-new-tokens", "9",
        "--mesh", "fsdp=8", "--stop", "7", "--output", str(out), cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in records] == ["Once upon", "a time, there"]
    import dew

    model, params = hf.load(folder)
    api = dew.generate(
        model, params, ["Once upon", "a time, there"], tokenizer=folder / "tokenizer.json",
        max_new_tokens=9, stop=[7], mesh=ONE_DEVICE,
    )  # fmt: skip
    assert [r["completion_ids"] for r in records] == [c.completion_ids for c in api]
    assert [r["completion"] for r in records] == [c.completion for c in api]
    assert all(len(r["completion_ids"]) == 9 or r["completion_ids"][-1] == 7 for r in records)
    assert records[0]["completion"] in run.stdout


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--temperature", "-0.5"], "--temperature must be 0 (greedy) or above, got -0.5"),
        (["--top-k", "-3"], "--top-k must be 0 (all tokens) or a positive integer, got -3"),
        (["--top-p", "1.5"], "--top-p must be above 0 and at most 1, got 1.5"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1, got 0"),
        ([], "no prompt: give --prompt TEXT or --prompts FILE.jsonl"),
    ],
)
def test_bad_flags_are_refused_in_one_line_before_loading(tmp_path, dew_here, flags, words):
    prompt = ["--prompt", "hi"] if flags else []
    run = dew_here("generate", str(tmp_path / "no-such-run"), *prompt, *flags, cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip() == f"dew generate: {words}"


def test_out_of_memory_is_one_line_naming_the_flags(tmp_path, dew_here, monkeypatch):
    """XLA's refusal (as a chip's compiler words it) from the generation: one line saying what
    it needs and which flags shrink it."""
    import dew.generation

    def refuse(self, *args, **kwargs):
        raise jax.errors.JaxRuntimeError(
            "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 17.20G of 15.48G hbm."
        )

    monkeypatch.setattr(dew.generation.Generator, "__call__", refuse)
    folder = DATA / "hf" / "llama3_tied"
    run = dew_here(
        "generate", str(folder), "--prompt", "hi", "--max-new-tokens", "8", "--mesh", "fsdp=8",
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("dew generate: generating does not fit")
    assert "--max-new-tokens" in lines[0] and "now fsdp=8" in lines[0]


def test_chat_wraps_each_prompt_in_the_tokenizers_template(tmp_path):
    """--chat: each prompt a user's message in tokenizer_config.json's chat_template, with its
    bos token and the assistant's turn opened; a tokenizer without a template is refused."""
    from dew.cli.generate import chat_prompts

    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config = {"chat_template": template, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "tokenizer.json").write_text("{}")
    got = chat_prompts(["hi", "two words"], tmp_path / "tokenizer.json")
    assert got == [
        "<s><|user|>hi<|end|><|assistant|>",
        "<s><|user|>two words<|end|><|assistant|>",
    ]
    with pytest.raises(ValueError, match="--chat: the tokenizer .* has no chat template"):
        chat_prompts(["hi"], DATA / "hf" / "llama3_tied" / "tokenizer.json")


def test_a_damaged_latest_step_is_refused_naming_step_and_an_intact_one_runs(tmp_path, dew_here):
    """A Dew checkpoint (the tied reference model as step 0, its weights plus one as step 1)
    whose latest step's data file is cut in half: dew generate refuses in one line naming the
    intact step and --step; --step 0 generates."""
    import os

    from dew.checkpoints import Checkpoints
    from dew.cli import convert
    from dew.models.checkpoint import load_checkpoint

    directory = tmp_path / "ckpt"
    convert.to_checkpoint(DATA / "hf" / "llama3_tied", directory)
    _, params = load_checkpoint(directory)
    checkpoints = Checkpoints(directory, keep=None)
    checkpoints.save(1, jax.tree.map(lambda a: a + 1, params), metadata=checkpoints.metadata(0))
    checkpoints.wait()
    (data,) = (directory / "step_00000001").glob("*.npz")
    os.truncate(data, data.stat().st_size // 2)
    run = dew_here("generate", str(directory), "--prompt", "hi", cwd=tmp_path)
    assert run.returncode == 2
    (line,) = run.stderr.splitlines()
    assert line.startswith(f"dew generate: checkpoint step 1 in {directory}, the latest, is dam")
    assert line.endswith("are 0: name one to read it (generate from one with --step N)"), line
    run = dew_here(
        "generate", str(directory), "--prompt", "hi", "--step", "0", "--max-new-tokens", "3",
        "--mesh", "fsdp=8", cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr


def test_prompt_and_new_tokens_beyond_the_context_are_refused_naming_the_flag(tmp_path, dew_here):
    folder = DATA / "hf" / "llama3_tied"  # a context of 64 tokens; "hello" is 5 bytes
    run = dew_here("generate", str(folder), "--prompt", "hello", "--max-new-tokens", "60",
                   cwd=tmp_path)  # fmt: skip
    assert run.returncode == 2
    assert run.stderr.strip() == (
        "dew generate: --max-new-tokens 60 after the longest prompt (5 tokens) exceeds the "
        "model's context of 64 tokens; give at most 59"
    )


def test_the_library_refuses_what_it_cannot_run_naming_the_values():
    """Before anything compiles: an MoE model, a sequence axis, string prompts without a
    tokenizer, a sampling value out of range, an id outside the vocabulary, a stop string that
    is not one token."""
    import dew

    model = tiny()
    params = jax.jit(model.init)(jax.random.key(0))
    moe = tiny(num_experts=4)
    with pytest.raises(ValueError, match="generation runs dense models; this one has 4 experts"):
        Generator(moe, jax.eval_shape(moe.init, jax.random.key(0)), mesh=ONE_DEVICE)
    with pytest.raises(ValueError, match="runs on data, fsdp and tensor axes; the mesh has seq"):
        Generator(model, params, mesh=MeshSpec(sequence=2))
    with pytest.raises(ValueError, match="string prompts need a tokenizer"):
        dew.generate(model, params, ["hi"], mesh=ONE_DEVICE)
    with pytest.raises(ValueError, match="top_p must be above 0 and at most 1, got 0"):
        dew.generate(model, params, [[1, 2]], top_p=0, mesh=ONE_DEVICE)
    with pytest.raises(ValueError, match=r"prompt ids \[96\] are outside the vocabulary \[0, 96\)"):
        dew.generate(model, params, [[1, 96]], mesh=ONE_DEVICE)
    with pytest.raises(ValueError, match="stop 'ab' is not one token of the tokenizer"):
        dew.generate(model, params, ["hi"], tokenizer="bytes", stop=["ab"], mesh=ONE_DEVICE)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ids_past_the_tokenizers_are_never_drawn_from_a_padded_vocabulary(temperature, seed):
    """dew train rounds a folder's vocabulary up to a multiple of 128: the rows past the
    tokenizer's ids must never be drawn, or the completion cannot be decoded. Here the padded
    rows (80..95 of 96) are made the likeliest: every real id's logit is 0, and padded ids 80
    and 81 get +-100 h.u, one of them above 0 wherever h.u is not 0. Unbounded, greedy takes
    them; bounded by the tokenizer's 80 ids, neither greedy nor sampling ever does."""
    import dew

    model = tiny(tie_embeddings=False)
    params = jax.jit(model.init)(jax.random.key(seed))
    u = jax.random.normal(jax.random.key(seed + 1), (48,))
    head = jnp.zeros((48, 96)).at[:, 80].set(100 * u).at[:, 81].set(-100 * u)
    params = {"params": {**params["params"], "lm_head": {"kernel": head}}}
    prompts = [[int(i) for i in np.random.default_rng(seed).integers(0, 80, n)] for n in (3, 9)]
    kwargs = dict(max_new_tokens=12, temperature=temperature, seed=seed, mesh=ONE_DEVICE)

    class Tokenizer80:  # a tokenizer of 80 ids, each decoded as one character
        vocab_size, eos_id = 80, None

        def decode(self, ids):
            assert all(0 <= i < 80 for i in ids), ids  # an id it does not have
            return "".join(chr(48 + i) for i in ids)

    out = dew.generate(model, params, prompts, tokenizer=Tokenizer80(), **kwargs)
    assert all(0 <= i < 80 for c in out for i in c.completion_ids), out
    assert all(len(c.completion_ids) == 12 for c in out), out
    greedy = Generator(model, params, mesh=ONE_DEVICE)(prompts, max_new_tokens=12)
    assert all(i in (80, 81) for row in greedy for i in row), greedy  # what the bound stops
