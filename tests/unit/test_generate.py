"""Generation on one process (infer/engine.py, models/kv_cache.py) against transformers and against itself.

Greedy ids are compared exactly: imported logits equal transformers' bitwise (test_hf_interop.py), and
a KV-cache step computes the same dot products as a full recomputation over the prefix (SDPA over the
cached keys), so argmax picks the same token at every step. Random weights of std 0.2 make the logits
far from ties (a near-tie would be the only way for exact ids to differ without a bug).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shardwise.cli import main
from shardwise.config import load_config
from shardwise.infer.engine import Engine
from shardwise.infer.sampling import Sampler
from shardwise.plan.decode import kv_cache_bytes
from shardwise.spec.shapes import ModelShape
from tests.hf_models import load_hf, save_random_llama  # skips the module without transformers

PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [11, 12, 13], [250]]  # different lengths: left padding
NEW = 12


@pytest.fixture(scope="module", params=["gqa", "mha"])
def model_dir(request, tmp_path_factory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp(request.param) / "hf", request.param)


def _engine(directory: Path) -> Engine:
    cfg = load_config(None, [f"--model.init_from=hf:{directory}", "--data.tokenizer=byte"])
    return Engine(cfg, torch.device("cpu"))


def _recompute(engine: Engine, prompt: list[int], new: int) -> list[int]:
    """Greedy decoding with no cache: the whole sequence through the model for every new token."""
    seq = list(prompt)
    for _ in range(new):
        seq.append(int(engine.forward(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_greedy_kv_cache_equals_recomputation_and_transformers(model_dir):
    engine = _engine(model_dir)
    result = engine.generate(PROMPTS, NEW, Sampler())
    hf = load_hf(model_dir)
    for prompt, ids in zip(PROMPTS, result.ids):
        assert len(ids) == NEW
        assert ids == _recompute(engine, prompt, NEW)
        alone = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
        assert alone[0, len(prompt):].tolist() == ids
    # transformers' own batched, left-padded generation agrees too.
    longest = max(map(len, PROMPTS))
    tokens = torch.zeros(len(PROMPTS), longest, dtype=torch.long)
    mask = torch.zeros_like(tokens)
    for i, p in enumerate(PROMPTS):
        tokens[i, longest - len(p):], mask[i, longest - len(p):] = torch.tensor(p), 1
    batched = hf.generate(tokens, attention_mask=mask, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    assert batched[:, longest:].tolist() == result.ids


def test_a_padded_prompt_decodes_as_it_would_alone(model_dir):
    engine = _engine(model_dir)
    together = engine.generate(PROMPTS, NEW, Sampler()).ids
    assert [engine.generate([p], NEW, Sampler()).ids[0] for p in PROMPTS] == together


def test_kv_cache_bytes_equal_the_planners_closed_form(model_dir):
    engine = _engine(model_dir)
    result = engine.generate(PROMPTS, NEW, Sampler())
    shape = ModelShape.from_config(engine.cfg.model)
    capacity = max(map(len, PROMPTS)) + NEW
    assert result.kv_cache_bytes == kv_cache_bytes(shape, 1, shape.n_layers, len(PROMPTS), capacity, 4)
    assert result.prefill_tokens == sum(map(len, PROMPTS)) and result.decode_tokens == (NEW - 1) * len(PROMPTS)


def test_generation_stops_at_the_end_token(model_dir):
    engine = _engine(model_dir)
    ids = engine.generate(PROMPTS[:1], NEW, Sampler()).ids[0]
    stop = ids[4]
    cut = engine.generate(PROMPTS[:1], NEW, Sampler(), eos_ids={stop}).ids[0]
    assert cut == ids[:ids.index(stop) + 1]


def test_cli_generate_json_lines_and_bad_input(model_dir, capsys):
    args = ["generate", "--hf", str(model_dir), "--prompt-ids", "5,17,33", "--prompt-ids", "11,12",
            "--max-new-tokens", "6", "--ignore-eos", "--json"]
    assert main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == 2 and all(len(line["ids"]) == 6 for line in lines)
    assert set(lines[0]) == {"ids", "text", "prefill_tokens_per_s", "decode_tokens_per_s"}
    assert lines[0]["decode_tokens_per_s"] > 0
    bad = {
        ("--prompt-ids", "1,x"): "--prompt-ids",
        ("--prompt-ids", "9999"): "within [0, 320)",
        ("--prompt-ids", "1", "--max-new-tokens", "500"): "max_seq_len",
        ("--prompt", "hello"): "no tokenizer.json",
        ("--prompt-ids", "1", "--parallel.dp_shard=2", "--nproc", "2"): "separate replicas",
        ("--prompt-ids", "1", "--parallel.tp=2"): "--nproc 2",
        ("--prompt-ids", "1", "--parallel.tp=3", "--nproc", "3"): "parallel.tp",
        ("--prompt-ids", "1", "--temperature", "0"): "--temperature",
    }
    for extra, words in bad.items():
        assert main(["generate", "--hf", str(model_dir), *extra]) == 2, extra
        err = capsys.readouterr().err
        assert words in err and "Traceback" not in err, (extra, err)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_compiled_decoding_equals_eager_and_compiles_once(model_dir, capsys):
    """--compile: the prefill (prompts left-padded to a bucket of 64) and every decode step one compiled
    graph each over a static KV cache (models/kv_cache.py StaticKVCache). The same ids as the eager path
    (which equals transformers, above) with prompts of unequal lengths and with an end token in the
    middle of the batch; two graphs for the whole generation, and none more for other prompts and
    lengths in the same bucket."""
    from shardwise.parallel.compile import compiled_graphs

    engine = _engine(model_dir)
    eager = engine.generate(PROMPTS, NEW, Sampler())
    before = compiled_graphs()
    compiled = engine.generate(PROMPTS, NEW, Sampler(), compiled=True)
    assert compiled.ids == eager.ids and compiled_graphs() - before == 2  # prefill, decode step
    stop = eager.ids[1][3]  # the second prompt ends early; the others go on
    cut = engine.generate(PROMPTS, NEW, Sampler(), eos_ids={stop}, compiled=True).ids
    assert cut == engine.generate(PROMPTS, NEW, Sampler(), eos_ids={stop}).ids and len(cut[1]) < NEW
    other = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3], [42, 43]]
    assert engine.generate(other, NEW, Sampler(), compiled=True).ids == engine.generate(other, NEW, Sampler()).ids
    assert compiled_graphs() - before == 2  # no recompilation
    args = ["generate", "--hf", str(model_dir), "--prompt-ids", "5,17,33", "--max-new-tokens", "6", "--json"]
    assert main(args + ["--compile=on"]) == 0 and main(args + ["--compile=off"]) == 0
    on, off = [json.loads(line)["ids"] for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert on == off  # compiled under TP and PP: tests/dist/test_hf_layouts.py


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_the_static_cache_is_a_cuda_graph_input_kept_between_generations(model_dir):
    """What CUDA graphs need, decided on any device: every buffer the compiled step writes in place is
    marked as a static address (else inductor skips CUDA graphs: "mutated inputs"), and the next
    generation of the same shape reuses those buffers, emptied (else the graph is recorded again), with
    the same ids as a fresh engine's."""
    engine = _engine(model_dir)
    first = engine.generate(PROMPTS, NEW, Sampler(), compiled=True)
    cache = engine._static_cache
    buffers = cache.tensors()
    assert len(buffers) == 3 + 2 * engine.cfg.model.n_layers
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in buffers)
    addresses = [t.data_ptr() for t in buffers]
    again = engine.generate(PROMPTS[::-1], NEW, Sampler(), compiled=True)
    assert engine._static_cache is cache and [t.data_ptr() for t in cache.tensors()] == addresses
    assert again.ids == first.ids[::-1] == _engine(model_dir).generate(PROMPTS[::-1], NEW, Sampler(), compiled=True).ids
    engine.generate(PROMPTS[:2], NEW, Sampler(), compiled=True)  # another batch: a cache of its own
    assert engine._static_cache is not cache and engine._static_cache.batch == 2


