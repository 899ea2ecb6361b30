"""Measured KV-cache decoding against `plan evaluate --mode=decode` (plan/decode.py), on this machine.

One process builds a llama (default: dim 1024, 8 blocks, ffn 2816, vocab 8192: 110M parameters, 440 MB in
fp32, far larger than any CPU cache, so every decode step streams the weights from memory) and runs
`shardwise generate`'s engine (infer/engine.py) greedily for each batch size. The planner is given
what it cannot know about this machine, measured in the same run: the bandwidth a matrix-vector
product achieves when it streams a weight matrix of the model's largest shape (decode's access pattern),
and the matmul probe's FLOP/s (train/peak_flops.py). Everything else (bytes read per token, KV cache,
FLOPs) is the planner's own. The table prints measured decode tokens/s, eager and compiled (`--compile=on`: one compiled graph per
step over a static KV cache; its ratio to eager, measured in the same run), the planner's decode
tokens/s, prefill tokens/s, KV-cache bytes (measured = allocated by the eager engine) and the ratios;
JSON goes to --out. It also times sequences that end at different times (--finishing-batch), the batch
shrinking as they end against every row decoding to the end (`finishing`).

    python benchmarks/decode.py [--device auto|cpu|cuda] [--batches 1,4,16] [--prompt-len 64] [--new-tokens 32]
        [--transformers-batches 1] [--compare-unfused] [--finishing-batch B] [--compile-mode M] [--compare-mode M]
        [--sample T,P] [--profile DIR]
        [--out F.json] [--smoke]

On a GPU (--device cuda, the default where there is one) the model is issue 30's 886M LLaMA in bf16 (dim
2048, 16 blocks, 16/8 heads, ffn 5632, vocab 32000), batches 1, 8 and 64, a 63-token prompt and 256 new
tokens. The table adds the fraction of the HBM roofline (batch / (bytes a step reads / the datasheet
bandwidth): weights once, plus the KV cache the step attends over) and transformers' generate on the
same weights (`--transformers-batches`): with its dynamic cache, and its best, cache_implementation=
"static" (which it compiles itself), timed end to end like ours (prefill included, after a warm-up
generation), with a check that its greedy ids equal ours. The planner is priced on the datasheet there.

Measured on one H200 (torch 2.11, `--batches 1,64 --new-tokens 128`), 2026-11-26: compiled 720 tokens/s at
batch 1 (8.6x eager's 83; 25% of the 2,910 tokens/s roofline; end to end 651 against transformers' best
340, its static cache compiled: 1.92x), 41,800 at batch 64 (30%); the planner's decode within +13% of
both. A profile of the batch-1 step: 1.24 ms of GPU time, 1.00 ms of it in 113 GEMM kernels of a few MB
each that do not reach the bandwidth (plan/constants.py DECODE_GEMM_KERNEL_S). In bf16 the greedy ids
of two decoders part at the first near-tie of the random weights' flat logits (compiled vs eager after
11% of the tokens, ours vs transformers after 2%): reported as agreement, not required. Those H200
figures predate fusing q|k|v and w1|w3 (--compare-unfused measures that gain: on this CPU 1.10x at batch
1 and 0.91x at 4, within its noise).
Measured on one H100 80GB (torch 2.11, `--batches 1,64 --new-tokens 128 --compare-unfused`), 2026-11-27,
with the fusion: compiled 877 tokens/s at batch 1 (14.7x eager's 60; 43% of the 2,031 tokens/s roofline;
1.14x the unfused engine's 771, where the planner predicts 1.25x; end to end 799 against transformers'
best 331: 2.41x); the planner's decode 903 (+3%). `--compare-mode reduce-overhead` against
coordinate_descent_tuning (inductor's own tuned one-row GEMMs): 782 against 888, 0.88x, so the engine
keeps reduce-overhead (infer/engine.py compile_settings).
Measured on one H200 (torch 2.11, `--batches 1 --new-tokens 128 --transformers-batches '' --finishing-batch 0
--compare-mode combo_kernels=1 --profile DIR`), 2026-11-28: compiled 1,011 tokens/s at batch 1 (35% of the
2,910 tokens/s roofline; the planner 1,010), with inductor's combo kernels 1,099 (1.087x, the same greedy
ids; prefill 37.6k against 33.7k tokens/s), so the engine takes them on a GPU since. The step's profile:
0.87 ms of GPU time in 1.04 ms of wall (the rest: the host between replays), 0.60 ms of it in 81 GEMMs
reading 1.65 GB at 2.7 TB/s. `--compare-mode combo_kernels=0` measures the engine without them.
Sequences ending at different times, on the 2-core CI machine (`--batches 16 --new-tokens 64`, 2026-11-26):
ending after 19 of 64 tokens on average, the shrinking batch computed 37% of the rows eager (44% compiled)
and decoded 1.49x (1.40x compiled) faster than every row to the end, the same ids.
`--sample 0.8,0.95` (sampling on the device, infer/sampling.py) on the 2-core CI machine, 2026-11-26
(`--batches 1,16`): compiled sampled decoding 0.91x greedy's tokens/s at batch 1, 0.99x at batch 16;
2026-11-27, the draw inside the compiled step (infer/engine.py _decode_on_device; every row's 8,192
probabilities sorted each step): 0.97x at batch 1, 0.91x at batch 16. On a GPU not measured yet.
Measured on the 2-core CI machine (torch 2.13, 2 threads), 2026-11-25: compiled decode steps 1.86x eager at
batch 1 (56 vs 30 tokens/s), 1.07x at batch 4, 0.99x at batch 16. Earlier: the KV cache bytes match exactly; decode at batch 1
is predicted 1.2-1.35x too fast (55-64 vs 44-47 tokens/s over three runs, the streaming figure varying 22-26
GB/s), and at batch 4 and 16 2.1-2.5x too fast.
Its step time is the roofline max(bytes / bandwidth, FLOPs / peak); on this CPU the matrix products of a
few rows neither stream at the bandwidth nor compute at the square-matmul rate, and the sum of the two
terms fits the measurements better (batch 4: 20 + 22 ms against 39 ms measured). On GPUs, where a
decode GEMM overlaps its loads, the roofline is the usual model; pricing each kernel by shape is the
planner-accuracy work (issue 17).

--profile DIR: one more compiled generation per batch under torch.profiler; DIR/decode_b<B>.json.gz is its
Chrome trace, and the row gets the decode steps' GPU time by kernel class (benchmarks/kernel_breakdown.py,
the kernels inside infer/engine.py's DECODE_MARK: the prefill left out), printed with the GEMMs' share and
the bandwidth the step's weights were read at (the planner's bytes over the GEMM time).

--smoke (tests/dist/test_benchmarks_smoke.py): the `tiny` preset, one batch size, a few tokens; its ratios
are not a measurement.
"""
from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import platform
import time
from pathlib import Path

