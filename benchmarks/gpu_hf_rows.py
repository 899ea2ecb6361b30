"""gpu-check's Hugging Face rows (benchmarks/gpu_check.py): hf/export (a run exported, then transformers'
greedy ids against `shardwise generate --run-dir`) and hf/import (a random llama read with `generate --hf`,
eager and compiled)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from typing import Any

from gpu_report import Row, one_line  # this folder

_GREEDY = """
import json, sys, torch, transformers
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], torch_dtype=torch.float32)
ids = torch.tensor([[int(i) for i in sys.argv[2].split(",")]])
out = model.generate(ids, max_new_tokens=int(sys.argv[3]), do_sample=False, eos_token_id=None)
print(json.dumps(out[0, ids.shape[1]:].tolist()))
"""
PROMPT, NEW_TOKENS = "1,2,3,4,5,6,7,8", 8


def _ids(p: subprocess.CompletedProcess) -> list[int]:
    return json.loads(p.stdout.strip().splitlines()[-1])["ids"][-NEW_TOKENS:]


# tests/hf_models.py save_random_llama's llama, rebuilt here: that module imports pytest to skip without
# transformers, and gpu-check runs outside pytest.
_RANDOM_HF = """
import sys, torch, transformers
torch.manual_seed(0)
config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                  rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.2)
transformers.LlamaForCausalLM(config).save_pretrained(sys.argv[1])
"""


def transformers_ids(ctx: Any, name: str) -> tuple[list[int] | None, str]:
    """The Hugging Face directory of row `name` and the greedy ids transformers generates from it (fp32, on
    the CPU): (ids, "") or (None, why not). hf/export: the resume row's run exported (`shardwise export`);
    hf/import: a random llama whose weights (std 0.2) give sharp logits, so the ids differ from step to
    step and a wrong position, mask or cache slot changes them (a model trained for 8 steps repeats one
    token: its ids would pass a broken decoder)."""
    hf = ctx.out / name.replace("/", "_")
    shutil.rmtree(hf, ignore_errors=True)
    if name == "hf/export":
        run = ctx.out / "runs" / "resume_cut"
        if not (run / "checkpoints").is_dir():
            return None, "needs the checkpoint of the resume/bitwise row"
        p = ctx.shardwise("export", "--run-dir", str(run), "--hf", str(hf))
        if p.returncode == 0:
            p = subprocess.run([sys.executable, "-c", _GREEDY, str(hf), PROMPT, str(NEW_TOKENS)], capture_output=True,
                               text=True, env=ctx.env, timeout=ctx.limit())
    else:
        # One process saves the random llama and then generates from the saved directory (from_pretrained, as for
        # hf/export): the same ids as two processes, one torch + transformers import fewer (seconds on a CPU).
        p = subprocess.run([sys.executable, "-c", _RANDOM_HF + _GREEDY, str(hf), PROMPT, str(NEW_TOKENS)],
                           capture_output=True, text=True, env=ctx.env, timeout=ctx.limit())
    return (json.loads(p.stdout.strip().splitlines()[-1]), "") if p.returncode == 0 else (None, one_line(p))


def hf_row(ctx: Any, name: str) -> Row:
    """Greedy ids of shardwise on this device equal transformers' (fp32, so no rounding to argue about).
    hf/export: `generate --run-dir` of the run that was exported. hf/import: `generate --hf` of a random
    llama, eager and compiled (`--compile=on`: on a GPU the CUDA-graph decode over the static cache)."""
    theirs, why = transformers_ids(ctx, name)
    if theirs is None:
        return Row(name, "fail", why)
    source = ["--run-dir", str(ctx.out / "runs" / "resume_cut")] if name == "hf/export" else ["--hf", str(ctx.out / "hf_import")]
    modes = ["off"] if name == "hf/export" else ["off", "on"]
    for mode in modes:
        ours = ctx.shardwise("generate", *source, "--prompt-ids", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--greedy",
                             "--ignore-eos", "--json", "--dtype", "float32", f"--compile={mode}")
        if ours.returncode != 0:
            return Row(name, "fail", f"--compile={mode}: {one_line(ours)}")
        if _ids(ours) != theirs:
            return Row(name, "fail", f"shardwise {source[0]} --compile={mode} {_ids(ours)} vs transformers {theirs}")
    return Row(name, "pass", f"greedy ids {theirs}: transformers and shardwise {source[0]}"
               + (" eager and compiled" if len(modes) > 1 else ""))
