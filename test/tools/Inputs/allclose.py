"""allclose.py A B TOL ORACLE_DIR: every tensor of A equals B's within TOL relative to B's
largest magnitude (absolutely where B is below 1e-6 everywhere); prints the worst error, exits 1 on a mismatch or a missing name."""
import sys

import numpy as np

sys.path.insert(0, sys.argv[4])
import st  # noqa: E402

a, b, tol = st.load(sys.argv[1]), st.load(sys.argv[2]), float(sys.argv[3])
if sorted(a) != sorted(b):
    sys.exit(f"names differ: {sorted(a)} vs {sorted(b)}")
worst = 0.0
for k in a:
    scale = float(np.abs(b[k]).max()) if b[k].size else 0.0
    diff = float(np.abs(a[k].astype(np.float64) - b[k]).max()) if b[k].size else 0.0
    # A reference that is all rounding noise (a mathematically zero gradient) is compared
    # absolutely.
    err = diff / scale if scale >= 1e-6 else diff
    worst = max(worst, err)
    if err > tol:
        sys.exit(f"{k}: relative error {err:.3e} > {tol}")
print(f"allclose: {len(a)} tensors, worst relative error {worst:.2e}")
