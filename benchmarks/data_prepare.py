"""Corpus preparation at two sizes: `shardwise data prepare` with 1 and 2 workers beside Hugging Face
`datasets` (load_dataset("json") + map(batched=True, num_proc=N)) with the same tokenizer, in one run.

    python benchmarks/data_prepare.py [--sizes 0.2,2] [--workers 1,2] [--dir runs/bench-data] [--out F.json] [--smoke]

1. Generates JSON-lines corpora of the given sizes in GB under --dir (never committed; reused by a
   later run): documents of pseudo-words with Zipf frequencies (a natural language's word statistics),
   punctuation and numbers, lengths log-normal around 2 KB; each size its own files (1/10 of it a file).
2. Trains a byte-level BPE tokenizer.json (vocabulary 32,768) with `tokenizers` on the first 20 MB.
3. For each size and worker count: `shardwise data prepare` into a fresh cache (--rounds times, in ABBA
   order, at sizes up to 1 GB: this shared machine's speed drifts; rows are medians), and the peer once, in
   a fresh process and cache (at sizes over 1 GB with the most workers only), each with one tokenizer
   thread per process (TOKENIZERS_PARALLELISM=false for the
   peer; our workers set it themselves). Measured: wall time, input MB/s, tokens/s (ours from the manifest,
   the peer's counted in its Arrow output, end-of-document tokens included on both sides: they must agree),
   and the peak resident memory of the whole process tree (the sum over the command and its descendants,
   sampled every 100 ms from /proc; shared pages count once per process, as for any RSS sum).
4. Start-up over many shards: a corpus prepared into >= 1,000 shards (byte tokenizer, fast), then a fresh
   process times what `train` does before its first step with data: find the preparation, open it, and
   build the first global batches.

Targets (issue 55; reported, not enforced: exit 0): peak memory at the largest size <= 1.1x the smallest's
and under 1 GiB; 2 workers >= 1.7x one; >= 1.0x the peer's tokens/s with less memory; >= 0.8M tokens/s
per worker; start-up over 1,000 shards under 10 s.
--smoke (tests/dist/test_benchmarks_smoke.py): 2 and 4 MB, ~200 shards; its numbers are not a measurement.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 32768
TOKENIZER_SAMPLE_BYTES = 20_000_000

PEER = r"""
import json, os, sys, time
t0 = time.perf_counter()
from datasets import load_dataset
from tokenizers import Tokenizer
import pyarrow.compute as pc
files, tokenizer, cache, procs = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
tok = Tokenizer.from_file(tokenizer)
tok.encode_special_tokens = True
eod = tok.token_to_id("<|endoftext|>")

def encode(batch):
    return {"ids": [e.ids + [eod] for e in tok.encode_batch_fast(batch["text"], add_special_tokens=False)]}

ds = load_dataset("json", data_files=files, split="train", cache_dir=cache)
loaded = time.perf_counter()
out = ds.map(encode, batched=True, num_proc=procs if procs > 1 else None, remove_columns=ds.column_names,
             desc=None)
done = time.perf_counter()
tokens = int(pc.sum(pc.list_value_length(out.data.column("ids"))).as_py())
print(json.dumps({"load_s": loaded - t0, "map_s": done - loaded, "tokens": tokens, "documents": len(out)}))
"""

STARTUP = r"""
import json, sys, time
t0 = time.perf_counter()
from shardwise.config import load_config
from shardwise.train.data import TokenBatches, batch_sources, prepare_data
imported = time.perf_counter()
cfg = load_config(None, sys.argv[1:])
data = prepare_data(cfg.data, cfg.model.vocab_size, log=lambda _: None)
found = time.perf_counter()
batches = TokenBatches(batch_sources(data, cfg.train.seq_len, cfg.data.loss_on), cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed)
for step in range(4):
    batches.global_batch_at(step)
ready = time.perf_counter()
shards = sum(len(s.corpus.manifest["shards"]) for s in data.sources)
print(json.dumps({"import_s": imported - t0, "find_s": found - imported, "first_batches_s": ready - found,
                  "data_s": ready - imported, "shards": shards}))
