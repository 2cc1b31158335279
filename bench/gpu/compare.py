"""Helpers for bench/gpu/check.sh, in plain Python (no numpy needed on the GPU machine).

  compare.py close GOT WANT TOL [--same-nonfinite]
                                    every tensor of GOT equals WANT's within TOL relative to
                                    WANT's largest finite magnitude (absolutely where that is
                                    below 1e-6), with the same names, shapes and lengths;
                                    a NaN or infinity in either fails (with --same-nonfinite,
                                    one both hold at the same place passes); prints the worst,
                                    exits 1 naming the tensor and first bad index if not
  compare.py params ARTIFACT OUT    random parameters for an artifact's param inputs
                                    (normal(0, 0.02); norm weights 1, biases 0), seed 0
  compare.py inputs ARTIFACT OUT    uniform(-1, 1) values for every f32 input, seed 0
  compare.py warm FILE              the optimizer state in FILE (adam.m.*, adam.v.*) made
                                    warm, in place, seed 0
  compare.py covers ARTIFACT FILE.. the files hold every input of the artifact, with its
                                    shape (exits 1 naming the first that is missing)
  compare.py families NCU.csv       ncu's per-launch times (gpu__time_duration) summed by
                                    kernel family (the name less its kernel number prefix)
  compare.py summary CHECK.log      the step times of a check.sh log as one table: workload,
                                    ours, PyTorch eager in the same precision, the user's
                                    PyTorch module (SDPA; bf16 with fused AdamW), and
                                    torch.compile where run, with our ratio to each
  compare.py train LOG STEPS GOAL TOKENS
                                    a training log (nnscaler-rt train's JSON lines; TOKENS
                                    per step): each evaluation's losses, the median step
                                    time, how long all STEPS take at it, and whether the
                                    last validation loss reached GOAL (or where it stopped)
  compare.py side PROFILE TORCH     nnscaler-rt run --profile's table (PROFILE: its output)
                                    grouped into the families torch_families.py times
                                    (TORCH: its output), side by side with PyTorch's, with
                                    the ratios; which of our kernel families went where

Optimizer state is drawn warm, as a few hundred steps leave it (adam.m normal(0, 1e-3),
adam.v uniform(1e-6, 1e-5)), not zero: from zero, Adam's first steps move each parameter
by about lr * sign(gradient), so a gradient element near 0, whose value depends on the
order its sum runs in, decides the update alone, and a GPU that sums in another order
than the CPU disagrees there by much more than rounding.
"""
import array
import json
import random
import struct
import sys