import torch

from gpu_throughput import SIZES  # this folder: the script's own path
from kernel_breakdown import record, table  # this folder
from shardwise.config import load_config
from shardwise.infer.engine import DECODE_MARK, Engine
from shardwise.infer.sampling import Sampler
from shardwise.plan.decode import decode_estimate
from shardwise.train.peak_flops import measure_cpu_peak_flops

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["--model.dim=1024", "--model.n_layers=8", "--model.n_heads=16", "--model.n_kv_heads=8", "--model.ffn_dim=2816",
         "--model.vocab_size=8192", "--model.max_seq_len=512"]
SMOKE_MODEL = ["--model.preset=tiny"]
GPU_MODEL = [f"--{key}={value}" for key, value in SIZES["886m"]["model"]]  # gpu_throughput.py's 886M llama
GPU_DEFAULTS = {"batches": "1,8,64", "prompt_len": 63, "new_tokens": 256, "rounds": 1}


def streaming_gbps(rows: int, cols: int, rounds: int = 5) -> float:
    """Bytes of a (rows, cols) fp32 weight over the best time of one vector-matrix product with it."""
    weight = torch.randn(rows, cols)
    x = torch.randn(1, cols)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        (x @ weight.T).sum().item()
        best = min(best, time.perf_counter() - start)
    return weight.numel() * 4 / best / 1e9