"""


# ---------------------------------------------------------------- corpus


def _words(rng: np.random.Generator, n: int) -> np.ndarray:
    """n pseudo-words of 1-4 syllables, shorter ones first (so the Zipf ranks favour short words)."""
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "pl", "ch", "sh"]
    vowels = ["a", "e", "i", "o", "u", "ea", "ou", "io"]
    codas = ["", "", "n", "r", "s", "t", "l", "nd", "st", "ng"]
    # The draws of rng.choice(list) and rng.choice(list, p=...) made directly: integers(len) and one random() against
    # the cumulative p are what choice does underneath, so the words and the generator's state after them are the
    # same (checked for seeds 0 and 7: the same 30,000 words, the same next draw), at an eighth of the time (choice
    # converts its list to an array at every call: 9 s of CPU a corpus, three corpora in a --smoke run).
    cdf = np.cumsum([0.35, 0.35, 0.2, 0.1])
    cdf /= cdf[-1]
    out = set()
    while len(out) < n:
        syll = 1 + int(cdf.searchsorted(rng.random(), side="right"))
        out.add("".join(onsets[rng.integers(len(onsets))] + vowels[rng.integers(len(vowels))] + codas[rng.integers(len(codas))]
                        for _ in range(syll)))
    return np.array(sorted(out, key=lambda w: (len(w), w)))


def write_corpus(directory: Path, size_bytes: int, seed: int = 0) -> list[Path]:
    """JSON lines of ~size_bytes in 10 files (reused when already there, same size asked)."""
    stamp = directory.with_name(f"{directory.name}.done.json")  # beside it: the corpus directory holds corpus only
    if stamp.is_file() and json.loads(stamp.read_text()).get("size") == size_bytes:
        return sorted(directory.glob("part-*.jsonl"))
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    stamp.unlink(missing_ok=True)
    rng = np.random.default_rng(seed)
    vocab = _words(rng, 30_000)
    ranks = np.arange(1, len(vocab) + 1)
    p = 1.0 / ranks ** 1.07
    p /= p.sum()
    punct = np.array([",", ".", ";", ":", "!", "?"])
    files = []
    per_file = size_bytes // 10
    for k in range(10):
        path = directory / f"part-{k:02d}.jsonl"
        written = 0
        with path.open("w") as f:
            while written < per_file:
                lengths = np.clip(rng.lognormal(5.6, 0.8, size=256).astype(int), 5, 5000)  # words per document
                words = vocab[rng.choice(len(vocab), size=int(lengths.sum()), p=p)]
                marks = rng.random(len(words))
                start = 0
                lines = []
                for n in lengths:
                    doc = words[start:start + n].tolist()
                    m = marks[start:start + n]
                    for i in np.flatnonzero(m < 0.08):
                        doc[i] += punct[int(m[i] * 75) % len(punct)]
                    for i in np.flatnonzero(m > 0.995):
                        doc[i] = str(int(m[i] * 1e7) % 10000)
                    start += n
                    lines.append(json.dumps({"text": " ".join(doc).capitalize(), "id": written}) + "\n")
                chunk = "".join(lines)
                f.write(chunk)
                written += len(chunk)
        files.append(path)
    stamp.write_text(json.dumps({"size": size_bytes}))
    return files


def train_tokenizer(files: list[Path], path: Path) -> Path:
    if path.is_file():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    def sample():
        seen = 0
        with files[0].open() as f:
            for line in f:
                text = json.loads(line)["text"]
                seen += len(text)
                yield text
                if seen >= TOKENIZER_SAMPLE_BYTES:
                    return

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(sample(), trainer=trainer)
    tok.save(str(path))
    return path


# ---------------------------------------------------------------- measuring a process tree


def _tree_rss(root: int) -> tuple[int, int]:
    """(sum, max) of the resident bytes of `root` and its descendants, from /proc (each process's children
    lists, so a sample reads a few files, not every process's: the sampler must not slow what it measures)."""
    page = os.sysconf("SC_PAGE_SIZE")
    values, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        try:
            values.append(int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page)
            for task in Path(f"/proc/{pid}/task").iterdir():
                frontier += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):  # gone meanwhile
            continue
    return sum(values), max(values, default=0)


def run_measured(args: list[str], env: dict | None = None) -> dict:
    """Run a command; its wall time, stdout, exit code and the peak (sum, largest) RSS of its process tree."""
    start = time.perf_counter()
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **(env or {})})
    peak = [0, 0]

    def sample():
        while proc.poll() is None:
            total, largest = _tree_rss(proc.pid)
            peak[0], peak[1] = max(peak[0], total), max(peak[1], largest)
            time.sleep(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(args[:6])}... exited {proc.returncode}:\n{err[-3000:]}")
    return {"wall_s": time.perf_counter() - start, "peak_tree_rss_bytes": peak[0], "peak_process_rss_bytes": peak[1],
            "stdout": out}


