"""PyTorch's time for each family of a GPT training step's work, on this GPU, at the
model's shapes: what `compare.py side` prints beside `nnscaler-rt run --profile`'s table.

    python3 torch_families.py LAYERS HEADS WIDTH BLOCK BATCH VOCAB [bf16]

Each family is timed alone (CUDA-synchronized medians of eager PyTorch) and multiplied by
how many times one step of nnscaler's GPT (q, k, v and output projections with biases, a
4x MLP with GELU, pre-norm layer norms, tied-free LM head, AdamW with clipping) runs it:

  matrix products   every linear's forward, input gradient and weight gradient GEMMs
  attention         causal SDPA forward + backward, per layer
  layer norm        forward + backward, 2 per layer + the final one
  bias gradients    the biases' gradients (sums over the tokens), 5 of width C and 1 of 4C per layer
  gelu              forward + backward on [tokens, 4C], per layer
  embedding         token and position embeddings, forward + backward
  cross entropy     forward + backward on [tokens, vocab]
  optimizer         clip_grad_norm_ (foreach) + AdamW (fused), over the model's parameters
  copies            the heads' split and merge (transpose + contiguous), 4 forward + 4 backward per layer
  elementwise       the residual adds, 2 forward + 2 backward per layer

bf16: products, attention, gelu, bias sums, copies and adds in bfloat16 (what autocast
runs in bf16), norms, cross-entropy and the optimizer in fp32. Prints `family: ms` lines.
TORCH_FAMILIES_DEVICE=cpu runs it on the CPU (a smoke test of the script: the lit test
does, with Debian's torch, whose attention is then written out as matmul-softmax-matmul).
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F


DEV = os.environ.get("TORCH_FAMILIES_DEVICE", "cuda")


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn, warm=3, runs=15):
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def sdpa(q, k, v):
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def main():
    args = sys.argv[1:]
    bf16 = args[-1:] == ["bf16"]
    if bf16:
        args = args[:-1]
    L, H, C, T, B, V = map(int, args)
    N, d = B * T, C // H
    dev = DEV
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    low = torch.bfloat16 if bf16 else torch.float32
    r = lambda *s, dt=low, g=False: torch.randn(*s, device=dev, dtype=dt, requires_grad=g)
    out = {}

    # Matrix products: forward x w^T, input gradient g w, weight gradient g^T x.
    def linear_ms(n, k, m):
        x, w, g = r(n, k), r(m, k), r(n, m)
        return timed(lambda: x @ w.t()) + timed(lambda: g @ w) + timed(lambda: g.t() @ x)

    out["matrix products"] = L * (4 * linear_ms(N, C, C) + linear_ms(N, C, 4 * C) + linear_ms(N, 4 * C, C)) + linear_ms(N, C, V)

    q, k, v = (r(B, H, T, d, g=True) for _ in range(3))
    go = r(B, H, T, d)

    def attn():
        o = sdpa(q, k, v)
        o.backward(go)

    out["attention"] = L * timed(attn)

    x, w, b = r(N, C, dt=torch.float32, g=True), r(C, dt=torch.float32, g=True), r(C, dt=torch.float32, g=True)
    gy = r(N, C, dt=torch.float32)
    out["layer norm"] = (2 * L + 1) * timed(lambda: F.layer_norm(x, (C,), w, b).backward(gy))

    g1, g4 = r(N, C), r(N, 4 * C)
    out["bias gradients"] = L * (5 * timed(lambda: g1.sum(0)) + timed(lambda: g4.sum(0)))

    h = r(N, 4 * C, g=True)
    gh = r(N, 4 * C)
    out["gelu"] = L * timed(lambda: F.gelu(h).backward(gh))

    ids = torch.randint(0, V, (B, T), device=dev)
    wte, wpe = r(V, C, dt=torch.float32, g=True), r(T, C, dt=torch.float32, g=True)
    ge = r(B, T, C, dt=torch.float32)
    pos = torch.arange(T, device=dev)
    out["embedding"] = timed(lambda: (F.embedding(ids, wte) + F.embedding(pos, wpe)).backward(ge))

    logits = r(N, V, dt=torch.float32, g=True)
    tg = torch.randint(0, V, (N,), device=dev)
    out["cross entropy"] = timed(lambda: F.cross_entropy(logits, tg).backward())

    shapes = [(V, C), (T, C)]
    for _ in range(L):
        shapes += [(C,), (C,)] + [(C, C), (C,)] * 4 + [(C,), (C,), (4 * C, C), (4 * C,), (C, 4 * C), (C,)]
    shapes += [(C,), (C,)]
    ps = [torch.randn(*s, device=dev, requires_grad=True) for s in shapes]
    for p in ps:
        p.grad = torch.randn_like(p)
    fused = {"fused": True} if dev == "cuda" else {"foreach": True}
    opt = torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, **fused)

    # foreach clipping where the torch has it (2.x; Debian's 1.13 does not).
    clip_kw = {"foreach": True} if dev == "cuda" else {}

    def step():
        torch.nn.utils.clip_grad_norm_(ps, 1.0, **clip_kw)
        opt.step()

    out["optimizer"] = timed(step)

    xs = r(B, T, C)
    out["copies"] = 8 * L * timed(lambda: xs.view(B, T, H, d).transpose(1, 2).contiguous())

    a1, a2 = r(N, C), r(N, C)
    out["elementwise"] = 4 * L * timed(lambda: a1 + a2)

    for name, s in out.items():
        print(f"{name}: {s * 1e3:.3f} ms")
    print(f"total: {sum(out.values()) * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
