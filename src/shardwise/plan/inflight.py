"""Micro-batches whose activations a pipeline rank holds at its peak, per schedule (plan/memory.py
multiplies one micro-batch's stored activations by these counts)."""
from __future__ import annotations


def inflight_microbatches(schedule: str, pp: int, m: int, v: int, first: bool) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of one micro-batch
    of its whole share of layers.
    gpipe: all m (every forward before any backward; Huang et al. 2019, arXiv 1811.06965).
    1f1b: rank r holds p - r (PipeDream-Flush / Megatron warm-up, Narayanan et al. 2021 §2.2).
    interleaved_1f1b: rank r holds 2(p-r-1) + (v-1)p + 1 chunk-micro-batches of 1/v of its layers, i.e.
      p + (p-1)/v on rank 0 = Korthikanti et al. §4.2.3's p(1 + (p-1)/(pv)).
    zero_bubble (ZB-H1): the same peak as 1F1B (Qi et al. 2024, arXiv 2401.10241 §2.1).
    zbv (ZB-V, ibid. §6): two V-placed chunks per rank with the same peak as 1F1B's first rank, p
      micro-batches (2p half-size chunk-micro-batches), on every rank. Counted on the order torch's
      ScheduleZBVZeroBubble runs (warm-up 2(p-r)-1 chunk-0 forwards, r pairs of chunk-1 / chunk-0
      forwards, then F-I-W triples; a chunk's activations live until its W): rank r peaks at
      min(2p, m + r + 1) chunk-micro-batches, i.e. p once m >= 2p - 1.
    dualpipev: p + 1/2, i.e. 2p + 1 chunk-micro-batches, on every rank. Counted on the order torch's
      ScheduleDualPipeV runs (DeepSeek's dualpipev steps): rank r runs 2(p-r-1) chunk-0 forwards, then
      r+1 chunk-0 / chunk-1 forward pairs (2p-r-1 chunk-0 and r+1 chunk-1 in flight), p-r-1 B-W-F
      triples of chunk 1 (no change), then the main step's pairs (F chunk 0, B chunk 1), (F chunk 1,
      B chunk 0), each forward before its backward: 2p-r + r+1 = 2p+1 at their peak. It runs at least
      once since m >= 2p (stages.py). DeepSeek-V3's Table 2 "PP + 1" (arXiv 2412.19437) is DualPipe's,
      with two copies of the model per rank; the measured peak (tests/dist/test_plan_validation.py,
      PeakActivationMeter) is 2p + 1 half-rank chunks.
    The stage holding the head (the loss's fp32 log-softmax, large with a big vocabulary) is a
    different count, see `head_inflight_microbatches`.
    """
    if pp == 1:
        return 1.0
    r = 0 if first else pp - 1
    if schedule == "gpipe":
        return float(m)
    if schedule == "interleaved_1f1b" and v > 1:
        return min(float(m), (2 * (pp - r - 1) + (v - 1) * pp + 1) / v)
    if schedule == "zbv":
        return min(float(m), min(2 * pp, m + r + 1) / 2)
    if schedule == "dualpipev":
        return min(float(m), pp + 0.5)
    return float(min(m, pp - r))


def head_inflight_microbatches(schedule: str, pp: int, m: int, v: int) -> float:
    """Micro-batches in flight on the last stage (the one with the output head and the loss), whose
    backward can start as soon as its own forward ends: 1 in every schedule that runs it so —
    1F1B's last rank alternates F and B; interleaved 1F1B's last rank starts its steady state with
    the last chunk (its warm-up, (v-1)p forwards, covers only the other chunks: F and B of the last
    chunk then alternate); ZB-V and DualPipeV put the last stage on rank 0 as chunk 1 and run its
    F then I (and W for ZB-V) back to back, or keep r+1 = 1 chunk-1 micro-batch on rank 0 (see
    `inflight_microbatches`). GPipe holds all m. ZB-H1 (zero_bubble) may defer the last stage's W
    (its saved inputs stay until then): counted as the rank's in-flight, not measured here."""
    if pp == 1:
        return 1.0
    if schedule == "gpipe":
        return float(m)
    if schedule == "zero_bubble":
        return inflight_microbatches(schedule, pp, m, v, False)
    return 1.0