def measure(engine: Engine, batch: int, prompt_len: int, new: int, rounds: int, compiled: bool = False,
            sampler=Sampler) -> dict:
    """The best of `rounds` generations after warm-up ones: one eager (on a GPU the first use of each
    kernel), compiled one on a CPU (it compiles the steps) and two on a GPU. There the first compiles each
    step and runs it once uncaptured (the warm-up of CUDA graph trees) and the second records its CUDA
    graph (torch/_inductor/cudagraph_trees.py); only later calls replay. Prefill runs once per generation,
    so after one warm-up the timed prefill was the recording: 3,272 and 4,118 tokens/s on an H100 (886M
    bf16, batch 1, 2026-11-27), where a second engine in the same run measured 33,463; not yet measured
    with two warm-ups. `sampler`: makes each generation's Sampler (default greedy)."""
    warmups = 2 if compiled and engine.device.type == "cuda" else 1
    for _ in range(warmups):
        engine.generate(prompts(engine.cfg, batch, prompt_len), new, sampler(), compiled=compiled)
    best = None
    for _ in range(rounds):
        result = engine.generate(prompts(engine.cfg, batch, prompt_len), new, sampler(), compiled=compiled)
        if best is None or result.decode_tokens_per_s > best.decode_tokens_per_s:
            best = result
    total = (best.decode_tokens + batch) / (best.prefill_s + best.decode_s)
    return {"decode_tokens_per_s": best.decode_tokens_per_s, "prefill_tokens_per_s": best.prefill_tokens_per_s,
            "kv_cache_bytes": best.kv_cache_bytes, "end_to_end_tokens_per_s": total, "ids": best.ids}


