"""Import a PyTorch nn.Module as nnscaler `dnn` MLIR.

    python3 importer.py FILE.py:FACTORY --input NAME=SHAPE:DTYPE ... [--params FILE] [--seed N] [--eval]
        [--user-op JSON]...
    python3 importer.py --supported     # the op table, as markdown

`FACTORY()` returns an `nn.Module` whose `forward` takes the inputs (in the order of the
`--input` flags) and returns a scalar loss. The module is traced concretely by running it
on example inputs (`torch.jit.trace`: floats from a seeded normal draw, integers zero), as
nnScaler's own tracer does; each recorded aten op becomes a `dnn` op, located at the line
of the user's file that called it, so every later error and remark points there. The
MLIR goes to standard output; `--params FILE` writes the parameters' values (safetensors,
by `state_dict` key: the `nns.name` of each `nns.param` argument). `--eval` traces the module
in evaluation mode (dropout off), as training's evaluation runs it. An aten op without a
mapping is an error naming it and its source line, with the list of supported ones,
unless a user op maps it: `--user-op '{"name": "softplus", "torch": "aten::softplus(x, 1,
20)", "operands": [TYPES], "results": [TYPES]}'` (what `nnscaler import torch --user-ops
FILE` passes for each function of FILE with `nns.torch`) makes such a call a `func.call
@softplus` of its tensor arguments; the call's other arguments must equal the pattern's
literals.

Run by `nnscaler import torch`; here with the system's python3 (Debian's torch 1.13) or
torch 2.x.
"""

import ast
import importlib.util
import json
import os
import struct
import sys

import warnings

import torch

# The tracer warns where a Python number comes from a tensor (`1 / math.sqrt(k.size(-1))`):
# shapes are static here, so that is what is meant.
warnings.filterwarnings("ignore", category=torch.jit.TracerWarning)

# aten ops and the dnn op each maps to, for the error message and the docs' table.
SUPPORTED = {
    "aten::linear": "dnn.linear (without a bias: dnn.transpose + dnn.matmul)",
    "aten::matmul": "dnn.matmul",
    "aten::relu": "dnn.relu",
    "aten::gelu": "dnn.gelu (approximate none or tanh)",
    "aten::tanh": "dnn.tanh",
    "aten::sigmoid": "dnn.sigmoid",
    "aten::silu": "dnn.silu",
    "aten::add": "dnn.add (two tensors, alpha 1)",
    "aten::sub": "dnn.sub (two tensors, alpha 1)",
    "aten::mul": "dnn.mul (two tensors)",
    "aten::div": "dnn.div (two tensors)",
    "aten::softmax": "dnn.softmax",
    "aten::layer_norm": "dnn.layer_norm (with weight and bias)",
    "aten::embedding": "dnn.embedding",
    "aten::cross_entropy_loss": "dnn.cross_entropy (mean, no weights, no label smoothing)",
    "aten::dropout": "dnn.dropout (identity when not training or p = 0)",
    "aten::view": "dnn.reshape",
    "aten::reshape": "dnn.reshape",
    "aten::transpose": "dnn.transpose",
    "aten::t": "dnn.transpose",
    "aten::permute": "dnn.transpose",
    "aten::contiguous": "(nothing: the value itself)",
    "aten::split": "dnn.split (equal pieces)",
    "aten::arange": "(a range of positions: embedding rows by dnn.slice)",
    "aten::masked_fill": "dnn.attention: scores (q @ k^T) * scale, masked_fill of a causal (lower-triangular) mask buffer with -inf, softmax, @ v",
    "aten::mul (by a number)": "dnn.fill + dnn.mul",
    "aten::add (a number)": "dnn.fill + dnn.add",
    "aten::pow": "dnn.mul (a square)",
    "aten::mean": "dnn.mean",
    "aten::rsqrt": "dnn.rsqrt",
    "aten::sqrt": "dnn.sqrt",
    "aten::exp": "dnn.exp",
    "aten::neg": "dnn.neg",
    "aten::abs": "dnn.abs",
    "aten::slice": "dnn.slice (step 1)",
    "aten::cat": "dnn.concat",
    "aten::repeat_interleave": "dnn.reshape + dnn.broadcast_to (dropped where attention takes grouped heads)",
    "aten::mul (by a buffer)": "dnn.rotary: x * cos + rotate_half(x) * sin, cos and sin the rotate-half tables of some theta (a buffer in any other product is an error)",
    "aten::scaled_dot_product_attention": "dnn.attention (torch 2.x: no attn_mask, dropout_p 0; is_causal, scale, enable_gqa kept)",
}

DTYPES = {"f32": torch.float32, "i64": torch.int64}
MLIR_ELEM = {"Float": "f32", "Long": "i64", "BFloat16": "bf16"}


class ImportError_(Exception):
    """An error at a source location (`where`: 'file:line', or '')."""

    def __init__(self, where, message):
        super().__init__(message)
        self.where = where


def load_factory(spec):
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ImportError_("", f"'{spec}' is not FILE.py:FACTORY")
    if not os.path.isfile(path):
        raise ImportError_("", f"{path}: no such file")
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    mod_name = "nnscaler_user_" + os.path.splitext(os.path.basename(path))[0]
    spec_ = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec_)
    spec_.loader.exec_module(module)
    factory = getattr(module, name, None)
    if factory is None or not callable(factory):
        raise ImportError_("", f"{path} has no function '{name}'")
    return os.path.abspath(path), factory