def ours(corpus: Path, tokenizer: Path, cache: Path, workers: int) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    r = run_measured([sys.executable, "-m", "shardwise.cli", "data", "prepare", f"--data.path={corpus}",
                      f"--data.tokenizer={tokenizer}", f"--model.vocab_size={VOCAB}", f"--data.cache_dir={cache}",
                      "--workers", str(workers)])
    [manifest] = list(cache.glob("prepared/*/manifest.json"))
    m = json.loads(manifest.read_text())
    shutil.rmtree(cache, ignore_errors=True)
    return {**{k: v for k, v in r.items() if k != "stdout"}, "tokens": m["tokens"], "documents": m["documents"],
            "input_bytes": m["input_bytes"], "shards": len(m["shards"])}


def peer(files: list[Path], tokenizer: Path, cache: Path, procs: int) -> dict:
    shutil.rmtree(cache, ignore_errors=True)
    r = run_measured([sys.executable, "-c", PEER, json.dumps([str(f) for f in files]), str(tokenizer), str(cache), str(procs)],
                     env={"TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    shutil.rmtree(cache, ignore_errors=True)
    facts = json.loads(r["stdout"].strip().splitlines()[-1])
    return {**{k: v for k, v in r.items() if k != "stdout"}, **facts}


def startup(directory: Path, size_bytes: int, shard_mb: float) -> dict:
    files = write_corpus(directory / "startup-corpus", size_bytes, seed=7)
    cache = directory / "startup-cache"
    args = [f"--data.path={files[0].parent}", "--data.tokenizer=byte", "--model.vocab_size=512",
            f"--data.cache_dir={cache}", f"--data.shard_mb={shard_mb}", "--train.seq_len=2048", "--train.global_batch=64"]
    if not list(cache.glob("prepared/*/manifest.json")):
        run_measured([sys.executable, "-m", "shardwise.cli", "data", "prepare", *args])
    r = run_measured([sys.executable, "-c", STARTUP, *args])
    facts = json.loads(r["stdout"].strip().splitlines()[-1])
    return {"process_wall_s": r["wall_s"], **facts}


# ---------------------------------------------------------------- the run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="0.2,2", help="corpus sizes in GB")
    parser.add_argument("--workers", default="1,2", help="worker counts (ours) and num_proc (the peer)")
    parser.add_argument("--dir", default=str(ROOT / "runs" / "bench-data"), help="where corpora and caches go")
    parser.add_argument("--no-peer", action="store_true", help="skip Hugging Face datasets")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each worker count at sizes up to 1 GB (ABBA order)")
    parser.add_argument("--startup-mb", type=float, default=120.0, help="corpus size for the start-up row (MB)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    sizes = [0.002, 0.004] if args.smoke else [float(s) for s in args.sizes.split(",")]
    args.rounds = 1 if args.smoke else args.rounds
    workers = [int(w) for w in args.workers.split(",")]
    work = Path(args.dir) / ("smoke" if args.smoke else "")
    rows = []
    tokenizer = None
    for size in sizes:
        files = write_corpus(work / f"corpus-{size:g}gb", int(size * 1e9))
        tokenizer = tokenizer or train_tokenizer(files, work / "tokenizer.json")
        # This machine's speed drifts by tens of percent over minutes (a shared VM): the worker counts are run
        # in rounds, in ABBA order, and each row is the median of its runs. The peer runs once per count, beside
        # round 0; at sizes over 1 GB one round, and the peer with the most workers only (hours otherwise).
        big = size > 1
        runs: dict[tuple[str, int], list[dict]] = {}
        for r in range(1 if big else args.rounds):
            for w in (workers if r % 2 == 0 else workers[::-1]):
                runs.setdefault(("shardwise", w), []).append(ours(files[0].parent, tokenizer, work / "cache-ours", w))
                print(_row({"size_gb": size, "side": "shardwise", "workers": w, **runs["shardwise", w][-1]}), flush=True)
                if r == 0 and not args.no_peer and (not big or w == max(workers)):
                    p = {**peer(files, tokenizer, work / "cache-peer", w), "input_bytes": sum(f.stat().st_size for f in files)}
                    runs[("datasets", w)] = [p]
                    print(_row({"size_gb": size, "side": "datasets", "workers": w, **p}), flush=True)
        for (side, w), done in runs.items():
            walls = sorted(run["wall_s"] for run in done)
            middle = min(done, key=lambda run: abs(run["wall_s"] - statistics.median(walls)))
            rows.append({"size_gb": size, "side": side, "workers": w, **middle, "wall_s": statistics.median(walls),
                         "walls_s": walls, "peak_tree_rss_bytes": max(run["peak_tree_rss_bytes"] for run in done),
                         "peak_process_rss_bytes": max(run["peak_process_rss_bytes"] for run in done)})
    print("medians:")
    for row in rows:
        print(_row(row))
    start = startup(work, int(0.001e9 if args.smoke else args.startup_mb * 1e6), 0.005 if args.smoke else 0.1)
    print(f"start-up over {start['shards']:,} shards: {start['data_s']:.2f} s to find the preparation and build "
          f"the first batches ({start['import_s']:.2f} s of imports before; {start['process_wall_s']:.2f} s the whole process)")
    result = {"smoke": args.smoke, "rows": rows, "startup": start, "targets": targets(rows, start),
              "cpu": _cpu(), "cores": os.cpu_count(), "python": platform.python_version(),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
    for line in result["targets"]["lines"]:
        print(line)
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / f"data_prepare{'.smoke' if args.smoke else ''}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


def _row(r: dict) -> str:
    rate = r["tokens"] / r["wall_s"]
    mbps = r["input_bytes"] / r["wall_s"] / 1e6
    return (f"{r['size_gb']:>6g} GB  {r['side']:<9} x{r['workers']}: {r['wall_s']:8.1f} s  {mbps:6.2f} MB/s  "
            f"{rate / 1e6:6.3f}M tokens/s ({rate / r['workers'] / 1e6:.3f}M per worker)  "
            f"peak RSS {r['peak_tree_rss_bytes'] / 2**20:7.0f} MiB (largest process {r['peak_process_rss_bytes'] / 2**20:.0f})  "
            f"{r['tokens']:,} tokens")


def targets(rows: list[dict], start: dict) -> dict:
    ours_rows = [r for r in rows if r["side"] == "shardwise"]
    sizes = sorted({r["size_gb"] for r in ours_rows})
    wmax = max(r["workers"] for r in ours_rows)
    by = {(r["side"], r["size_gb"], r["workers"]): r for r in rows}
    small, large = by[("shardwise", sizes[0], wmax)], by[("shardwise", sizes[-1], wmax)]
    out = {"rss_ratio": large["peak_tree_rss_bytes"] / small["peak_tree_rss_bytes"],
           "rss_largest_gib": large["peak_tree_rss_bytes"] / 2**30}
    lines = [f"peak RSS at {sizes[-1]:g} GB / at {sizes[0]:g} GB ({wmax} workers): {out['rss_ratio']:.2f}x (target <= 1.1), "
             f"{out['rss_largest_gib']:.2f} GiB (target < 1)"]
    one = by.get(("shardwise", sizes[-1], 1))
    if one is not None and wmax > 1:
        out["speedup"] = one["wall_s"] / large["wall_s"]
        lines.append(f"{wmax} workers / 1 at {sizes[-1]:g} GB: {out['speedup']:.2f}x (target >= 1.7)")
    out["tokens_per_s_per_worker"] = min(r["tokens"] / r["wall_s"] / r["workers"] for r in ours_rows if r["size_gb"] == sizes[-1])
    lines.append(f"tokens/s per worker at {sizes[-1]:g} GB (the lowest): {out['tokens_per_s_per_worker'] / 1e6:.3f}M (target >= 0.8M)")
    for w in sorted({r["workers"] for r in ours_rows}):
        for size in sizes:
            mine, theirs = by.get(("shardwise", size, w)), by.get(("datasets", size, w))
            if mine and theirs:
                speed = (mine["tokens"] / mine["wall_s"]) / (theirs["tokens"] / theirs["wall_s"])
                memory = mine["peak_tree_rss_bytes"] / theirs["peak_tree_rss_bytes"]
                same = mine["tokens"] == theirs["tokens"]
                out[f"vs_peer_{size:g}gb_x{w}"] = {"speed": speed, "memory": memory, "same_tokens": same}
                lines.append(f"against datasets at {size:g} GB x{w}: {speed:.2f}x its tokens/s (target >= 1.0), {memory:.2f}x its "
                             f"memory (target < 1){'' if same else '; TOKEN COUNTS DIFFER'}")
    lines.append(f"start-up over {start['shards']:,} shards: {start['data_s']:.2f} s (target < 10)")
    return {**out, "lines": lines}


def _cpu() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    sys.exit(main())
