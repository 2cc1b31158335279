"""Writes the safetensors files of run-cli.test into DIR."""
import os
import sys

import numpy as np

sys.path.insert(0, sys.argv[2])
import st  # noqa: E402

d = sys.argv[1]
r = np.random.default_rng(0)
x = r.standard_normal((8, 16)).astype(np.float32)
labels = r.integers(0, 10, 8).astype(np.int64)
st.save(os.path.join(d, "in.safetensors"), {"x": x, "labels": labels})
st.save(os.path.join(d, "missing.safetensors"), {"x": x})
st.save(os.path.join(d, "extra.safetensors"), {"x": x, "labels": labels, "y": x})
st.save(os.path.join(d, "shape.safetensors"), {"x": x[:4], "labels": labels})
st.save(os.path.join(d, "dtype.safetensors"), {"x": x.astype(np.float64), "labels": labels})
st.save(os.path.join(d, "nan.safetensors"), {"x": np.full((8, 16), np.nan, np.float32), "labels": labels})
st.save(os.path.join(d, "badlabel.safetensors"), {"x": x, "labels": np.full(8, 12, np.int64)})
with open(os.path.join(d, "in.safetensors"), "rb") as f:
    raw = f.read()
with open(os.path.join(d, "truncated.safetensors"), "wb") as f:
    f.write(raw[: len(raw) - 10])
# A header naming tensor 'x' twice (JSON parsers would keep the second silently).
xb, lb = x.tobytes(), labels.tobytes()
entry = lambda a, b, shape, dt: '{"dtype":"%s","shape":%s,"data_offsets":[%d,%d]}' % (dt, shape, a, b)
n = len(xb)
header = '{"labels":%s,"x":%s,"x":%s}' % (
    entry(0, len(lb), "[8]", "I64"),
    entry(len(lb), len(lb) + n, "[8,16]", "F32"),
    entry(len(lb) + n, len(lb) + 2 * n, "[8,16]", "F32"),
)
header += " " * (-len(header) % 8)
with open(os.path.join(d, "dupkey.safetensors"), "wb") as f:
    f.write(len(header).to_bytes(8, "little") + header.encode() + lb + xb + xb)