def parse_input(text):
    """NAME=SHAPE:DTYPE, SHAPE as 8x16 (a scalar: 'scalar')."""
    name, eq, rest = text.partition("=")
    shape, colon, dtype = rest.rpartition(":")
    if not eq or not colon or not name or not shape:
        raise ImportError_("", f"--input '{text}' is not NAME=SHAPE:DTYPE (e.g. x=8x16:f32)")
    if dtype not in DTYPES:
        raise ImportError_("", f"--input '{text}': dtype '{dtype}' is not one of {', '.join(DTYPES)}")
    try:
        dims = [] if shape == "scalar" else [int(d) for d in shape.split("x")]
    except ValueError:
        raise ImportError_("", f"--input '{text}': shape '{shape}' is not dims joined by x (e.g. 8x16)")
    if any(d <= 0 for d in dims):
        raise ImportError_("", f"--input '{text}': every dim must be positive")
    return name, dims, dtype


def where_of(node, user_file):
    """The user's file and line of a traced node ('' when unknown): the innermost frame of
    the recorded call stack in the user's file."""
    text = node.sourceRange()
    for line in text.splitlines():
        head = line.split("):", 1)[0]
        if "(" not in head:
            continue
        path, _, num = head.rpartition("(")
        if os.path.abspath(path) == user_file and num.isdigit():
            return f"{os.path.basename(user_file)}:{num}", int(num)
    return "", 0


def tensor_type(value):
    t = value.type()
    if not isinstance(t, torch._C.TensorType) or t.sizes() is None:
        return None
    elem = MLIR_ELEM.get(t.scalarType())
    if elem is None:
        return None
    dims = t.sizes()
    if not dims:
        return f"tensor<{elem}>"
    return "tensor<" + "x".join(str(d) for d in dims) + f"x{elem}>"


class Emitter:
    def __init__(self, user_file):
        self.user_file = user_file
        self.values = {}  # jit value -> SSA name
        self.types = {}  # SSA name -> MLIR type
        self.consts = {}  # jit value -> Python value
        self.lines = []
        self.next = 0
        self.file = os.path.basename(user_file)
        # How a value was made, for patterns spanning several ops (attention).
        self.recipe = {}
        self.lists = {}  # jit value -> [SSA names] (a split's pieces)
        self.ranges = {}  # jit value -> (start, end) (an arange)
        self.dropouts = 0
        self.user_ops = {}  # aten kind -> [(spec, pattern args)]

    def fresh(self):
        n = f"%{self.next}"
        self.next += 1
        return n

    def ssa(self, value, node, what):
        if value in self.values:
            name = self.values[value]
            if name.startswith("%pending"):
                where, _ = where_of(node, self.user_file)
                if self.recipe[name][0] == "mulc":
                    raise ImportError_(
                        where,
                        f"{node.kind()}: a product with a constant tensor (a buffer) is supported "
                        "only as rotary's: x * cos + rotate_half(x) * sin",
                    )
                raise ImportError_(
                    where,
                    f"{node.kind()}: a masked score tensor is supported only as attention's: "
                    "(q @ k^T) * scale, masked_fill of a causal mask with -inf, softmax, then @ v",
                )
            return name
        where, _ = where_of(node, self.user_file)
        raise ImportError_(where, f"{node.kind()}: its {what} is not a tensor the model computes")

    def const(self, value, node, what):
        if value not in self.consts:
            where, _ = where_of(node, self.user_file)
            raise ImportError_(where, f"{node.kind()}: its {what} must be a constant")
        return self.consts[value]

    def op_multi(self, node, name, operands, result_types, attrs=""):
        base = self.fresh()
        _, line = where_of(node, self.user_file)
        ins = ", ".join(operands)
        tys = ", ".join(self.types[o] for o in operands)
        loc = f' loc("{self.file}":{line}:0)' if line else ""
        a = f" {{{attrs}}}" if attrs else ""
        outs = ", ".join(result_types)
        self.lines.append(f'    {base}:{len(result_types)} = "{name}"({ins}){a} : ({tys}) -> ({outs}){loc}')
        names = [f"{base}#{k}" for k in range(len(result_types))]
        for n, t in zip(names, result_types):
            self.types[n] = t
        return names

    def op(self, node, name, operands, result_type, attrs=""):
        out = self.fresh()
        _, line = where_of(node, self.user_file)
        ins = ", ".join(operands)
        tys = ", ".join(self.types[o] for o in operands)
        loc = f' loc("{self.file}":{line}:0)' if line else ""
        a = f" {{{attrs}}}" if attrs else ""
        self.lines.append(f'    {out} = "{name}"({ins}){a} : ({tys}) -> {result_type}{loc}')
        self.types[out] = result_type
        return out


def parse_pattern(text):
    """`"aten::softplus(x, 1, 20)"` as ("aten::softplus", [("tensor", "x"), ("const", 1),
    ("const", 20)])."""
    kind, paren, rest = text.partition("(")
    kind = kind.strip()
    if not kind.startswith("aten::") or not paren or not rest.rstrip().endswith(")"):
        raise ImportError_("", f"user op pattern {text!r}: write the aten call, like \"aten::softplus(x, 1, 20)\"")
    try:
        call = ast.parse("f(" + rest, mode="eval").body
    except SyntaxError as e:
        raise ImportError_("", f"user op pattern {text!r}: {e.msg}")
    if not isinstance(call, ast.Call) or call.keywords:
        raise ImportError_("", f"user op pattern {text!r}: arguments are positional: names (tensors) or literals")
    args = []
    for a in call.args:
        if isinstance(a, ast.Name):
            args.append(("tensor", a.id))
            continue
        try:
            args.append(("const", ast.literal_eval(a)))
        except ValueError:
            raise ImportError_("", f"user op pattern {text!r}: {ast.unparse(a)} is neither a name nor a literal")
    return kind, args


