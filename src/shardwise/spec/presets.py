"""Named model shapes. Values are the published architecture hyper-parameters.

Sources: Llama 3 herd paper (Dubey et al. 2024, arXiv 2407.21783, Table 3) for llama3-*;
GPT-3 paper (Brown et al. 2020, arXiv 2005.14165, Table 2.1) for gpt3-*; GPT-2 small for gpt2-small.
Mixtral 8x7B: Jiang et al. 2024, arXiv 2401.04088, Table 1 (8 experts, top-2, every block MoE).
DeepSeekMoE 16B: Dai et al. 2024, arXiv 2401.06066, §5.1 / Appendix A (64 fine-grained routed experts of
ffn 1408, top-6, 2 shared experts, 28 blocks, hidden 2048, 16 heads, vocab 102400); the paper keeps the
first block dense, which every_k_layers cannot express, so here every block is MoE (planner-only sizes).
The tiny / small presets (tiny-moe included) are ours, sized for CPU tests and the demo.
"""
from __future__ import annotations

PRESETS: dict[str, dict] = {
    # CPU-sized: tests, demo, benchmarks.
    "tiny": dict(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
                 vocab_size=2048, max_seq_len=512),
    "tiny-gpt": dict(arch="gpt", dim=64, n_layers=2, n_heads=4, n_kv_heads=4, ffn_dim=256,
                     vocab_size=2048, max_seq_len=512),
    # 8 experts of ffn 64, top-2, every block: small enough for 4-process CPU parity tests.
    "tiny-moe": dict(arch="llama", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=192,
                     vocab_size=2048, max_seq_len=512,
                     moe=dict(num_experts=8, top_k=2, every_k_layers=1, expert_ffn_dim=64)),
    "small": dict(arch="llama", dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=704,
                  vocab_size=8192, max_seq_len=1024),
    "gpt2-small": dict(arch="gpt", dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=3072,
                       vocab_size=50257, max_seq_len=1024),
    # Published shapes, for the planner and for GPU runs.
    "llama3-8b": dict(arch="llama", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": dict(arch="llama", dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                       vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": dict(arch="llama", dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                        vocab_size=128256, max_seq_len=8192, rope_theta=500000.0),
    "mixtral-8x7b": dict(arch="llama", dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                         vocab_size=32000, max_seq_len=32768, rope_theta=1e6,
                         moe=dict(num_experts=8, top_k=2, every_k_layers=1)),
    "deepseekmoe-16b": dict(arch="llama", dim=2048, n_layers=28, n_heads=16, n_kv_heads=16, ffn_dim=10944,
                            vocab_size=102400, max_seq_len=4096,
                            moe=dict(num_experts=64, top_k=6, every_k_layers=1, expert_ffn_dim=1408,
                                     num_shared_experts=2)),
    "gpt3-175b": dict(arch="gpt", dim=12288, n_layers=96, n_heads=96, n_kv_heads=96, ffn_dim=49152,
                      vocab_size=50257, max_seq_len=2048),
}
