"""`shardwise plan search --verify K` (launch/verify.py, issue 58): the K best layouts rehearsed on the meta
device, the ones that cannot be built at the cluster's size dropped with their reason, --emit writing the
best one left; bad input refused before the search (exit 2); plan/ still imports no torch.

The search: tiny-moe on 4 H100s. Some of its best layouts put experts on ep with ZeRO-0/1, which the planner
prices and this version's trainer refuses (pre-flight: EP needs FSDP), so --verify must drop them; the others
the trainer runs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardwise.cli import main
from shardwise.config import load_config

SEARCH = ["plan", "search", "--model.preset=tiny-moe", "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=4",
          "--train.global_batch=8", "--train.seq_len=128", "--train.compile=false"]


def _verified(capsys, *extra: str) -> tuple[int, dict]:
    code = main([*SEARCH, "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_verify_drops_what_cannot_be_built_and_emits_the_best_left(tmp_path, capsys):
    """--verify 50, more than the search found (the top 3 and the runners-up of other families): all of
    them, in the search's order; the refused ones dropped with pre-flight's reason; the others built at
    ranks 0 and last with the planner's bytes; --emit writes the fastest one built."""
    from shardwise.spec.layout import Layout

    emitted = tmp_path / "best.toml"
    code, data = _verified(capsys, "--top", "3", "--verify", "50", "--emit", str(emitted))
    assert code == 0
    verified = data["verify"]
    assert 3 < len(verified) < 50 and [v["index"] for v in verified] == list(range(1, len(verified) + 1))
    assert [v["layout"] for v in verified[:3]] == [t["layout"] for t in data["top"]]  # the K best, in order
    refused = [v for v in verified if "ep" in v["layout"].split()[0] and v["layout"].split()[1] in ("z0", "z1")]
    assert refused  # the case this test is for
    for v in refused:
        assert v["dropped"].startswith("pre-flight refuses it: parallel.zero: expert parallelism needs FSDP"), v
        assert v["ranks"] == []
    built = [v for v in verified if v["dropped"] is None]
    assert built and len(built) + len(refused) == len(verified), verified
    for v in built:
        assert [r["rank"] for r in v["ranks"]] == [0, 3] and v["exact"], v  # 0,last; the planner's bytes
        assert v["cpu_s"] > 0 and v["wall_s"] > 0 and v["peak_rss_bytes"] > 0
        first = v["ranks"][0]
        assert all(first[c] == first["planned"][c] for c in ("params", "grads", "optimizer")), first
    assert Layout.from_config(load_config(str(emitted)), 4).describe() == built[0]["layout"]  # the fastest built


def _fail_first_built_layout(monkeypatch, every: bool = False) -> None:
    """The ranks of the first layout pre-flight accepts (every layout: `every`) fail to build: the flag is set
    in this process just before that layout's ranks are forked from it, so they see it, the next ones not."""
    import shardwise.launch.dryrun as dryrun
    import shardwise.launch.verify as verify

    real_rank, real_ranks, state = dryrun.build_rank, verify.build_ranks, {"layouts": 0}

    def build_rank(cfg, world, rank):
        if state["fail"]:
            raise RuntimeError(f"no mesh of {world} ranks here (test)")
        return real_rank(cfg, world, rank)

    def build_ranks(*args, **kwargs):
        state["layouts"] += 1
        state["fail"] = every or state["layouts"] == 1
        return real_ranks(*args, **kwargs)

    monkeypatch.setattr(dryrun, "build_rank", build_rank)
    monkeypatch.setattr(verify, "build_ranks", build_ranks)


def test_a_rank_that_fails_to_build_drops_its_layout(tmp_path, capsys, monkeypatch):
    """A build error (not a pre-flight refusal) drops the layout with the error's last line, the next layout
    is still built, and --emit writes that one, saying why #1 was not."""
    _fail_first_built_layout(monkeypatch)
    emitted = tmp_path / "best.toml"
    assert main([*SEARCH, "--top", "3", "--verify", "50", "--emit", str(emitted)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("  #")]
    failed = [line for line in lines if "dropped: rank 0 does not build: RuntimeError: no mesh of 4 ranks here (test)" in line]
    built = [line for line in lines if ": built ranks 0, 3 in " in line]
    assert len(failed) == 1 and built and lines.index(failed[0]) < lines.index(built[0]), out
    assert "model states as planned: rank 0 equal" in built[0]
    number, layout = built[0].split(":")[0].split(" ", 3)[2:]
    assert f"wrote {emitted}: {number} {layout}" in out
    if lines[0] == failed[0]:  # #1 itself failed: said so
        assert "note: #1 cannot be built at this size (rank 0 does not build: RuntimeError" in out


def test_no_layout_built_is_exit_2(capsys, monkeypatch):
    """Nothing built (pre-flight refused some, the others' ranks fail): the command ends with the --verify
    line, exit 2, after each layout's line."""
    _fail_first_built_layout(monkeypatch, every=True)
    assert main([*SEARCH, "--top", "3", "--verify", "3"]) == 2
    captured = capsys.readouterr()
    assert sum(": dropped: " in line for line in captured.out.splitlines()) == 3, captured.out
    assert captured.err.startswith("error: --verify: none of the 3 best layouts can be built at 4 ranks")
    assert "fix:" in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("extra, field", [(["--verify", "0"], "--verify"), (["--verify", "-2"], "--verify"),
                                          (["--verify", "2", "--verify-ranks", "7"], "--verify-ranks"),
                                          (["--verify", "2", "--verify-ranks", "zero"], "--verify-ranks"),
                                          (["--verify-ranks", "0"], "--verify-ranks")])
def test_bad_input_exits_2_before_the_search_without_torch(extra, field):
    """Refused before the search runs (no table printed) and before torch is imported."""
    probe = ("import sys; from shardwise.cli import main\n"
             "code = main(sys.argv[1:])\n"
             "print(code, 'torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)")
    done = subprocess.run([sys.executable, "-c", probe, *SEARCH, *extra], capture_output=True, text=True, timeout=120)
    assert done.stderr.startswith(f"error: {field}: ") and "fix:" in done.stderr, done.stderr
    assert done.stderr.strip().endswith("2 no torch") and "Traceback" not in done.stderr, done.stderr
    assert "top " not in done.stdout  # no search table: refused first


def test_default_verify_ranks_are_dryruns(capsys):
    """--verify-ranks default: dryrun's own default ranks, with EP the corners of the (efsdp, ep) grid
    (tiny-moe, dp_shard4 x ep2 on 4 ranks: every rank is one)."""
    from shardwise.launch.verify import verify_layouts

    cfg = load_config(None, ["--model.preset=tiny-moe", "--cluster.gpu=h100-sxm-80gb", "--cluster.num_gpus=4",
                             "--parallel.dp_shard=4", "--parallel.ep=2", "--parallel.zero=3", "--train.global_batch=8",
                             "--train.micro_batch=1", "--train.seq_len=64", "--train.compile=false"])
    done = verify_layouts([("ep2", cfg)], 4, "default", lambda _line: None)[0]
    assert done.dropped is None and done.exact, done.line()
    assert [(r["expert_coordinates"]["efsdp"], r["expert_coordinates"]["ep"]) for r in done.rows] == \
        [(0, 0), (0, 1), (1, 0), (1, 1)]
