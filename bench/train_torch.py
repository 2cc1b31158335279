"""PyTorch doing nnscaler train's steps on the nanoGPT CPU config, for bench/train.sh:
the same model (test/oracle/models.py's gpt), AdamW (betas 0.9/0.99, weight decay 0.1 on
matrices), clipping at 1, batch 12 x block 64 of tinyshakespeare ids, single-threaded.

usage: train_torch.py DATA_DIR STEPS   prints 'tokens/s N'
"""
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test", "oracle"))
import models  # noqa: E402


def main(data_dir, steps):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    vocab = json.load(open(os.path.join(data_dir, "meta.json")))["vocab_size"]
    ids = np.fromfile(os.path.join(data_dir, "train.bin"), dtype="<u2").astype(np.int64)
    c = {"layers": 4, "heads": 4}
    width, block, batch = 128, 64, 12
    p = models.gpt_params(vocab, width, block, c["layers"])
    decay = [v for v in p.values() if v.dim() >= 2]
    plain = [v for v in p.values() if v.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": plain, "weight_decay": 0.0}],
                            lr=1e-3, betas=(0.9, 0.99))
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for _ in range(steps):
        off = rng.integers(0, len(ids) - block - 1, batch)
        x = torch.from_numpy(np.stack([ids[o:o + block] for o in off]))
        y = torch.from_numpy(np.stack([ids[o + 1:o + block + 1] for o in off]))
        loss = models.gpt(p, {"tokens": x, "targets": y}, c)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(p.values()), 1.0)
        opt.step()
    secs = time.perf_counter() - start
    print(f"tokens/s {steps * batch * block / secs:.0f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
