"""Helpers for bench/gpu/check.sh, in plain Python (no numpy needed on the GPU machine).

  compare.py close GOT WANT TOL     every tensor of GOT equals WANT's within TOL relative to
                                    WANT's largest magnitude; prints the worst, exits 1 if not
  compare.py params ARTIFACT OUT    random parameters for an artifact's param inputs
                                    (normal(0, 0.02); norm weights 1, biases 0), seed 0
  compare.py inputs ARTIFACT OUT    uniform(-1, 1) values for every f32 input, seed 0
  compare.py warm FILE              the optimizer state in FILE (adam.m.*, adam.v.*) made
                                    warm, in place, seed 0
  compare.py covers ARTIFACT FILE.. the files hold every input of the artifact, with its
                                    shape (exits 1 naming the first that is missing)

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


def close(got, want, tol):
    a, b = load(got), load(want)
    if sorted(a) != sorted(b):
        sys.exit(f"names differ: {sorted(set(a) ^ set(b))}")
    worst = 0.0
    for k in b:
        x, y = a[k][1], b[k][1]
        scale = max((abs(v) for v in y), default=0.0)
        diff = max((abs(p - q) for p, q in zip(x, y)), default=0.0)
        err = diff / scale if scale >= 1e-6 else diff
        worst = max(worst, err)
        if err > tol:
            sys.exit(f"{k}: relative error {err:.3e} > {tol}")
    print(f"close: {len(b)} tensors, worst relative error {worst:.2e}")


def header(artifact):
    raw = open(artifact, "rb").read()
    (n,) = struct.unpack("<Q", raw[8:16])
    return json.loads(raw[16:16 + n])


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


def inputs(artifact, out):
    h = header(artifact)
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


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "close":
        close(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    elif cmd == "params":
        params(sys.argv[2], sys.argv[3])
    elif cmd == "inputs":
        inputs(sys.argv[2], sys.argv[3])
    elif cmd == "warm":
        warm(sys.argv[2])
    elif cmd == "covers":
        covers(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
