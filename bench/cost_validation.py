#!/usr/bin/env python3
"""The cost model against every measured workload we have (issue 44): predicted step
times next to measured ones, with the error of each row.

    bench/cost_validation.py [--bin target/release] [--only published|h200] [--markdown]

1. Published large-scale runs: Megatron-LM's GPT models from 1.7B to 1T parameters on
   32 to 3072 A100 80GB GPUs (Narayanan et al., "Efficient Large-Scale Language Model
   Training on GPU Clusters Using Megatron-LM", SC'21, Table 1: heads, hidden size,
   layers, tensor- and pipeline-parallel sizes, GPUs, batch, achieved teraFLOP/s per GPU;
   vocabulary 51200, sequence 2048, mixed precision, full activation recomputation). The
   measured step is the paper's FLOP count per step (its equation: 96 B s l h^2 (1 +
   s / 6h + V / 16lh), recomputation included) over the achieved rate times the GPUs.
   Predicted: `nnscaler plan --cluster dgx-a100 --precision bf16 --fix dp=..,tp=..,pp=..,
   recompute=full,zero=0,splits=megatron,schedule=1f1b,schedule=interleaved`: the
   published configuration (its degrees; full recomputation; no distributed optimizer,
   no sequence parallelism, 1F1B or interleaved stages, as Megatron-LM had in 2021), the
   micro-batches searched. Beside it, the model's best plan at those degrees with
   everything else searched (what nnscaler would run instead). Both MFUs use the
   same model FLOPs (no recomputation: 72 B s l h^2 (1 + s / 6h) + 6 B s h V) against the
   A100's 312 TFLOP/s bf16 peak, so the MFU error is the step-time error inverted.
2. The H200 runs in ../shared/data/h200/ (2026-12-04 kernels): the nanoGPT GPU config's
   training step (fp32 and bf16) predicted with the GPU's microbenchmarks fitted
   (`nnscaler calibrate --device gpu --timings calib-timings.json --base h200`) and with
   the datasheet preset `h200`, against the measured median step.

Prints one row per workload (predicted, measured, error = predicted / measured - 1), the
median absolute error and, for the published rows, Spearman's rho between predicted and
measured MFU. The model is never fitted to these steps. The CPU's rows are
bench/cost.sh's (it calibrates this machine first; run it separately)."""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200 = os.path.join(ROOT, "..", "shared", "data", "h200")

# (billions of parameters, heads, hidden, layers, tp, pp, GPUs, batch, TFLOP/s per GPU)
MEGATRON = [
    (1.7, 24, 2304, 24, 1, 1, 32, 512, 137),
    (3.6, 32, 3072, 30, 2, 1, 64, 512, 138),
    (7.5, 32, 4096, 36, 4, 1, 128, 512, 142),
    (18.4, 48, 6144, 40, 8, 1, 256, 1024, 135),
    (39.1, 64, 8192, 48, 8, 2, 512, 1536, 138),
    (76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140),
    (145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148),
    (310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155),
    (529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163),
    (1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163),
]
SEQ, VOCAB, A100_BF16 = 2048, 51200, 312e12
# Megatron-LM's --bf16: activations in bf16 between ops, f32 master weights and loss.
PRECISION = "bf16-activations"

# The H200 runs (median step, seconds) of ../shared/data/h200/README.md.
H200_STEPS = {"fp32": 102.9e-3, "bf16": 83.2e-3}


def run(cmd, cwd):
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def spearman(a, b):
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.mean(ra), statistics.mean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


# Megatron-LM's attention in 2021 (before FlashAttention): the scores of every head are a
# bf16 tensor in memory between its kernels, all s x t of them (the causal mask is applied
# to them, nothing is skipped). Bytes per score, forward: the Q K^T product writes it (2),
# the fused scale-mask-softmax reads and writes it (4), dropout reads it and writes it and
# its 1-byte mask (5), the product with V reads it (2): 13. Backward: dP = dO V^T writes
# (2), dropout's backward reads it and the mask and writes (5), the softmax's backward
# reads dP and the saved probabilities and writes dS (6), dQ and dK read dS (4), dV reads
# the dropped probabilities (2): 19. Matrix FLOPs per score and head dim: 2 forward (Q K^T,
# P V), 4 backward (dP, dV, dQ, dK), at the products' efficiency for large operands.
MEGATRON_ATTENTION_BYTES = {"dnn.attention": 13, "dnn.attention_grad": 19}
MEGATRON_ATTENTION_FLOPS = {"dnn.attention": 2, "dnn.attention_grad": 4}


