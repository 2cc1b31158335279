"""PyTorch evaluation of elementwise formulas as `nnscaler emit-torch` writes them.

usage: formulas.py DIR   (DIR/manifest.json lists the cases written by
tools/tests/integration/oracle_ops.rs: each an id and a PyTorch expression over x0, x1)

For case N, reads DIR/caseN.in.safetensors (operands x0, x1, ... as float32), evaluates the
expression in float32 and writes DIR/caseN.torch.safetensors with y.
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402


def main(d):
    with open(os.path.join(d, "manifest.json")) as f:
        cases = json.load(f)
    for c in cases:
        xs = st.load(os.path.join(d, f"case{c['id']}.in.safetensors"))
        scope = {"torch": torch}
        scope.update({k: torch.from_numpy(v) for k, v in xs.items()})
        y = eval(c["expr"], scope)  # noqa: S307 (the test's own expressions)
        y = torch.as_tensor(y, dtype=torch.float32).broadcast_to(xs["x0"].shape)
        st.save(os.path.join(d, f"case{c['id']}.torch.safetensors"), {"y": y.numpy()})


if __name__ == "__main__":
    main(sys.argv[1])
