"""`shardwise dryrun` (launch/dryrun.py, issue 58): a tiny llama rehearsed at 1,024 ranks on the meta device
under torch's fake process group, its built bytes held to the planner's, and bad input refused (exit 2)
before any rank is built.

The planner prices the most loaded rank of each pipeline position: the first rank of a stage (dp and tp
coordinate 0) holds FSDP2's full ceil(d0 / n) rows of every parameter and, under ZeRO-1, the largest tensors
(spec/sharding.py zero1_owners gives ties to the lowest rank), so its bytes must equal the planner's; any other
rank holds as much or less (the last ranks of an uneven dim 0 keep fewer unpadded rows: their AdamW moments
are smaller, while FSDP2 pads their parameter and gradient storages to the full shard)."""
from __future__ import annotations

import json

import pytest

from shardwise.cli import main
from shardwise.launch.dryrun import CATEGORIES, default_ranks, expert_ranks, stage_ranks

TINY_1024 = ["--nnodes", "128", "--nproc", "8", "--model.preset=tiny", "--model.n_layers=4", "--parallel.pp=2",
             "--parallel.tp=2", "--parallel.dp_shard=-1", "--train.global_batch=512", "--train.micro_batch=1",
             "--train.seq_len=64", "--train.compile=false"]  # compile: only its imports


def _rows(tmp_path, extra: list[str], ranks: str) -> list[dict]:
    out = tmp_path / "dryrun.json"
    assert main(["dryrun", *TINY_1024, *extra, "--ranks", ranks, "--json", str(out)]) == 0
    return json.loads(out.read_text())["ranks"]


@pytest.mark.parametrize("zero, ranks", [(3, "0,512,last"), (1, "0,last")])
def test_tiny_llama_at_1024_ranks_matches_the_planner(tmp_path, capsys, zero, ranks):
    """pp2 x dp_shard256 x tp2: the first rank of each stage equals the planner byte for byte; the last
    ranks of the stages hold no more than it (ZeRO-1 over 256 ranks: fewer tensors than ranks, the last
    owns none)."""
    rows = _rows(tmp_path, [f"--parallel.zero={zero}"], ranks)
    assert [r["rank"] for r in rows] == [int(r) for r in ranks.replace("last", "1023").split(",")]
    for r in rows:
        assert "error" not in r, r
        assert r["wall_s"] > 0 and r["cpu_s"] > 0 and r["peak_rss_bytes"] > 0
        for c in CATEGORIES:
            assert r[c] > 0 or (c == "optimizer" and r["rank"] == 1023), (r["rank"], c)
            if r["rank"] in (0, 512):
                assert r[c] == r["planned"][c], (zero, r["rank"], c, r[c], r["planned"][c])
            else:
                assert r[c] <= r["planned"][c], (zero, r["rank"], c, r[c], r["planned"][c])
    assert rows[0]["coordinates"]["pp"] == 0 and rows[-1]["coordinates"]["pp"] == 1
    assert rows[0]["blocks"] == [0, 1] and rows[-1]["blocks"] == [2, 3]
    text = capsys.readouterr().out
    assert "planned B" in text and "optimizer" in text


def test_default_ranks_are_each_stages_first_and_last():
    from shardwise.spec.dims import ParallelDims

    dims = ParallelDims(dp_replicate=1, dp_shard=16, cp=1, tp=8, pp=8, ep=1, world_size=1024)
    assert stage_ranks(dims, 1) == (128, 255)
    assert default_ranks(dims) == [r for s in range(8) for r in (128 * s, 128 * s + 127)]


def test_default_ranks_add_the_expert_corners_of_each_stage():
    """With EP a stage's dp_shard x cp ranks are (efsdp, ep) row-major: besides the stage's first (0, 0) and
    last (efsdp-1, ep-1) rank, the last ep rank of efsdp 0 and the first of the last efsdp shard; none
    without EP, none more where efsdp is 1 (they would be the first and last's corners again)."""
    from shardwise.spec.dims import ParallelDims

    # pp2 x dp_shard8 x tp2, ep4: efsdp 2; (0, 3) is shard index 3 -> rank 3 x tp, (1, 0) index 4 -> 8
    dims = ParallelDims(dp_replicate=1, dp_shard=8, cp=1, tp=2, pp=2, ep=4, world_size=32)
    assert expert_ranks(dims, 0) == [6, 8] and expert_ranks(dims, 1) == [22, 24]
    assert default_ranks(dims) == [0, 6, 8, 15, 16, 22, 24, 31]
    # ep folds over dp_shard x cp: index 3 is dp_shard 1, cp 1 (rank 3); index 12 is dp_shard 6, cp 0
    dims = ParallelDims(dp_replicate=2, dp_shard=8, cp=2, tp=1, pp=1, ep=4, world_size=32)
    assert default_ranks(dims) == [0, 3, 12, 31]
    assert default_ranks(ParallelDims(1, 4, 1, 2, 1, 4, 8)) == [0, 7]  # efsdp 1: each ep rank's experts whole
    assert default_ranks(ParallelDims(1, 8, 1, 2, 1, 1, 16)) == [0, 15]  # no EP


