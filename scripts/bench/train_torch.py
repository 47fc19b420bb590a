#!/usr/bin/python3
"""train_torch.py - the peer for scripts/bench/train: the same LLaMA
(rotate-half RoPE, grouped-query attention, SwiGLU, RMSNorm, untied head),
the same batch shape, AdamW with torch defaults and lr 1e-3, clipping at
1.0, written directly in PyTorch, in the configurations a user picks:

  eager         float32, attention written out (softmax(q k^T + mask) v)
  sdpa          float32, F.scaled_dot_product_attention(is_causal=True)
  compile       the same, the model wrapped in torch.compile
  bf16-sdpa     the same under torch.autocast("cpu", torch.bfloat16)
  bf16-compile  the same, the model wrapped in torch.compile

  train_torch.py TOKENS.bin --hidden H --layers L --heads A --inter I
                 [--seq 256] [--batch 8] [--steps 12] [--threads 2]
                 [--mode eager|sdpa|compile|bf16-sdpa|bf16-compile]

Prints `summary tokens_per_s=.. gflops=.. loss_first=.. loss_last=..`,
tokens/s the median over steps after the first two (warm-up)."""
import argparse, array, math, random, statistics, sys, time

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("tokens")
p.add_argument("--hidden", type=int, default=256)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--heads", type=int, default=8)
p.add_argument("--kv-heads", type=int, default=0)
p.add_argument("--inter", type=int, default=688)
p.add_argument("--vocab", type=int, default=256)
p.add_argument("--seq", type=int, default=256)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--steps", type=int, default=12)
p.add_argument("--threads", type=int, default=2)
p.add_argument("--mode", default="eager",
               choices=["eager", "sdpa", "compile", "bf16-sdpa", "bf16-compile"])
a = p.parse_args()
sdpa = a.mode != "eager"
autocast = a.mode.startswith("bf16")
torch.set_num_threads(a.threads)
torch.manual_seed(0)
kvh = a.kv_heads or a.heads
C, H, D, T, B = a.hidden, a.heads, a.hidden // a.heads, a.seq, a.batch


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate_half(x):
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        L = lambda i, o: torch.nn.Linear(i, o, bias=False)
        self.q, self.k, self.v, self.o = L(C, H * D), L(C, kvh * D), L(C, kvh * D), L(H * D, C)
        self.g, self.u, self.d = L(C, a.inter), L(C, a.inter), L(a.inter, C)
        self.n1 = torch.nn.Parameter(torch.ones(C))
        self.n2 = torch.nn.Parameter(torch.ones(C))

    def forward(self, x, cos, sin, mask):
        h = rms(x, self.n1)
        q = self.q(h).view(B, T, H, D).transpose(1, 2)
        k = self.k(h).view(B, T, kvh, D).transpose(1, 2)
        v = self.v(h).view(B, T, kvh, D).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if kvh != H:
            k = k.repeat_interleave(H // kvh, dim=1)
            v = v.repeat_interleave(H // kvh, dim=1)
        if sdpa:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            s = (q @ k.transpose(-1, -2)) / math.sqrt(D) + mask
            o = torch.softmax(s, dim=-1) @ v
        o = o.transpose(1, 2).reshape(B, T, C)
        x = x + self.o(o)
        h = rms(x, self.n2)
        return x + self.d(F.silu(self.g(h)) * self.u(h))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(a.vocab, C)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(a.layers))
        self.norm = torch.nn.Parameter(torch.ones(C))
        self.head = torch.nn.Linear(C, a.vocab, bias=False)
        for m in self.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(m.weight, std=0.02)
        inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
        f = torch.outer(torch.arange(T).float(), inv)
        e = torch.cat((f, f), dim=-1)
        self.cos, self.sin = e.cos(), e.sin()
        self.mask = torch.full((T, T), float("-inf")).triu(1)

    def forward(self, ids, tgt):
        x = self.emb(ids)
        for l in self.layers:
            x = l(x, self.cos, self.sin, self.mask)
        logits = self.head(rms(x, self.norm))
        return F.cross_entropy(logits.view(-1, a.vocab), tgt.view(-1))


buf = array.array("H")
with open(a.tokens, "rb") as f:
    buf.frombytes(f.read())
raw = torch.tensor(buf[512:], dtype=torch.int64)  # after the llm.c header
model = Model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
forward = torch.compile(model) if a.mode.endswith("compile") else model
rng = random.Random(0)
times, losses = [], []
for step in range(a.steps):
    off = [rng.randrange(0, len(raw) - T - 1) for _ in range(B)]
    ids = torch.stack([raw[o:o + T] for o in off])
    tgt = torch.stack([raw[o + 1:o + T + 1] for o in off])
    t0 = time.perf_counter()
    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        loss = forward(ids, tgt)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    times.append(time.perf_counter() - t0)
    losses.append(loss.item())
mm = a.layers * (C * H * D * 2 + 2 * C * kvh * D + 3 * C * a.inter) + C * a.vocab
flops = 6 * mm * B * T + 12 * a.layers * B * T * T * C  # + attention scores, values
tps = B * T / statistics.median(times[2:])
print("summary tokens_per_s=%.1f gflops=%.2f loss_first=%.4f loss_last=%.4f torch=%s"
      % (tps, flops / (B * T) * tps / 1e9, losses[0], losses[-1], torch.__version__))
