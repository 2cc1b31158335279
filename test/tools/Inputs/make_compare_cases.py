"""make_compare_cases.py ORACLE_DIR: writes the files compare-helpers.test compares: a
reference and, beside it, results that must fail (all NaN, one NaN, an infinity, another
shape, a missing and an extra tensor) or pass (a rounding apart; the same NaN on both sides,
which passes only when allowed)."""
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
import st  # noqa: E402

want = {"w": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
        "b": np.array([0.5, -0.25, 2.0], dtype=np.float32)}
st.save("want.safetensors", want)
cases = {
    "close": {"w": want["w"] * np.float32(1 + 1e-7), "b": want["b"]},
    "allnan": {k: np.full_like(v, np.nan) for k, v in want.items()},
    "onenan": {"w": want["w"].copy(), "b": np.array([0.5, np.nan, 2.0], dtype=np.float32)},
    "inf": {"w": want["w"].copy(), "b": np.array([0.5, -0.25, np.inf], dtype=np.float32)},
    "shape": {"w": want["w"].reshape(4, 3), "b": want["b"]},
    "length": {"w": want["w"], "b": want["b"][:2]},
    "missing": {"w": want["w"]},
    "extra": {"w": want["w"], "b": want["b"], "c": want["b"]},
}
for name, t in cases.items():
    st.save(f"{name}.safetensors", t)
nan = {"w": want["w"], "b": np.array([0.5, np.nan, 2.0], dtype=np.float32)}
st.save("nan-want.safetensors", nan)
st.save("nan-got.safetensors", {k: v.copy() for k, v in nan.items()})
