"""What the PyTorch programs of `nnscaler emit-torch` import (written next to them as
`nns_runtime.py`): the `dnn` ops that have no one-line PyTorch spelling (`ops`), the mesh's
process groups and collectives (`Comm`), tensor files (`load`, `save`) and the driver that
`train.py` runs (`main`).

Every op computes what nnscaler's CPU runtime computes (runtime/src/kernels), within
float rounding: the same formulas, masks, offsets and random streams. Needs only torch
(1.13 or later); collectives go through torch.distributed: NCCL where CUDA is present,
gloo otherwise (gloo has no reduce-scatter: it is an all-reduce and a cut there)."""

import functools
import json
import math
import os
import struct
import sys
import time

import torch
import torch.nn.functional as F
import torch.distributed as dist

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16,
          "f64": torch.float64, "i64": torch.int64, "i32": torch.int32, "i1": torch.bool}
ST_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
             "F64": torch.float64, "I64": torch.int64, "I32": torch.int32, "BOOL": torch.bool}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}


# ---- tensor files (safetensors) -------------------------------------------------------

def load(path):
    """The tensors of safetensors file `path`, by name."""
    with open(path, "rb") as f:
        data = f.read()
    if len(data) < 8:
        raise SystemExit(f"{path}: not a safetensors file (shorter than its header's length)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise SystemExit(f"{path}: header of {n} bytes runs past the end of the file")
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, h in header.items():
        if name == "__metadata__":
            continue
        dtype = ST_DTYPES.get(h["dtype"])
        if dtype is None:
            raise SystemExit(f"{path}: tensor {name!r} has dtype {h['dtype']}, which nnscaler does not use")
        start, end = h["data_offsets"]
        buf = bytearray(data[base + start:base + end])
        t = torch.frombuffer(buf, dtype=dtype) if buf else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(h["shape"]).clone()
    return out


def save(path, tensors):
    """Writes [(name, tensor)] to `path` atomically (a partial file is never left)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors:
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t
        data = raw.numpy().tobytes()
        header[name] = {"dtype": ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = f"{path}.partial.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


# ---- ops --------------------------------------------------------------------------------

_LOW = (torch.bfloat16, torch.float16)


def _in_f32(fn):
    """`fn` computed in float32 and rounded once to its first float operand's type (the
    result type the IR gives it), as nnscaler's runtimes compute an op on bf16 values;
    on float32 operands `fn` itself, unchanged. Without it a helper of several steps would
    round every intermediate to bf16."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not any(torch.is_tensor(a) and a.dtype in _LOW for a in args):
            return fn(*args, **kwargs)
        dt = next(a.dtype for a in args if torch.is_tensor(a) and a.is_floating_point())
        out = fn(*(a.float() if torch.is_tensor(a) and a.dtype in _LOW else a for a in args),
                 **kwargs)
        if isinstance(out, tuple):
            return tuple(o.to(dt) for o in out)
        return out.to(dt)
    return wrapper


