"""torch.optim.AdamW with clip_grad_norm_, the oracle of the optimizer ops.

usage: adamw.py DIR   (DIR/config.json: {"steps", "beta1", "beta2", "eps", "weight_decay",
"clip", "lr": [per step]}; DIR/params.safetensors the initial parameters; DIR/grads.safetensors
the gradient of each parameter at each step, "<t>.<name>" for t = 1..steps). Parameters of
rank >= 2 get the weight decay, the others none. Writes DIR/torch.safetensors with the
parameters after every step, "<t>.<name>".
"""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402


def main(d):
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    torch.set_num_threads(1)
    params = {k: torch.nn.Parameter(torch.from_numpy(v))
              for k, v in st.load(os.path.join(d, "params.safetensors")).items()}
    grads = st.load(os.path.join(d, "grads.safetensors"))
    names = sorted(params)
    decay = [params[n] for n in names if params[n].dim() >= 2]
    plain = [params[n] for n in names if params[n].dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": c["weight_decay"]},
         {"params": plain, "weight_decay": 0.0}],
        lr=c["lr"][0], betas=(c["beta1"], c["beta2"]), eps=c["eps"])
    out = {}
    for t in range(1, c["steps"] + 1):
        for g in opt.param_groups:
            g["lr"] = c["lr"][t - 1]
        for n in names:
            params[n].grad = torch.from_numpy(grads[f"{t}.{n}"]).clone()
        if c["clip"] > 0:
            torch.nn.utils.clip_grad_norm_([params[n] for n in names], c["clip"])
        opt.step()
        for n in names:
            out[f"{t}.{n}"] = params[n].detach().numpy().copy()
    st.save(os.path.join(d, "torch.safetensors"), out)


if __name__ == "__main__":
    main(sys.argv[1])
