"""The custom-op example against PyTorch: loss and gradients of
examples/custom-op/linear-gelu.mlir (a user op linear+gelu, then a linear and a
cross-entropy), computed by `nnscaler run --autodiff` through the derived VJP function.

  torch_check.py write DIR      -> DIR/batch.safetensors, DIR/params.safetensors
  torch_check.py check DIR      -> compares DIR/out.safetensors with PyTorch
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "oracle"))
import numpy as np  # noqa: E402
import st  # noqa: E402

cmd, d = sys.argv[1], sys.argv[2]
rng = np.random.default_rng(7)
x = rng.standard_normal((8, 16)).astype(np.float32)
labels = rng.integers(0, 4, (8,)).astype(np.int64)
w1 = (0.3 * rng.standard_normal((32, 16))).astype(np.float32)
w2 = (0.3 * rng.standard_normal((4, 32))).astype(np.float32)
if cmd == "write":
    st.save(os.path.join(d, "batch.safetensors"), {"x": x, "labels": labels})
    st.save(os.path.join(d, "params.safetensors"), {"fc1.weight": w1, "fc2.weight": w2})
    sys.exit(0)
import torch  # noqa: E402

t1 = torch.tensor(w1, dtype=torch.float64, requires_grad=True)
t2 = torch.tensor(w2, dtype=torch.float64, requires_grad=True)
h = torch.nn.functional.gelu(torch.tensor(x, dtype=torch.float64) @ t1.T)
loss = torch.nn.functional.cross_entropy(h @ t2.T, torch.tensor(labels))
loss.backward()
got = st.load(os.path.join(d, "out.safetensors"))
worst = 0.0
for name, want in [("loss", loss.detach().numpy()), ("grad.fc1.weight", t1.grad.numpy()),
                   ("grad.fc2.weight", t2.grad.numpy())]:
    assert got[name].shape == want.shape, f"{name}: shape {got[name].shape}, want {want.shape}"
    assert np.isfinite(got[name]).all(), f"{name}: a non-finite value"
    err = float(np.abs(got[name] - want).max() / max(np.abs(want).max(), 1e-30))
    worst = max(worst, err)
    assert err < 1e-5, f"{name}: relative error {err:.2e}"
print(f"custom op matches PyTorch: worst relative error {worst:.1e}")