class ops:
    """The dnn ops without a one-line PyTorch spelling, as the CPU runtime computes them."""

    @staticmethod
    @_in_f32
    def gelu_grad(dy, x, approximate="none"):
        if approximate == "tanh":
            c, k = 0.7978846, 0.044715
            t = torch.tanh(c * (x + k * x * x * x))
            du = c * (1.0 + 3.0 * k * x * x)
            return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du)
        e = torch.erf(x * 0.70710678)
        g = torch.exp(-0.5 * x * x)
        return dy * (0.5 * (1.0 + e) + x * 0.3989423 * g)

    @staticmethod
    @_in_f32
    def silu_grad(dy, x):
        s = torch.sigmoid(x)
        return dy * s * (1.0 + x * (1.0 - s))

    @staticmethod
    def relu_grad(dy, x):
        return torch.where(x > 0, dy, torch.zeros_like(dy))

    @staticmethod
    @_in_f32
    def softmax_grad(dy, y, dim):
        return y * (dy - (dy * y).sum(dim, keepdim=True))

    @staticmethod
    @_in_f32
    def log_softmax_grad(dy, y, dim):
        return dy - torch.exp(y) * dy.sum(dim, keepdim=True)

    @staticmethod
    def _moments(x, eps):
        x64 = x.double()
        mean = x64.mean(-1, keepdim=True)
        var = ((x64 - mean) ** 2).mean(-1, keepdim=True)
        return mean.to(x.dtype), torch.rsqrt(var + eps).to(x.dtype)

    @staticmethod
    @_in_f32
    def layer_norm_grad(dy, x, w, eps):
        h = w.shape[0]
        mean, rstd = ops._moments(x, eps)
        xhat = (x - mean) * rstd
        g = dy * w
        mg = g.mean(-1, keepdim=True)
        mgx = (g * xhat).mean(-1, keepdim=True)
        dx = rstd * (g - mg - xhat * mgx)
        dw = (dy * xhat).reshape(-1, h).double().sum(0).to(w.dtype)
        db = dy.reshape(-1, h).double().sum(0).to(w.dtype)
        return dx, dw, db

    @staticmethod
    def _rms(x, eps):
        ms = (x.double() * x.double()).mean(-1, keepdim=True)
        return torch.rsqrt(ms + eps).to(x.dtype)

    @staticmethod
    @_in_f32
    def rms_norm(x, w, eps):
        return x * ops._rms(x, eps) * w

    @staticmethod
    @_in_f32
    def rms_norm_grad(dy, x, w, eps):
        h = w.shape[0]
        r = ops._rms(x, eps)
        dot = (dy * w * x).double().mean(-1, keepdim=True).to(x.dtype)
        dx = r * (dy * w - x * (dot * r * r))
        dw = (dy * x * r).reshape(-1, h).double().sum(0).to(w.dtype)
        return dx, dw

    @staticmethod
    def embedding(ids, table, offset=None):
        """Rows of `table` by `ids`; on a shard of the rows that starts at `offset`
        (vocabulary parallelism), ids of other shards give zero rows."""
        if offset is None:
            return F.embedding(ids, table)
        r = ids - offset
        inside = (r >= 0) & (r < table.shape[0])
        rows = F.embedding(r.clamp(0, table.shape[0] - 1), table)
        return torch.where(inside.unsqueeze(-1), rows, torch.zeros_like(rows))

    @staticmethod
    @_in_f32
    def embedding_grad(dy, ids, vocab):
        e = dy.shape[-1]
        out = torch.zeros(vocab, e, dtype=dy.dtype, device=dy.device)
        return out.index_add_(0, ids.reshape(-1), dy.reshape(-1, e))

    @staticmethod
    def linear_weight_grad(dy, x):
        return dy.reshape(-1, dy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])

    @staticmethod
    def _probs(q, k, causal, scale, q0):
        h, g = q.shape[1], k.shape[1]
        k = k.repeat_interleave(h // g, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale
        if causal:
            s, t = q.shape[2], k.shape[2]
            i = torch.arange(s, device=q.device).unsqueeze(1) + q0
            j = torch.arange(t, device=q.device).unsqueeze(0)
            scores = scores.masked_fill(j > i, float("-inf"))
        return torch.softmax(scores, -1)

    @staticmethod
    def attention(q, k, v, causal=False, scale=None, q0=0):
        """Scaled dot-product attention over [b, h, s, d]: grouped-query when k and v have
        fewer heads (query head i reads key/value head i / (h / g)); with `causal`, query
        position q0 + i sees keys up to q0 + i (q0: the start of this rank's positions)."""
        # Computed in float32 and rounded once (as nnscaler's kernels and flash attention
        # do), whatever the inputs' type.
        dt = q.dtype
        q, k, v = q.float(), k.float(), v.float()
        scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
        p = ops._probs(q, k, causal, scale, q0)
        return torch.matmul(p, v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)).to(dt)

    @staticmethod
    def attention_grad(dout, q, k, v, causal=False, scale=None, q0=0):
        with torch.enable_grad():
            types = [t.dtype for t in (q, k, v)]
            q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
            out = ops.attention(q, k, v, causal, scale, q0)
            grads = torch.autograd.grad(out, (q, k, v), dout.float())
            return tuple(g.to(t) for g, t in zip(grads, types))

    @staticmethod
    @_in_f32
    def rotary(x, theta=10000.0, p0=0, sign=1.0):
        """Rotate-half rotary embedding of [b, h, s, d] at positions p0 .. p0 + s (sign -1:
        the inverse rotation, the gradient)."""
        s, d = x.shape[2], x.shape[3]
        half = d // 2
        j = torch.arange(half, dtype=torch.float64, device=x.device)
        inv = torch.pow(torch.tensor(theta, dtype=torch.float64, device=x.device),
                        -2.0 * j / d).to(torch.float32)
        pos = torch.arange(p0, p0 + s, dtype=torch.float32, device=x.device)
        a = pos.unsqueeze(1) * inv.unsqueeze(0)
        cos, sin = torch.cos(a).to(x.dtype), (sign * torch.sin(a)).to(x.dtype)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)

    @staticmethod
    def cross_entropy(logits, targets, count=None):
        """Mean cross-entropy over every token; `count`: the whole batch's token count when
        this rank holds a part of it."""
        v = logits.shape[-1]
        l2, t = logits.reshape(-1, v), targets.reshape(-1)
        n = t.numel() if count is None else count
        lse = torch.logsumexp(l2.double(), -1)
        picked = l2.double().gather(1, t.unsqueeze(1)).squeeze(1)
        return ((lse - picked).sum() / n).to(logits.dtype)

    @staticmethod
    @_in_f32
    def cross_entropy_grad(dloss, logits, targets, count=None):
        n = targets.numel() if count is None else count
        p = torch.softmax(logits, -1)
        p = p.scatter_add(-1, targets.unsqueeze(-1), torch.full_like(p[..., :1], -1.0))
        return p * (dloss / n)

    @staticmethod
    def pick(logits, targets, offset=0):
        """logits[.., targets[..]]; on a shard of the classes starting at `offset`, tokens
        whose target lies elsewhere give 0."""
        v = logits.shape[-1]
        k = targets - offset
        inside = (k >= 0) & (k < v)
        got = logits.gather(-1, k.clamp(0, v - 1).unsqueeze(-1)).squeeze(-1)
        return torch.where(inside, got, torch.zeros_like(got))

    @staticmethod
    def pick_grad(dy, targets, classes):
        out = torch.zeros(*targets.shape, classes, dtype=dy.dtype, device=dy.device)
        return out.scatter(-1, targets.unsqueeze(-1), dy.unsqueeze(-1))

    @staticmethod
    @_in_f32
    def softmax_xent_grad(dloss, logits, targets, lse, count=None, offset=0):
        n = targets.numel() if count is None else count
        scale = dloss / n
        out = torch.exp(logits - lse) * scale
        v = logits.shape[-1]
        k = targets - offset
        inside = (k >= 0) & (k < v)
        minus = torch.where(inside, -scale * torch.ones_like(k, dtype=out.dtype),
                            torch.zeros_like(k, dtype=out.dtype))
        return out.scatter_add(-1, k.clamp(0, v - 1).unsqueeze(-1), minus.unsqueeze(-1))

    @staticmethod
    @_in_f32
    def max_grad(dy, x, dims, keepdim=False):
        mx = x.amax(dims, keepdim=True)
        at = x == mx
        ties = at.sum(dims, keepdim=True).to(x.dtype)
        if not keepdim:
            for d in sorted(dims):
                dy = dy.unsqueeze(d)
        return torch.where(at, dy / ties, torch.zeros_like(x))

    @staticmethod
    def pad(x, dim, before, after):
        shape = list(x.shape)
        parts = []
        if before:
            shape[dim] = before
            parts.append(torch.zeros(shape, dtype=x.dtype, device=x.device))
        parts.append(x)
        if after:
            shape[dim] = after
            parts.append(torch.zeros(shape, dtype=x.dtype, device=x.device))
        return torch.cat(parts, dim) if len(parts) > 1 else x

    @staticmethod
    def adamw(p, g, m, v, lr, step, scale=None, *, beta1, beta2, eps, weight_decay):
        """One torch.optim.AdamW step in f32 on g times `scale` (clipping's factor)."""
        lr, t = float(lr), float(step)
        bc2_sqrt = math.sqrt(1.0 - beta2 ** t)
        step_size = lr / (1.0 - beta1 ** t)
        decay = 1.0 - lr * weight_decay
        if scale is not None:
            g = g * scale
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * (g * g)
        return p * decay - step_size * (m / (v.sqrt() / bc2_sqrt + eps)), m, v

    @staticmethod
    def clip_scale(sumsq, max_norm):
        return torch.clamp(max_norm / (sumsq.sqrt() + 1e-6), max=1.0)

    # Dropout's mask: the runtime's counter-based generator (splitmix64 of seed, stream and
    # the element's index in the whole tensor), bit for bit.
    _M64 = (1 << 64) - 1

    @staticmethod
    def _mix64_int(z):
        m = ops._M64
        z = (z + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)

    @staticmethod
    def _signed(u):
        return u - (1 << 64) if u >= (1 << 63) else u

    @staticmethod
    def _shr(z, k):
        """Logical right shift of int64 tensor `z` (as u64) by k."""
        return (z >> k) & ((1 << (64 - k)) - 1)

    @staticmethod
    def _mix64(z):
        s = ops._signed
        z = z + s(0x9E3779B97F4A7C15)
        z = (z ^ ops._shr(z, 30)) * s(0xBF58476D1CE4E5B9)
        z = (z ^ ops._shr(z, 27)) * s(0x94D049BB133111EB)
        return z ^ ops._shr(z, 31)

    @staticmethod
    def dropout(x, p, seed, step=None, offsets=None, global_shape=None):
        """Zeroes each element with probability p, scales the rest by 1/(1-p); the mask is
        a function of (seed, the step when given, the element's index in the whole
        tensor: this rank's piece starts at `offsets` of `global_shape`)."""
        if p == 0.0:
            return x
        seed &= ops._M64
        if step is not None:
            seed = ops._mix64_int(ops._mix64_int(seed ^ ops._mix64_int(0x5EED)) ^ int(float(step)))
        shape = list(x.shape)
        offsets = offsets or [0] * len(shape)
        whole = global_shape or shape
        index = torch.zeros(shape, dtype=torch.int64, device=x.device)
        stride = 1
        for d in reversed(range(len(shape))):
            r = torch.arange(offsets[d], offsets[d] + shape[d], dtype=torch.int64, device=x.device)
            view = [1] * len(shape)
            view[d] = shape[d]
            index = index + r.reshape(view) * stride
            stride *= whole[d]
        key = ops._signed(ops._mix64_int(seed ^ ops._mix64_int(0x64726F706F7574)))
        bits = ops._mix64(torch.full_like(index, key) ^ index)
        u = ops._shr(bits, 11).double() * (1.0 / (1 << 53))
        return torch.where(u >= p, x * (1.0 / (1.0 - p)), torch.zeros_like(x))


