"""compare.py A.safetensors B.safetensors: every tensor of B equals A's within 1e-5
relative to its largest magnitude, with the same names and shapes; a NaN or infinity on
either side fails; prints the worst error."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "oracle"))
import numpy as np  # noqa: E402
import st  # noqa: E402

a, b = st.load(sys.argv[1]), st.load(sys.argv[2])
assert sorted(a) == sorted(b), (sorted(a), sorted(b))
worst = 0.0
for k in b:
    assert a[k].shape == b[k].shape, f"{k}: shape {a[k].shape}, want {b[k].shape}"
    assert np.isfinite(a[k]).all() and np.isfinite(b[k]).all(), f"{k}: a non-finite value"
    err = float(np.abs(a[k] - b[k]).max() / max(np.abs(b[k]).max(), 1e-30))
    assert err <= 1e-5, f"{k}: relative error {err:.2e}"
    worst = max(worst, err)
print(f"equal within 1e-5 (worst {worst:.1e})")
