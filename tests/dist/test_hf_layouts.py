"""An imported Hugging Face model under parallel layouts: logits, greedy generation, continued training.

Each rank reads only its slices of the .safetensors files (models/weights.py) and must compute
transformers' logits: within 1e-5 (the issue's bound). FSDP and PP compute every value as one device
does (gathered weights; whole blocks per stage), so they are bitwise equal; tensor parallelism sums the
row-parallel matmuls' partial products over ranks in another order, which moves fp32 logits of
magnitude ~7 by up to 7.6e-6 here (~1e-6 relative: a few fp32 roundings of sums of 64-160 terms).
Greedy ids under TP and PP decoding (infer/engine.py, gloo), eager and compiled (one graph per stage and
step kind, TP's collectives traced inside it), must equal transformers' generate(do_sample=False) exactly: a 1e-6 relative change cannot flip an argmax whose top two
logits are far apart, which std-0.2 random weights make overwhelmingly likely; a wrong mask, position or
cache slot changes the ids within a few tokens.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_world
from tests.hf_models import load_hf, save_random_llama  # skips the module without transformers

LOGITS_ATOL = 1e-5
PROMPTS = [[5, 17, 33, 2, 99, 100, 7], [11, 12, 13]]
NEW = 10
TOKENS = torch.randint(0, 320, (2, 32), generator=torch.Generator().manual_seed(3))


def _config(directory: Path, **parallel):
    from shardwise.config import build_config

    over = [("model.init_from", f"hf:{directory}"), ("data.tokenizer", "byte"), ("train.seq_len", "32"),
            ("train.micro_batch", "2"), ("train.global_batch", "4")]
    return build_config(None, over + [(f"parallel.{k}", str(v)) for k, v in parallel.items()])


def _training_logits(directory: Path, **parallel) -> torch.Tensor:
    """Logits of the model as `shardwise train` builds it for this layout (parallelize -> materialize)."""
    from shardwise.models import build_model
    from shardwise.parallel.mesh import build_meshes
    from shardwise.parallel.parallelize import build_parallel_model
    from shardwise.preflight import check

    cfg = _config(directory, **parallel)
    dims = check(cfg, torch.distributed.get_world_size())
    with torch.device("meta"):
        model = build_model(cfg.model)
    model = build_parallel_model(model, dims, build_meshes(dims, "cpu"), cfg, torch.device("cpu"))
    with torch.no_grad():
        out = model(TOKENS)
    return (out.full_tensor() if hasattr(out, "full_tensor") else out).numpy()  # numpy: tensors would cross as shared memory


def _serving(directory: Path, **parallel) -> dict:
    """This layout's logits (None on ranks before the last stage), its eager and compiled greedy ids, the
    compiled ids of the prompts reversed and with an end token mid-batch (eager too: the ended sequence
    leaves the batch, Running.shrink, and the other decodes on alone in a graph of batch 1), and the
    graphs compiled by repeated shapes (0: every stage reuses its prefill and decode graphs)."""
    from shardwise.infer.engine import Engine
    from shardwise.infer.sampling import Sampler
    from shardwise.parallel.compile import compiled_graphs

    engine = Engine(_config(directory, **parallel), torch.device("cpu"))
    logits = engine.forward(TOKENS)
    out = {"logits": None if logits is None else logits.numpy(), "eager": engine.generate(PROMPTS, NEW, Sampler()).ids,
           "compiled": engine.generate(PROMPTS, NEW, Sampler(), compiled=True).ids}
    before = compiled_graphs()
    out["reversed"] = engine.generate(PROMPTS[::-1], NEW, Sampler(), compiled=True).ids
    out["new_graphs"] = compiled_graphs() - before
    stop = {out["eager"][0][3]}
    out["eos"] = engine.generate(PROMPTS, NEW, Sampler(), eos_ids=stop, compiled=True).ids  # compiles batch 1
    before = compiled_graphs()
    out["eos_again"] = engine.generate(PROMPTS, NEW, Sampler(), eos_ids=stop, compiled=True).ids
    out["new_graphs"] += compiled_graphs() - before
    out["eos_eager"] = engine.generate(PROMPTS, NEW, Sampler(), eos_ids=stop).ids
    out["sampled"] = engine.generate(PROMPTS, NEW, Sampler(False, 0.9, 0.8, seed=3)).ids  # TP: from the vocab shards
    # Compiled: PP draws inside the last stage's graph (Engine._decode_on_device), TP on the host's schedule.
    out["sampled_compiled"] = engine.generate(PROMPTS, NEW, Sampler(False, 0.9, 0.8, seed=3), compiled=True).ids
    return out


def _assert_greedy_ids(served: dict, want: list[list[int]]) -> None:
    assert served["eager"] == served["compiled"] == want
    assert served["reversed"] == want[::-1] and served["new_graphs"] == 0
    stop = want[0][3]
    cut = [ids[:ids.index(stop) + 1] if stop in ids else ids for ids in want]
    assert served["eos"] == served["eos_again"] == served["eos_eager"] == cut and len(cut[0]) == 4 and len(cut[1]) == NEW  # one sequence ends mid-batch


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_random_llama(tmp_path_factory.mktemp("hf") / "hf", "gqa", max_shard_size="100KB")


@pytest.fixture(scope="module")
def two_ranks(model_dir):
    def work(rank: int) -> dict:
        torch.manual_seed(0)
        return {"fsdp": _training_logits(model_dir, dp_shard=2, zero=3),
                "tp_train": _training_logits(model_dir, tp=2),
                "tp": _serving(model_dir, tp=2), "pp": _serving(model_dir, pp=2)}

    return run_world(2, work)


@pytest.fixture(scope="module")
def reference(model_dir, two_ranks):
    hf = load_hf(model_dir)
    with torch.no_grad():
        logits = hf(TOKENS).logits
    ids = [hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)[0, len(p):]
           .tolist() for p in PROMPTS]
    return logits, ids


@pytest.mark.parametrize("layout", ["fsdp", "tp_train"])
def test_training_layouts_compute_transformers_logits(two_ranks, reference, layout):
    for rank in range(2):
        torch.testing.assert_close(torch.from_numpy(two_ranks[rank][layout]), reference[0], atol=LOGITS_ATOL, rtol=0)
    if layout == "fsdp":
        assert torch.equal(torch.from_numpy(two_ranks[0][layout]), reference[0])


@pytest.mark.parametrize("layout", ["tp", "pp"])
def test_serving_layouts_give_transformers_logits_and_greedy_ids(two_ranks, reference, layout):
    last = [r for r in range(2) if two_ranks[r][layout]["logits"] is not None]
    assert last == ([0, 1] if layout == "tp" else [1])  # the pipeline's logits live on its last stage
    for rank in last:
        torch.testing.assert_close(torch.from_numpy(two_ranks[rank][layout]["logits"]), reference[0], atol=LOGITS_ATOL, rtol=0)
    for rank in range(2):
        _assert_greedy_ids(two_ranks[rank][layout], reference[1])


def test_tp2_x_pp2_greedy_ids_equal_transformers_eager_and_compiled(model_dir, reference):
    for served in run_world(4, lambda rank: _serving(model_dir, tp=2, pp=2)):
        _assert_greedy_ids(served, reference[1])


def test_generate_cli_under_tp_and_pp(model_dir, reference):
    """The command a user runs, launched by torchrun: --json ids equal transformers'."""
    for layout in (["--parallel.tp=2"], ["--parallel.pp=2"], ["--parallel.tp=2", "--compile=on"]):
        out = subprocess.run([sys.executable, "-m", "shardwise.cli", "generate", "--hf", str(model_dir), "--nproc", "2", *layout,
                              "--ignore-eos", "--max-new-tokens", str(NEW), "--json"]
                             + [arg for p in PROMPTS for arg in ("--prompt-ids", ",".join(map(str, p)))],
                             capture_output=True, text=True, timeout=300)
        # rank 0's traceback of a peer's crash would fill the message: the other ranks' lines say why
        assert out.returncode == 0, (layout, "\n".join(line for line in out.stderr.splitlines()
                                                       if not line.startswith("[rank0]"))[-4000:])
        lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        assert [line["ids"] for line in lines] == reference[1], layout