def match_user_op(em, ins, args):
    """The operands of a call whose inputs `ins` match pattern `args`, or why not."""
    operands = []
    for k, v in enumerate(ins):
        want = args[k] if k < len(args) else ("const", None)
        if want[0] == "tensor":
            if v not in em.values:
                return None, f"argument {k} is not a tensor the model computes"
            operands.append(em.values[v])
            continue
        got = em.consts.get(v, "<computed>") if v not in em.values else "<a tensor>"
        if isinstance(got, torch.Tensor) or got != want[1]:
            return None, f"argument {k} is {got!r}, the pattern's {want[1]!r}"
    if len(args) > len(ins):
        return None, f"the call has {len(ins)} arguments, the pattern {len(args)}"
    return operands, None


def user_op_call(node, em, kind, ins, outs, where):
    """`kind`'s call made a func.call of the first user op whose pattern it matches."""
    why = []
    for spec, args in em.user_ops[kind]:
        operands, reason = match_user_op(em, ins, args)
        if operands is None:
            why.append(f"@{spec['name']} ({spec['torch']}): {reason}")
            continue
        types = [em.types[o] for o in operands]
        if types != spec["operands"]:
            raise ImportError_(where, f"{kind}: @{spec['name']} takes ({', '.join(spec['operands'])}), the model passes ({', '.join(types)})")
        results = [tensor_type(o) for o in outs]
        if results != spec["results"]:
            raise ImportError_(where, f"{kind}: @{spec['name']} returns ({', '.join(spec['results'])}), the model's call returns ({', '.join(str(r) for r in results)})")
        attrs = f"callee = @{spec['name']}"
        if len(outs) == 1:
            em.values[outs[0]] = em.op(node, "func.call", operands, results[0], attrs)
        else:
            for o, n in zip(outs, em.op_multi(node, "func.call", operands, results, attrs)):
                em.values[o] = n
        return
    raise ImportError_(where, f"{kind}: no user op matches this call: " + "; ".join(why))


def dims_of(em, value):
    """A value's static shape: from its MLIR type where it has one (parameters' jit types
    carry none), else from the trace."""
    name = em.values.get(value)
    if name is not None:
        body = em.types[name][len("tensor<"):-1]
        return [int(d) for d in body.split("x")[:-1]]
    return list(value.type().sizes())


def dead_code_removed(lines, live):
    """`lines` without the ops none of whose results reach `live` (the return): ops a
    pattern replaced (attention's scores, mask and softmax)."""
    import re

    keep = [False] * len(lines)
    needed = set(live)
    for k in range(len(lines) - 1, -1, -1):
        head, _, rest = lines[k].partition(" = ")
        base = head.strip().split(":")[0]
        results = {base} | {n for n in needed if n.startswith(base + "#")}
        if any(r in needed for r in results):
            keep[k] = True
            body = rest.split(" : ", 1)[0]
            needed |= set(re.findall(r"%[A-Za-z0-9_]+(?:#[0-9]+)?", body))
            needed |= {re.sub(r"#.*", "", n) for n in re.findall(r"%[0-9]+#[0-9]+", body)}
    return [l for l, k in zip(lines, keep) if k]


def scalar(node, em, c, like):
    """A rank-0 dnn.fill of `c`, of the element type of tensor type `like` (a Python
    number in an op with a tensor, broadcast by the op)."""
    elem = like.rsplit("x", 1)[1][:-1] if "x" in like else like[len("tensor<"):-1]
    return em.op(node, "dnn.fill", [], f"tensor<{elem}>", f"shape = array<i64>, value = {c:.17e} : f64")


def i64_array(xs):
    return "array<i64: " + ", ".join(str(int(x)) for x in xs) + ">"