def load(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        code = {"F32": "f", "I64": "q", "F64": "d", "I32": "i"}[info["dtype"]]
        arr = array.array(code)
        arr.frombytes(raw[8 + n + a:8 + n + b])
        out[name] = (info["shape"], arr)
    return out


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        shape, arr = tensors[name]
        b = arr.tobytes()
        header[name] = {"dtype": {"f": "F32", "q": "I64"}[arr.typecode], "shape": shape,
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def finite(v):
    return v == v and v not in (float("inf"), float("-inf"))


def mismatch(name, x, y, shape_x, shape_y, tol, same_nonfinite=False):
    """The first reason tensor `name` of GOT (`x`, `shape_x`) is not WANT's (`y`, `shape_y`)
    within `tol`, or None; and the relative error (0 on a mismatch of another kind)."""
    if list(shape_x) != list(shape_y):
        return f"{name}: shape {list(shape_x)}, want {list(shape_y)}", 0.0
    if len(x) != len(y):
        return f"{name}: {len(x)} elements, want {len(y)}", 0.0
    for i, (p, q) in enumerate(zip(x, y)):
        if not (finite(p) and finite(q)):
            same = (p != p and q != q) or p == q
            if not (same_nonfinite and same):
                return f"{name}: element {i} is {p}, want {q} (non-finite)", 0.0
    scale = max((abs(v) for v in y if finite(v)), default=0.0)
    worst, at = 0.0, -1
    for i, (p, q) in enumerate(zip(x, y)):
        if finite(p) and finite(q):
            d = abs(p - q)
            if d > worst:
                worst, at = d, i
    err = worst / scale if scale >= 1e-6 else worst
    if not err <= tol:
        return f"{name}: relative error {err:.3e} > {tol} (first worst at element {at})", err
    return None, err


def close(got, want, tol, same_nonfinite=False):
    a, b = load(got), load(want)
    missing = sorted(set(b) - set(a))
    extra = sorted(set(a) - set(b))
    if missing:
        sys.exit(f"{got}: no tensor {missing[0]!r} (WANT has it; missing: {missing})")
    if extra:
        sys.exit(f"{got}: tensor {extra[0]!r} is not in {want} (extra: {extra})")
    worst = 0.0
    for k in sorted(b):
        why, err = mismatch(k, a[k][1], b[k][1], a[k][0], b[k][0], tol, same_nonfinite)
        if why:
            sys.exit(why)
        worst = max(worst, err)
    print(f"close: {len(b)} tensors, worst relative error {worst:.2e}")


def header(artifact):
    raw = open(artifact, "rb").read()
    # "NNSX", version (u32), header length (u64), header checksum (u64), header.
    (n,) = struct.unpack("<Q", raw[8:16])
    return json.loads(raw[24:24 + n])


def warm_state(name, count, rng):
    """Warm optimizer state for input `name`, or None if it is not optimizer state."""
    if name.startswith("adam.m."):
        return [rng.gauss(0.0, 1e-3) for _ in range(count)]
    if name.startswith("adam.v."):
        return [rng.uniform(1e-6, 1e-5) for _ in range(count)]
    return None


def warm(path):
    t = load(path)
    rng = random.Random(0)
    n = 0
    for name in sorted(t):
        shape, arr = t[name]
        vals = warm_state(name, len(arr), rng)
        if vals is not None:
            t[name] = (shape, array.array("f", vals))
            n += 1
    save(path, t)
    print(f"warm: {n} optimizer state tensors in {path}")


def params(artifact, out):
    h = header(artifact)
    total = sum(count_of(p["global_shape"]) for p in h["inputs"])
    if total > 10_000_000:
        try:
            import numpy  # noqa: F401  (large models: drawn with numpy, seconds not minutes)
            return params_np(h, artifact, out)
        except ImportError:
            pass
    rng = random.Random(0)
    t = {}
    for p in h["inputs"]:
        shape = p["global_shape"]
        count = 1
        for d in shape:
            count *= d
        name = p["name"]
        state = warm_state(name, count, rng)
        if state is not None:
            t[name] = (shape, array.array("f", state))
            continue
        if not p["param"]:
            continue
        if "ln" in name and name.endswith(".weight"):
            vals = [1.0] * count
        elif name.endswith(".bias"):
            vals = [0.0] * count
        else:
            vals = [rng.gauss(0.0, 0.02) for _ in range(count)]
        t[name] = (shape, array.array("f", vals))
    save(out, t)
    print(f"params: {len(t)} tensors (parameters and optimizer state) for {artifact}")


def count_of(shape):
    n = 1
    for d in shape:
        n *= d
    return n


def save_np(path, tensors):
    """Writes numpy f32 arrays as safetensors, one array at a time."""
    header_, off = {}, 0
    for name in sorted(tensors):
        header_[name] = {"dtype": "F32", "shape": list(tensors[name].shape),
                         "data_offsets": [off, off + tensors[name].nbytes]}
        off += tensors[name].nbytes
    hb = json.dumps(header_).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb)
        for name in sorted(tensors):
            f.write(tensors[name].tobytes())


def params_np(h, artifact, out):
    """params() for large models, with numpy's generator (the same distributions, other
    draws): written tensor by tensor, never the whole file in memory twice."""
    import numpy as np
    rng = np.random.default_rng(0)
    t = {}
    for p in h["inputs"]:
        shape, name = p["global_shape"], p["name"]
        if name.startswith("adam.m."):
            t[name] = rng.normal(0.0, 1e-3, shape).astype(np.float32)
        elif name.startswith("adam.v."):
            t[name] = rng.uniform(1e-6, 1e-5, shape).astype(np.float32)
        elif not p["param"]:
            continue
        elif "ln" in name and name.endswith(".weight"):
            t[name] = np.ones(shape, np.float32)
        elif name.endswith(".bias"):
            t[name] = np.zeros(shape, np.float32)
        else:
            t[name] = rng.normal(0.0, 0.02, shape).astype(np.float32)
    save_np(out, t)
    print(f"params: {len(t)} tensors (parameters and optimizer state) for {artifact} (numpy)")


def inputs(artifact, out):
    h = header(artifact)
    if sum(count_of(p["global_shape"]) for p in h["inputs"]) > 1_000_000:
        try:
            import numpy as np
            rng = np.random.default_rng(0)
            t = {p["name"]: rng.uniform(-1, 1, p["global_shape"]).astype(np.float32) for p in h["inputs"]}
            save_np(out, t)
            print(f"inputs: {len(t)} tensors for {artifact} (numpy)")
            return
        except ImportError:
            pass
    rng = random.Random(0)
    t = {}
    for p in h["inputs"]:
        count = 1
        for d in p["global_shape"]:
            count *= d
        t[p["name"]] = (p["global_shape"], array.array("f", (rng.random() * 2 - 1 for _ in range(count))))
    save(out, t)
    print(f"inputs: {len(t)} tensors for {artifact}")


def covers(artifact, files):
    have = {}
    for f in files:
        raw = open(f, "rb").read(8)
        (n,) = struct.unpack("<Q", raw)
        with open(f, "rb") as fh:
            fh.seek(8)
            for name, info in json.loads(fh.read(n)).items():
                if name != "__metadata__":
                    have[name] = info["shape"]
    ins = header(artifact)["inputs"]
    for p in ins:
        if p["name"] not in have:
            sys.exit(f"{artifact}: no tensor '{p['name']}' in {', '.join(files)}")
        if have[p["name"]] != p["global_shape"]:
            sys.exit(f"{artifact}: '{p['name']}' is {have[p['name']]}, the program takes {p['global_shape']}")
    print(f"covers: {len(ins)} inputs of {artifact}")


def families(path):
    import csv
    import re
    fam, total = {}, 0.0
    with open(path, newline="") as f:
        lines = [ln for ln in f if ln.startswith('"') or ln[:1].isdigit() or ln.startswith("ID")]
    for r in csv.DictReader(lines):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        ns = float(r["Metric Value"].replace(",", ""))
        if r.get("Metric Unit") == "usecond":
            ns *= 1e3
        elif r.get("Metric Unit") == "msecond":
            ns *= 1e6
        name = re.sub(r"^[a-z]+[0-9]+_", "", r["Kernel Name"])
        name = "cuBLAS " + name[:40] if ("gemm" in name or "cutlass" in name or "cublas" in name) else name
        c, t = fam.get(name, (0, 0.0))
        fam[name] = (c + 1, t + ns)
        total += ns
    print(f"{path}: {sum(c for c, _ in fam.values())} launches, {total / 1e6:.3f} ms of kernels")
    for name, (c, t) in sorted(fam.items(), key=lambda x: -x[1][1])[:25]:
        print(f"  {name[:60]:60s} {c:5d} {t / 1e6:9.3f} ms {100 * t / max(total, 1):5.1f}%")


# Our kernel families (nnscaler-rt --profile's names) by the family of work PyTorch is
# timed on (torch_families.py); the first rule that matches. The optimizer's `sum`s and
# `mul`s are the clipping's squared norms (the biases' sums are `*_cols`).
SIDE_RULES = [
    (r"^(linear|linear_gemm|linear_weight_grad|linear_input_grad|matmul)$", "matrix products"),
    (r"^attention", "attention"),
    (r"^(layer_norm|rms_norm)", "layer norm"),
    (r"_cols(_parts|_total)?$", "bias gradients"),
    (r"^gelu", "gelu"),
    (r"^embedding", "embedding"),
    (r"^(cross_entropy|softmax_xent|pick|log_softmax)", "cross entropy"),
    (r"^(adamw|adamw_multi|clip_scale|sum|sum_parts|sum_total|mul)$", "optimizer"),
    (r"^(transpose|reshape|copy|microbatch)", "copies"),
    (r"", "elementwise"),
]


def side(profile_path, torch_path):
    import re
    ours, where = {}, {}
    rows = 0
    for line in open(profile_path):
        m = re.match(r"^(\S+)\s+([0-9.]+)\s+[0-9.]+%\s+([0-9]+)\s", line)
        if not m or line.startswith("profile:"):
            continue
        name, ms = m.group(1), float(m.group(2))
        rows += 1
        fam = next(f for rule, f in SIDE_RULES if re.search(rule, name))
        ours[fam] = ours.get(fam, 0.0) + ms
        where.setdefault(fam, []).append(name)
    if rows == 0:
        sys.exit(f"{profile_path}: no profile table (nnscaler-rt run --profile's output)")
    theirs = {}
    for line in open(torch_path):
        m = re.match(r"^([a-z ]+): ([0-9.]+) ms$", line.strip())
        if m and m.group(1) != "total":
            theirs[m.group(1)] = float(m.group(2))
    if not theirs:
        sys.exit(f"{torch_path}: no 'family: N ms' lines (torch_families.py's output)")
    fams = [f for _, f in SIDE_RULES]
    print(f"{'family':18s} {'ours ms':>10s} {'PyTorch ms':>11s} {'ours/PyTorch':>13s}  our kernel families")
    for f in fams:
        if f not in ours and f not in theirs:
            continue
        a, b = ours.get(f, 0.0), theirs.get(f)
        ratio = f"{a / b:.2f}" if b else "-"
        shown = "-" if b is None else f"{b:.3f}"
        print(f"{f:18s} {a:10.3f} {shown:>11s} {ratio:>13s}  {', '.join(where.get(f, [])) or '-'}")
    ta, tb = sum(ours.values()), sum(theirs.values())
    print(f"{'total':18s} {ta:10.3f} {tb:11.3f} {ta / tb if tb else 0:13.2f}")


# check.sh's artifacts of the timed steps: (workload, precision).
SUMMARY_STEPS = {
    "nanogpt-gpu-step.nnsx": ("nanoGPT GPU config", "fp32"),
    "nanogpt-gpu-bf16-step.nnsx": ("nanoGPT GPU config", "bf16"),
    "gpt2-step.nnsx": ("GPT-2 124M B8 T1024", "fp32"),
    "gpt2-bf16-step.nnsx": ("GPT-2 124M B8 T1024", "bf16"),
    "nanogpt-gpu-act-step.nnsx": ("nanoGPT GPU config", "bf16 activations"),
}


def train(path, steps, goal, tokens):
    import json
    try:
        lines = [json.loads(l) for l in open(path)]
    except OSError as e:
        print(f"train: {e}")
        sys.exit(1)
    runs = [l for l in lines if l["kind"] == "step"]
    evals = [l for l in lines if l["kind"] == "eval"]
    if not runs:
        print(f"train: {path} has no steps")
        sys.exit(1)
    for e in evals:
        print(f"step {e['step']:5d}: train loss {e['loss']:.4f}, val loss {e['val_loss']:.4f}")
    # A step's tokens over its tokens/s: its seconds (the first steps load the kernels).
    rates = sorted(l["tokens_per_s"] for l in runs[min(5, len(runs) - 1):] if l.get("tokens_per_s"))
    rate = rates[len(rates) // 2]
    done = runs[-1]["step"]
    step = tokens / rate
    print(f"{len(runs)} steps logged (last {done} of {steps}); median step {step * 1e3:.1f} ms ({rate:.0f} tokens/s); all {steps} steps: {steps * step / 60:.1f} min of steps")
    if evals:
        last = evals[-1]
        if last["step"] >= steps:
            verdict = "reached" if last["val_loss"] <= goal else "MISSED"
            print(f"final val loss {last['val_loss']:.4f}: {verdict} the goal {goal}")
        else:
            print(f"stopped at step {last['step']} of {steps} (val loss {last['val_loss']:.4f}); the goal {goal} is judged at step {steps}")


def summary(path):
    import re
    rows = {k: {} for k in SUMMARY_STEPS.values()}
    last = None
    models = list(dict.fromkeys(m for m, _ in SUMMARY_STEPS.values()))
    user_model = -1
    for line in open(path, errors="replace"):
        line = line.strip()
        m = re.match(r"^(graph|tf32): ran (\S+) on the GPU .* in ([0-9.]+) s \(median", line)
        if m and m.group(2) in SUMMARY_STEPS:
            rows[SUMMARY_STEPS[m.group(2)]][m.group(1)] = float(m.group(3)) * 1e3
            continue
        m = re.match(r"^ran (\S+) on the GPU .* in ([0-9.]+) s \(median", line)
        if m and m.group(1) in SUMMARY_STEPS:
            last = SUMMARY_STEPS[m.group(1)]
            rows[last]["ours"] = float(m.group(2)) * 1e3
            continue
        m = re.match(r"^pytorch eager step( \(autocast bf16\))? ([0-9.]+) s$", line)
        if m and last is not None:
            key = (last[0], "bf16" if m.group(1) else "fp32")
            rows[key]["eager"] = float(m.group(2)) * 1e3
            continue
        # torch_user.py prints torch's version first, once per model (nanoGPT, then GPT-2).
        if re.match(r"^[0-9]+\.[0-9]+\.[0-9]+\S* ", line):
            user_model += 1
            continue
        m = re.match(r"^user-torch (.+): step ([0-9.]+) ms", line)
        if m and 0 <= user_model < len(models):
            name, ms = m.group(1), float(m.group(2))
            model = models[user_model]
            if name.startswith("eager fp32 (TF32 off"):
                rows[(model, "fp32")]["user"] = ms
            elif name.startswith("eager bf16"):
                rows[(model, "bf16")]["user"] = ms
            elif name.startswith("torch.compile bf16"):
                rows[(model, "bf16")]["compile"] = ms
    # Every activation in bf16 is timed against PyTorch's autocast, as the bf16 row is.
    for (model, prec), r in rows.items():
        if prec == "bf16 activations":
            for k in ("eager", "user", "compile"):
                r.setdefault(k, rows.get((model, "bf16"), {}).get(k))
    cell = lambda v: "-" if v is None else f"{v:.1f}"
    ratio = lambda a, b: "-" if a is None or not b else f"{a / b:.2f}"
    print(f"{'workload':32s} {'ours ms':>9s} {'eager ms':>9s} {'ratio':>6s} {'module ms':>10s} {'ratio':>6s} {'compile ms':>11s} {'ratio':>6s} {'graph ms':>9s} {'tf32 ms':>8s}")
    for (model, prec), r in rows.items():
        o = r.get("ours")
        print(f"{model + ', ' + prec:32s} {cell(o):>9s} {cell(r.get('eager')):>9s} {ratio(o, r.get('eager')):>6s} "
              f"{cell(r.get('user')):>10s} {ratio(o, r.get('user')):>6s} {cell(r.get('compile')):>11s} {ratio(o, r.get('compile')):>6s} "
              f"{cell(r.get('graph')):>9s} {cell(r.get('tf32')):>8s}")
    print("eager: torch_ref.py (the same model, TF32 off; bf16: autocast); module: torch_user.py (nn.Module with SDPA; bf16: autocast + fused AdamW); "
          "graph: ours replayed as a CUDA graph (--graph); tf32: ours with --matmul-precision high")


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "close":
        flags = [x for x in sys.argv[5:] if x.startswith("--")]
        if len(sys.argv) < 5 or set(flags) - {"--same-nonfinite"} or len(sys.argv) - len(flags) != 5:
            sys.exit(__doc__)
        close(sys.argv[2], sys.argv[3], float(sys.argv[4]), "--same-nonfinite" in flags)
    elif cmd == "params":
        params(sys.argv[2], sys.argv[3])
    elif cmd == "inputs":
        inputs(sys.argv[2], sys.argv[3])
    elif cmd == "warm":
        warm(sys.argv[2])
    elif cmd == "families":
        families(sys.argv[2])
    elif cmd == "covers":
        covers(sys.argv[2], sys.argv[3:])
    elif cmd == "summary" and len(sys.argv) == 3:
        summary(sys.argv[2])
    elif cmd == "train" and len(sys.argv) == 6:
        train(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), int(sys.argv[5]))
    elif cmd == "side" and len(sys.argv) == 4:
        side(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