def test_continued_training_from_an_import_matches_across_layouts(model_dir):
    """`shardwise parity` from the imported weights: TP=2, ZeRO-3 and CP=2 over 2 ranks track one process."""
    out = subprocess.run([sys.executable, "-m", "shardwise.cli", "parity", "--nproc", "2", "--layout", "tp=2",
                          "--layout", "dp_shard=2,zero=3", "--layout", "cp=2", "--steps", "4", f"--model.init_from=hf:{model_dir}",
                          "--data.tokenizer=byte", "--train.seq_len=32", "--train.global_batch=4", "--train.micro_batch=2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("PASS") == 3, out.stdout


def test_sampled_ids_under_tp_and_pp_equal_one_process(model_dir, two_ranks):
    """Temperature 0.9, top-p 0.8, seed 3: TP samples from the vocabulary shards (Sampler.vocab_parallel) and
    draws what one process draws; the logits differ by rounding only, far from the draws' edges. Compiled
    too: PP's last stage draws inside its graph."""
    def work(rank: int) -> list[list[int]]:
        from shardwise.infer.engine import Engine
        from shardwise.infer.sampling import Sampler

        engine = Engine(_config(model_dir), torch.device("cpu"))
        return engine.generate(PROMPTS, NEW, Sampler(False, 0.9, 0.8, seed=3)).ids

    (one,) = run_world(1, work)
    assert len({tuple(ids) for ids in one}) > 1 and one != two_ranks[0]["tp"]["eager"]  # sampled, not greedy
    for rank in range(2):
        assert two_ranks[rank]["tp"]["sampled"] == two_ranks[rank]["pp"]["sampled"] == one
        assert two_ranks[rank]["tp"]["sampled_compiled"] == two_ranks[rank]["pp"]["sampled_compiled"] == one


def test_vocab_parallel_sampling_equals_one_process_on_uneven_shards_ties_and_few_candidates():
    """Sampler.vocab_parallel on 4 ranks against Sampler on the whole logits, same seed, 4 draws each: a
    vocabulary of 7 splits 2/2/2/1 (ties across shards), one of 3 leaves the last rank empty, one of 50 is
    random; top-p 1 (the whole distribution), 0.9 and 0.55; 1,024 candidates, and 2, which leaves most
    rows to the gathered fallback."""
    def work(rank: int) -> list:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from shardwise.infer import sampling

        mesh = init_device_mesh("cpu", (4,))
        logits = [torch.tensor([[0., 5., 1., 2., 5., 0., 3.], [0., 1., 2., 3., 4., 5., 9.], [7.] * 7]),
                  torch.tensor([[1., 3., 3.], [-2., -1., -5.]]),
                  torch.randn(5, 50, generator=torch.Generator().manual_seed(0)) * 2]
        out = []
        for candidates in (1024, 2):
            sampling.CANDIDATES = candidates
            for full in logits:
                for top_p in (1.0, 0.9, 0.55):
                    one, tp = sampling.Sampler(False, 0.7, top_p, seed=11), sampling.Sampler(False, 0.7, top_p, seed=11)
                    sharded = distribute_tensor(full, mesh, [Shard(1)])
                    out.append(([one(full).tolist() for _ in range(4)], [tp.vocab_parallel(sharded).tolist() for _ in range(4)]))
        return out

    for got in run_world(4, work):
        for one, tp in got:
            assert tp == one


def test_vocab_parallel_argmax_equals_the_full_argmax_on_uneven_shards_and_ties():
    """Greedy under TP picks from the vocab shards (infer/sampling.py vocab_parallel_argmax): on 4 ranks a
    vocabulary of 7 splits 2/2/2/1 and one of 3 leaves the last rank empty; ties across shards go to
    the lowest id, as a full argmax's."""
    def work(rank: int) -> list:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        from shardwise.infer.sampling import vocab_parallel_argmax

        mesh = init_device_mesh("cpu", (4,))
        out = []
        for full in (torch.tensor([[0., 5., 1., 2., 5., 0., 3.], [0., 1., 2., 3., 4., 5., 9.], [7.] * 7]),
                     torch.tensor([[1., 3., 3.], [-2., -1., -5.]])):
            out.append((vocab_parallel_argmax(distribute_tensor(full, mesh, [Shard(1)])).tolist(), full.argmax(-1).tolist()))
        return out

    for got in run_world(4, work):
        assert got == [([1, 6, 0], [1, 6, 0]), ([1, 1], [1, 1])]