def test_greedy_compiled_decoding_looks_at_the_ids_every_few_steps(model_dir):
    """Greedy compiled decoding keeps each step's ids on the device (infer/engine.py _decode_on_device) and
    reads them back every DONE_CHECK_EVERY steps: sequences ending at different steps inside one such
    block keep exactly their ids up to the end token, and once all have ended no more than
    DONE_CHECK_EVERY - 1 further steps run."""
    from shardwise.infer.engine import DONE_CHECK_EVERY

    engine = _engine(model_dir)
    eager = engine.generate(PROMPTS, NEW, Sampler())
    eos = {eager.ids[0][2], eager.ids[1][4], eager.ids[2][5]}  # every sequence ends by its 6th token
    want = engine.generate(PROMPTS, NEW, Sampler(), eos_ids=eos).ids
    assert max(len(ids) for ids in want) <= 6 and len({len(ids) for ids in want}) > 1
    engine.generate(PROMPTS, NEW, Sampler(), compiled=True)  # compiles the greedy step
    calls = []
    step = engine._compiled["greedy"]
    engine._compiled["greedy"] = lambda *args: calls.append(1) or step(*args)
    assert engine.generate(PROMPTS, NEW, Sampler(), eos_ids=eos, compiled=True).ids == want
    assert len(calls) == DONE_CHECK_EVERY < NEW - 1  # the prefill chose the first ids; one block of steps


