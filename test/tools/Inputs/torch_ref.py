"""torch_ref.py FILE.py:FACTORY PARAMS.safetensors BATCH_OUT WANT_OUT NAME=SHAPE:DTYPE...

PyTorch's loss and gradients for a module `nnscaler import torch` imported: the module
made by FACTORY with the parameters the importer wrote (PARAMS), on seeded inputs
(floats normal, integers below 10, which every test model's tables and classes exceed);
writes the inputs (BATCH_OUT) and `loss` with `grad.<param>` (WANT_OUT), as `nnscaler run
--autodiff` names them."""
import importlib.util
import json
import os
import struct
import sys

import numpy as np
import torch


def load(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        dt = {"F32": np.float32, "I64": np.int64}[v["dtype"]]
        out[k] = torch.from_numpy(np.frombuffer(raw[8 + n + a:8 + n + b], dtype=dt).reshape(v["shape"]).copy())
    return out


def save(path, tensors):
    header, blobs, off = {}, [], 0
    for k, t in tensors.items():
        a = t.detach().contiguous().numpy()
        dt = {np.dtype(np.float32): "F32", np.dtype(np.int64): "I64"}[a.dtype]
        data = a.tobytes()
        header[k] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(data)]}
        blobs.append(data)
        off += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


spec, params_path, batch_out, want_out = sys.argv[1:5]
path, _, name = spec.rpartition(":")
sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
m = importlib.util.spec_from_file_location("models", path)
mod = importlib.util.module_from_spec(m)
m.loader.exec_module(mod)
model = getattr(mod, name)()
params = load(params_path)
with torch.no_grad():
    for k, p in model.named_parameters():
        p.copy_(params[k])
gen = torch.Generator().manual_seed(5)
inputs = {}
for spec_ in sys.argv[5:]:
    n, _, rest = spec_.partition("=")
    shape, _, dtype = rest.rpartition(":")
    dims = [int(d) for d in shape.split("x")]
    if dtype == "f32":
        inputs[n] = torch.randn(dims, generator=gen)
    else:
        inputs[n] = torch.randint(0, 10, dims, generator=gen)
loss = model(*inputs.values())
loss.backward()
want = {"loss": loss.detach()}
for k, p in model.named_parameters():
    want["grad." + k] = p.grad
save(batch_out, inputs)
save(want_out, want)
print(f"torch_ref: loss {loss.item():.6f}, {len(want) - 1} gradients")