def finishing(engine: Engine, batch: int, prompt_len: int, new: int, rounds: int) -> dict:
    """Sequences ending at different times, the batch shrinking as they end (infer/engine.py Running.shrink)
    against every row decoding to the end (compact=False), eager and compiled, in this run: sequence i
    is stopped near step new x (i + 1) / batch by taking the token it generates there as an end token
    (an end token can also stop another sequence earlier: the same set for both runs, whose ids must be
    equal). The best decode time of `rounds` generations after a warm-up (which compiles the smaller
    batches' graphs)."""
    asked = prompts(engine.cfg, batch, prompt_len)
    full = engine.generate(asked, new, Sampler())
    eos = {ids[max(0, new * (i + 1) // batch - 1)] for i, ids in enumerate(full.ids)}
    got: dict = {"batch": batch}
    for mode in ("eager", "compiled"):
        runs = {}
        for compact in (False, True):
            results = [engine.generate(asked, new, Sampler(), eos_ids=eos, compiled=mode == "compiled", compact=compact)
                       for _ in range(rounds + 1)]
            runs[compact] = min(results[1:], key=lambda g: g.decode_s)
        if runs[True].ids != runs[False].ids:
            raise SystemExit(f"finishing ({mode}): the shrinking batch's ids differ from the full batch's")
        got[f"{mode}_speedup"] = runs[False].decode_s / runs[True].decode_s
        got[f"{mode}_rows_fraction"] = runs[True].decode_rows / runs[False].decode_rows
        got["mean_length"] = sum(map(len, runs[True].ids)) / batch
    return got


def prompts(cfg, batch: int, prompt_len: int) -> list[list[int]]:
    return [[(7 * i + 3 * j) % cfg.model.vocab_size for j in range(prompt_len)] for i in range(batch)]


def transformers_generate(engine: Engine, batch: int, prompt_len: int, new: int) -> dict:
    """transformers' generate on the engine's own weights (one process): dynamic cache, then its best
    (static cache, compiled by generate itself); end-to-end tokens/s after a warm-up call, and its ids."""
    import transformers

    from shardwise.spec import hf

    config = transformers.LlamaConfig.from_dict(hf.hf_config(engine.cfg.model, "bfloat16"))
    with torch.device(engine.device):
        model = transformers.LlamaForCausalLM(config).to(engine.dtype).eval()
    model.load_state_dict({hf.hf_name(k): v for k, v in engine.model.state_dict().items()})
    ids = torch.tensor(prompts(engine.cfg, batch, prompt_len), device=engine.device)
    out: dict = {}
    for name, extra in (("dynamic", {}), ("static", {"cache_implementation": "static"})):
        for _ in range(2):  # the first call compiles (static) or warms up; the second is timed
            engine._sync()
            start = time.perf_counter()
            got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                 do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
            engine._sync()
        out[f"transformers_{name}_tokens_per_s"] = batch * new / (time.perf_counter() - start)
        out[f"transformers_{name}_ids"] = got[:, prompt_len:].tolist()
    del model
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--batches", default=None, help="default: 1,4,16 on CPU, 1,8,64 on a GPU")
    parser.add_argument("--prompt-len", type=int, default=None, help="default: 64 on CPU, 63 on a GPU")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 32 on CPU, 256 on a GPU")
    parser.add_argument("--rounds", type=int, default=None, help="timed generations after the warm-ups (3 CPU, 1 GPU)")
    parser.add_argument("--transformers-batches", default="1", help="batches transformers runs too ('' none; needs "
                        "transformers, else skipped with the reason)")
    parser.add_argument("--compare-unfused", action="store_true", help="also compiled decoding with q, k, v, w1 and w3 as "
                        "separate GEMMs (a second engine), and the fused engine's ratio to it")
    parser.add_argument("--finishing-batch", type=int, default=None, help="the batch of the sequences-ending-at-"
                        "different-times comparison (default: the largest of --batches; 0: none)")
    parser.add_argument("--compile-mode", default=None, help="torch.compile mode of the compiled steps (default: the "
                        "engine's, infer/engine.py compile_settings), e.g. max-autotune, or inductor options k=v[,k=v] "
                        "(on a GPU over CUDA graphs), e.g. combo_kernels=1")
    parser.add_argument("--compare-mode", default=None, help="also compiled decoding with torch.compile mode or options M "
                        "(as --compile-mode; a second engine), and the first engine's ratio to it")
    parser.add_argument("--sample", default=None, help="T,P: also compiled decoding sampled at temperature T and top-p P "
                        "(infer/sampling.py, on the device), against greedy")
    parser.add_argument("--profile", type=Path, default=None, help="write a Chrome trace of one compiled generation per "
                        "batch here, and add its kernel breakdown to the row")
    parser.add_argument("--out", default=None, help="default: benchmarks/results/decode.json (decode.smoke.json with --smoke)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    cuda = args.device == "cuda" or (args.device == "auto" and not args.smoke and torch.cuda.is_available())
    defaults = GPU_DEFAULTS if cuda else {"batches": "1,4,16", "prompt_len": 64, "new_tokens": 32, "rounds": 3}
    if args.smoke:
        args.compare_unfused, args.sample = True, "0.8,0.95"
        # --profile's path too, its traces beside the JSON (on a CPU: operators only)
        args.profile = args.profile or Path(args.out or ROOT / "benchmarks/results/decode.smoke.json").with_suffix(".profile")
        args.compare_mode = args.compare_mode or "epilogue_fusion=1"  # the options path (inductor's default value)
        defaults = {"batches": "2", "prompt_len": 8, "new_tokens": 4, "rounds": 1}
    for key, value in defaults.items():
        setattr(args, key, value if getattr(args, key) is None or args.smoke else getattr(args, key))
    if cuda:
        from shardwise.spec.hardware import DEVICES, match_cuda_name

        gpu = match_cuda_name(torch.cuda.get_device_name())
        cfg = load_config(None, GPU_MODEL + ["--data.tokenizer=byte", "--train.precision=bf16"]
                          + ([f"--cluster.gpu={gpu}"] if gpu else []))
        device, dtype = torch.device("cuda"), "bfloat16"
    else:
        # fp32, as the engine decodes on a CPU: the planner then prices 4-byte weights and KV cache too.
        cfg = load_config(None, (SMOKE_MODEL if args.smoke else MODEL) + ["--data.tokenizer=byte", "--train.precision=fp32"])
        device, dtype = torch.device("cpu"), "float32"
    engine = Engine(cfg, device, dtype=dtype, compile_mode=compile_mode(args.compile_mode))
    # The same weights (same seed), q/k/v and w1/w3 as separate GEMMs.
    unfused = (Engine(cfg, device, dtype=dtype, fuse_projections=False, compile_mode=compile_mode(args.compile_mode))
               if args.compare_unfused else None)
    other = Engine(cfg, device, dtype=dtype, compile_mode=compile_mode(args.compare_mode)) if args.compare_mode else None
    if cuda:
        datasheet_gbps = DEVICES[gpu].memory_bandwidth_gbps if gpu else None
        gbps = flops = None  # the planner's datasheet figures for this GPU
        print(f"model: {engine.model.num_params() / 1e6:.1f}M params bf16 on {torch.cuda.get_device_name()} "
              f"(planner device {gpu}, HBM {datasheet_gbps} GB/s datasheet)")
    else:
        m = cfg.model
        gbps = datasheet_gbps = streaming_gbps(max(m.ffn_dim, m.vocab_size), m.dim)
        flops = measure_cpu_peak_flops("fp32")
        print(f"model: {engine.model.num_params() / 1e6:.1f}M params fp32; measured here: weight streaming {gbps:.1f} GB/s "
              f"(vector x ({max(m.ffn_dim, m.vocab_size)}, {m.dim}) matrix), matmul {flops / 1e9:.1f} GFLOP/s, "
              f"{torch.get_num_threads()} threads")
    hf_batches = {int(b) for b in (args.batches if args.smoke else args.transformers_batches).split(",") if b.strip()}
    if hf_batches and importlib.util.find_spec("transformers") is None:
        print("transformers is not installed: no transformers columns (pip install transformers)")
        hf_batches = set()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        got = measure(engine, batch, args.prompt_len, args.new_tokens, args.rounds)
        progress(batch, "eager", got)
        # `shardwise generate --compile=on`: one compiled graph per decode step over a static KV cache.
        comp = measure(engine, batch, args.prompt_len, args.new_tokens, args.rounds, compiled=True)
        progress(batch, "compiled", comp)
        got["compiled_decode_tokens_per_s"] = comp["decode_tokens_per_s"]
        got["compiled_end_to_end_tokens_per_s"] = comp["end_to_end_tokens_per_s"]
        got["compiled_prefill_tokens_per_s"] = comp["prefill_tokens_per_s"]  # the bucketed, compiled prefill
        got["compiled_over_eager"] = comp["decode_tokens_per_s"] / got["decode_tokens_per_s"]
        compiled_ids = comp.pop("ids")
        got["compiled_ids_agree_eager"] = agreement(compiled_ids, got.pop("ids"))
        if args.sample:
            temperature, top_p = map(float, args.sample.split(","))
            sampled = measure(engine, batch, args.prompt_len, args.new_tokens, args.rounds, compiled=True,
                              sampler=lambda t=temperature, p=top_p: Sampler(False, t, p, seed=0))
            got["compiled_sampled_decode_tokens_per_s"] = sampled["decode_tokens_per_s"]
            got["sampled_over_greedy"] = sampled["decode_tokens_per_s"] / comp["decode_tokens_per_s"]
        if unfused is not None:
            separate = measure(unfused, batch, args.prompt_len, args.new_tokens, args.rounds, compiled=True)
            got["compiled_unfused_decode_tokens_per_s"] = separate["decode_tokens_per_s"]
            got["fused_over_unfused"] = comp["decode_tokens_per_s"] / separate["decode_tokens_per_s"]
            progress(batch, "compiled, unfused", separate)
        if other is not None:
            theirs_mode = measure(other, batch, args.prompt_len, args.new_tokens, args.rounds, compiled=True)
            got["compiled_compare_mode_decode_tokens_per_s"] = theirs_mode["decode_tokens_per_s"]
            got["over_compare_mode"] = comp["decode_tokens_per_s"] / theirs_mode["decode_tokens_per_s"]
            got["compare_mode_ids_agree"] = agreement(theirs_mode["ids"], compiled_ids)
            progress(batch, f"compiled, mode {args.compare_mode}", theirs_mode)
        plan = decode_estimate(cfg, batch, args.prompt_len, args.new_tokens, memory_bandwidth_gbps=gbps, gemm_flops_per_s=flops)
        # The roofline: the bytes one step must read (weights, the KV cache at the average context) at the
        # datasheet bandwidth (on CPU the measured streaming rate).
        read = sum(st.decode_read_bytes for st in plan.stages)
        roofline = batch * datasheet_gbps * 1e9 / read
        rows.append({"batch": batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, **got,
                     "roofline_tokens_per_s": roofline,
                     "compiled_roofline_fraction": got["compiled_decode_tokens_per_s"] / roofline,
                     "predicted_decode_tokens_per_s": plan.decode_tokens_per_s,
                     "predicted_prefill_tokens_per_s": plan.prefill_tokens_per_s,
                     "predicted_kv_cache_bytes": plan.stages[0].kv_cache_bytes,
                     "decode_ratio": plan.decode_tokens_per_s / got["decode_tokens_per_s"],
                     "compiled_decode_ratio": plan.decode_tokens_per_s / got["compiled_decode_tokens_per_s"],
                     "prefill_ratio": plan.prefill_tokens_per_s / got["prefill_tokens_per_s"]})
        if args.profile is not None:
            try:  # after the measurements, which stand whatever the profiler does
                rows[-1]["profile"] = profile(engine, batch, args.prompt_len, args.new_tokens, args.profile, read)
            except (RuntimeError, OSError, ValueError) as e:
                rows[-1]["profile_error"] = str(e)
                print(f"batch {batch}: not profiled ({e})", flush=True)
        if batch in hf_batches:
            theirs = transformers_generate(engine, batch, args.prompt_len, args.new_tokens)
            rows[-1]["transformers_static_ids_agree"] = agreement(theirs.pop("transformers_static_ids"), compiled_ids)
            rows[-1]["transformers_dynamic_ids_agree"] = agreement(theirs.pop("transformers_dynamic_ids"), compiled_ids)
            rows[-1].update(theirs, compiled_over_transformers_best=got["compiled_end_to_end_tokens_per_s"]
                            / max(theirs["transformers_static_tokens_per_s"], theirs["transformers_dynamic_tokens_per_s"]))
        print(json.dumps(rows[-1]), flush=True)  # a row at a time: a run cut short keeps what it measured
    print(f"{'batch':>5} {'decode tok/s':>13} {'compiled':>9} {'x eager':>8} {'roofline':>9} {'predicted':>10} {'ratio':>6} "
          f"{'prefill tok/s':>14} {'predicted':>10} {'ratio':>6} {'KV bytes':>10} {'predicted':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['decode_tokens_per_s']:>13,.0f} {r['compiled_decode_tokens_per_s']:>9,.0f} "
              f"{r['compiled_over_eager']:>8.2f} {r['compiled_roofline_fraction']:>9.1%} {r['predicted_decode_tokens_per_s']:>10,.0f} "
              f"{r['compiled_decode_ratio']:>6.2f} {r['prefill_tokens_per_s']:>14,.0f} {r['predicted_prefill_tokens_per_s']:>10,.0f} "
              f"{r['prefill_ratio']:>6.2f} {r['kv_cache_bytes']:>10,} {r['predicted_kv_cache_bytes']:>10,.0f}")
    ended = None
    if args.finishing_batch is None:
        args.finishing_batch = max(map(int, args.batches.split(",")))
    if args.finishing_batch > 1:
        ended = finishing(engine, args.finishing_batch, args.prompt_len, args.new_tokens, args.rounds)
        print(f"batch {ended['batch']}, sequences ending at different times (mean {ended['mean_length']:.1f} of "
              f"{args.new_tokens} tokens): dropping the ended ones computes {ended['eager_rows_fraction']:.0%} of "
              f"the rows eager ({ended['compiled_rows_fraction']:.0%} compiled, in powers of two); decode "
              f"{ended['eager_speedup']:.2f}x eager, {ended['compiled_speedup']:.2f}x compiled, same ids")
    for r in rows:
        if "sampled_over_greedy" in r:
            print(f"batch {r['batch']}: compiled, sampled at T,top-p {args.sample}: "
                  f"{r['compiled_sampled_decode_tokens_per_s']:,.0f} tokens/s, {r['sampled_over_greedy']:.2f}x greedy")
        if "over_compare_mode" in r:
            print(f"batch {r['batch']}: compiled {r['compiled_decode_tokens_per_s']:,.0f} tokens/s, with mode "
                  f"{args.compare_mode} {r['compiled_compare_mode_decode_tokens_per_s']:,.0f}: {r['over_compare_mode']:.2f}x; "
                  f"greedy ids agree {r['compare_mode_ids_agree']:.0%}")
        if "fused_over_unfused" in r:
            print(f"batch {r['batch']}: compiled with q|k|v and w1|w3 fused {r['compiled_decode_tokens_per_s']:,.0f} tokens/s, "
                  f"separate {r['compiled_unfused_decode_tokens_per_s']:,.0f}: {r['fused_over_unfused']:.2f}x")
        if "transformers_static_tokens_per_s" in r:
            print(f"batch {r['batch']}, end to end: shardwise compiled {r['compiled_end_to_end_tokens_per_s']:,.0f} tokens/s, "
                  f"transformers dynamic {r['transformers_dynamic_tokens_per_s']:,.0f}, static+compiled "
                  f"{r['transformers_static_tokens_per_s']:,.0f}: {r['compiled_over_transformers_best']:.2f}x its best; "
                  f"greedy ids agree (mean common prefix): {r['transformers_static_ids_agree']:.0%} with its static, "
                  f"{r['transformers_dynamic_ids_agree']:.0%} with its dynamic, ours compiled vs eager "
                  f"{r['compiled_ids_agree_eager']:.0%}")
    out = Path(args.out or ROOT / f"benchmarks/results/decode{'.smoke' if args.smoke else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"smoke": args.smoke, "date": dt.datetime.now().isoformat(timespec="seconds"),
                               "machine": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                               "device": torch.cuda.get_device_name() if cuda else "cpu", "compile_mode": args.compile_mode,
                               "compare_mode": args.compare_mode,
                               "sample": args.sample,
                               "streaming_gbps": gbps, "matmul_flops": flops, "model": vars(cfg.model) | {"moe": vars(cfg.model.moe)},
                               "rows": rows, "finishing": ended}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


def compile_mode(text: str | None) -> str | dict | None:
    """--compile-mode / --compare-mode: a torch.compile mode name, or inductor options "k=v,k=v" (values 1 / 0,
    true / false, numbers, else strings), e.g. "combo_kernels=1,coordinate_descent_tuning=1"."""
    if text is None or "=" not in text:
        return text

    def value(v: str):
        if v.lower() in ("1", "true", "0", "false"):
            return v.lower() in ("1", "true")
        try:
            return float(v) if "." in v else int(v)
        except ValueError:
            return v
    return {k.strip(): value(v.strip()) for k, v in (item.split("=", 1) for item in text.split(",") if item.strip())}


def profile(engine: Engine, batch: int, prompt_len: int, new: int, out: Path, read_bytes: float) -> dict:
    """One compiled generation (warm: `measure` compiled and recorded it) under torch.profiler: the decode
    steps' kernels by class, per step, with the rate the GEMMs read the step's bytes at (None on a CPU)."""
    path = out / f"decode_b{batch}.json.gz"
    got = record(lambda: engine.generate(prompts(engine.cfg, batch, prompt_len), new, Sampler(), compiled=True), 1, path,
                 engine._sync, steps_per_call=new - 1, window=DECODE_MARK)
    gemm = got["classes"].get("gemm", {}).get("ms", 0.0)
    got["gemm_gbps"] = read_bytes / (gemm * 1e-3) / 1e9 if gemm else None
    print(f"batch {batch}, compiled decode step by kernel class ({path}):\n{table([got], ['ms per step'])}"
          + (f"\n{got['note']}" if "note" in got else ""))
    if got["gemm_gbps"]:
        print(f"GEMMs {gemm:.3f} ms of {got['busy_ms']:.3f} busy: the step's {read_bytes / 1e9:.2f} GB read at "
              f"{got['gemm_gbps']:,.0f} GB/s", flush=True)
    return got


def progress(batch: int, what: str, got: dict) -> None:
    """One line per measurement as it ends: a GPU run cut short still shows what it measured."""
    print(f"  batch {batch}, {what}: decode {got['decode_tokens_per_s']:,.0f} tokens/s, prefill "
          f"{got['prefill_tokens_per_s']:,.0f} tokens/s ({time.strftime('%H:%M:%S')})", flush=True)


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """The mean fraction of each sequence's ids before the first difference: 1.0 when equal. In bf16 two
    correct decoders part at the first near-tie of random weights' nearly flat logits (rounding in a
    different kernel order), so this is reported, not required; fp32 equality is the tests' job."""
    def prefix(x: list[int], y: list[int]) -> int:
        return next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return sum(prefix(x, y) / max(len(x), len(y), 1) for x, y in zip(a, b)) / max(len(a), 1)


if __name__ == "__main__":
    raise SystemExit(main())
