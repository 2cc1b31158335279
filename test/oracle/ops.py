"""PyTorch reference for single dnn ops: forward results and gradients.

usage: ops.py DIR   (DIR/manifest.json lists the cases written by tools/tests/oracle.rs)

For case N, reads DIR/caseN.in.safetensors (operands x0, x1, ... and result weights w0,
w1, ...), computes y_i = op(x...), loss = sum_i sum(y_i * w_i) and its gradient with
respect to every float operand, and writes DIR/caseN.torch.safetensors with y0.., loss
and grad.x0...
"""
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import st  # noqa: E402


def rotary(x, theta, sign=1.0):
    s, d = x.shape[2], x.shape[3]
    half = d // 2
    inv = torch.tensor([theta ** (-2.0 * j / d) for j in range(half)], dtype=torch.float64)
    ang = torch.arange(s, dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = ang.cos().float(), (sign * ang.sin()).float()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def attention(q, k, v, causal, scale):
    h, g = q.shape[1], k.shape[1]
    if g != h:
        k = k.repeat_interleave(h // g, dim=1)
        v = v.repeat_interleave(h // g, dim=1)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril()
        s = s.masked_fill(~mask, float("-inf"))
    return s.softmax(-1) @ v


def apply(op, a, x):
    g = a.get
    if op == "matmul":
        p, q = x
        if g("transpose_a"):
            p = p.transpose(-1, -2)
        if g("transpose_b"):
            q = q.transpose(-1, -2)
        return [p @ q]
    if op == "linear":
        return [F.linear(*x)]
    simple = {
        "add": torch.add, "sub": torch.sub, "mul": torch.mul, "div": torch.div,
        "neg": torch.neg, "exp": torch.exp, "log": torch.log, "sqrt": torch.sqrt,
        "rsqrt": torch.rsqrt, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "silu": F.silu, "relu": F.relu,
        "abs": torch.abs,
    }
    if op in simple:
        return [simple[op](*x)]
    if op == "gelu":
        return [F.gelu(x[0], approximate=g("approximate", "none"))]
    if op == "softmax":
        return [x[0].softmax(g("dim", -1))]
    if op == "log_softmax":
        return [x[0].log_softmax(g("dim", -1))]
    if op == "layer_norm":
        return [F.layer_norm(x[0], x[0].shape[-1:], x[1], x[2], g("eps", 1e-5))]
    if op == "rms_norm":
        t = x[0]
        return [t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + g("eps", 1e-5)) * x[1]]
    if op == "embedding":
        return [F.embedding(x[0], x[1])]
    if op == "reshape":
        return [x[0].reshape(g("shape"))]
    if op == "transpose":
        return [x[0].permute(g("perm"))]
    if op == "slice":
        return [x[0].narrow(g("dim"), g("start"), g("end") - g("start"))]
    if op == "pad":
        t, d = x[0], g("dim") % x[0].dim()
        pads = [0, 0] * (t.dim() - 1 - d) + [g("before"), g("after")]
        return [F.pad(t, pads)]
    if op == "concat":
        return [torch.cat(x, g("dim"))]
    if op == "split":
        return list(torch.split(x[0], g("sizes"), g("dim")))
    if op in ("sum", "mean", "max"):
        f = {"sum": torch.sum, "mean": torch.mean, "max": torch.amax}[op]
        return [f(x[0], dim=g("dims"), keepdim=bool(g("keepdim", False)))]
    if op == "broadcast_to":
        return [x[0].expand(g("shape"))]
    if op == "attention":
        return [attention(*x, bool(g("causal", False)), g("scale"))]
    if op == "rotary":
        return [rotary(x[0], g("theta", 10000.0))]
    if op == "cross_entropy":
        # [tokens.., classes] logits: every leading dim is a token.
        return [F.cross_entropy(x[0].reshape(-1, x[0].shape[-1]), x[1].reshape(-1))]
    if op == "pick":
        return [x[0].gather(-1, x[1][..., None])[..., 0]]
    raise SystemExit(f"ops.py: no reference for dnn.{op}")


def main(d):
    with open(os.path.join(d, "manifest.json")) as f:
        cases = json.load(f)
    torch.set_num_threads(1)
    for c in cases:
        data = st.load(os.path.join(d, f"case{c['id']}.in.safetensors"))
        xs = []
        for i in range(c["operands"]):
            t = torch.from_numpy(data[f"x{i}"])
            if t.is_floating_point():
                t.requires_grad_(True)
            xs.append(t)
        ys = apply(c["op"][4:], c["attrs"], xs)
        loss = sum((y * torch.from_numpy(data[f"w{i}"])).sum() for i, y in enumerate(ys))
        out = {f"y{i}": y.detach().numpy() for i, y in enumerate(ys)}
        out["loss"] = loss.detach().numpy()
        floats = [t for t in xs if t.requires_grad]
        if floats:
            grads = torch.autograd.grad(loss, floats, allow_unused=True)
            k = 0
            for i, t in enumerate(xs):
                if t.requires_grad:
                    gr = grads[k]
                    k += 1
                    out[f"grad.x{i}"] = (torch.zeros_like(t) if gr is None else gr).numpy()
        st.save(os.path.join(d, f"case{c['id']}.torch.safetensors"),
                out)


if __name__ == "__main__":
    main(sys.argv[1])
