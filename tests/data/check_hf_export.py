#!/usr/bin/env python3
"""Trains a tiny LLaMA (grouped-query attention), and a tiny GPT-2 under
tensor parallelism (its fused q|k|v weight split by heads), with `meshrun
launch`, exports each checkpoint with `meshrun export`, loads the directory
with Hugging Face transformers' from_pretrained (LlamaForCausalLM,
GPT2LMHeadModel), and checks its logits on a prompt against `meshrun
logits` on the same directory.

Usage: check_hf_export.py MESHRUN_BIN
Exit 77 (skipped) when torch or transformers cannot be had here."""
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import pydeps

SKIP = 77


def ensure_transformers():
    try:
        import torch  # noqa: F401
    except Exception:
        print("SKIP: torch is not importable by %s (Debian: apt-get install python3-torch)"
              % sys.executable)
        return False
    return pydeps.ensure(["transformers"], "transformers==4.40.2")


LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
         "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 256,
        "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 128}
TP2 = {"auto_mode": "manual", "tensor_parallel": {"degree": 2}}


def check(meshrun, model_json, strategy, model_class):
    import torch

    d = tempfile.mkdtemp(prefix="mr-hf-")
    with open(os.path.join(d, "train.bin"), "wb") as f:
        text = (b"the quick brown fox jumps over the lazy dog. " * 400)
        f.write(struct.pack("<256i", 20240520, 1, len(text), *([0] * 253)))
        f.write(struct.pack("<%dH" % len(text), *text))
    job = {
        "model": model_json,
        "data": {"train": "train.bin"},
        "train": {"steps": 6, "global_batch": 4, "seq_len": 32, "lr": 0.01},
        "checkpoint": {"dir": "ck", "save_interval_steps": 6},
    }
    if strategy:
        job["strategy"] = strategy
    with open(os.path.join(d, "job.json"), "w") as f:
        json.dump(job, f)
    subprocess.run([meshrun, "launch", "--nproc", "2", "--log-dir", os.path.join(d, "run"),
                    os.path.join(d, "job.json")], check=True, stdout=subprocess.DEVNULL)
    out = os.path.join(d, "hf")
    subprocess.run([meshrun, "export", os.path.join(d, "ck"), "--out", out], check=True)

    prompt = "the quick brown fox"
    subprocess.run([meshrun, "logits", os.path.join(out, "model.safetensors"), "--config",
                    os.path.join(out, "config.json"), "--text", prompt, "--out",
                    os.path.join(d, "logits.bin")], check=True)
    with open(os.path.join(d, "logits.bin"), "rb") as f:
        raw = f.read()
    ours = torch.tensor(struct.unpack("<%df" % (len(raw) // 4), raw)).view(len(prompt), 256)

    model = model_class.from_pretrained(out, torch_dtype=torch.float32)
    model.eval()
    ids = torch.tensor([list(prompt.encode())])
    with torch.no_grad():
        theirs = model(ids).logits[0].float()
    scale = theirs.abs().max().item()
    diff = (ours - theirs).abs().max().item()
    name = model_class.__name__
    print("%s: max |logit| %.4f, max difference %.3g" % (name, scale, diff))
    if not diff <= 1e-4 * max(scale, 1.0):
        print("FAIL: meshrun's logits differ from transformers' %s" % name)
        sys.exit(1)
    print("ok: transformers loads the export as %s and gives meshrun's logits" % name)
    shutil.rmtree(d)  # a failure's folder stays, to be read


def main():
    meshrun = sys.argv[1]
    if not ensure_transformers():
        sys.exit(SKIP)
    from transformers import GPT2LMHeadModel, LlamaForCausalLM
    check(meshrun, LLAMA, None, LlamaForCausalLM)
    check(meshrun, GPT2, TP2, GPT2LMHeadModel)


if __name__ == "__main__":
    main()
