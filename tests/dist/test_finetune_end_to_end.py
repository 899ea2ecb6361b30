"""One fine-tuning path end to end, as a user runs it (docs/finetune.md): a Hugging Face Llama with a chat
template is imported, fine-tuned on chat records with TP=2 x FSDP=2 (ZeRO-3), document masking and a
held-out validation set, exported; transformers' logits of the export equal the run's final weights'; and
`transformers serve` answers a chat completion sent with the openai client over 127.0.0.1 with the greedy
tokens `shardwise generate` gives for the same rendered prompt.

Tolerances: the export is the run's weights in fp32, so transformers and our model compute the same
function; their logits differ by the order of fp32 sums (test_hf_layouts.py's 1e-5 bound). Greedy ids must
be equal: both decode the same weights greedily, and random weights make near-ties of the top two logits
rare (test_hf_layouts.py's argument).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.harness import free_port
from tests.hf_models import load_hf, save_random_llama  # skips the module without transformers

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QUESTION = [{"role": "user", "content": "add 7 and 7"}]
NEW = 12


def _cli(*args: str, cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    p = subprocess.run([sys.executable, "-m", "shardwise.cli", *args], capture_output=True, text=True, cwd=cwd, timeout=timeout)
    assert p.returncode == 0, f"{args[0]}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The model directory (tokenizer and chat template in it), the chat records, the run, the export."""
    from shardwise.data.tokenizer import byte_tokenizer

    root = tmp_path_factory.mktemp("finetune")
    hf = save_random_llama(root / "hf", vocab=320)
    tok = byte_tokenizer()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
                                                          "eos_token": "<|im_end|>", "clean_up_tokenization_spaces": False}))
    with open(root / "chat.jsonl", "w") as f:
        for i in range(300):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"add {i} and {i}"},
                                             {"role": "assistant", "content": f"{2 * i}"}]}) + "\n")
    out = _cli("train", "--nproc", "4", f"--model.init_from=hf:{hf}", f"--data.path={root / 'chat.jsonl'}",
               f"--data.tokenizer={hf / 'tokenizer.json'}", f"--data.cache_dir={root / 'cache'}", "--parallel.tp=2",
               "--parallel.dp_shard=2", "--parallel.zero=3", "--data.valid_fraction=0.1", "--eval.every=3",
               "--train.document_mask=true", "--train.seq_len=128", "--train.global_batch=8", "--train.micro_batch=2",
               "--train.steps=6", "--train.precision=fp32", "--run.save_final_model=true", "--run.progress=false",
               f"--run.dir={root / 'run'}", cwd=root).stdout
    _cli("export", "--run-dir", str(root / "run"), "--hf", str(root / "export"), cwd=root)
    return root, out


def test_the_run_reports_packing_and_validation(exported):
    root, out = exported
    assert "records packed into" in out and "(data.loss_on=completion)" in out, out
    rows = [json.loads(line) for line in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    rounds = [r["step"] for r in rows if "valid_loss_chat" in r]
    assert rounds == [3, 6], rounds
    losses = [r["loss"] for r in rows if "loss" in r]
    assert all(0 < v < 10 for v in losses), losses


def test_transformers_logits_of_the_export_equal_the_final_weights(exported):
    from shardwise.train.export import run_config
    from shardwise.models import build_model

    root, _ = exported
    cfg = run_config(root / "run" / "config.toml")
    ours = build_model(cfg.model)
    ours.load_state_dict(torch.load(root / "run" / "final_model.pt", weights_only=True))
    ours.reset_buffers()
    tokens = torch.randint(0, 259, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(root / "export")(tokens).logits, ours(tokens), atol=1e-5, rtol=0)
    saved = json.loads((root / "export" / "tokenizer_config.json").read_text())
    assert saved["chat_template"] == CHATML and saved["eos_token"] == "<|im_end|>"


def test_transformers_serve_answers_with_the_ids_shardwise_generates(exported):
    pytest.importorskip("openai", reason="openai is not installed (pip install -e '.[test]')")
    pytest.importorskip("fastapi", reason="fastapi is not installed (pip install -e '.[test]': transformers[serving])")
    from openai import OpenAI
    from tokenizers import Tokenizer

    from shardwise.data.chat import ChatTemplate

    root, _ = exported
    model = root / "export"
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    prompt = tok.encode(ChatTemplate.from_dir(model).render(QUESTION, add_generation_prompt=True), add_special_tokens=False).ids
    ours = _cli("generate", "--hf", str(model), "--max-new-tokens", str(NEW), "--json", "--prompt-ids",
                ",".join(map(str, prompt)), cwd=root).stdout
    ids = next(json.loads(line) for line in ours.splitlines() if line.startswith("{"))["ids"]

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # a local directory: nothing to download
    server = subprocess.Popen([str(Path(sys.executable).parent / "transformers"), "serve", str(model), "--host", "127.0.0.1",
                               "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
        deadline = time.monotonic() + 180
        while True:
            try:
                reply = client.chat.completions.create(model=str(model), messages=QUESTION, max_tokens=NEW, temperature=0)
                break
            except Exception:  # the server is still starting (connection refused)
                if server.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(1)
    finally:
        server.terminate()
        try:
            log = server.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:  # no server outlives the test
            server.kill()
            log = server.communicate()[0]
    assert reply.usage.prompt_tokens == len(prompt), log[-2000:]
    assert reply.choices[0].message.content == tok.decode(ids), (reply.choices[0].message.content, tok.decode(ids), ids)