class _CopyPending:
    """A GPU copy's event, on a CPU: the block counts as not yet read back until it is waited for."""

    def __init__(self, waited: list):
        self.waited = waited

    def synchronize(self) -> None:
        self.waited.append(1)


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_ids_read_back_behind_the_next_block_as_on_a_gpu_give_the_same_ids(model_dir, monkeypatch):
    """On a GPU a block's ids are copied to the host behind its steps and read READ_BACK_AT steps into the
    next block (infer/engine.py ids_read_back_async), which a CPU never does: forced here, with the copy's
    event stood in for. The ids equal eager's, greedy with sequences ending at different steps and sampled
    with the batch shrinking (rows recorded per block); once all have ended, at most DONE_CHECK_EVERY +
    READ_BACK_AT - 1 further steps run, and the last block is read at once."""
    from shardwise.infer import engine as engine_module
    from shardwise.infer.engine import DONE_CHECK_EVERY, READ_BACK_AT, IdsOnTheWay

    waited: list = []

    def start(cls, ids, rows, asynchronous):
        return cls(ids.cpu(), list(rows), _CopyPending(waited) if asynchronous else None)

    engine = _engine(model_dir)
    eager = engine.generate(PROMPTS, NEW, Sampler())
    eos = {eager.ids[0][2], eager.ids[1][4], eager.ids[2][5]}  # every sequence ends by its 6th token
    long = 2 * DONE_CHECK_EVERY + 2  # a second block long enough to be read into
    want = engine.generate(PROMPTS, long, Sampler(), eos_ids=eos).ids
    lengths = {new: engine.generate(PROMPTS, new, Sampler()).ids for new in (2, DONE_CHECK_EVERY + 2, 2 * DONE_CHECK_EVERY + 1)}
    sampled_eager = engine.generate(BATCH, 24, Sampler(False, 0.8, 0.9, seed=11))
    sampled_eos = {ids[2] for ids in sampled_eager.ids[:6]}
    sampled_want = engine.generate(BATCH, 24, Sampler(False, 0.8, 0.9, seed=11), eos_ids=sampled_eos).ids
    monkeypatch.setattr(engine_module, "ids_read_back_async", lambda device_type: True)
    monkeypatch.setattr(IdsOnTheWay, "start", classmethod(start))
    assert engine.generate(PROMPTS, NEW, Sampler(), compiled=True).ids == eager.ids
    assert waited  # a block was read behind the next one
    calls = []
    step = engine._compiled["greedy"]
    engine._compiled["greedy"] = lambda *args: calls.append(1) or step(*args)
    assert engine.generate(PROMPTS, long, Sampler(), eos_ids=eos, compiled=True).ids == want
    assert len(calls) == DONE_CHECK_EVERY + READ_BACK_AT  # the first block, read 4 steps into the next
    assert engine.generate(BATCH, 24, Sampler(False, 0.8, 0.9, seed=11), eos_ids=sampled_eos, compiled=True).ids \
        == sampled_want
    assert engine.generate(BATCH, 24, Sampler(False, 0.8, 0.9, seed=11), compiled=True).ids == sampled_eager.ids
    for new, ids in lengths.items():  # last blocks shorter than READ_BACK_AT: read at once, behind another or not
        assert engine.generate(PROMPTS, new, Sampler(), compiled=True).ids == ids


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_sampled_compiled_decoding_draws_on_the_device_and_equals_eager(model_dir):
    """Sampled compiled decoding runs like greedy (infer/engine.py _decode_on_device): the draw inside the
    compiled step, the ids read back every DONE_CHECK_EVERY steps, the block's random numbers drawn up
    front in the step-by-step order; so the same seed samples the same ids as eager decoding, with
    prompts of unequal lengths, sequences ending mid-block and the batch shrinking. One graph per
    temperature and top_p, none more for the next generation."""
    from shardwise.infer.engine import DONE_CHECK_EVERY
    from shardwise.parallel.compile import compiled_graphs

    engine, new = _engine(model_dir), 24
    for temperature, top_p in ((0.8, 0.9), (1.2, 1.0)):
        sampler = lambda t=temperature, p=top_p: Sampler(False, t, p, seed=11)  # noqa: E731
        eager = engine.generate(BATCH, new, sampler())
        assert engine.generate(BATCH, new, sampler(), compiled=True).ids == eager.ids
        assert len({tuple(ids) for ids in eager.ids}) > 1 and eager.ids != engine.generate(BATCH, new, Sampler()).ids
        eos = {ids[2] for ids in eager.ids[:6]}  # most sequences end early, at different steps: the batch shrinks
        want = engine.generate(BATCH, new, sampler(), eos_ids=eos)
        assert engine.generate(BATCH, new, sampler(), eos_ids=eos, compiled=True).ids == want.ids
    engine.generate(PROMPTS, NEW, Sampler(False, 0.8, 0.9, seed=2), compiled=True)  # batch 3's graphs
    graphs = compiled_graphs()
    key = ("sampled", 0.8, 0.9)
    step, calls = engine._compiled[key], []
    engine._compiled[key] = lambda *args: calls.append(args[2].shape) or step(*args)  # (tokens, cache, uniform)
    got = engine.generate(PROMPTS, NEW, Sampler(False, 0.8, 0.9, seed=2), compiled=True)
    assert got.ids == engine.generate(PROMPTS, NEW, Sampler(False, 0.8, 0.9, seed=2)).ids
    assert len(calls) == NEW - 1 and set(calls) == {(len(PROMPTS),)}  # one number per row and step
    assert compiled_graphs() == graphs and DONE_CHECK_EVERY < NEW - 1  # the blocks replayed the compiled step


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_one_process_serving_runs_qkv_and_w1_w3_as_one_gemm_each(model_dir):
    """A decode step's GEMMs are small and each pays a fixed kernel time (plan/constants.py
    DECODE_GEMM_KERNEL_S): one process serves with q|k|v and w1|w3 fused (models/feed_forward.py
    fuse_linears). The separate weights become views of the fused buffer (no copy; state_dict as a
    fresh model's), and the compiled step reads the fused buffers, never the separate weights; ids as
    transformers' (the tests above)."""
    engine = _engine(model_dir)
    attention, ffn = engine.model.layers[0].attention, engine.model.layers[0].feed_forward
    assert attention.wq.weight.data_ptr() == attention.wqkv.data_ptr()
    assert attention.wv.weight.data_ptr() == attention.wqkv[-attention.wv.out_features:].data_ptr()
    assert ffn.w3.weight.data_ptr() == ffn.w13[ffn.w1.out_features:].data_ptr()
    fresh = load_config(None, [f"--model.init_from=hf:{model_dir}", "--data.tokenizer=byte"])
    from shardwise.models import build_model

    assert list(engine.model.state_dict()) == list(build_model(fresh.model).state_dict())
    read: list[str] = []

    def backend(gm, inputs):
        read.extend(str(n.target) for n in gm.graph.nodes if n.op == "placeholder")
        return gm.forward

    from shardwise.models.kv_cache import StaticKVCache

    cache = StaticKVCache(1, 64, engine.device)
    positions = cache.begin(torch.ones(1, 3, dtype=torch.bool))
    engine.forward(torch.tensor([[5, 6, 7]]), positions, cache, last_only=True)
    cache.end(3)
    def greedy(tokens, cache):  # a code object of its own: the engine's step may be cached from other tests
        return engine._greedy_step(tokens, cache)

    with torch.no_grad():
        torch.compile(greedy, backend=backend)(torch.tensor([[8]]), cache)
    assert sum("buffers_wqkv" in n for n in read) == sum("buffers_w13" in n for n in read) == engine.cfg.model.n_layers
    assert not [n for n in read if any(f"modules_{w}_parameters" in n for w in ("wq", "wk", "wv", "w1", "w3"))]


