"""Models written as ordinary PyTorch, for `nnscaler import torch` (test/tools/import-torch.test)."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x, labels):
        h = F.gelu(self.fc1(x))
        h = torch.tanh(self.fc2(h)) + h
        return F.cross_entropy(self.head(h), labels)


class Block(nn.Module):
    """An embedding, a layer norm, a bias-free projection with a transpose and a matrix
    product, a softmax, reshapes: the shape-changing ops the importer maps."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 16)
        self.ln = nn.LayerNorm(16)
        self.q = nn.Linear(16, 16, bias=False)
        self.out = nn.Linear(16, 11)

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.ln(self.emb(idx))
        q = self.q(x)
        att = torch.softmax(q @ x.transpose(1, 2), dim=-1)
        y = (att @ x).reshape(b * t, 16)
        logits = self.out(F.relu(y)).view(b, t, 11)
        return F.cross_entropy(logits.view(b * t, 11), targets.view(b * t))


def mlp():
    return MLP()


def block():
    return Block()


def unsupported():
    class Cumsum(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 4)

        def forward(self, x):
            return torch.cumsum(self.w(x), 0).sum()

    return Cumsum()


class CausalSelfAttention(nn.Module):
    """nanoGPT's attention, as written there (a mask buffer, masked_fill, softmax), or with
    `sdpa` as nanoGPT writes it on torch 2.x (F.scaled_dot_product_attention, causal)."""

    def __init__(self, n_embd, n_head, block, sdpa=False):
        super().__init__()
        self.sdpa = sdpa
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPTBlock(nn.Module):
    def __init__(self, n_embd, n_head, block, sdpa=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block, sdpa)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x))))


class GPT(nn.Module):
    """A nanoGPT-style GPT: token and position embeddings, blocks, a final norm, the LM
    head tied to the token embedding."""

    def __init__(self, vocab=11, block=8, n_layer=2, n_head=2, n_embd=16, sdpa=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block, n_embd)
        self.h = nn.ModuleList([GPTBlock(n_embd, n_head, block, sdpa) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight

    def forward(self, idx, targets):
        b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def gpt():
    return GPT()


def gpt_sdpa():
    """The GPT above with F.scaled_dot_product_attention (torch 2.x only; bench/gpu/check.sh
    imports it on the GPU machine's torch)."""
    return GPT(sdpa=True)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class Llama(nn.Module):
    """A Llama-style model as Hugging Face writes it: RMSNorm written with ops, rotary
    embedding from cos/sin buffers with rotate_half, grouped-query attention by
    repeat_interleave, a causal mask buffer, SwiGLU."""

    def __init__(self, vocab=11, dim=16, n_heads=4, n_kv=2, ffn=32, seq=8, n_layer=2, theta=10000.0):
        super().__init__()
        self.h, self.kv, self.hd = n_heads, n_kv, dim // n_heads
        self.tok = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList()
        for _ in range(n_layer):
            layer = nn.Module()
            layer.attn_norm = RMSNorm(dim)
            layer.wq = nn.Linear(dim, n_heads * self.hd, bias=False)
            layer.wk = nn.Linear(dim, n_kv * self.hd, bias=False)
            layer.wv = nn.Linear(dim, n_kv * self.hd, bias=False)
            layer.wo = nn.Linear(n_heads * self.hd, dim, bias=False)
            layer.ffn_norm = RMSNorm(dim)
            layer.w1 = nn.Linear(dim, ffn, bias=False)
            layer.w2 = nn.Linear(ffn, dim, bias=False)
            layer.w3 = nn.Linear(dim, ffn, bias=False)
            self.layers.append(layer)
        self.norm = RMSNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2).float() / self.hd))
        freqs = torch.outer(torch.arange(seq).float(), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos())
        self.register_buffer("sin", emb.sin())
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)))

    def forward(self, idx, targets):
        b, t = idx.shape
        x = self.tok(idx)
        cos, sin = self.cos[:t], self.sin[:t]
        for layer in self.layers:
            h = layer.attn_norm(x)
            q = layer.wq(h).view(b, t, self.h, self.hd).transpose(1, 2)
            k = layer.wk(h).view(b, t, self.kv, self.hd).transpose(1, 2)
            v = layer.wv(h).view(b, t, self.kv, self.hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k = k.repeat_interleave(self.h // self.kv, dim=1)
            v = v.repeat_interleave(self.h // self.kv, dim=1)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hd)
            att = att.masked_fill(self.mask[:t, :t] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
            x = x + layer.wo(y.transpose(1, 2).reshape(b, t, self.h * self.hd))
            g = layer.ffn_norm(x)
            x = x + layer.w2(F.silu(layer.w1(g)) * layer.w3(g))
        logits = self.out(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def llama():
    return Llama()


def buffer_product():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 3)
            self.register_buffer("gain", torch.full((3,), 2.0))

        def forward(self, x, labels):
            return F.cross_entropy(self.w(x) * self.gain, labels)

    return Scaled()


def gpt_char():
    """The GPT above over a character vocabulary of 32 (test/tools/import-torch.test trains
    it on a corpus of 28 characters)."""
    return GPT(vocab=32, block=8)


def buffer_sum():
    class Shifted(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Linear(4, 3)
            self.register_buffer("shift", torch.ones(3))

        def forward(self, x, labels):
            return F.cross_entropy(self.w(x) + self.shift, labels)

    return Shifted()


class SoftplusMLP(nn.Module):
    """An MLP with softplus, which the importer does not map: a user op does
    (Inputs/softplus-op.mlir, `nnscaler import torch --user-ops`)."""

    def __init__(self, beta=1.0):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.head = nn.Linear(32, 10)
        self.beta = beta

    def forward(self, x, labels):
        h = F.softplus(self.fc1(x), beta=self.beta)
        return F.cross_entropy(self.head(h), labels)


def softplus_mlp():
    return SoftplusMLP()


class AbsMLP(nn.Module):
    """An MLP with |x| (aten::abs, dnn.abs) as its activation."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x, labels):
        return F.cross_entropy(self.head(torch.abs(self.fc1(x))), labels)


def abs_mlp():
    return AbsMLP()


def softplus_beta2():
    return SoftplusMLP(beta=2.0)


class SoftplusChar(nn.Module):
    """A character model with softplus (a user op maps it: Inputs/softplus-char-op.mlir,
    `[model] user_ops` in test/tools/import-torch.test's training)."""

    def __init__(self, vocab=32, width=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.fc = nn.Linear(width, 32)
        self.head = nn.Linear(32, vocab)

    def forward(self, idx, targets):
        h = F.softplus(self.fc(self.emb(idx)))
        logits = self.head(h)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def softplus_char():
    return SoftplusChar()