def megatron_2021(toml):
    """The cluster TOML `toml` (a preset's) with attention priced as Megatron-LM ran it in
    2021 (the device's `head_kernels`: seconds per score and per score and head dim, from
    its memory bandwidth and its bf16 matrix rate at its largest products' efficiency)."""
    device = tomllib.loads(toml)["device"]
    bandwidth, rate = device["memory_bandwidth"], device["matrix_flops_bf16"]
    efficiency = max(e for _, e in device["matrix_efficiency"])
    lines = ["", "[device.head_kernels]"]
    for op in ("dnn.attention", "dnn.attention_grad"):
        c = [0.0, 0.0, MEGATRON_ATTENTION_BYTES[op] / bandwidth,
             MEGATRON_ATTENTION_FLOPS[op] / (rate * efficiency)]
        for key in (op, op + ".bf16"):
            lines.append(f'"{key}" = [{", ".join(repr(x) for x in c)}]')
    at = toml.index("\n[[network]]")
    return toml[:at] + "\n".join(lines) + "\n" + toml[at:]


def published(bin_dir, work):
    # The preset with Megatron-LM's 2021 attention (what the published runs ran), and the
    # same with ten times the memory: for a published configuration (one that ran) the
    # model thinks does not fit, its predicted time and memory all the same. nnscaler's own
    # plans are priced on the preset itself (its attention is a fused kernel).
    toml = run([os.path.join(bin_dir, "nnscaler"), "presets", "--toml", "dgx-a100"], work)
    toml = megatron_2021(toml)
    as_ran = os.path.join(work, "dgx-a100-megatron-2021.toml")
    with open(as_ran, "w") as f:
        f.write(toml)
    whole = os.path.join(work, "dgx-a100-megatron-2021-roomy.toml")
    with open(whole, "w") as f:
        for line in toml.splitlines(True):
            if line.startswith("memory = "):
                line = f"memory = {int(line.split('=')[1]) * 10}\n"
            f.write(line)
    rows = []
    for params, heads, h, layers, tp, pp, gpus, batch, tflops in MEGATRON:
        dp = gpus // (tp * pp)
        model = os.path.join(work, f"gpt-{params}b.mlir")
        run([os.path.join(bin_dir, "nnscaler"), "import", "gpt", "--layers", str(layers),
             "--heads", str(heads), "--width", str(h), "--vocab", str(VOCAB), "--block", str(SEQ),
             "--batch", str(batch), "-o", model], work)
        def plan(fix, cluster="dgx-a100"):
            r = subprocess.run([os.path.join(bin_dir, "nnscaler"), "plan", model, "--cluster", cluster,
                                "--devices", str(gpus), "--precision", PRECISION, "--fix", fix, "--json"],
                               cwd=work, capture_output=True, text=True)
            if r.returncode != 0:
                return None, r.stderr.strip()
            return json.loads(r.stdout)["best"], None

        degrees = f"dp={dp},tp={tp},pp={pp}"
        fixed = degrees + ",recompute=full,zero=0,splits=megatron,schedule=1f1b,schedule=interleaved"
        best, why = plan(fixed, as_ran)
        note = ""
        if best is None:
            best, _ = plan(fixed, whole)
            if best is None:
                sys.exit(f"GPT {params}B: no plan even without the memory margin: {why}")
            note = f"the model's memory {best['memory'] / 2**30:.0f} GiB > 72.2 GiB, though it ran"
        ours, why = plan(degrees)
        if ours is None:
            sys.exit(f"GPT {params}B: {why}")
        hw_flops = 96 * batch * SEQ * layers * h * h * (1 + SEQ / (6 * h) + VOCAB / (16 * layers * h))
        model_flops = 72 * batch * SEQ * layers * h * h * (1 + SEQ / (6 * h)) + 6 * batch * SEQ * h * VOCAB
        measured = hw_flops / (tflops * 1e12 * gpus)
        predicted = best["seconds"]
        mfu = lambda step: model_flops / (step * gpus * A100_BF16)  # noqa: E731
        rows.append({
            "name": f"GPT {params}B, {gpus} A100 (dp{dp} tp{tp} pp{pp}, batch {batch})",
            "predicted": predicted, "measured": measured,
            "mfu_predicted": mfu(predicted), "mfu_measured": mfu(measured),
            "ours": ours["seconds"],
            "note": note,
        })
    return rows