# ---- the mesh's process groups ----------------------------------------------------------

class Comm:
    """This rank's place in the mesh and a process group for each set of mesh axes the
    program's collectives run over. A group's members are ordered as nnscaler orders them:
    by the coordinates along its axes, in the order the collective names them."""

    def __init__(self, axes, rank, group_axes, receives=None, device=None):
        self.device = device or torch.device("cpu")
        self.names = [a for a, _ in axes]
        self.sizes = [n for _, n in axes]
        self.rank = rank
        self.world = math.prod(self.sizes)
        self.coords = self._coords(rank)
        self.backend = dist.get_backend() if dist.is_initialized() else None
        self.groups = {}
        for key in group_axes:
            self._make_groups(key)
        # Messages from each peer in the order it sends them; a receive takes the next
        # ones, holding those meant for later receives (what nnscaler's mailbox does).
        self.expected = {src: list(msgs) for src, msgs in (receives or {}).items()}
        self.inbox = {}
        self.pending = []

    def _coords(self, rank):
        c = [0] * len(self.sizes)
        for a in reversed(range(len(self.sizes))):
            c[a] = rank % self.sizes[a]
            rank //= self.sizes[a]
        return c

    def _rank_of(self, coords):
        r = 0
        for c, n in zip(coords, self.sizes):
            r = r * n + c
        return r

    def _make_groups(self, key):
        axes = [self.names.index(a) for a in key.split(",")]
        others = [a for a in range(len(self.sizes)) if a not in axes]
        mine = None
        # Every rank creates every group, in the same order (torch.distributed requires it).
        for gid in range(math.prod(self.sizes[a] for a in others)):
            base = [0] * len(self.sizes)
            rest = gid
            for a in reversed(others):
                base[a] = rest % self.sizes[a]
                rest //= self.sizes[a]
            members = []
            for m in range(math.prod(self.sizes[a] for a in axes)):
                c = list(base)
                rest = m
                for a in reversed(axes):
                    c[a] = rest % self.sizes[a]
                    rest //= self.sizes[a]
                members.append(self._rank_of(c))
            pg = dist.new_group(sorted(members)) if len(members) > 1 else None
            if self.rank in members:
                mine = (pg, members, members.index(self.rank))
        self.groups[key] = mine

    def _group(self, key):
        return self.groups[key]

    @staticmethod
    def _to_member_order(parts, members):
        # torch orders a group's ranks by global rank; nnscaler by member index.
        ranks = sorted(members)
        return [parts[ranks.index(m)] for m in members]

    @staticmethod
    def _to_group_order(parts, members):
        ranks = sorted(members)
        return [parts[members.index(r)] for r in ranks]

    # gloo (torch 1.13) has no bfloat16 in its collectives ("Invalid scalar type"): data
    # that only moves travels as float16 bits (the same two bytes, unchanged); data that is
    # reduced is summed in float32 and rounded back once (as nnscaler's runtimes sum).
    def _bf16_on_gloo(self, x):
        return self.backend == "gloo" and x.dtype == torch.bfloat16

    def _wire(self, x):
        return x.view(torch.float16) if self._bf16_on_gloo(x) else x

    def _unwire(self, y, like):
        return y.view(torch.bfloat16) if self._bf16_on_gloo(like) else y

    def all_reduce(self, x, axes, op="sum"):
        pg, members, _ = self._group(axes)
        if pg is None:
            return x.clone().contiguous()
        y = x.float() if self._bf16_on_gloo(x) else x.clone()
        y = y.contiguous()
        dist.all_reduce(y, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=pg)
        return y.to(x.dtype)

    def all_gather(self, x, axes, dim):
        pg, members, _ = self._group(axes)
        if pg is None:
            return x.clone()
        w = self._wire(x.contiguous())
        parts = [torch.empty_like(w) for _ in members]
        dist.all_gather(parts, w, group=pg)
        return self._unwire(torch.cat(self._to_member_order(parts, members), dim), x)

    def reduce_scatter(self, x, axes, dim, op="sum"):
        pg, members, me = self._group(axes)
        n = len(members)
        if pg is None:
            return x.clone()
        red = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        if self.backend == "nccl" and hasattr(dist, "reduce_scatter_tensor"):
            pieces = self._to_group_order(list(x.movedim(dim, 0).chunk(n, 0)), members)
            inp = torch.cat(pieces, 0).contiguous()
            out = torch.empty_like(pieces[0])
            dist.reduce_scatter_tensor(out, inp, op=red, group=pg)
            return out.movedim(0, dim).contiguous()
        # gloo has no reduce-scatter: reduce the whole, keep this member's piece.
        y = self.all_reduce(x, axes, op)
        return y.chunk(n, dim)[me].contiguous()

    def all_to_all(self, x, axes, split_dim, concat_dim):
        pg, members, me = self._group(axes)
        n = len(members)
        if pg is None:
            return x.clone()
        moved = x.movedim(split_dim, 0)
        pieces = self._to_group_order(list(moved.chunk(n, 0)), members)
        inp = self._wire(torch.cat(pieces, 0).contiguous())
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp, group=pg)
        got = self._to_member_order(list(self._unwire(out, x).chunk(n, 0)), members)
        return torch.cat([p.movedim(0, split_dim) for p in got], concat_dim).contiguous()

    def broadcast(self, x, axes, root):
        pg, members, _ = self._group(axes)
        y = x.clone().contiguous()
        if pg is not None:
            dist.broadcast(self._wire(y), members[root], group=pg)
        return y

    def send(self, x, tag, dst):
        x = x.contiguous()
        self.pending.append((dist.isend(x, dst), x, tag))

    def recv(self, tag, src):
        if tag in self.inbox:
            return self.inbox.pop(tag)
        queue = self.expected.get(src, [])
        while queue:
            t, shape, dtype = queue.pop(0)
            buf = torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
            dist.recv(buf, src)
            if t == tag:
                return buf
            self.inbox[t] = buf
        raise RuntimeError(f"rank {self.rank}: no message {tag!r} is expected from rank {src}")

    def finish(self):
        """Waits for this rank's sends to be received."""
        for h, _, _ in self.pending:
            h.wait()
        self.pending = []
        if self.inbox:
            raise RuntimeError(f"rank {self.rank}: messages never used: {sorted(self.inbox)}")


