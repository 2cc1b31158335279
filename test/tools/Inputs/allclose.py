"""allclose.py A B TOL ORACLE_DIR [--same-nonfinite]: every tensor of A equals B's within
TOL relative to B's largest finite magnitude (absolutely where that is below 1e-6), with the
same names, shapes and dtypes. A NaN or infinity in either fails, unless --same-nonfinite is
given and both hold the same one at the same place. Prints the worst error; exits 1 naming
the tensor and the first bad index on a mismatch, a missing or an extra tensor."""
import sys

import numpy as np

sys.path.insert(0, sys.argv[4])
import st  # noqa: E402

a, b, tol = st.load(sys.argv[1]), st.load(sys.argv[2]), float(sys.argv[3])
same_nonfinite = "--same-nonfinite" in sys.argv[5:]
missing, extra = sorted(set(b) - set(a)), sorted(set(a) - set(b))
if missing:
    sys.exit(f"{sys.argv[1]}: no tensor {missing[0]!r} (missing: {missing})")
if extra:
    sys.exit(f"{sys.argv[1]}: tensor {extra[0]!r} is not in {sys.argv[2]} (extra: {extra})")
worst = 0.0
for k in sorted(b):
    x, y = a[k], b[k]
    if x.shape != y.shape:
        sys.exit(f"{k}: shape {list(x.shape)}, want {list(y.shape)}")
    if x.dtype.kind != y.dtype.kind:
        sys.exit(f"{k}: dtype {x.dtype}, want {y.dtype}")
    x, y = x.astype(np.float64).ravel(), y.astype(np.float64).ravel()
    bad = ~(np.isfinite(x) & np.isfinite(y))
    if same_nonfinite:
        bad &= ~((np.isnan(x) & np.isnan(y)) | (x == y))
    if bad.any():
        i = int(np.argmax(bad))
        sys.exit(f"{k}: element {i} is {x[i]}, want {y[i]} (non-finite)")
    ok = np.isfinite(x) & np.isfinite(y)
    scale = float(np.abs(y[ok]).max()) if ok.any() else 0.0
    d = np.abs(x[ok] - y[ok])
    diff = float(d.max()) if d.size else 0.0
    # A reference that is all rounding noise (a mathematically zero gradient) is compared
    # absolutely.
    err = diff / scale if scale >= 1e-6 else diff
    worst = max(worst, err)
    if not err <= tol:
        i = int(np.flatnonzero(ok)[int(np.argmax(d))])
        sys.exit(f"{k}: relative error {err:.3e} > {tol} (largest at element {i})")
print(f"allclose: {len(b)} tensors, worst relative error {worst:.2e}")
