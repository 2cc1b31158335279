"""PyTorch implementations of the zoo models (MLP, GPT, Llama), written independently of
nnscaler, for the whole-model oracle test.

usage: models.py DIR   (DIR/config.json: {"family": ..., sizes...}; DIR/params.safetensors
and DIR/inputs.safetensors hold the weights and the batch). Writes DIR/torch.safetensors
with "loss" and "grad.<param>" for every parameter.

With "precision": "bf16" in the config, the matrix products (linear layers, attention) run
on bf16-rounded operands and their results are rounded to bf16 (f32 arithmetic in between,
as a GPU GEMM accumulates), the recipe of nnscaler's --autocast=bf16, written here with
PyTorch's own casts: their autograd rounds the gradients at the same places. The f32
results are written too, as "f32.loss" and "f32.grad.<param>", so that a test can show how
far bf16 is from f32.

With "precision": "bf16-activations" every activation is rounded to bf16 as well, where
nnscaler's --autocast="bf16 activations=bf16" rounds it: each op's result (an embedding, a
norm, an activation function, a residual add, a rotation, a product) and each use of a
parameter; the logits stay f32 for the loss. Reshapes and transposes move bf16 values
exactly, so they need no rounding.
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F



# The precision of the matrix products, and of every activation: main() sets them from the
# config.
BF16 = False
ACT = False


def bf(t):
    """t rounded to bfloat16 (kept f32) when BF16; the backward rounds the gradient too."""
    return t.to(torch.bfloat16).to(torch.float32) if BF16 else t


def act(t):
    """t rounded to bfloat16 when every activation is (ACT): an op's result, or a
    parameter at its use."""
    return t.to(torch.bfloat16).to(torch.float32) if ACT else t


class _RoundGrad(torch.autograd.Function):
    """The identity, whose gradient is rounded to bfloat16."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return g.to(torch.bfloat16).to(torch.float32)


def use(t):
    """One use of an activation read more than once (ACT): nnscaler's backward rounds the
    gradient each use sends back before summing them in bf16, where autograd would sum them
    in f32 and round once at the producer."""
    return _RoundGrad.apply(t) if ACT else t


class _Fan(torch.autograd.Function):
    """n uses of one value whose gradients are summed as nnscaler's backward sums them
    in bf16 (ACT): the last use's with the one before it, rounded, then each earlier one,
    rounded (the order --autodiff visits the uses, from the last)."""

    @staticmethod
    def forward(ctx, t, n):
        return tuple(t.view_as(t) for _ in range(n))

    @staticmethod
    def backward(ctx, *gs):
        r = lambda x: x.to(torch.bfloat16).to(torch.float32)  # noqa: E731
        total = r(gs[-1])
        for g in reversed(gs[:-1]):
            total = r(total + r(g))
        return total, None


def fan(t, n):
    """n uses of t (ACT: their gradients summed as nnscaler's backward sums them)."""
    return _Fan.apply(t, n) if ACT else (t,) * n


def lin(x, w, b=None):
    return bf(F.linear(bf(x), bf(w), None if b is None else bf(b)))


def attention(q, k, v):
    """Causal attention; grouped-query when k and v have fewer heads than q (each key/value
    head serves a group of query heads). The casts come before the heads are repeated, as
    dnn.attention takes the key/value heads themselves."""
    rep = q.shape[1] // k.shape[1]
    k, v = (bf(t).repeat_interleave(rep, dim=1) for t in (k, v))
    return bf(causal_attention(bf(q), k, v))


def mlp(p, inp, c):
    h = inp["x"]
    for i in range(c["layers"]):
        h = act(F.relu(lin(h, p[f"layers.{i}.weight"], p[f"layers.{i}.bias"])))
    logits = lin(h, p["head.weight"], p["head.bias"])
    return F.cross_entropy(logits, inp["labels"])


def causal_attention(q, k, v):
    t = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~mask, float("-inf")).softmax(-1) @ v


def gpt(p, inp, c):
    tok = inp["tokens"]
    b, t = tok.shape
    nh = c["heads"]
    x = act(act(F.embedding(tok, act(p["wte"]))) + act(p["wpe"]))
    for i in range(c["layers"]):
        q = lambda n: act(p[f"h.{i}.{n}"])  # noqa: E731
        h = act(F.layer_norm(use(x), x.shape[-1:], q("ln_1.weight"), q("ln_1.bias"), 1e-5))
        heads = []
        for n, hn in zip("qkv", fan(h, 3)):
            y = lin(hn, q(f"attn.{n}.weight"), q(f"attn.{n}.bias"))
            heads.append(y.view(b, t, nh, -1).transpose(1, 2))
        a = attention(*heads).transpose(1, 2).reshape(b, t, -1)
        x = act(use(x) + lin(a, q("attn.proj.weight"), q("attn.proj.bias")))
        h = act(F.layer_norm(use(x), x.shape[-1:], q("ln_2.weight"), q("ln_2.bias"), 1e-5))
        h = act(F.gelu(lin(h, q("mlp.fc.weight"), q("mlp.fc.bias"))))
        x = act(use(x) + lin(h, q("mlp.proj.weight"), q("mlp.proj.bias")))
    x = act(F.layer_norm(x, x.shape[-1:], act(p["ln_f.weight"]), act(p["ln_f.bias"]), 1e-5))
    logits = lin(x, p["wte"])
    return F.cross_entropy(logits.reshape(b * t, -1), inp["targets"].reshape(-1))


