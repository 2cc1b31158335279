"""Minimal safetensors reader/writer (numpy), so the oracle scripts need only torch+numpy."""
import json
import struct

import numpy as np

_DT = {"F32": np.float32, "I64": np.int64, "I32": np.int32, "F64": np.float64}
_NAME = {np.dtype(v): k for k, v in _DT.items()}


def load(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        a, b = info["data_offsets"]
        arr = np.frombuffer(raw[base + a : base + b], dtype=_DT[info["dtype"]])
        out[name] = arr.reshape(info["shape"]).copy()
    return out


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        arr = np.asarray(tensors[name])
        data = arr.tobytes()
        header[name] = {
            "dtype": _NAME[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [off, off + len(data)],
        }
        blobs.append(data)
        off += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
