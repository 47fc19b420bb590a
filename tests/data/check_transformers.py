#!/usr/bin/env python3
"""check_transformers.py - meshrun held to Hugging Face transformers and
PyTorch on models transformers itself makes.

For each family (LLaMA with grouped-query attention, tied embeddings, a
head_dim of 24 beside hidden 64 / 4 heads and rope_theta 500000; Qwen2 with its
q/k/v biases, tied, rope_theta 1e6 (its per-layer sliding window refused
where shorter than the sequence); Mistral with a sliding window of 12
keys over sequences of 32; GPT-2) a
small random model is made by transformers and written with
save_pretrained (safetensors, the current config format).  Then:

1. logits: `meshrun logits FOLDER --tokens ...` against the model's own
   float32 forward, within 1e-5 of the largest logit, from the folder,
   from the same model saved in shards and saved in bf16; for LLaMA also the
   same weights with config.json in transformers 4.x's form (rope_theta at
   the top level) beside 5.x's (rope_parameters).
2. training: 10 steps of `meshrun launch` from the folder's weights
   (train.init; the tp2 x dp2 run from the same model saved in shards,
   model.safetensors.index.json) on 1 rank, on tp2 x dp2 and on pp2 x dp2
   with ZeRO-3,
   against the same 10 steps in PyTorch (torch.optim.AdamW with the same
   hyperparameters, clip_grad_norm_ at 1.0) on the same token rows: the
   data formula of common/tokens.h, with Philox4x32-10 written out here
   and checked against Random123's known answers.  Each step's loss within
   1e-4 relative.
3. export: each run's last checkpoint (sharded as the strategy holds it)
   through `meshrun export` (the last in shards of 30 KB), loaded by
   AutoModelForCausalLM.from_pretrained: its logits within 1e-5 of the
   largest of `meshrun logits` on the exported folder; every field of the
   source config.json carried, generation_config.json with its token ids.
4. tokenizers (Hugging Face's library, the helper meshrun-tokenize):
   prepare-data --tokenizer on text and JSONL gives the library's own ids
   with the end-of-text id after each document, uint16 or (a vocabulary of
   70000) uint32 files; sample --tokenizer gives the text transformers'
   greedy generate decodes to; a run from that folder, exported, carries
   the tokenizer files and generation_config.json, and sample takes the
   export as it is.

Usage: check_transformers.py MESHRUN_BIN
Runs under the project's virtual environment (.venv, made by
`scripts/setup --reference`); exits 77 (skipped) where it is missing."""
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile

SKIP = 77
SRC = os.environ.get("MESHRUN_SOURCE_DIR",
                     os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
VENV = os.path.realpath(os.path.join(SRC, ".venv"))

if os.path.realpath(sys.prefix) != VENV:
    py = os.path.join(VENV, "bin", "python")
    if not os.path.exists(py):
        print("SKIP: no %s (scripts/setup --reference makes it)" % py)
        sys.exit(SKIP)
    os.execv(py, [py] + sys.argv)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402

# ---- the training rows, as common/tokens.h defines them ----

MASK = 0xFFFFFFFF
DATA_KEY = 0x64617461746F6B73  # "datatoks"


def philox4x32_10(ctr, key):
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0) & MASK, p1 & MASK, ((p0 >> 32) ^ c3 ^ k1) & MASK, \
            p0 & MASK
        k0, k1 = (k0 + 0x9E3779B9) & MASK, (k1 + 0xBB67AE85) & MASK
    return c0, c1, c2, c3