def test_default_ranks_reach_every_expert_corner_of_the_built_mesh(tmp_path):
    """The ranks built by default, read back from the trainer's own expert mesh (parallel/mesh.py), are the
    four (efsdp, ep) corners; each holds at most the planner's bytes, the first exactly them. tiny-moe with
    cp2 (ep folds over dp_shard x cp) at 16 ranks: efsdp 4, ep 4."""
    out = tmp_path / "dryrun.json"
    assert main(["dryrun", "--nnodes", "2", "--nproc", "8", "--model.preset=tiny-moe", "--parallel.dp_shard=8",
                 "--parallel.cp=2", "--parallel.ep=4", "--parallel.zero=3", "--train.global_batch=8",
                 "--train.micro_batch=1", "--train.seq_len=64", "--train.compile=false", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["ranks"]
    assert [r["rank"] for r in rows] == [0, 3, 12, 15]
    assert [(r["expert_coordinates"]["efsdp"], r["expert_coordinates"]["ep"]) for r in rows] == \
        [(0, 0), (0, 3), (3, 0), (3, 3)]
    for r in rows:
        assert all(r[c] <= r["planned"][c] for c in CATEGORIES), r
    assert all(rows[0][c] == rows[0]["planned"][c] for c in CATEGORIES), rows[0]


@pytest.mark.parametrize("tier", ["cpu", "nvme"])
def test_offloaded_states_are_host_bytes_as_planned(tmp_path, tier):
    """parallel.offload: what the trainer keeps on the host (FSDP2's CPU shards, gradients and AdamW state;
    "nvme": the moments in a file, two I/O buffers and the step counters in memory) equals the planner's
    host and disk bytes, and nothing of the model states is left on the device. Llama 3 8B on 8 ranks, ZeRO-3:
    the state of a rank (8 B x 1.0 G elements) is cut into many of NvmeAdamW's 64 MiB chunks, the largest
    one the embedding's shard."""
    out = tmp_path / "dryrun.json"
    nvme = [f"--parallel.offload_dir={tmp_path}"] if tier == "nvme" else []
    assert main(["dryrun", "--nnodes", "1", "--nproc", "8", "--model.preset=llama3-8b", "--parallel.dp_shard=8",
                 "--parallel.zero=3", f"--parallel.offload={tier}", *nvme, "--cluster.gpu=h100-sxm-80gb",
                 "--train.global_batch=8", "--train.micro_batch=1", "--train.seq_len=1024", "--train.compile=false",
                 "--ranks", "0", "--json", str(out)]) == 0
    row = json.loads(out.read_text())["ranks"][0]
    assert all(row[c] == 0 for c in CATEGORIES), row
    assert row["host"] > 0 and row["host"] == row["planned"]["host"], row
    assert row["disk"] == row["planned"]["disk"] and (row["disk"] > 0) == (tier == "nvme"), row
    assert list(tmp_path.glob("**/adamw_state.bin")) == []  # the dry run writes no state file


def test_bad_input_exits_2_with_the_field_before_building(tmp_path, capsys):
    """A tp that does not divide the heads at this size: pre-flight's line (field, problem, fix), no rank built."""
    assert main(["dryrun", *TINY_1024, "--parallel.zero=3", "--parallel.tp=8", "--ranks", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "parallel.tp" in err and "fix:" in err
    assert "Traceback" not in err
    # the world: 1,000 ranks do not hold pp2 x tp2 x dp_shard 256
    assert main(["dryrun", *TINY_1024[4:], "--nnodes", "125", "--nproc", "8", "--parallel.zero=3",
                 "--parallel.dp_shard=256"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "fix:" in err
    # a rank outside the job
    assert main(["dryrun", *TINY_1024, "--parallel.zero=3", "--ranks", "1024"]) == 2
    assert "--ranks" in capsys.readouterr().err


def test_experts_sharded_over_more_ranks_than_local_experts_match_the_planner(tmp_path):
    """Found by the dry run: with fewer local experts than efsdp ranks (here 1 expert a rank, efsdp 128) the
    trainer sharded the stacked experts on dim 0, each rank keeping a padded whole expert, while the planner
    priced dim-1 shards; the trainer now cuts dim 1 there (parallel/expert.py expert_placement)."""
    for nodes, cut in ((16, "dim 1: 64 rows / 16 ranks"), (128, "dim 0, padded: 64 rows do not divide over 128")):
        rows = _rows(tmp_path, ["--model.preset=tiny-moe", "--model.n_layers=2", "--parallel.pp=1", "--parallel.tp=1",
                                "--parallel.zero=3", "--parallel.ep=8", f"--train.global_batch={nodes * 8}",
                                "--nnodes", str(nodes)], "0")
        assert all(rows[0][c] == rows[0]["planned"][c] for c in CATEGORIES), (cut, rows[0])


@pytest.mark.parametrize("argv, code", [(["dryrun", "--help"], 0),
                                        (["dryrun", "--nnodes", "128", "--nproc", "8", "--parallel.zero=7"], 2)])
def test_help_and_bad_input_answer_without_importing_torch(argv, code):
    """Pre-flight refuses before torch is imported (it takes seconds), as `shardwise train` does."""
    import subprocess
    import sys

    probe = ("import sys; from shardwise.cli import main\n"
             "try:\n    code = main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
             "print(code, 'torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, timeout=60)
    assert done.stderr.strip().endswith(f"{code} no torch"), done.stderr[-2000:]
