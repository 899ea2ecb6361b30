"""Layout search: enumerate dp_replicate x dp_shard x cp x tp x pp x ep, ZeRO stage, micro-batch,
pipeline schedule and virtual stages, recomputation and offload; prune; rank by step time.

Order of work, cheapest test first, so a 405B model on 16,384 GPUs searches in well under 5 s:
  1. axis sizes: divisibility (heads % tp, layers % (pp x v), seq % 2cp, batch % dp, experts % ep) and
     topology (tp within a node unless allowed) — counted per reason;
  2. model states of the structure (tp, pp, ep, zero, dp split, offload) against the device: a
     structure whose parameters + gradients + optimizer state alone overflow is dropped before its
     micro-batch / schedule / recompute variants are generated;
  3. activations, linear in the micro-batch and scaled by the schedule's in-flight micro-batches;
  4. only then the step time (cost.evaluate) of what fits;
  5. the pipeline layouts shown, cut as the trainer's pp_split = "balanced" would, where faster (looped
     schedules, which the planner prices exactly under any split).
"Why the rest lost" reports the prune counts and, for the runners-up, the breakdown term that
separates each from the winner.

2-D tensor parallelism (tp_mode="2d", SUMMA on a q x q grid, tp = q^2) is one more structure per
perfect-square tp where the trainer runs it (spec/rules.py tensor_parallel_2d_rules, its trainer_only
refusals included: dp_replicate only, no pp / cp / ep / ZeRO, dense llama, fp32 / bf16), with
micro-batches divisible by q; it competes on the same step time.

Offload and linear tiles only trade time for memory: they are proposed only when no layout without
them fits (a second pass, `SearchResult.needs` says so), one device included (ZeRO-Offload over a
1-rank shard group). Offload's tier: "cpu" when the rank's states fit the host memory
(Cluster.host_memory_bytes), else "nvme" (the AdamW moments on disk). Tiles: 2, 4, 8 (the fewest that
fit: more only shrink the working set, at a GEMM-efficiency cost), dense MLPs, no TP / FP8 / MoE
(what the trainer implements, spec/rules.py linear_tiles_rules).
"""
from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from shardwise.errors import Violation
from shardwise.plan.cost import Estimate, compute_lower_bound, evaluate, step_seconds
from shardwise.plan.inventory import priced_layout
from shardwise.plan.layout import Problem, check_layout
from shardwise.plan.memory import capacity_bytes
from shardwise.plan.screen import host_bytes, peak_bytes, states_lower_bound
from shardwise.spec import rules
from shardwise.spec.layout import Layout
from shardwise.spec.rules import microbatch_rule, split_backward_rule
from shardwise.spec.stages import balanced_split, even_split

# In the order of the work they add: keeping every other matmul output recomputes GEMMs ("op_alternate",
# dense blocks only: spec/rules.py alternate_matmuls_rule), full recomputation the whole forward.
RECOMPUTE_MODES = (("none", "op"), ("selective", "op"), ("selective", "op_alternate"), ("full", "op"))
TILE_OPTIONS = (2, 4, 8)  # parallel.linear_tiles tried when nothing fits without it