def h200(bin_dir, work):
    timings = os.path.join(H200, "calib-timings.json")
    if not os.path.exists(timings):
        print(f"(no {timings}: the H200 rows are skipped)")
        return []
    n, opt = os.path.join(bin_dir, "nnscaler"), os.path.join(bin_dir, "nnscaler-opt")
    cal = os.path.join(work, "h200-fit.toml")
    run([n, "calibrate", "--device", "gpu", "--timings", timings, "--base", "h200", "-o", cal], work)
    big = os.path.join(work, "big.mlir")
    run([n, "import", "gpt", "--preset", "nanogpt-cpu", "--layers", "6", "--heads", "6", "--width", "384",
         "--block", "256", "--batch", "64", "--vocab", "65", "-o", big], work)
    rows = []
    for precision, flags in (("fp32", []), ("bf16", ["--autocast=bf16"])):
        step = os.path.join(work, f"big-{precision}-step.mlir")
        run([opt] + flags + ["--autodiff", "--optimizer=clip=1.0 weight_decay=0.1", big, "-o", step], work)
        for cluster, what in ((cal, "fitted to the H200's microbenchmarks"), ("h200", "datasheet preset")):
            r = subprocess.run([opt, f"--print-stats=cluster={cluster}", step, "-o", "/dev/null"],
                               cwd=work, capture_output=True, text=True)
            m = re.search(r"^predicted time per run[^:]*: ([0-9.e+-]+) s", r.stderr + r.stdout, re.M)
            if not m:
                sys.exit(f"no prediction in --print-stats' output:\n{r.stderr}")
            rows.append({
                "name": f"nanoGPT GPU config {precision} step, H200 ({what})",
                "predicted": float(m.group(1)), "measured": H200_STEPS[precision],
            })
    return rows


def show(title, rows, markdown, mfu):
    print(f"\n{title}")
    if markdown:
        head = "| workload | predicted step | measured step | error |"
        head += " predicted MFU | measured MFU | nnscaler's best plan at these degrees |" if mfu else ""
        print(head)
        print("|---" * (7 if mfu else 4) + "|")
    for r in rows:
        err = r["predicted"] / r["measured"] - 1
        r["error"] = err
        if markdown:
            line = f"| {r['name']} | {r['predicted']:.4g} s | {r['measured']:.4g} s | {err:+.1%} |"
            if mfu:
                line += f" {r['mfu_predicted']:.1%} | {r['mfu_measured']:.1%} | {r['ours']:.4g} s |"
                if r["note"]:
                    line = line.replace(f"| {r['predicted']:.4g} s |", f"| {r['predicted']:.4g} s ({r['note']}) |", 1)
            print(line)
        else:
            line = f"{r['name']:<62} predicted {r['predicted']:10.4g} s  measured {r['measured']:10.4g} s  error {err:+7.1%}"
            if mfu:
                line += f"  MFU {r['mfu_predicted']:.1%} vs {r['mfu_measured']:.1%}; best plan {r['ours']:.4g} s"
                if r["note"]:
                    line += f"  ({r['note']})"
            print(line)
    if rows:
        med = statistics.median(abs(r["error"]) for r in rows)
        print(f"median |error| of the step {med:.1%} over {len(rows)} rows", end="")
        if mfu:
            mfu_err = statistics.median(abs(r["mfu_predicted"] / r["mfu_measured"] - 1) for r in rows)
            print(f"; of MFU {mfu_err:.1%}", end="")
        if mfu and len(rows) > 1:
            rho = spearman([r["mfu_predicted"] for r in rows], [r["mfu_measured"] for r in rows])
            print(f"; Spearman rho of predicted and measured MFU {rho:.3f}", end="")
        print()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("--only", choices=["published", "h200"])
    ap.add_argument("--markdown", action="store_true", help="print markdown tables")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        if a.only in (None, "published"):
            show("Published: Megatron-LM GPT on A100 (SC'21 Table 1), dgx-a100 preset, bf16",
                 published(a.bin, work), a.markdown, True)
        if a.only in (None, "h200"):
            show("Measured here: the H200 runs of 2026-12-04 (../shared/data/h200)",
                 h200(a.bin, work), a.markdown, False)


if __name__ == "__main__":
    main()