# Random123's known-answer vectors for philox4x32_10
assert philox4x32_10((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
assert philox4x32_10((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)) \
    == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)


def row_offset(seed, step, row, n_tokens, seq):
    k = seed ^ DATA_KEY
    w = philox4x32_10((row & MASK, row >> 32, step & MASK, step >> 32), (k & MASK, k >> 32))
    return (w[0] | w[1] << 32) % (n_tokens - seq)


# ---- the models ----

VOCAB, SEQ, BATCH, STEPS, LR, SEED = 96, 32, 4, 10, 3e-3, 7


def llama_model(**extra):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=24,
              max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
              rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    cfg = transformers.LlamaConfig(**dict(kw, **extra))
    return transformers.LlamaForCausalLM(cfg)


def llama_bias_model():  # attention_bias: q, k, v and o_proj biases
    return llama_model(attention_bias=True, tie_word_embeddings=False)


# RoPE scaled as Llama 3.1/3.2 ship it (the original context cut to 32 so
# that the tiny model's 16 dimensions fall in all three bands), linearly,
# and dynamic NTK (within max_position_embeddings: plain, in transformers
# as here)
def llama3_rope_model():
    return llama_model(rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
                                        "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 32})


def linear_rope_model():
    return llama_model(rope_parameters={"rope_type": "linear", "rope_theta": 10000.0,
                                        "factor": 4.0})


def dynamic_rope_model():
    return llama_model(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0,
                                        "factor": 2.0})


def qwen2_model():
    cfg = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
    return transformers.Qwen2ForCausalLM(cfg)


def mistral_model():  # a window of 12 keys over sequences of 32: sliding-window attention
    cfg = transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=12,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return transformers.MistralForCausalLM(cfg)


def gpt2_model():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                  n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                  attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(cfg)


def randomize(model, seed):
    """Weights of a trained model's spread, not init's near-zero: logits
    with structure, a loss that moves."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 1.0 if ("norm" in name or ".ln_" in name) and name.endswith("weight") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=g))


def save(model, folder, shard=None):
    if shard:
        model.save_pretrained(folder, max_shard_size=shard)
    else:
        model.save_pretrained(folder)
    files = sorted(os.listdir(folder))
    want = "model.safetensors.index.json" if shard else "model.safetensors"
    assert want in files and "config.json" in files, files
    return json.load(open(os.path.join(folder, "config.json")))


# ---- running meshrun ----

def run(cmd, **kw):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    if r.returncode != 0:
        print("FAIL: %s exited %d:\n%s" % (" ".join(cmd), r.returncode, r.stdout[-4000:]))
        sys.exit(1)
    return r.stdout


def meshrun_logits(meshrun, folder, ids, work):
    out = os.path.join(work, "logits.bin")
    run([meshrun, "logits", folder, "--tokens", ",".join(map(str, ids)), "--out", out])
    raw = open(out, "rb").read()
    return torch.tensor(struct.unpack("<%df" % (len(raw) // 4), raw)).view(len(ids), -1)


def hf_logits(folder, ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def close_logits(what, ours, theirs, tol=1e-5):
    scale = theirs.abs().max().item()
    diff = (ours - theirs).abs().max().item()
    print("%s: max |logit| %.3f, max difference %.3g (%.2g of the largest)"
          % (what, scale, diff, diff / scale))
    if ours.shape != theirs.shape or not diff <= tol * scale:
        print("FAIL: %s: meshrun's logits differ from transformers' by more than %g of the "
              "largest" % (what, tol))
        sys.exit(1)


STRATEGIES = [
    ("1 rank", 1, {"auto_mode": "manual"}),
    ("tp2 x dp2", 4, {"auto_mode": "manual", "data_parallel": {"degree": 2},
                      "tensor_parallel": {"degree": 2}}),
    ("pp2 x dp2, ZeRO-3", 4, {"auto_mode": "manual", "data_parallel": {"degree": 2},
                              "pipeline_parallel": {"degree": 2, "schedule": "1f1b",
                                                    "micro_batches": 2},
                              "sharding": {"stage": 3}}),
]


def meshrun_train(meshrun, folder, data, nproc, strategy, work):
    job = {"model": folder, "data": {"train": data},
           "train": {"steps": STEPS, "global_batch": BATCH, "seq_len": SEQ, "lr": LR,
                     "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.01,
                     "betas": [0.9, 0.999], "eps": 1e-8, "grad_clip": 1.0, "seed": SEED,
                     "init": folder, "eval_interval_steps": 0},
           "checkpoint": {"dir": os.path.join(work, "ck"), "save_interval_steps": STEPS},
           "strategy": strategy}
    path = os.path.join(work, "job.json")
    json.dump(job, open(path, "w"))
    logs = os.path.join(work, "run")
    run([meshrun, "launch", "--nproc", str(nproc), "--threads", "1", "--log-dir", logs, path])
    losses = {}
    for line in open(os.path.join(logs, "metrics.jsonl")):
        m = json.loads(line)
        if "loss" in m and "step" in m:
            losses[m["step"]] = m["loss"]
    return [losses[s] for s in sorted(losses)]


def torch_train(folder, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                                              attn_implementation="eager")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    losses = []
    for step in range(STEPS):
        offs = [row_offset(SEED, step, r, len(tokens), SEQ) for r in range(BATCH)]
        ids = torch.tensor([tokens[o:o + SEQ] for o in offs])
        tgt = torch.tensor([tokens[o + 1:o + SEQ + 1] for o in offs])
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return losses


def check_export_files(out, source, sharded):
    """Every field of the source config.json carried; generation_config.json
    with its token ids; shards and their index as save_pretrained writes
    them."""
    got = json.load(open(os.path.join(out, "config.json")))
    lost = {k: v for k, v in source.items() if got.get(k) != v}
    gen = json.load(open(os.path.join(out, "generation_config.json")))
    gen_lost = {k: source[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                if source.get(k) is not None and gen.get(k) != source[k]}
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.startswith("model-") and f.endswith(".safetensors")]
    if sharded:
        index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
        layout_ok = len(shards) > 1 and "model.safetensors" not in files and \
            sorted(set(index["weight_map"].values())) == shards and \
            all(f.endswith("-of-%05d.safetensors" % len(shards)) for f in shards)
    else:
        layout_ok = "model.safetensors" in files and not shards
    if lost or gen_lost or not layout_ok:
        print("FAIL: %s: config fields lost %s, generation ids lost %s, files %s"
              % (out, lost, gen_lost, files))
        sys.exit(1)


def same_weights(folder, config, tag):
    """A folder of folder's weights under another config.json."""
    out = folder + "-" + tag
    os.makedirs(out)
    os.symlink(os.path.join(folder, "model.safetensors"), os.path.join(out, "model.safetensors"))
    json.dump(config, open(os.path.join(out, "config.json"), "w"))
    return out


def check_family(meshrun, name, make, work, train=True):
    torch.manual_seed(0)
    model = make()
    randomize(model, 1)
    folder = os.path.join(work, name)
    config = save(model, folder)
    sharded = os.path.join(work, name + "-sharded")
    save(model, sharded, shard="40KB")
    pick = random.Random(3)
    ids = [pick.randrange(VOCAB) for _ in range(SEQ)]
    theirs = hf_logits(folder, ids)
    close_logits("%s, transformers %s's folder" % (name, transformers.__version__),
                 meshrun_logits(meshrun, folder, ids, work), theirs)
    close_logits("%s, the same in %d shards" % (name, len(os.listdir(sharded)) - 3),
                 meshrun_logits(meshrun, sharded, ids, work), theirs)
    half = os.path.join(work, name + "-bf16")  # the weights stored as BF16, as hubs ship them
    model.to(torch.bfloat16).save_pretrained(half)
    close_logits("%s, weights stored as bf16" % name, meshrun_logits(meshrun, half, ids, work),
                 hf_logits(half, ids))
    if "rope_parameters" in config:  # the same weights, config.json in the 4.x form
        legacy = {k: v for k, v in config.items() if k != "rope_parameters"}
        scaling = dict(config["rope_parameters"])
        legacy["rope_theta"] = scaling.pop("rope_theta")
        if scaling.get("rope_type", "default") != "default":
            legacy["rope_scaling"] = scaling
        close_logits("%s, config.json in the 4.x form" % name,
                     meshrun_logits(meshrun, same_weights(folder, legacy, "4.x"), ids, work),
                     theirs)
        if legacy.get("rope_scaling", {}).get("rope_type") in ("llama3", "linear"):
            # the scaling matters: plain RoPE's logits differ
            plain = dict(legacy)
            del plain["rope_scaling"]
            off = (hf_logits(same_weights(folder, plain, "plain"), ids) - theirs).abs().max()
            print("%s: plain RoPE's logits differ by %.3g of the largest"
                  % (name, off / theirs.abs().max()))
            assert off > 1e-3 * theirs.abs().max(), "the scaling changes nothing here"
    if config.get("model_type") == "mistral":  # the window matters: full attention differs
        full = dict(config, sliding_window=None)
        off = (hf_logits(same_weights(folder, full, "full"), ids) - theirs).abs().max()
        print("%s: full attention's logits differ by %.3g of the largest"
              % (name, off / theirs.abs().max()))
        assert off > 1e-3 * theirs.abs().max(), "the window changes nothing here"
    if not train:
        return

    rng = random.Random(5)
    tokens = [rng.randrange(VOCAB) for _ in range(4096)]
    data = os.path.join(work, name + "-train.bin")
    with open(data, "wb") as f:
        f.write(struct.pack("<256i", 20240520, 1, len(tokens), *([0] * 253)))
        f.write(struct.pack("<%dH" % len(tokens), *tokens))
    if name == "qwen2":  # Qwen2's per-layer window, shorter than the sequence: refused
        narrow = os.path.join(work, name + "-narrow")
        os.makedirs(narrow)
        json.dump(dict(config, use_sliding_window=True, sliding_window=SEQ // 2),
                  open(os.path.join(narrow, "config.json"), "w"))
        job = {"model": narrow, "data": {"train": data}, "train": {"steps": 1, "seq_len": SEQ}}
        json.dump(job, open(os.path.join(narrow, "job.json"), "w"))
        refused([meshrun, "launch", "--nproc", "1", os.path.join(narrow, "job.json")],
                "train.seq_len", "sliding_window: %d" % (SEQ // 2), "not built")
        refused([meshrun, "logits", folder, "--config", os.path.join(narrow, "config.json"),
                 "--tokens", ",".join(map(str, ids)), "--out", os.path.join(work, "l")],
                "sliding_window: %d" % (SEQ // 2), "not built")
    want = torch_train(folder, tokens)
    print("%s: PyTorch %s AdamW losses %s" % (name, torch.__version__,
                                              " ".join("%.5f" % v for v in want)))
    for i, (label, nproc, strategy) in enumerate(STRATEGIES):
        w = os.path.join(work, "%s-run%d" % (name, i))
        os.makedirs(w)
        got = meshrun_train(meshrun, sharded if i == 1 else folder, data, nproc, strategy, w)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got, want)) if len(got) == STEPS else 1
        print("%s, %s: meshrun losses %s: at most %.2g relative from PyTorch's"
              % (name, label, " ".join("%.5f" % v for v in got), worst))
        if len(got) != STEPS or not worst <= 1e-4:
            print("FAIL: %s, %s: the losses differ from PyTorch's by more than 1e-4 relative"
                  % (name, label))
            sys.exit(1)
        out = os.path.join(w, "export")
        export = [meshrun, "export", os.path.join(w, "ck"), "--out", out]
        run(export + (["--max-shard-size", "30KB"] if i == 2 else []))
        close_logits("%s, %s: meshrun export%s reloaded by transformers"
                     % (name, label, " in shards" if i == 2 else ""),
                     meshrun_logits(meshrun, out, ids, work), hf_logits(out, ids))
        check_export_files(out, config, i == 2)


def refused(cmd, *words):
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 2 or not all(w in r.stdout for w in words):
        print("FAIL: %s: expected exit 2 naming %s, got %d: %s"
              % (" ".join(cmd), words, r.returncode, r.stdout))
        sys.exit(1)


def read_token_file(path):
    raw = open(path, "rb").read()
    head = struct.unpack("<256i", raw[:1024])
    width = {20240520: "H", 20240801: "I"}[head[0]]
    toks = list(struct.unpack("<%d%s" % (head[2], width), raw[1024:]))
    assert len(raw) == 1024 + head[2] * struct.calcsize(width), path
    return width, toks


def check_tokenizer(meshrun, work):
    """prepare-data --tokenizer and sample --tokenizer against the
    tokenizers library itself and transformers' greedy generate."""
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers
    folder = os.path.join(work, "tok-model")
    torch.manual_seed(0)
    model = llama_model()
    randomize(model, 2)
    save(model, folder)
    corpus = os.path.join(work, "corpus.txt")
    rng = random.Random(9)
    words = ["the", "fox", "dog", "quick", "lazy", "jumps", "over", "brown", "a", "cat", "runs",
             "far", "and", "sleeps", "all", "day"]
    with open(corpus, "w") as f:
        for _ in range(400):
            f.write(" ".join(rng.choice(words) for _ in range(12)) + ".\n")
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([corpus], trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["[UNK]", "</s>"]))
    tok.save(os.path.join(folder, "tokenizer.json"))
    json.dump({"eos_token": "</s>"}, open(os.path.join(folder, "tokenizer_config.json"), "w"))
    eos = tok.token_to_id("</s>")
    jsonl = os.path.join(work, "docs.jsonl")
    docs = ["the quick fox", "a lazy dog sleeps all day", "cat runs far"] * 40
    with open(jsonl, "w") as f:
        for d in docs:
            f.write(json.dumps({"body": d, "id": 1}) + "\n")
    out = os.path.join(work, "tok.bin")
    env = dict(os.environ, MESHRUN_PYTHON=sys.executable)
    r = subprocess.run([meshrun, "prepare-data", corpus, jsonl, "--tokenizer", folder,
                        "--jsonl-field", "body", "--out", out, "--val-fraction", "0.1"],
                       env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert r.returncode == 0, r.stdout
    want = tok.encode(open(corpus).read(), add_special_tokens=False).ids + [eos]
    for d in docs:
        want += tok.encode(d, add_special_tokens=False).ids + [eos]
    width, train = read_token_file(out)
    _, val = read_token_file(os.path.join(work, "tok-val.bin"))
    if width != "H" or train + val != want or not val or val[-1] != eos:
        print("FAIL: prepare-data --tokenizer: %s, %d + %d tokens, expected %d as tokenizers "
              "encodes them" % (width, len(train), len(val), len(want)))
        sys.exit(1)
    print("prepare-data --tokenizer: %d + %d tokens, each as tokenizers %s encodes them, "
          "the end-of-text id after each document" % (len(train), len(val),
                                                       tokenizers.__version__))
    # a vocabulary past 65536: uint32 files
    big = tokenizers.Tokenizer(models.WordLevel({("w%d" % i): i for i in range(70000)},
                                                unk_token="w0"))
    big.pre_tokenizer = pre_tokenizers.Whitespace()
    big_path = os.path.join(work, "big-tokenizer.json")
    big.save(big_path)
    text = os.path.join(work, "big.txt")
    open(text, "w").write("w1 w69999 w65536 w3\n")
    r = subprocess.run([meshrun, "prepare-data", text, "--tokenizer", big_path, "--out",
                        os.path.join(work, "big.bin"), "--val-fraction", "0"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert r.returncode == 0, r.stdout
    width, toks = read_token_file(os.path.join(work, "big.bin"))
    if width != "I" or toks != [1, 69999, 65536, 3]:
        print("FAIL: a 70000-token vocabulary: %s %s" % (width, toks))
        sys.exit(1)
    print("prepare-data --tokenizer, vocabulary 70000: uint32 (llm.c 20240801) %s" % toks)
    # sample: the prompt encoded, greedy, decoded, as transformers' generate
    prompt, n = "the quick brown fox jumps", 20
    ids = tok.encode(prompt, add_special_tokens=False).ids
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          pad_token_id=0, eos_token_id=None)[0].tolist()
    want_text = tok.decode(gen, skip_special_tokens=False)
    r = subprocess.run([meshrun, "sample", folder, "--prompt", prompt, "--tokens", str(n),
                        "--temperature", "0", "--tokenizer", folder], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0 or r.stdout.rstrip("\n") != want_text:
        print("FAIL: sample --tokenizer: %r (exit %d, %s), transformers' greedy generate "
              "decodes to %r" % (r.stdout, r.returncode, r.stderr, want_text))
        sys.exit(1)
    print("sample --tokenizer: %r, as transformers' greedy generate" % want_text)
    # trained from the folder, exported: the tokenizer and generation config come along
    w = os.path.join(work, "tok-run")
    os.makedirs(w)
    meshrun_train(meshrun, folder, out, 1, {"auto_mode": "manual"}, w)
    exported = os.path.join(w, "export")
    run([meshrun, "export", os.path.join(w, "ck"), "--out", exported])
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if open(os.path.join(folder, f), "rb").read() != open(os.path.join(exported, f),
                                                              "rb").read():
            print("FAIL: export: %s not carried from the model folder" % f)
            sys.exit(1)
    r = subprocess.run([meshrun, "sample", exported, "--prompt", prompt, "--tokens", "4",
                        "--temperature", "0", "--tokenizer", exported], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert r.returncode == 0 and r.stdout.startswith("the quick brown fox"), r.stderr
    print("export carries tokenizer.json, tokenizer_config.json, generation_config.json; "
          "sample takes the exported folder as it is: %r" % r.stdout.strip())
    refused([meshrun, "prepare-data", corpus, "--tokenizer", os.path.join(work, "none.json"),
             "--out", os.path.join(work, "x.bin")], "none.json")


def main():
    meshrun = sys.argv[1]
    work = tempfile.mkdtemp(prefix="mr-test-transformers-")
    refused([meshrun, "export", work, "--out", work, "--max-shard-size", "5 parsecs"],
            "--max-shard-size", "5 parsecs", "5GB")
    refused([meshrun, "logits", work, "--tokens", "1,x,3", "--out", os.path.join(work, "l")],
            "--tokens", "entry 2", "x,3")
    check_tokenizer(meshrun, work)
    check_family(meshrun, "llama", llama_model, work)
    check_family(meshrun, "llama-attention-bias", llama_bias_model, work)
    check_family(meshrun, "llama3-rope", llama3_rope_model, work)
    check_family(meshrun, "linear-rope", linear_rope_model, work, train=False)
    check_family(meshrun, "dynamic-rope", dynamic_rope_model, work, train=False)
    check_family(meshrun, "qwen2", qwen2_model, work)
    check_family(meshrun, "mistral", mistral_model, work)
    check_family(meshrun, "gpt2", gpt2_model, work)
    print("ok: logits, 10 training steps on three strategies and the export agree with "
          "transformers %s and PyTorch %s" % (transformers.__version__, torch.__version__))
    shutil.rmtree(work)  # a failure's folder stays, to be read


if __name__ == "__main__":
    main()