@dataclass
class SearchResult:
    ranked: list[Estimate]                       # the fastest feasible candidates, fastest first (top + near)
    points: list[tuple[float, float]]            # (step seconds, peak bytes) of every timed candidate
    pruned: Counter = field(default_factory=Counter)
    considered: int = 0
    feasible: int = 0                            # candidates that fit (timed or bounded out)
    seconds: float = 0.0
    needs: str = ""                              # "offload", "tiling" or "offload/tiling": nothing fits without

    @property
    def note(self) -> str:
        """The line saying why the ranked layouts offload or tile ("" when plain layouts fit)."""
        if not self.needs:
            return ""
        return f"nothing fits without {self.needs}; these layouts need it (offload and tiling only trade time for memory)"

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _dp_splits(dp: int, max_split_options: int) -> list[tuple[int, int, int]]:
    """(dp_replicate, dp_shard, zero) options: DDP, and for zero 1-3 full sharding plus HSDP with a
    power-of-two shard group (the powers of two keep the option count logarithmic in dp)."""
    out = [(dp, 1, 0)]
    if dp == 1:
        return out
    shards = [dp] + [d for d in reversed(divisors(dp)) if 1 < d < dp and d & (d - 1) == 0][:max_split_options]
    for zero in (1, 2, 3):
        out += [(dp // s, s, zero) for s in shards]
    return out


def _schedules(pp: int, n_layers: int, allow_uneven: bool, max_virtual: int) -> list[tuple[str, int]]:
    if pp == 1:
        return [("1f1b", 1)]
    out = [("gpipe", 1), ("1f1b", 1), ("zero_bubble", 1)]
    for v in range(2, max_virtual + 1):
        if pp * v <= n_layers and (allow_uneven or n_layers % (pp * v) == 0):
            out.append(("interleaved_1f1b", v))
    if 2 * pp <= n_layers and (allow_uneven or n_layers % (2 * pp) == 0):
        out += [("zbv", 2), ("dualpipev", 2)]  # the two V-shaped schedules (two stages per rank)
    return out


def search(problem: Problem, top: int = 10, allow_cross_node_tp: bool = False, allow_uneven_pp: bool = False,
           max_virtual: int = 4, max_split_options: int = 3, offload: bool = True, sequence_parallel: bool = True,
           near: int = 5, tp2d: bool = True) -> SearchResult:
    """Every layout of `problem` on its cluster, pruned and ranked; see the module docstring. `tp2d`
    False leaves 2-D tensor parallelism out."""
    start = time.perf_counter()
    capacity = capacity_bytes(problem)
    pruned: Counter = Counter()
    candidates: list[tuple[float, float, Layout, str, int]] = []  # (compute lower bound, peak bytes, ...)
    considered = _enumerate(problem, False, False, allow_cross_node_tp, allow_uneven_pp, max_virtual, max_split_options,
                            sequence_parallel, capacity, pruned, candidates, tp2d)
    needs = ""
    tiles = _tiles_possible(problem)
    if not candidates and (offload or tiles):
        # Nothing fits as it is: the second pass adds offload and / or linear tiles (module doc).
        considered += _enumerate(problem, offload, tiles, allow_cross_node_tp, allow_uneven_pp, max_virtual,
                                 max_split_options, sequence_parallel, capacity, pruned, candidates)
        used = {(c[2].offload, c[2].linear_tiles > 1) for c in candidates}
        needs = "/".join(w for w, on in (("offload", any(o for o, _ in used)), ("tiling", any(t for _, t in used))) if on)
    # Branch and bound: time the fitting candidates in order of their compute-only lower bound, and stop
    # once that bound exceeds the k-th best step time found (k = top + near): the rest cannot rank.
    candidates.sort(key=lambda c: c[0])
    bound = _Bound(top + near)
    found: list[tuple[float, float, Layout, str, int]] = []
    for i, (lower, peak, core, schedule, v) in enumerate(candidates):
        if lower > bound.threshold:
            pruned["bounded: compute alone slower than the top"] += len(candidates) - i
            break
        t = step_seconds(problem, core, schedule, v)
        bound.add(t)
        found.append((t, peak, core, schedule, v))
    found.sort(key=lambda f: f[0])
    # The runners-up shown after the top: the fastest of each other family of layouts (tp, pipeline or
    # not, CP or not, ZeRO stage, recompute), so "why the rest lost" covers real alternatives.
    shown = found[:top]
    families = {_family(f[2]) for f in shown}
    for f in found[top:]:
        if len(shown) >= top + near:
            break
        if _family(f[2]) not in families:
            families.add(_family(f[2]))
            shown.append(f)
    ranked = [evaluate(problem, core.with_(schedule=sch, virtual_stages=v)) for _, _, core, sch, v in shown]
    # An uneven even split under a written-out order was screened at its ranks' average (plan/screen.py peak_bytes);
    # priced stage by stage it can need more than the GPU has: such a layout is not offered.
    ranked = [e for e in ranked if e.memory.fits or priced_layout(problem.shape, e.layout) is e.layout]
    ranked = sorted(ranked + _balanced_variants(problem, ranked), key=lambda e: e.step_time_s)
    return SearchResult(ranked, [(f[0], f[1]) for f in found], pruned, considered, len(candidates), time.perf_counter() - start,
                        needs)


def _balanced_variants(problem: Problem, ranked: list[Estimate]) -> list[Estimate]:
    """The layouts shown, cut as `pp_split = "balanced"` would (spec/stages.py balanced_split: the head's and
    the embedding's stages get fewer blocks), where that is faster and fits: the trainer runs them (the V
    schedules' too: a 6-block ZB-V [2, 1, 1, 2] and DualPipeV [1, 2, 2, 1] over pp2 gave one process's losses
    bitwise), and the planner prices every split by replaying the schedule's order (plan/cost.py
    _split_bubbles). Only the layouts the search timed get a variant: a balanced split can only speed a
    layout up, so one the branch and bound dropped could gain too, which this does not look for."""
    costs, out = problem.shape.pipeline_costs(problem.seq_len), []
    for est in ranked:
        lay = est.layout
        n = lay.pp * lay.chunks_per_rank
        if lay.pp == 1 or lay.stage_layers or problem.shape.n_layers < n:
            continue
        split = tuple(balanced_split(costs, problem.shape.n_layers, [1.0] * n))
        if split == tuple(even_split(problem.shape.n_layers, n)):
            continue
        variant = evaluate(problem, lay.with_(stage_layers=split))
        if variant.memory.fits and variant.step_time_s < est.step_time_s:
            out.append(variant)
    return out


def _tiles_possible(problem: Problem) -> bool:
    """linear tiles as the trainer runs them: dense MLPs, not FP8 (tp = 1 is checked per layout)."""
    return problem.shape.moe is None and problem.precision != "fp8"


def _enumerate(problem: Problem, offload: bool, tiles: bool, allow_cross_node_tp: bool, allow_uneven_pp: bool,
               max_virtual: int, max_split_options: int, sequence_parallel: bool, capacity: float, pruned: Counter,
               candidates: list, tp2d: bool = True) -> int:
    """Every axis structure of the cluster into `candidates` (what fits); returns how many variants were
    considered. Plain (offload and tiles False): as before the memory-saving options existed, plus 2-D
    TP's structures (`_search_2d`). Else only the structures that offload and / or tile (the plain ones
    did not fit)."""
    s, cl = problem.shape, problem.cluster
    n = cl.num_gpus
    considered = 0
    rescue = offload or tiles
    # (offload tier, tiles) options of one structure, cheapest first; plain only in the first pass.
    options = [("none", 1)] if not rescue else \
        [(tier, t) for t in ((1,) + (TILE_OPTIONS if tiles else ())) for tier in ("none", "offload" if offload else "")
         if tier and (tier, t) != ("none", 1)]
    for tp in divisors(n):
        for cp in divisors(n // tp):
            for pp in divisors(n // (tp * cp)):
                dp = n // (tp * cp * pp)
                schedules = _schedules(pp, s.n_layers, allow_uneven_pp, max_virtual)
                if dict(problem.stack_choices).get("pp_engine") == "deepspeed":  # its TrainSchedule is 1F1B only
                    schedules = [("1f1b", 1)]
                local_batch = problem.global_batch // dp if problem.global_batch % dp == 0 else 0
                variants = len(schedules) * len(RECOMPUTE_MODES) * max(1, len(divisors(local_batch)) if local_batch else 1)
                base = Layout(dp_replicate=dp, tp=tp, cp=cp, pp=pp, sequence_parallel=sequence_parallel)
                splits = _dp_splits(dp, max_split_options)
                if rescue and dp == 1 and cp == 1:
                    splits = splits + [(1, 1, 2), (1, 1, 3)]  # ZeRO-Offload on one data-parallel rank
                if tp2d and not rescue and cp == 1 and pp == 1:
                    considered += _search_2d(problem, tp, dp, local_batch, schedules, capacity, allow_cross_node_tp,
                                             allow_uneven_pp, pruned, candidates)
                bad = check_layout(problem, base, allow_cross_node_tp, allow_uneven_pp)
                if bad is not None and bad.reason not in ("microbatches < pp", "zero"):
                    considered += variants * len(splits) * len(options)
                    pruned[bad.reason] += variants * len(splits) * len(options)
                    continue
                eps = divisors(s.moe.num_experts) if s.moe is not None else [1]
                fitted: set[tuple] = set()
                for tier, t in options:
                    for dp_rep, dp_shard, zero in splits:
                        if tier == "offload" and zero < 2 or t > 1 and tp > 1 or (dp_shard * cp == 1 and zero and tier == "none"):
                            continue
                        for ep in eps:
                            key = (dp_rep, dp_shard, zero, ep)
                            considered += variants
                            if (dp_shard * cp) % ep or (ep > 1 and s.moe is None):
                                pruned["ep"] += variants
                                continue
                            if tier == "offload" and (key, "none", t) in fitted:
                                pruned["dominated: fits without offload"] += variants
                                continue
                            if t > 1 and any((key, tier, fewer) in fitted for fewer in (1,) + TILE_OPTIONS if fewer < t):
                                pruned["dominated: fits with fewer tiles"] += variants
                                continue
                            struct = dict(dp_replicate=dp_rep, dp_shard=dp_shard, zero=zero, ep=ep, offload=tier != "none",
                                          tp=tp, cp=cp, pp=pp, sequence_parallel=sequence_parallel, linear_tiles=t)
                            if tier == "offload" and not _offload_tier(problem, struct, pruned, variants):
                                continue
                            if _search_structure(problem, struct, local_batch, schedules, capacity, pruned, candidates):
                                fitted.add((key, tier, t))
    return considered


def _search_2d(problem: Problem, tp: int, dp: int, local_batch: int, schedules: list[tuple[str, int]], capacity: float,
               allow_cross_node_tp: bool, allow_uneven_pp: bool, pruned: Counter, candidates: list) -> int:
    """tp_mode="2d" (parallel/tensor2d.py) on tp = q^2 ranks, as the trainer runs it: data parallelism over
    dp_replicate only (zero 0), no pp / cp / ep, dense llama, fp32 / bf16 — every rule of
    spec/rules.py tensor_parallel_2d_rules, the trainer_only ones included, must pass (the planner never
    proposes a layout the trainer refuses); micro-batches divisible by q. Returns the variants considered."""
    q = math.isqrt(tp)
    if tp < 4 or q * q != tp:
        return 0
    mbs = [mb for mb in divisors(local_batch) if mb % q == 0] if local_batch else []
    variants = len(schedules) * len(RECOMPUTE_MODES) * max(1, len(mbs))
    probe = Layout(dp_replicate=dp, tp=tp, micro_batch=mbs[0] if mbs else q, tp_mode="2d")
    node = 0 if allow_cross_node_tp else problem.cluster.gpus_per_node
    bad = next(iter(rules.tensor_parallel_2d_rules(problem.shape, probe, node, problem.precision)), None)
    if bad is None:
        bad = check_layout(problem, probe, allow_cross_node_tp, allow_uneven_pp)
    if bad is None and not mbs:
        bad = Violation("tp2d split", "train.micro_batch", "no micro-batch divisible by q", "")
    if bad is not None:
        pruned[f"{bad.reason} (2-D TP)"] += variants
        return variants
    struct = dict(dp_replicate=dp, dp_shard=1, zero=0, ep=1, offload=False, tp=tp, cp=1, pp=1, tp_mode="2d")
    _search_structure(problem, struct, local_batch, schedules, capacity, pruned, candidates, q)
    return variants


def _offload_tier(problem: Problem, struct: dict, pruned: Counter, variants: int) -> bool:
    """Sets struct["nvme"]: "cpu" when the rank's offloaded states fit the host memory, else "nvme" when
    they fit with the moments on disk; False (pruned) when neither does. A CPU device (the host is the
    device) gains nothing from "cpu": only "nvme" moves anything out of its memory."""
    host = problem.cluster.host_memory_bytes()
    lower = Layout(micro_batch=1, recompute="full", **struct)
    if not problem.cluster.device_is_host and host_bytes(problem, lower) <= host:
        struct["nvme"] = False
        return True
    if host_bytes(problem, lower.with_(nvme=True)) <= host:
        struct["nvme"] = True
        if not problem.cluster.device_is_host:
            pruned["offload=cpu over host memory: nvme instead"] += variants
        return True
    pruned["host memory > capacity (offload)"] += variants
    return False


class _Bound:
    """The k-th best step time found so far (k = top + near): a candidate whose compute alone is
    slower cannot enter the ranking, so its communication is never timed."""

    def __init__(self, k: int):
        self.k = k
        self.heap: list[float] = []  # negated times: a max-heap of the k best

    @property
    def threshold(self) -> float:
        return -self.heap[0] if len(self.heap) >= self.k else float("inf")

    def add(self, t: float) -> None:
        if len(self.heap) < self.k:
            heapq.heappush(self.heap, -t)
        elif t < -self.heap[0]:
            heapq.heapreplace(self.heap, -t)


def _family(lay: Layout) -> tuple:
    return (lay.tp, lay.tp_mode, lay.pp > 1, lay.cp > 1, lay.ep > 1, lay.zero, lay.recompute, lay.offload)


def _search_structure(problem: Problem, struct: dict, local_batch: int, schedules: list[tuple[str, int]],
                      capacity: float, pruned: Counter, candidates: list, mb_multiple: int = 1) -> bool:
    """Micro-batch x recompute x schedule variants of one axis layout that fit, with their compute-only
    lower bound, appended to `candidates`; True if any fits.

    Nothing faster than the reported top is lost: a recompute mode is skipped for a (micro-batch,
    schedule) where a cheaper mode (none < selective < op_alternate < full) already fits — it only adds work;
    likewise offload for a structure that fits without it (search()); and search() never times a
    candidate whose compute alone exceeds the k-th best step time (`_Bound`)."""
    mbs = [mb for mb in divisors(local_batch) if mb % mb_multiple == 0]  # 2-D TP: micro-batches divisible by q
    n_var = len(schedules) * len(RECOMPUTE_MODES) * len(mbs)
    lower = Layout(micro_batch=mbs[0] if mbs else 1, recompute="full", **struct)
    if states_lower_bound(problem, lower) > capacity:
        pruned["memory > capacity (model states)"] += n_var
        return False
    any_fit = False
    pp = struct["pp"]
    for mb in mbs:
        m = local_batch // mb
        fits_cheaper: set[tuple[str, int]] = set()
        for rc, policy in RECOMPUTE_MODES:
            core = Layout(micro_batch=mb, recompute=rc, recompute_policy=policy, **struct)
            not_here = rules.alternate_matmuls_rule(problem.shape, core)
            if not_here is not None:
                pruned[not_here.reason] += len(schedules)
                continue
            for schedule, v in schedules:
                bad = microbatch_rule(schedule, pp, m) or split_backward_rule(schedule, struct["zero"], rc, policy)
                if bad is not None:
                    pruned[bad.reason] += 1
                    continue
                if (schedule, v) in fits_cheaper:
                    pruned["dominated: fits with less recompute"] += 1
                    continue
                peak = peak_bytes(problem, core, schedule, v)
                if peak > capacity:
                    pruned["memory > capacity"] += 1
                    continue
                fits_cheaper.add((schedule, v))
                any_fit = True
                candidates.append((compute_lower_bound(problem, core, schedule, v), peak, core, schedule, v))
    return any_fit


def prune_meaning(reason: str) -> str:
    """What a prune reason of `SearchResult.pruned` means, in a few words (why_lost prints it beside the
    count): the rule's key as spec/rules.py names it, or one of the search's own cuts above."""
    base = reason.removesuffix(" (2-D TP)")
    meanings = {
        "memory > capacity (model states)": "parameters + gradients + optimizer state alone overflow the GPU",
        "memory > capacity": "with activations, over the GPU's usable memory",
        "host memory > capacity (offload)": "the offloaded states overflow the host memory too",
        "offload=cpu over host memory: nvme instead": "offloaded to disk (nvme) instead of host memory",
        "bounded: compute alone slower than the top": "not timed: its compute alone exceeds the step time of the "
                                                      "layouts shown",
        "dominated: fits with less recompute": "the same layout fits with less recomputation, which is faster",
        "dominated: fits without offload": "the same layout fits without offload, which is faster",
        "dominated: fits with fewer tiles": "the same layout fits with fewer linear tiles, which is faster",
        "split backward": "a zero-bubble / V schedule (separate weight-gradient pass) with ZeRO-3 or per-op "
                          "selective recompute: wrong gradients or a second backward",
        "tp > gpus_per_node": "tp would span nodes (--allow-cross-node-tp allows it)",
        "microbatches < pp": "fewer micro-batches than pipeline ranks",
        "microbatches < 2pp": "DualPipeV needs 2 x pp micro-batches",
        "microbatches % rounds": "micro-batches not a multiple of the schedule's rounds of pp",
        "layers % (pp*v)": "more pipeline stages than blocks, or blocks not divisible by them (--allow-uneven-pp)",
        "heads % tp": "attention heads not divisible by tp",
        "kv heads vs tp": "key/value heads and tp: neither divides the other",
        "ffn % tp": "the MLP's hidden dim not divisible by tp",
        "expert ffn % tp": "the experts' hidden dim not divisible by tp",
        "seq % tp": "sequence not divisible by tp (sequence parallelism)",
        "seq % 2cp": "sequence not divisible by 2 x cp (context parallelism's load-balanced chunks)",
        "seq/cp % tp": "a cp shard of the sequence not divisible by tp",
        "heads/tp % cp": "heads per tp rank not divisible by cp",
        "batch": "global batch not divisible by micro-batch x data-parallel ranks",
        "ep": "ep does not divide dp_shard x cp, or the model has no experts",
        "tp2d split": "2-D TP's grid does not divide the dims",
    }
    return meanings.get(base) or "a rule the trainer applies (spec/rules.py; `shardwise plan evaluate` of such a layout says why)"


def why_lost(result: SearchResult, top: int, near: int = 5) -> list[str]:
    """Lines explaining the losers: prune counts by reason, each with what it means (prune_meaning), then
    for the best layout of each other family (after the top-k) how much slower its step is than #1's, and
    the terms that differ most: the one that grows most and the one that shrinks most (they may nearly
    cancel: +0.8% in all with compute +0.278 s and the bubble -0.295 s)."""
    lines = [f"{result.considered:,} candidates considered, {result.feasible:,} feasible, "
             f"searched in {result.seconds:.2f} s"]
    if result.pruned:
        lines.append("  pruned: candidates dropped before timing, by the first rule each broke, and what the rule means:")
    for reason, count in result.pruned.most_common():
        lines.append(f"  pruned {count:>8,}  {reason}: {prune_meaning(reason)}")
    best = result.best
    if best is None:
        return lines
    if len(result.ranked) > top:
        lines.append("  best of the other families: its step against #1's, = the term that grows most, the one that "
                     "shrinks most, and the rest:")

    def amount(delta: float) -> str:  # milliseconds below 1 ms, so a tiny model's differences are not all +0.000 s
        return f"{delta:+.3f} s" if abs(delta) >= 1e-3 else f"{delta * 1e3:+.3f} ms"

    for e in result.ranked[top:top + near]:
        diffs = {k: e.breakdown_s.get(k, 0.0) - best.breakdown_s.get(k, 0.0) for k in best.breakdown_s}
        grows = max(diffs.items(), key=lambda kv: kv[1])
        shrinks = min(diffs.items(), key=lambda kv: kv[1])
        total = e.step_time_s - best.step_time_s
        parts = [f"{grows[0]} {amount(grows[1])}"]
        rest = total - grows[1]
        if shrinks[1] < 0 and shrinks[0] != grows[0]:
            parts.append(f"{shrinks[0]} {amount(shrinks[1])}")
            rest -= shrinks[1]
        if abs(rest) >= 1e-6:
            parts.append(f"rest {amount(rest)}")
        lines.append(f"  {e.layout.describe():<48} step +{(e.step_time_s / best.step_time_s - 1) * 100:.1f}% "
                     f"({amount(total)}) = {', '.join(parts)}")
    return lines