def translate(node, em, training):
    kind = node.kind()
    ins = list(node.inputs())
    outs = list(node.outputs())
    where, _ = where_of(node, em.user_file)
    if kind == "prim::Constant":
        o = outs[0]
        em.consts[o] = o.toIValue() if o.type().kind() != "NoneType" else None
        return
    if kind == "prim::ListConstruct":
        if all(v in em.consts for v in ins):
            em.consts[outs[0]] = [em.consts[v] for v in ins]
            return
        if all(v in em.values for v in ins):
            em.lists[outs[0]] = [em.ssa(v, node, "element") for v in ins]
            return
        raise ImportError_(where, "a list of computed values and constants is not supported")
    # Shapes are static: size queries and arithmetic on them (`b, t = idx.shape`, `b * t`)
    # fold to constants.
    if kind == "aten::size":
        dims = dims_of(em, ins[0])
        em.consts[outs[0]] = dims[em.const(ins[1], node, "dim")] if len(ins) > 1 else dims
        return
    if kind in ("prim::NumToTensor", "aten::Int", "aten::ScalarImplicit", "aten::Float"):
        em.consts[outs[0]] = em.const(ins[0], node, "value")
        return
    if kind in ("aten::mul", "aten::add", "aten::sub", "aten::floordiv", "aten::floor_divide",
                "aten::div", "aten::remainder") and all(
        v in em.consts for v in ins[:2]
    ):
        a, b = em.consts[ins[0]], em.consts[ins[1]]
        ops = {
            "aten::mul": lambda: a * b,
            "aten::add": lambda: a + b,
            "aten::sub": lambda: a - b,
            "aten::floordiv": lambda: a // b,
            "aten::floor_divide": lambda: a // b,
            "aten::remainder": lambda: a % b,
            "aten::div": lambda: a / b,
        }
        em.consts[outs[0]] = ops[kind]()
        return
    if kind in em.user_ops and any(v in em.values for v in ins):
        user_op_call(node, em, kind, ins, outs, where)
        return
    if kind == "aten::arange":
        nums = [em.consts.get(v) for v in ins]
        ints = [n for n in nums if isinstance(n, int) and not isinstance(n, bool)]
        if len(ins) == 5 and len(ints) >= 1:
            em.ranges[outs[0]] = (0, ints[0])
        elif len(ins) >= 6 and len(ints) >= 2 and (len(ins) == 6 or nums[2] in (1, None)):
            em.ranges[outs[0]] = (ints[0], ints[1])
        else:
            raise ImportError_(where, "aten::arange: only a range of step 1 is supported")
        return
    if kind == "prim::ListUnpack":
        src = ins[0]
        if src in em.lists:
            for o, name in zip(outs, em.lists[src]):
                em.values[o] = name
            return
        if src in em.consts:
            for o, v in zip(outs, em.consts[src]):
                em.consts[o] = v
            return
        raise ImportError_(where, "a list of computed values is not supported")
    if kind == "aten::split" and ins[0] in em.values:
        dims = dims_of(em, ins[0])
        size, dim = em.const(ins[1], node, "split_size"), em.const(ins[2], node, "dim")
        if not isinstance(size, int):
            raise ImportError_(where, "aten::split: only equal pieces (an int size) are supported")
        dim %= len(dims)
        sizes = [size] * (dims[dim] // size) + ([dims[dim] % size] if dims[dim] % size else [])
        elem = em.types[em.values[ins[0]]].rsplit("x", 1)[1][:-1]
        tys = []
        for n in sizes:
            d = list(dims)
            d[dim] = n
            tys.append("tensor<" + "x".join(str(x) for x in d) + f"x{elem}>")
        em.lists[outs[0]] = em.op_multi(node, "dnn.split", [em.ssa(ins[0], node, "input")], tys,
                                        f"dim = {dim} : i64, sizes = {i64_array(sizes)}")
        return
    # Constant tensors (buffers, such as a causal mask) are sliced and compared here.
    if kind == "aten::slice" and isinstance(em.consts.get(ins[0]), torch.Tensor):
        t = em.consts[ins[0]]
        dim, start, end, step = (em.const(v, node, "slice bound") for v in ins[1:5])
        idx = [slice(None)] * t.dim()
        idx[dim] = slice(start, end, step)
        em.consts[outs[0]] = t[tuple(idx)]
        return
    if kind == "aten::eq" and isinstance(em.consts.get(ins[0]), torch.Tensor):
        em.consts[outs[0]] = em.consts[ins[0]] == em.const(ins[1], node, "other")
        return
    if kind == "aten::masked_fill":
        mask = em.consts.get(ins[1])
        value = em.consts.get(ins[2])
        scores = em.values.get(ins[0])
        dims = dims_of(em, ins[0]) if scores else None
        causal = False
        if isinstance(mask, torch.Tensor) and dims and len(dims) >= 2 and value == float("-inf"):
            t, s_ = dims[-2], dims[-1]
            want = torch.ones(t, s_).triu(1).bool()
            m = mask.bool()
            causal = m.shape[-2:] == want.shape and bool((m == want).all())
        if not causal or scores.startswith("%pending"):
            raise ImportError_(where, "aten::masked_fill is supported only as attention's causal mask "
                               "(a lower-triangular mask buffer == 0, filled with -inf)")
        name = f"%pending{len(em.recipe)}"
        em.recipe[name] = ("causal", scores)
        em.values[outs[0]] = name
        return
    if kind == "aten::softmax" and em.values.get(ins[0], "").startswith("%pending"):
        dims = len(outs[0].type().sizes())
        if em.const(ins[1], node, "dim") % dims != dims - 1:
            raise ImportError_(where, "attention's softmax must be over the keys (the last dim)")
        name = f"%pending{len(em.recipe)}"
        em.recipe[name] = ("softmax", em.values[ins[0]])
        em.values[outs[0]] = name
        return
    if kind == "aten::dropout" and em.values.get(ins[0], "").startswith("%pending"):
        if training and bool(em.const(ins[2], node, "train")) and float(em.const(ins[1], node, "p")) > 0:
            raise ImportError_(where, "dropout of attention's weights is not supported yet (p = 0, or eval)")
        em.values[outs[0]] = em.values[ins[0]]
        return
    if kind == "aten::matmul" and em.values.get(ins[0], "").startswith("%pending"):
        em.values[outs[0]] = attention(node, em, em.values[ins[0]], ins[1], tensor_type(outs[0]))
        return
    if kind in ("aten::mul", "aten::div") and ins[0] in em.values and isinstance(em.consts.get(ins[1]), (int, float)):
        c = float(em.consts[ins[1]])
        c = c if kind == "aten::mul" else 1.0 / c
        rt = tensor_type(outs[0])
        xs = em.ssa(ins[0], node, "input")
        r = em.op(node, "dnn.mul", [xs, scalar(node, em, c, rt)], rt)
        em.recipe[r] = ("scale", xs, c)
        em.values[outs[0]] = r
        return
    if kind in ("aten::add", "aten::sub") and ins[0] in em.values and isinstance(em.consts.get(ins[1]), (int, float)):
        if len(ins) > 2 and em.const(ins[2], node, "alpha") != 1:
            raise ImportError_(where, f"{kind}: alpha must be 1")
        c = float(em.consts[ins[1]])
        rt = tensor_type(outs[0])
        f = scalar(node, em, c, rt)
        em.values[outs[0]] = em.op(node, "dnn." + kind.split("::")[1], [em.ssa(ins[0], node, "input"), f], rt)
        return
    if kind == "aten::pow" and ins[0] in em.values:
        if em.consts.get(ins[1]) != 2:
            raise ImportError_(where, "aten::pow: only a square (x ** 2) is supported")
        xs = em.ssa(ins[0], node, "input")
        em.values[outs[0]] = em.op(node, "dnn.mul", [xs, xs], tensor_type(outs[0]))
        return
    if kind == "aten::mean" and ins[0] in em.values:
        dims = em.const(ins[1], node, "dim")
        rank = len(dims_of(em, ins[0]))
        dims = sorted(d % rank for d in (dims if isinstance(dims, list) else [dims]))
        keep = bool(em.const(ins[2], node, "keepdim"))
        if len(ins) > 3 and em.consts.get(ins[3]) is not None:
            raise ImportError_(where, "aten::mean: a dtype is not supported")
        attrs = f"dims = {i64_array(dims)}" + (", keepdim = true" if keep else "")
        em.values[outs[0]] = em.op(node, "dnn.mean", [em.ssa(ins[0], node, "input")], tensor_type(outs[0]), attrs)
        return
    if kind in ("aten::rsqrt", "aten::sqrt", "aten::exp", "aten::neg", "aten::abs") and ins[0] in em.values:
        xs = em.ssa(ins[0], node, "input")
        r = em.op(node, "dnn." + kind.split("::")[1], [xs], tensor_type(outs[0]))
        em.recipe[r] = (kind.split("::")[1], xs)
        em.values[outs[0]] = r
        return
    if kind == "aten::slice" and ins[0] in em.values:
        dims = dims_of(em, ins[0])
        dim, start, end, step = (em.const(v, node, "slice bound") for v in ins[1:5])
        dim %= len(dims)
        start, end, step = slice(start, end, step).indices(dims[dim])
        if step != 1:
            raise ImportError_(where, "aten::slice: only step 1 is supported")
        xs = em.ssa(ins[0], node, "input")
        if (start, end) == (0, dims[dim]):
            em.values[outs[0]] = xs
            return
        r = em.op(node, "dnn.slice", [xs], tensor_type(outs[0]),
                  f"dim = {dim} : i64, start = {start} : i64, end = {end} : i64")
        em.recipe[r] = ("slice", xs, dim, start, end)
        em.values[outs[0]] = r
        return
    if kind == "aten::cat" and ins[0] in em.lists:
        parts = em.lists[ins[0]]
        rank = em.types[parts[0]].count("x")
        dim = em.const(ins[1], node, "dim") % rank
        r = em.op(node, "dnn.concat", parts, tensor_type(outs[0]), f"dim = {dim} : i64")
        em.recipe[r] = ("cat", parts, dim)
        em.values[outs[0]] = r
        return
    if kind == "aten::repeat_interleave" and ins[0] in em.values:
        dims = dims_of(em, ins[0])
        rep, dim = em.const(ins[1], node, "repeats"), em.const(ins[2], node, "dim")
        if not isinstance(rep, int) or dim is None or dim % len(dims) != 1 or len(dims) != 4:
            raise ImportError_(where, "aten::repeat_interleave: only an int count over dim 1 of [b, heads, s, d] (grouped-query heads) is supported")
        b_, g_, t_, d_ = dims
        xs = em.ssa(ins[0], node, "input")
        elem = em.types[xs].rsplit("x", 1)[1][:-1]
        ty = lambda ds: "tensor<" + "x".join(str(v) for v in ds) + f"x{elem}>"
        r1 = em.op(node, "dnn.reshape", [xs], ty([b_, g_, 1, t_, d_]), f"shape = {i64_array([b_, g_, 1, t_, d_])}")
        r2 = em.op(node, "dnn.broadcast_to", [r1], ty([b_, g_, rep, t_, d_]), f"shape = {i64_array([b_, g_, rep, t_, d_])}")
        r = em.op(node, "dnn.reshape", [r2], ty([b_, g_ * rep, t_, d_]), f"shape = {i64_array([b_, g_ * rep, t_, d_])}")
        em.recipe[r] = ("repeat_heads", xs, rep)
        em.values[outs[0]] = r
        return
    if kind == "aten::mul" and ins[0] in em.values and isinstance(em.consts.get(ins[1]), torch.Tensor):
        name = f"%pending{len(em.recipe)}"
        em.recipe[name] = ("mulc", em.ssa(ins[0], node, "input"), em.consts[ins[1]])
        em.values[outs[0]] = name
        return
    if kind == "aten::add" and all(em.values.get(v, "").startswith("%pending") for v in ins[:2]):
        em.values[outs[0]] = rotary(node, em, em.values[ins[0]], em.values[ins[1]], tensor_type(outs[0]))
        return
    if kind == "aten::embedding" and ins[1] in em.ranges:
        start, end = em.ranges[ins[1]]
        r = em.op(node, "dnn.slice", [em.ssa(ins[0], node, "weight")], tensor_type(outs[0]),
                  f"dim = 0 : i64, start = {start} : i64, end = {end} : i64")
        em.values[outs[0]] = r
        return
    if kind not in SUPPORTED:
        table = ", ".join(sorted(SUPPORTED))
        raise ImportError_(where, f"unsupported op '{kind}' (supported: {table}; or map it to a user op: --user-ops, docs/pytorch.md)")
    rt = tensor_type(outs[0])
    if rt is None:
        raise ImportError_(where, f"{kind}: its result has no static shape and dtype")
    x = lambda i, what: em.ssa(ins[i], node, what)
    c = lambda i, what: em.const(ins[i], node, what)
    r = None
    if kind == "aten::linear":
        xs, w = x(0, "input"), x(1, "weight")
        if ins[2] in em.consts and em.consts[ins[2]] is None:
            wt = dims_of(em, ins[1])
            t = f"tensor<{wt[1]}x{wt[0]}x{em.types[w].rsplit('x', 1)[1]}"
            wT = em.op(node, "dnn.transpose", [w], t, f"perm = {i64_array([1, 0])}")
            r = em.op(node, "dnn.matmul", [xs, wT], rt)
        else:
            r = em.op(node, "dnn.linear", [xs, w, x(2, "bias")], rt)
    elif kind in ("aten::matmul", "aten::relu", "aten::tanh", "aten::sigmoid", "aten::silu"):
        name = "dnn." + kind.split("::")[1]
        operands = [x(i, f"operand {i}") for i in range(len(ins))]
        r = em.op(node, name, operands, rt)
        if kind == "aten::matmul":
            em.recipe[r] = ("matmul", operands[0], operands[1])
    elif kind == "aten::gelu":
        approx = c(1, "approximate") if len(ins) > 1 else "none"
        if approx not in ("none", "tanh"):
            raise ImportError_(where, f"aten::gelu: approximate '{approx}' (none or tanh)")
        attrs = 'approximate = "tanh"' if approx == "tanh" else ""
        r = em.op(node, "dnn.gelu", [x(0, "input")], rt, attrs)
    elif kind in ("aten::add", "aten::sub"):
        if ins[1] not in em.values:
            raise ImportError_(where, f"{kind} with a constant tensor (a buffer) is not supported: "
                               "buffers take part only in attention's mask and rotary's tables")
        if len(ins) > 2 and c(2, "alpha") != 1:
            raise ImportError_(where, f"{kind}: alpha must be 1")
        r = em.op(node, "dnn." + kind.split("::")[1], [x(0, "input"), x(1, "other")], rt)
    elif kind in ("aten::mul", "aten::div"):
        if ins[1] not in em.values:
            raise ImportError_(where, f"{kind} with a constant tensor (a buffer) is not supported: "
                               "buffers take part only in attention's mask and rotary's tables")
        if len(ins) > 2:
            raise ImportError_(where, f"{kind}: rounding modes are not supported")
        r = em.op(node, "dnn." + kind.split("::")[1], [x(0, "input"), x(1, "other")], rt)
    elif kind == "aten::scaled_dot_product_attention":
        # (query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
        # enable_gqa=False): torch 2.x. Grouped heads (fewer key/value heads) are what
        # dnn.attention takes as they are.
        if ins[3] in em.values or em.consts.get(ins[3]) is not None:
            raise ImportError_(where, "aten::scaled_dot_product_attention: only without attn_mask (is_causal=True for a causal mask)")
        if c(4, "dropout_p"):
            raise ImportError_(where, "aten::scaled_dot_product_attention: dropout_p must be 0 (dropout inside attention is not supported)")
        qkv = [x(0, "query"), x(1, "key"), x(2, "value")]
        if any(em.types[t].count("x") != 4 for t in qkv):
            raise ImportError_(where, "aten::scaled_dot_product_attention: q, k and v must be [batch, heads, positions, width]")
        attrs = f"causal = {'true' if c(5, 'is_causal') else 'false'}"
        scale = c(6, "scale") if len(ins) > 6 else None
        if scale is not None:
            attrs += f", scale = {float(scale):.17e} : f64"
        r = em.op(node, "dnn.attention", qkv, rt, attrs)
    elif kind == "aten::softmax":
        if len(ins) > 2 and c(2, "dtype") is not None:
            raise ImportError_(where, "aten::softmax: a dtype is not supported")
        r = em.op(node, "dnn.softmax", [x(0, "input")], rt, f"dim = {int(c(1, 'dim'))} : i64")
    elif kind == "aten::layer_norm":
        if ins[2] in em.consts or ins[3] in em.consts:
            raise ImportError_(where, "aten::layer_norm without weight or bias is not supported yet")
        eps = float(c(4, "eps"))
        r = em.op(node, "dnn.layer_norm", [x(0, "input"), x(2, "weight"), x(3, "bias")], rt,
                  f"eps = {eps:.6e} : f64")
    elif kind == "aten::embedding":
        r = em.op(node, "dnn.embedding", [x(1, "indices"), x(0, "weight")], rt)
    elif kind == "aten::cross_entropy_loss":
        if c(2, "weight") is not None:
            raise ImportError_(where, "cross_entropy: class weights are not supported")
        if c(3, "reduction") != 1:
            raise ImportError_(where, "cross_entropy: only reduction='mean' is supported")
        if float(c(5, "label_smoothing")) != 0.0:
            raise ImportError_(where, "cross_entropy: label smoothing is not supported")
        r = em.op(node, "dnn.cross_entropy", [x(0, "input"), x(1, "target")], rt)
    elif kind == "aten::dropout":
        p, train = float(c(1, "p")), bool(c(2, "train"))
        if not train or p == 0.0 or not training:
            r = x(0, "input")
        else:
            # Each dropout its own mask seed, in program order (as the zoo's models number
            # theirs).
            em.dropouts += 1
            r = em.op(node, "dnn.dropout", [x(0, "input")], rt,
                      f"p = {p:.6e} : f64, seed = {em.dropouts} : i64")
    elif kind in ("aten::view", "aten::reshape"):
        dims = outs[0].type().sizes()
        r = em.op(node, "dnn.reshape", [x(0, "input")], rt, f"shape = {i64_array(dims)}")
    elif kind in ("aten::transpose", "aten::t", "aten::permute"):
        rank = len(dims_of(em, ins[0]))
        if kind == "aten::permute":
            perm = [d % rank for d in c(1, "dims")]
        else:
            d0, d1 = (0, 1) if kind == "aten::t" else (c(1, "dim0") % rank, c(2, "dim1") % rank)
            perm = list(range(rank))
            perm[d0], perm[d1] = perm[d1], perm[d0]
        xs = x(0, "input")
        r = em.op(node, "dnn.transpose", [xs], rt, f"perm = {i64_array(perm)}")
        if rank >= 2 and perm == list(range(rank - 2)) + [rank - 1, rank - 2]:
            em.recipe[r] = ("transposed", xs)
    elif kind == "aten::contiguous":
        r = x(0, "input")
    em.values[outs[0]] = r
    if r not in em.types:
        em.types[r] = rt


def attention(node, em, weights, v, result_type):
    """`softmax(causal((q @ k^T) * scale)) @ v` as one dnn.attention: `weights` is the
    pending softmax of the masked scores."""
    where, _ = where_of(node, em.user_file)
    bad = ImportError_(where, "attention's scores must be (q @ k.transpose(-2, -1)) * scale")
    _, masked = em.recipe[weights]
    _, scores = em.recipe[masked]
    scale = 1.0
    rec = em.recipe.get(scores)
    if rec and rec[0] == "scale":
        scale, scores = rec[2], rec[1]
        rec = em.recipe.get(scores)
    if not rec or rec[0] != "matmul":
        raise bad
    q, kt = rec[1], rec[2]
    rk = em.recipe.get(kt)
    if not rk or rk[0] != "transposed":
        raise bad
    k = rk[1]
    vs = em.ssa(v, node, "values")
    # Grouped-query heads repeated for the product: attention takes them as they are.
    gk, gv = em.recipe.get(k), em.recipe.get(vs)
    if gk and gv and gk[0] == gv[0] == "repeat_heads" and gk[2] == gv[2]:
        k, vs = gk[1], gv[1]
    for t in (q, k, vs):
        if em.types[t].count("x") != 4:
            raise ImportError_(where, "attention's q, k and v must be [batch, heads, positions, width]")
    return em.op(node, "dnn.attention", [q, k, vs], result_type, f"causal = true, scale = {scale:.17e} : f64")


def rotary(node, em, a, b, result_type):
    """`x * cos + rotate_half(x) * sin` as one dnn.rotary: `a`, `b` the pending products
    with the constant tables, checked against the rotate-half tables of the theta their
    second frequency gives."""
    where, _ = where_of(node, em.user_file)
    bad = ImportError_(where, "a product with a constant tensor is supported only as rotary's: "
                       "x * cos + rotate_half(x) * sin (rotate_half: cat(-x2, x1))")
    ra, rb = em.recipe.get(a), em.recipe.get(b)
    if not ra or not rb or ra[0] != "mulc" or rb[0] != "mulc":
        raise bad
    x, cos = ra[1], ra[2]
    rot, sin = rb[1], rb[2]
    rc = em.recipe.get(rot)
    if not rc or rc[0] != "cat" or len(rc[1]) != 2:
        raise bad
    neg, first = rc[1]
    rn, rf = em.recipe.get(neg), em.recipe.get(first)
    if not rn or rn[0] != "neg" or not rf or rf[0] != "slice":
        raise bad
    rs = em.recipe.get(rn[1])
    dims = [int(d) for d in em.types[x][len("tensor<"):-1].split("x")[:-1]]
    if len(dims) != 4 or not rs or rs[0] != "slice":
        raise bad
    s_, d = dims[2], dims[3]
    half = d // 2
    if rc[2] != 3 or rs[1:] != (x, 3, half, d) or rf[1:] != (x, 3, 0, half):
        raise bad
    cos, sin = cos.reshape(-1, d) if cos.dim() != 2 else cos, sin.reshape(-1, d) if sin.dim() != 2 else sin
    if tuple(cos.shape) != (s_, d) or tuple(sin.shape) != (s_, d):
        raise ImportError_(where, f"rotary: cos and sin must be [{s_}, {d}] tables")
    import math as _m

    theta = None
    if s_ > 1 and half > 1:
        angle = _m.atan2(float(sin[1, 1]), float(cos[1, 1]))
        if angle > 0:
            theta = angle ** (-d / 2.0)
    if theta is None:
        raise ImportError_(where, "rotary: cannot read theta from the tables")
    theta = float(f"{theta:.6g}")
    p = torch.arange(s_, dtype=torch.float64)[:, None]
    inv = theta ** (-2.0 * torch.arange(half, dtype=torch.float64) / d)
    want = torch.cat((p * inv, p * inv), dim=1)
    if not (torch.allclose(cos.double(), want.cos(), atol=1e-5) and torch.allclose(sin.double(), want.sin(), atol=1e-5)):
        raise ImportError_(where, f"rotary: cos and sin are not the rotate-half tables of theta {theta:g}")
    return em.op(node, "dnn.rotary", [x], result_type, f"theta = {theta:.17e} : f64")


def param_paths(graph):
    """Each prim::GetAttr value's dotted path from the module (`fc1.weight`)."""
    paths = {}
    self_value = next(iter(graph.inputs()))
    paths[self_value] = ""
    for node in graph.nodes():
        if node.kind() == "prim::GetAttr":
            base = paths.get(node.inputsAt(0))
            if base is not None:
                name = node.s("name")
                paths[node.outputsAt(0)] = f"{base}.{name}" if base else name
    return paths


def write_safetensors(path, tensors):
    header, blobs, offset = {}, [], 0
    for name, t in tensors:
        data = t.detach().contiguous().to(torch.float32).numpy().tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = path + ".partial"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def import_module(spec, inputs, seed=0, training=True, user_ops=()):
    """The MLIR text of `spec`'s module traced on `inputs` [(name, dims, dtype)], and its
    parameters [(state_dict key, tensor)] in argument order."""
    user_file, factory = load_factory(spec)
    # The module's initial parameters are drawn from torch's generator: seeded, so an
    # import is the same every time.
    torch.manual_seed(seed)
    model = factory()
    if not isinstance(model, torch.nn.Module):
        raise ImportError_("", f"{spec} returned {type(model).__name__}, not an nn.Module")
    model.train(training)
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for _, dims, dtype in inputs:
        if dtype == "f32":
            examples.append(torch.randn(dims, generator=gen))
        else:
            examples.append(torch.zeros(dims, dtype=DTYPES[dtype]))
    try:
        # Without autograd's records (the trace records the same ops): a third of the
        # memory and time on GPT-2 124M.
        with torch.no_grad():
            traced = torch.jit.trace(model, tuple(examples), check_trace=False)
    except Exception as e:  # noqa: BLE001 - the tracer's own message is the point
        raise ImportError_("", f"tracing {spec} on the example inputs failed: {e}")
    graph = traced.inlined_graph
    em = Emitter(user_file)
    for u in user_ops:
        kind, args = parse_pattern(u["torch"])
        em.user_ops.setdefault(kind, []).append((u, args))
    graph_inputs = list(graph.inputs())[1:]
    if len(graph_inputs) != len(inputs):
        raise ImportError_("", f"{spec}: forward takes {len(graph_inputs)} inputs, --input gave {len(inputs)}")
    args = []
    for k, (v, (name, _, _)) in enumerate(zip(graph_inputs, inputs)):
        ssa = f"%arg{k}"
        em.values[v] = ssa
        em.types[ssa] = tensor_type(v)
        args.append(f'{ssa}: {em.types[ssa]} {{nns.name = "{name}"}}')
    paths = param_paths(graph)
    # A parameter reached under several names (tied weights) is one argument, named as
    # named_parameters() names it first.
    canonical = {}
    for name, p in model.named_parameters():
        canonical.setdefault(id(p), name)
    buffers = dict(model.named_buffers())
    params, arg_of = [], {}

    def resolve(path):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
        return obj

    for node in graph.nodes():
        if node.kind() == "prim::GetAttr":
            out = node.outputsAt(0)
            path = paths.get(out)
            obj = resolve(path) if path else None
            if isinstance(obj, torch.nn.Parameter) and id(obj) in canonical:
                name = canonical[id(obj)]
                if name not in arg_of:
                    ssa = f"%arg{len(args)}"
                    arg_of[name] = ssa
                    em.types[ssa] = "tensor<" + "x".join(str(d) for d in obj.shape) + "xf32>"
                    args.append(f'{ssa}: {em.types[ssa]} {{nns.name = "{name}", nns.param}}')
                    params.append((name, obj))
                em.values[out] = arg_of[name]
            elif path in buffers:
                em.consts[out] = buffers[path]
            continue
        translate(node, em, training)
    ret = list(graph.outputs())
    if len(ret) != 1 or ret[0] not in em.values or em.types[em.values[ret[0]]] != "tensor<f32>":
        raise ImportError_("", f"{spec}: forward must return one scalar f32 loss")
    loss = em.values[ret[0]]
    lines = ["module {"]
    lines.append(f'  func.func @train({", ".join(args)}) -> (tensor<f32> {{nns.name = "loss"}}) {{')
    lines.extend(dead_code_removed(em.lines, [loss]))
    lines.append(f"    return {loss} : tensor<f32>")
    lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n", params


def supported_table():
    """The supported ops as a markdown table (docs/pytorch.md holds it; a test compares)."""
    rows = ["| PyTorch (aten) | nnscaler |", "|---|---|"]
    rows += [f"| `{k}` | {v} |" for k, v in sorted(SUPPORTED.items())]
    return "\n".join(rows) + "\n"


def main(argv):
    if argv == ["--supported"]:
        sys.stdout.write(supported_table())
        return
    spec, inputs, params_path, seed, training, user_ops = None, [], None, 0, True, []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--input" and i + 1 < len(argv):
            inputs.append(parse_input(argv[i + 1]))
            i += 2
        elif a == "--params" and i + 1 < len(argv):
            params_path = argv[i + 1]
            i += 2
        elif a == "--seed" and i + 1 < len(argv):
            seed = int(argv[i + 1])
            i += 2
        elif a == "--user-op" and i + 1 < len(argv):
            user_ops.append(json.loads(argv[i + 1]))
            i += 2
        elif a == "--eval":
            training = False
            i += 1
        elif spec is None and not a.startswith("--"):
            spec = a
            i += 1
        else:
            raise ImportError_("", f"unexpected argument '{a}'")
    if spec is None:
        raise ImportError_("", "no FILE.py:FACTORY")
    if not inputs:
        raise ImportError_("", "no --input NAME=SHAPE:DTYPE (one per argument of forward)")
    text, params = import_module(spec, inputs, seed, training, user_ops)
    if params_path:
        write_safetensors(params_path, params)
    sys.stdout.write(text)


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except ImportError_ as e:
        where = f"{e.where}: " if e.where else ""
        sys.stderr.write(f"error: {where}{e}\n")
        sys.exit(1)
