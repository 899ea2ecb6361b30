"""Issue 58's rows at their real size, held by the trainer's own build (launch/dryrun.py): the Llama 3 405B layout
`plan search` picks on 16,384 H100s, rehearsed by `plan search --verify 1`, and Mixtral 8x7B with its experts
over ep 8 across nodes (tp8 x dp_shard128 x ep8 on 1,024 ranks, `shardwise dryrun`'s default ranks: each expert
group corner). test_dryrun.py holds the same rules on tiny models; here the shapes, shard counts and paddings
are the real ones.

Every built rank's bytes are held exactly: its parameters and gradients (FSDP2's padded shards, the same on
every rank) equal the planner's; its AdamW state equals the planner's on the first rank (the most loaded, which
the planner prices) and, on the others, the closed form of its own FSDP2 shard below (`own_optimizer_bytes`:
the last shards of an uneven dim 0 are shorter or empty, and the moments are made at the unpadded size).

Cost (2 cores shared with other work, CPU seconds): the 405B search ~5 s, each 405B rank 12-17 s (1.7 GiB peak
RSS), each Mixtral rank 1.4-3.0 s (310 MiB); the file alone 47 s of CPU with pytest's start and torch's import
(2026-11-29). Found by the Mixtral row's ranks: none; rank 960 (dense shard 120 of 128) keeps no row of the
8-row router gate (1 MiB of AdamW state less than rank 0), which the closed form counts."""
from __future__ import annotations

import json

from shardwise.cli import main
from shardwise.config import Config, load_config
from shardwise.launch.dryrun import CATEGORIES
from shardwise.plan.inventory import local_shape, numel, pipeline_rank, rank_params
from shardwise.plan.layout import Problem
from shardwise.spec.dims import ParallelDims

SEARCH_405B = ["--model.preset=llama3-405b", "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=16384",
               "--cluster.gpus_per_node=8", "--train.seq_len=8192", "--train.global_batch=2048"]  # benchmarks/plan_search_speed.py
MIXTRAL = ["--model.preset=mixtral-8x7b", "--cluster.gpu=h100-sxm-80gb", "--parallel.tp=8", "--parallel.dp_shard=128",
           "--parallel.ep=8", "--parallel.zero=3", "--train.seq_len=4096", "--train.global_batch=1024",
           "--train.micro_batch=1", "--train.precision=bf16"]


def shard_numel(ls: tuple[int, ...], n: int, index: int, expert: bool) -> int:
    """Elements of FSDP2's shard `index` of a local tensor of shape `ls` over n ranks, unpadded (the size of its
    AdamW moments): torch.chunk's pieces of ceil(d0 / n) rows along dim 0, the last ones shorter or empty; stacked
    experts with fewer local experts than ranks along dim 1 where it divides (parallel/expert.py)."""
    if expert and len(ls) == 3 and ls[0] < n and ls[1] % n == 0:
        return ls[0] * (ls[1] // n) * ls[2]
    rows = -(-ls[0] // n)
    return max(0, min(rows, ls[0] - index * rows)) * numel(ls[1:])


def own_optimizer_bytes(cfg: Config, world: int, coords: dict[str, int]) -> int:
    """AdamW's bytes on the rank at `coords` of a ZeRO-3 job without pipeline: 8 per element of each parameter's
    own shard + a 4-byte step per tensor. Dense parameters are sharded over dp_shard x cp (index dp_shard x cp +
    cp); under EP the stacked experts over efsdp = that / ep, the shard index // ep (parallel/mesh.py)."""
    problem, dims = Problem.from_config(cfg), ParallelDims.from_config(cfg.parallel, world)
    assert dims.pp == 1 and cfg.parallel.zero == 3
    n, index = dims.shard_group, coords["dp_shard"] * dims.cp + coords["cp"]
    efsdp = n // dims.ep
    total = 0
    for spec, copies, _ in rank_params(problem.shape, pipeline_rank(problem.shape, 1, 1, "1f1b", 0)):
        ls = local_shape(spec, problem.shape, dims.tp, dims.ep)
        if spec.tp == "expert" and dims.ep > 1:
            elems = numel(ls) if efsdp == 1 else shard_numel(ls, efsdp, index // dims.ep, True)
        else:
            elems = shard_numel(ls, n, index, False)
        total += copies * (8 * elems + 4)
    return total


def _hold(rows: list[dict], cfg: Config, world: int) -> None:
    for r in rows:
        assert "error" not in r, r
        assert r["params"] == r["planned"]["params"] and r["grads"] == r["planned"]["grads"], r
        assert r["optimizer"] == own_optimizer_bytes(cfg, world, r["coordinates"]), r
    first = rows[0]
    assert first["rank"] == 0 and all(first[c] == first["planned"][c] for c in CATEGORIES), first


def test_llama3_405b_layout_the_search_picks_on_16384_gpus(tmp_path, capsys):
    emitted = tmp_path / "best.toml"
    assert main(["plan", "search", *SEARCH_405B, "--top", "1", "--verify", "1", "--json", "--emit", str(emitted)]) == 0
    data = json.loads(capsys.readouterr().out)
    verified = data["verify"][0]
    assert verified["layout"] == data["best"]["layout"] and verified["dropped"] is None and verified["exact"], verified
    rows = verified["ranks"]
    assert [r["rank"] for r in rows] == [0, 16383]
    cfg = load_config(str(emitted))  # the layout built: --emit writes the best one --verify built
    _hold(rows, cfg, 16384)
    # the last rank's shards are the short ones: less AdamW state than the plan's most loaded rank
    assert rows[1]["optimizer"] < rows[1]["planned"]["optimizer"]


def test_mixtral_8x7b_with_experts_over_nodes_at_1024_ranks(tmp_path):
    out = tmp_path / "dryrun.json"
    assert main(["dryrun", *MIXTRAL, "--nnodes", "128", "--nproc", "8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["ranks"]
    # ep 8 crosses nodes (dp_shard x cp ranks are tp = 8 apart); efsdp 16: the four (efsdp, ep) corners
    assert [r["rank"] for r in rows] == [0, 56, 960, 1023]
    assert [(r["expert_coordinates"]["efsdp"], r["expert_coordinates"]["ep"]) for r in rows] == \
        [(0, 0), (0, 7), (15, 0), (15, 7)]
    _hold(rows, load_config(None, [*MIXTRAL, "--cluster.num_gpus=1024", "--cluster.gpus_per_node=8"]), 1024)
