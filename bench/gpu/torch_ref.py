"""PyTorch references on the GPU for bench/gpu/check.sh.

  torch_ref.py step LAYERS HEADS WIDTH BLOCK BATCH VOCAB [bf16]   nanoGPT training step time
      (eager, fp32, TF32 off; with bf16 under torch.autocast(dtype=torch.bfloat16), fp32
      master weights): forward, backward, clipping at 1, AdamW; median of 10 after 3 warm-ups
  torch_ref.py gemm N                                      torch.matmul TFLOP/s, fp32, TF32 off
  torch_ref.py attn B H T D [bf16]                         causal scaled_dot_product_attention:
      forward, and forward + backward, median of 20 after 3 warm-ups (PyTorch picks its
      fastest kernel: flash or memory-efficient)
"""
import statistics
import sys
import time

import torch

import models  # test/oracle/models.py, carried along


def timed(fn, warm=3, runs=10):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def step(layers, heads, width, block, batch, vocab, bf16=False):
    torch.manual_seed(0)
    dev = "cuda"
    c = {"layers": layers, "heads": heads}
    p = models.gpt_params(vocab, width, block, layers, dev)
    opt = torch.optim.AdamW([{"params": [v for v in p.values() if v.dim() >= 2], "weight_decay": 0.1},
                             {"params": [v for v in p.values() if v.dim() < 2], "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))
    x = torch.randint(0, vocab, (batch, block), device=dev)
    y = torch.randint(0, vocab, (batch, block), device=dev)

    def one():
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            loss = models.gpt(p, {"tokens": x, "targets": y}, c)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), 1.0)
        opt.step()

    print(f"pytorch eager step{' (autocast bf16)' if bf16 else ''} {timed(one):.6f} s")


def gemm(n):
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    s = timed(lambda: torch.matmul(a, b))
    print(f"torch.matmul {n}^3 fp32: {2 * n ** 3 / s / 1e12:.2f} TFLOP/s ({s:.6f} s)")


def attn(b, h, t, d, bf16=False):
    import torch.nn.functional as F
    dt = torch.bfloat16 if bf16 else torch.float32
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, t, d, device="cuda", dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(b, h, t, d, device="cuda", dtype=dt)
    fw = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), runs=20)

    def fb():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(g)

    tb = timed(fb, runs=20)
    print(f"pytorch sdpa causal B{b} H{h} T{t} d{d} {'bf16' if bf16 else 'fp32'}: "
          f"forward {fw:.6f} s, forward+backward {tb:.6f} s")


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if sys.argv[1] == "step":
        step(*map(int, sys.argv[2:8]), bf16=sys.argv[8:9] == ["bf16"])
    elif sys.argv[1] == "attn":
        attn(*map(int, sys.argv[2:6]), bf16=sys.argv[6:7] == ["bf16"])
    elif sys.argv[1] == "gemm":
        gemm(int(sys.argv[2]))
    else:
        sys.exit(__doc__)