def test_greedy_chooses_on_the_logits_device_and_returns_cpu_ids():
    """Greedy moves b ids, not b x vocab logits, off the device; the same ids as an fp32 argmax on the CPU
    (bf16 logits included: the float conversion is exact), lowest id on a tie."""
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie
    ids = Sampler()(logits)
    assert ids.device.type == "cpu" and ids.tolist() == logits.float().argmax(-1).tolist() and ids[0] == 7


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
@pytest.mark.parametrize("preset", ["tiny-gpt", "tiny-moe"])
def test_kv_cache_decoding_equals_recomputation_for_gpt_and_moe(preset):
    """Our own architectures too (learned positions for gpt; routed experts): cache == no cache."""
    cfg = load_config(None, [f"--model.preset={preset}", "--data.tokenizer=byte", "--model.vocab_size=320"])
    engine = Engine(cfg, torch.device("cpu"))
    with torch.no_grad():  # std 0.02 init gives near-uniform logits; scale the head so argmax has clear winners
        engine.model.output.weight.mul_(50)
    result = engine.generate(PROMPTS, NEW, Sampler())
    for prompt, ids in zip(PROMPTS, result.ids):
        assert ids == _recompute(engine, prompt, NEW)
    # Compiled decoding too (MoE: its feed-forward stays eager between graphs), and once only.
    from shardwise.parallel.compile import compiled_graphs

    assert engine.generate(PROMPTS, NEW, Sampler(), compiled=True).ids == result.ids
    graphs = compiled_graphs()
    assert engine.generate(PROMPTS[::-1], NEW, Sampler(), compiled=True).ids == result.ids[::-1]
    assert compiled_graphs() == graphs


