"""Helpers for bench/gpu/check.sh, in plain Python (no numpy needed on the GPU machine).

  compare.py close GOT WANT TOL     every tensor of GOT equals WANT's within TOL relative to
                                    WANT's largest magnitude; prints the worst, exits 1 if not
  compare.py params ARTIFACT OUT    random parameters for an artifact's param inputs
                                    (normal(0, 0.02); norm weights 1, biases 0), seed 0
  compare.py inputs ARTIFACT OUT    uniform(-1, 1) values for every f32 input, seed 0
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


def params(artifact, out):
    h = header(artifact)
    rng = random.Random(0)
    t = {}
    for p in h["inputs"]:
        if not p["param"]:
            continue
        shape = p["global_shape"]
        count = 1
        for d in shape:
            count *= d
        name = p["name"]
        if "ln" in name and name.endswith(".weight"):
            vals = [1.0] * count
        elif name.endswith(".bias"):
            vals = [0.0] * count
        else:
            vals = [rng.gauss(0.0, 0.02) for _ in range(count)]
        t[name] = (shape, array.array("f", vals))
    save(out, t)
    print(f"params: {len(t)} tensors for {artifact}")


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


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "close":
        close(sys.argv[2], sys.argv[3], float(sys.argv[4]))
    elif cmd == "params":
        params(sys.argv[2], sys.argv[3])
    elif cmd == "inputs":
        inputs(sys.argv[2], sys.argv[3])
    else:
        sys.exit(__doc__)