# ---- the driver -------------------------------------------------------------------------

def _environment():
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    local = int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))
    return rank, world, local


def main(plan, argv=None):
    """Runs one step of the emitted program on this process's rank (torchrun's or Slurm's
    environment): loads the whole inputs and parameters, cuts this rank's pieces, runs the
    rank's program and writes the whole results (rank 0, `-o`)."""
    import argparse
    import importlib

    ap = argparse.ArgumentParser(description="Run one step of the emitted program on this rank.")
    ap.add_argument("--inputs", help="the step's inputs (safetensors, by argument name)")
    ap.add_argument("--params", help="the parameters (safetensors, by name)")
    ap.add_argument("-o", "--output", help="write the whole results here (safetensors; rank 0)")
    ap.add_argument("--backend", choices=["nccl", "gloo"],
                    help="torch.distributed backend (default: nccl with CUDA, else gloo)")
    a = ap.parse_args(argv)
    rank, world, local = _environment()
    if world != plan["world"]:
        raise SystemExit(f"the program runs on {plan['world']} ranks; this launch has {world} "
                         f"(torchrun --nproc-per-node {plan['world']})")
    backend = a.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    device = torch.device(f"cuda:{local}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group(backend)
    sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
    program = importlib.import_module(f"rank{rank}")
    comm = Comm(plan["mesh"], rank, plan["groups"], program.RECEIVES, device)
    whole = {}
    for path in (a.inputs, a.params):
        if path:
            whole.update(load(path))
    local_args = []
    for name, shape, dtype, ranges in program.ARGS:
        if name not in whole:
            raise SystemExit(f"no tensor {name!r} in --inputs or --params")
        t = whole[name]
        if list(t.shape) != shape:
            raise SystemExit(f"{name}: shape {list(t.shape)}, the program takes {shape}")
        piece = t[tuple(slice(lo, hi) for lo, hi in ranges)]
        local_args.append(piece.to(DTYPES[dtype]).contiguous().to(device))
    started = time.perf_counter()
    with torch.no_grad():
        results = program.step(comm, *local_args)
    comm.finish()
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    # Each result made whole on rank 0 from the ranks holding its distinct pieces.
    mine = dict(zip(program.RESULTS, results))
    gathered = []
    for name, shape, dtype, pieces in plan["results"]:
        out = torch.zeros(shape, dtype=DTYPES[dtype]) if rank == 0 else None
        for holder, ranges in pieces:
            where = tuple(slice(lo, hi) for lo, hi in ranges)
            if holder == rank:
                t = mine[name].contiguous()
                if rank == 0:
                    out[where] = t.cpu()
                else:
                    dist.send(t, 0)
            elif rank == 0:
                buf = torch.empty([hi - lo for lo, hi in ranges], dtype=DTYPES[dtype], device=device)
                dist.recv(buf, holder)
                out[where] = buf.cpu()
        if rank == 0:
            gathered.append((name, out))
    if rank == 0:
        if a.output:
            save(a.output, gathered)
        print(f"step: {seconds * 1e3:.3f} ms on {world} rank(s) ({backend}); "
              f"{len(gathered)} results" + (f" -> {a.output}" if a.output else ""))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