BATCH = [[5, 17, 33, 2, 99, 100, 7], [11, 12, 13], [250], [1, 2], [3, 4, 5, 6], [77], [8, 9, 10], [40, 41, 42, 43, 44]]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")  # inductor's import
def test_finished_sequences_leave_the_batch(model_dir):
    """Once at most half the rows hold unfinished sequences, the batch shrinks to them (infer/engine.py
    Running.shrink): the same ids as a batch that keeps every row, fewer rows computed; compiled steps
    shrink to powers of two (a graph each, compiled once: a second generation compiles nothing), and a
    seeded sampler draws the same tokens either way (each sequence takes its own noise)."""
    from shardwise.parallel.compile import compiled_graphs

    engine, new = _engine(model_dir), 24  # compiled greedy looks at the ids every 8 steps: 3 looks
    full = engine.generate(BATCH, new, Sampler())
    eos = {ids[2] for ids in full.ids[:6]}  # six of eight sequences end by their third token
    for compiled in (False, True):
        kept = engine.generate(BATCH, new, Sampler(), eos_ids=eos, compiled=compiled, compact=False)
        shrunk = engine.generate(BATCH, new, Sampler(), eos_ids=eos, compiled=compiled)
        assert shrunk.ids == kept.ids == [ids[:next((k + 1 for k, t in enumerate(ids) if t in eos), new)] for ids in full.ids]
        assert sum(len(ids) < 4 for ids in shrunk.ids) >= 6 and max(len(ids) for ids in shrunk.ids) > 16
        assert shrunk.decode_tokens == kept.decode_tokens < kept.decode_rows == (new - 1) * len(BATCH)
        assert shrunk.decode_rows < kept.decode_rows * 0.6, (compiled, shrunk.decode_rows, kept.decode_rows)
    graphs = compiled_graphs()
    assert engine.generate(BATCH, new, Sampler(), eos_ids=eos, compiled=True).ids == kept.ids
    assert compiled_graphs() == graphs
    sampler = lambda: Sampler(greedy=False, temperature=0.7, seed=5)  # noqa: E731
    sampled = engine.generate(BATCH, new, sampler(), compact=False)
    stop = {ids[1] for ids in sampled.ids[:6]}
    want = engine.generate(BATCH, new, sampler(), eos_ids=stop, compact=False)
    got = engine.generate(BATCH, new, sampler(), eos_ids=stop)
    assert got.ids == want.ids and got.decode_rows < want.decode_rows


def test_a_static_cache_keeps_rows_in_place_at_the_same_addresses():
    """What a compiled step of the smaller batch needs (CUDA graphs replay at fixed addresses): the kept
    rows move to the front of the same buffers, in the order asked, viewed from there and marked static;
    no new keys or values are allocated."""
    from shardwise.models.kv_cache import StaticKVCache

    cache = StaticKVCache(4, 64, torch.device("cpu"))
    cache.layer("0").allocate(2, 8, torch.float32)
    cache.layer("0").k.copy_(torch.randn(4, 2, 64, 8))
    cache.valid[:, :5] = torch.tensor([[True], [False], [True], [True]])
    before = cache.layer("0").k.clone(), cache.valid.clone()
    cache.length = 5
    small = cache.keep_rows([3, 1])
    assert small.batch == 2 and small.length == 5 and small.filled is cache.filled
    assert torch.equal(small.layer("0").k, before[0][[3, 1]]) and torch.equal(small.valid, before[1][[3, 1]])
    assert [t.data_ptr() for t in small.tensors()] == [t.data_ptr() for t in cache.tensors()]
    assert all(getattr(t, "_dynamo_static_input_type", None) for t in small.tensors())
    assert small.layer("0").owner is small
