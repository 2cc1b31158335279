#!/usr/bin/env python3
"""Benchmarks of the CPU runtime against numpy/OpenBLAS and PyTorch, single-threaded, the
two sides interleaved round by round in one run; prints medians and ratios.

usage: bench/compare.py [--rounds R] [--quick]
  (builds nothing: run `cargo build --release -p nnscaler-tools` first; needs Debian's
   python3-torch, python3-numpy and libopenblas0-pthread)

  gemm: f32 NxN @ NxN for N in 256..2048, GFLOP/s of the gemm crate vs numpy (OpenBLAS);
        target ratio >= 0.8.
  step: one forward+backward step of the nanogpt-cpu preset (autodiff'ed IR on the CPU
        runtime) vs the same model in PyTorch (test/oracle/models.py); target ratio <= 1.5.
"""
import json
import os
import statistics
import subprocess
import sys
import time

os.environ["OMP_NUM_THREADS"] = "1"
os.environ["OPENBLAS_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test", "oracle"))
import models  # noqa: E402

BENCH = os.path.join(ROOT, "target", "release", "nnscaler-bench")


def ours(*args):
    out = subprocess.run([BENCH, *map(str, args)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)["times"]


def numpy_gemm(n, reps):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    a @ b
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - t)
    return times


def torch_step_fn():
    # nanogpt-cpu: 4 layers, 4 heads, width 128, block 64, batch 12, vocab 65.
    c = {"layers": 4, "heads": 4}
    b, t, w, v = 12, 64, 128, 65
    g = torch.Generator().manual_seed(0)
    shapes = {"wte": (v, w), "wpe": (t, w), "ln_f.weight": (w,), "ln_f.bias": (w,)}
    for i in range(4):
        p = f"h.{i}."
        shapes.update({p + "ln_1.weight": (w,), p + "ln_1.bias": (w,), p + "ln_2.weight": (w,),
                       p + "ln_2.bias": (w,), p + "attn.proj.weight": (w, w), p + "attn.proj.bias": (w,),
                       p + "mlp.fc.weight": (4 * w, w), p + "mlp.fc.bias": (4 * w,),
                       p + "mlp.proj.weight": (w, 4 * w), p + "mlp.proj.bias": (w,)})
        for n in "qkv":
            shapes[p + f"attn.{n}.weight"] = (w, w)
            shapes[p + f"attn.{n}.bias"] = (w,)
    params = {k: (0.02 * torch.randn(s, generator=g)).requires_grad_(True) for k, s in shapes.items()}
    inputs = {"tokens": torch.randint(0, v, (b, t), generator=g),
              "targets": torch.randint(0, v, (b, t), generator=g)}
    names = sorted(params)

    def step():
        loss = models.gpt(params, inputs, c)
        torch.autograd.grad(loss, [params[n] for n in names])

    return step


def torch_steps(step, reps):
    step()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def main():
    rounds = 5
    if "--rounds" in sys.argv:
        rounds = int(sys.argv[sys.argv.index("--rounds") + 1])
    quick = "--quick" in sys.argv
    torch.set_num_threads(1)
    if not os.path.exists(BENCH):
        sys.exit(f"{BENCH} is missing: run `cargo build --release -p nnscaler-tools` first")
    print(f"single-threaded, {rounds} interleaved rounds, medians")
    print(f"{'gemm N':>8} {'ours GF/s':>10} {'numpy GF/s':>11} {'ratio':>6}")
    sizes = [256, 512] if quick else [256, 512, 1024, 2048]
    ratios = []
    for n in sizes:
        reps = max(2, int(2e9 / (2 * n**3)))
        a, b = [], []
        for _ in range(rounds):
            a += ours("gemm", n, reps)
            b += numpy_gemm(n, reps)
        fa = 2 * n**3 / statistics.median(a) / 1e9
        fb = 2 * n**3 / statistics.median(b) / 1e9
        ratios.append(fa / fb)
        print(f"{n:>8} {fa:>10.1f} {fb:>11.1f} {fa / fb:>6.2f}")
    print(f"gemm: worst ratio {min(ratios):.2f} (target >= 0.8)")
    step = torch_step_fn()
    a, b = [], []
    for _ in range(rounds):
        a += ours("step", "nanogpt-cpu", 3)
        b += torch_steps(step, 3)
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"nanogpt-cpu step: ours {ma * 1e3:.1f} ms, PyTorch {mb * 1e3:.1f} ms, "
          f"ratio {ma / mb:.2f} (target <= 1.5)")


if __name__ == "__main__":
    main()
