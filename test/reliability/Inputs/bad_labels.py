"""Writes input files with one out-of-range label or token: bad_labels.py OUT_DIR ORACLE_DIR."""
import sys

sys.path.insert(0, sys.argv[2])
import numpy as np  # noqa: E402
import st  # noqa: E402

out = sys.argv[1]
r = np.random.default_rng(0)
x = r.standard_normal((8, 16)).astype(np.float32)
for bad in (10, -1, 99):
    labels = r.integers(0, 10, (8,))
    labels[3] = bad
    st.save(f"{out}/mlp-{bad}.safetensors", {"x": x, "labels": labels})
tokens, targets = r.integers(0, 12, (4, 8)), r.integers(0, 12, (4, 8))
bad_tokens = tokens.copy()
bad_tokens[1, 2] = 12
st.save(f"{out}/gpt-token.safetensors", {"tokens": bad_tokens, "targets": targets})
bad_targets = targets.copy()
bad_targets[2, 5] = 40
st.save(f"{out}/gpt-target.safetensors", {"tokens": tokens, "targets": bad_targets})