def gpt_params(vocab, width, block, layers, device="cpu"):
    """nanoGPT's parameters for gpt(): normal(0, 0.02) matrices, unit norm weights, zero
    biases (drawn from torch's current seed, in a fixed order)."""
    p = {"wte": torch.randn(vocab, width) * 0.02, "wpe": torch.randn(block, width) * 0.02,
         "ln_f.weight": torch.ones(width), "ln_f.bias": torch.zeros(width)}
    for i in range(layers):
        q = lambda n: f"h.{i}.{n}"  # noqa: E731
        for n in ["ln_1", "ln_2"]:
            p[q(n + ".weight")] = torch.ones(width)
            p[q(n + ".bias")] = torch.zeros(width)
        for n in ["attn.q", "attn.k", "attn.v", "attn.proj"]:
            p[q(n + ".weight")] = torch.randn(width, width) * 0.02
            p[q(n + ".bias")] = torch.zeros(width)
        p[q("mlp.fc.weight")] = torch.randn(4 * width, width) * 0.02
        p[q("mlp.fc.bias")] = torch.zeros(4 * width)
        p[q("mlp.proj.weight")] = torch.randn(width, 4 * width) * 0.02
        p[q("mlp.proj.bias")] = torch.zeros(width)
    return {k: v.to(device).requires_grad_(True) for k, v in p.items()}


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, theta):
    t, d = x.shape[-2], x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat([ang, ang], dim=-1)
    cos, sin = emb.cos().float(), emb.sin().float()
    half = d // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rot * sin


def llama(p, inp, c):
    tok = inp["tokens"]
    b, t = tok.shape
    nh, nkv, eps, theta = c["heads"], c["kv_heads"], c["norm_eps"], c["rope_theta"]
    x = act(F.embedding(tok, act(p["embed_tokens.weight"])))
    for i in range(c["layers"]):
        q = lambda n: act(p[f"layers.{i}.{n}"])  # noqa: E731
        h = act(rms_norm(use(x), q("input_layernorm.weight"), eps))
        hq, hk, hv = fan(h, 3)
        qs = lin(hq, q("self_attn.q_proj.weight")).view(b, t, nh, -1).transpose(1, 2)
        ks = lin(hk, q("self_attn.k_proj.weight")).view(b, t, nkv, -1).transpose(1, 2)
        vs = lin(hv, q("self_attn.v_proj.weight")).view(b, t, nkv, -1).transpose(1, 2)
        qs, ks = act(rope(qs, theta)), act(rope(ks, theta))
        a = attention(qs, ks, vs).transpose(1, 2).reshape(b, t, -1)
        x = act(use(x) + lin(a, q("self_attn.o_proj.weight")))
        h = act(rms_norm(use(x), q("post_attention_layernorm.weight"), eps))
        g = act(F.silu(lin(h, q("mlp.gate_proj.weight"))))
        x = act(use(x) + lin(act(g * lin(h, q("mlp.up_proj.weight"))), q("mlp.down_proj.weight")))
    x = act(rms_norm(x, act(p["norm.weight"]), eps))
    logits = lin(x, p["lm_head.weight"])
    return F.cross_entropy(logits.reshape(b * t, -1), inp["targets"].reshape(-1))


def main(d):
    # The safetensors helper (numpy) only for the oracle run, so that the models load where
    # numpy is absent (bench/gpu/torch_ref.py on a GPU machine).
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import st
    with open(os.path.join(d, "config.json")) as f:
        c = json.load(f)
    torch.set_num_threads(1)
    params = {k: torch.from_numpy(v).requires_grad_(True)
              for k, v in st.load(os.path.join(d, "params.safetensors")).items()}
    inputs = {k: torch.from_numpy(v) for k, v in st.load(os.path.join(d, "inputs.safetensors")).items()}
    global BF16, ACT
    out = {}
    precision = c.get("precision", "f32")
    for bf16 in [False, True] if precision != "f32" else [False]:
        BF16, ACT = bf16, bf16 and precision == "bf16-activations"
        prefix = "" if bf16 == (precision != "f32") else "f32."
        loss = {"mlp": mlp, "gpt": gpt, "llama": llama}[c["family"]](params, inputs, c)
        names = sorted(params)
        grads = torch.autograd.grad(loss, [params[n] for n in names])
        out[prefix + "loss"] = loss.detach().numpy()
        for n, g in zip(names, grads):
            out[f"{prefix}grad.{n}"] = g.numpy()
    st.save(os.path.join(d, "torch.safetensors"), out)


if __name__ == "__main__":
    main(sys.argv[1])
