//! Every `dnn` op, forward and backward, against PyTorch, plus finite-difference checks of
//! every VJP.
//!
//! Each case builds `loss = sum_i sum(op(x...)_i * w_i)` with random operands and weights,
//! differentiates it with `--autodiff` (so the op's VJP rule and the backward ops' kernels
//! run), executes it on the CPU runtime and compares results and operand gradients with
//! PyTorch autograd (test/oracle/ops.py). Errors are `max|ours - torch| / max|torch|` per
//! tensor.

use crate::common;

use nnscaler_dialects::diag::SrcLoc;
use nnscaler_dialects::graph::{Graph, Output, ValueId};
use nnscaler_dialects::types::{AttrValue, Attrs, Elem, TensorType};
use nnscaler_passes::transforms::autodiff::differentiate;
use nnscaler_runtime::tensor::{Data, Tensor};
use nnscaler_runtime::{io, rng, run, Options};

#[derive(Clone, Copy)]
enum Gen {
    /// Standard normal.
    Normal,
    /// |normal| + 0.5 (for log, sqrt, rsqrt, denominators).
    Positive,
    /// Integers in [0, n).
    Below(i64),
}

struct Case {
    op: &'static str,
    operands: Vec<(Vec<i64>, Gen)>,
    attrs: Vec<(&'static str, AttrValue)>,
}

fn case(op: &'static str, operands: &[(&[i64], Gen)], attrs: &[(&'static str, AttrValue)]) -> Case {
    Case {
        op,
        operands: operands.iter().map(|(s, g)| (s.to_vec(), *g)).collect(),
        attrs: attrs.to_vec(),
    }
}

fn i(v: i64) -> AttrValue {
    AttrValue::Int(v)
}
fn ints(v: &[i64]) -> AttrValue {
    AttrValue::Ints(v.to_vec())
}
fn f(v: f64) -> AttrValue {
    AttrValue::Float(v)
}
fn b(v: bool) -> AttrValue {
    AttrValue::Bool(v)
}
fn s(v: &str) -> AttrValue {
    AttrValue::Str(v.into())
}

const N: Gen = Gen::Normal;
const P: Gen = Gen::Positive;

fn cases() -> Vec<Case> {
    let mut v = vec![
        case("dnn.matmul", &[(&[3, 5], N), (&[5, 7], N)], &[]),
        case(
            "dnn.matmul",
            &[(&[5, 3], N), (&[5, 7], N)],
            &[("transpose_a", b(true))],
        ),
        case(
            "dnn.matmul",
            &[(&[3, 5], N), (&[7, 5], N)],
            &[("transpose_b", b(true))],
        ),
        case("dnn.matmul", &[(&[2, 3, 5], N), (&[2, 5, 4], N)], &[]),
        case("dnn.matmul", &[(&[2, 3, 5], N), (&[5, 4], N)], &[]),
        case(
            "dnn.matmul",
            &[(&[2, 5, 3], N), (&[2, 4, 5], N)],
            &[("transpose_a", b(true)), ("transpose_b", b(true))],
        ),
        case(
            "dnn.matmul",
            &[(&[2, 5, 3], N), (&[5, 4], N)],
            &[("transpose_a", b(true))],
        ),
        case(
            "dnn.matmul",
            &[(&[2, 3, 5], N), (&[4, 5], N)],
            &[("transpose_b", b(true))],
        ),
        case(
            "dnn.linear",
            &[(&[2, 3, 5], N), (&[7, 5], N), (&[7], N)],
            &[],
        ),
        case("dnn.linear", &[(&[4, 5], N), (&[3, 5], N)], &[]),
        case("dnn.linear", &[(&[5], N), (&[3, 5], N), (&[3], N)], &[]),
        case("dnn.add", &[(&[2, 3], N), (&[3], N)], &[]),
        case("dnn.add", &[(&[2, 1, 4], N), (&[3, 1], N)], &[]),
        case("dnn.add", &[(&[2, 3, 4], N), (&[3, 4], N)], &[]),
        case("dnn.mul", &[(&[2, 3, 4], N), (&[2, 3, 1], N)], &[]),
        case("dnn.sub", &[(&[2, 3], N), (&[2, 1], N)], &[]),
        case("dnn.mul", &[(&[3, 4], N), (&[], N)], &[]),
        case("dnn.mul", &[(&[1, 4], N), (&[3, 1], N)], &[]),
        case("dnn.div", &[(&[2, 3], N), (&[1, 3], P)], &[]),
        case("dnn.div", &[(&[3], N), (&[2, 3], P)], &[]),
        case("dnn.gelu", &[(&[3, 7], N)], &[]),
        case("dnn.gelu", &[(&[3, 7], N)], &[("approximate", s("tanh"))]),
        case("dnn.softmax", &[(&[2, 3, 5], N)], &[]),
        case("dnn.softmax", &[(&[2, 3, 5], N)], &[("dim", i(1))]),
        case("dnn.log_softmax", &[(&[4, 3], N)], &[("dim", i(0))]),
        case("dnn.log_softmax", &[(&[2, 9], N)], &[]),
        case(
            "dnn.layer_norm",
            &[(&[2, 3, 8], N), (&[8], N), (&[8], N)],
            &[("eps", f(1e-5))],
        ),
        case(
            "dnn.rms_norm",
            &[(&[3, 6], N), (&[6], N)],
            &[("eps", f(1e-6))],
        ),
        case(
            "dnn.embedding",
            &[(&[2, 3], Gen::Below(11)), (&[11, 4], N)],
            &[],
        ),
        case(
            "dnn.reshape",
            &[(&[2, 3, 4], N)],
            &[("shape", ints(&[6, 4]))],
        ),
        case(
            "dnn.transpose",
            &[(&[2, 3, 4], N)],
            &[("perm", ints(&[2, 0, 1]))],
        ),
        case("dnn.transpose", &[(&[3, 5], N)], &[("perm", ints(&[1, 0]))]),
        case(
            "dnn.slice",
            &[(&[3, 5], N)],
            &[("dim", i(1)), ("start", i(1)), ("end", i(4))],
        ),
        case(
            "dnn.slice",
            &[(&[4, 2, 3], N)],
            &[("dim", i(0)), ("start", i(0)), ("end", i(3))],
        ),
        case(
            "dnn.pad",
            &[(&[2, 3], N)],
            &[("dim", i(1)), ("before", i(1)), ("after", i(2))],
        ),
        case(
            "dnn.concat",
            &[(&[2, 3], N), (&[2, 2], N)],
            &[("dim", i(1))],
        ),
        case(
            "dnn.concat",
            &[(&[1, 3], N), (&[2, 3], N), (&[3, 3], N)],
            &[("dim", i(0))],
        ),
        case(
            "dnn.split",
            &[(&[5, 4], N)],
            &[("dim", i(0)), ("sizes", ints(&[2, 3]))],
        ),
        case(
            "dnn.split",
            &[(&[2, 6, 3], N)],
            &[("dim", i(1)), ("sizes", ints(&[1, 2, 3]))],
        ),
        case("dnn.sum", &[(&[2, 3, 4], N)], &[("dims", ints(&[1]))]),
        case(
            "dnn.sum",
            &[(&[2, 3, 4], N)],
            &[("dims", ints(&[0, 2])), ("keepdim", b(true))],
        ),
        case(
            "dnn.mean",
            &[(&[3, 5], N)],
            &[("dims", ints(&[1])), ("keepdim", b(true))],
        ),
        case("dnn.mean", &[(&[3, 5], N)], &[("dims", ints(&[0, 1]))]),
        case("dnn.max", &[(&[3, 5], N)], &[("dims", ints(&[1]))]),
        case(
            "dnn.max",
            &[(&[2, 3, 4], N)],
            &[("dims", ints(&[0, 2])), ("keepdim", b(true))],
        ),
        case(
            "dnn.broadcast_to",
            &[(&[3, 1], N)],
            &[("shape", ints(&[2, 3, 4]))],
        ),
        case(
            "dnn.broadcast_to",
            &[(&[3, 4], N)],
            &[("shape", ints(&[2, 3, 4]))],
        ),
        case(
            "dnn.attention",
            &[(&[2, 2, 5, 4], N), (&[2, 2, 5, 4], N), (&[2, 2, 5, 3], N)],
            &[],
        ),
        case(
            "dnn.attention",
            &[(&[2, 2, 5, 4], N), (&[2, 2, 7, 4], N), (&[2, 2, 7, 3], N)],
            &[("causal", b(true))],
        ),
        case(
            "dnn.attention",
            &[(&[1, 4, 6, 4], N), (&[1, 2, 6, 4], N), (&[1, 2, 6, 4], N)],
            &[("causal", b(true)), ("scale", f(0.3))],
        ),
        case("dnn.rotary", &[(&[1, 2, 5, 6], N)], &[]),
        case(
            "dnn.rotary",
            &[(&[2, 1, 7, 8], N)],
            &[("theta", f(500000.0))],
        ),
        case(
            "dnn.cross_entropy",
            &[(&[7, 5], N), (&[7], Gen::Below(5))],
            &[],
        ),
        case("dnn.pick", &[(&[7, 5], N), (&[7], Gen::Below(5))], &[]),
        case(
            "dnn.cross_entropy",
            &[(&[2, 3, 5], N), (&[2, 3], Gen::Below(5))],
            &[],
        ),
        case(
            "dnn.pick",
            &[(&[2, 3, 5], N), (&[2, 3], Gen::Below(5))],
            &[],
        ),
    ];
    for op in [
        "dnn.neg",
        "dnn.exp",
        "dnn.sigmoid",
        "dnn.tanh",
        "dnn.silu",
        "dnn.abs",
        "dnn.relu",
    ] {
        v.push(case(op, &[(&[3, 7], N)], &[]));
    }
    for op in ["dnn.log", "dnn.sqrt", "dnn.rsqrt"] {
        v.push(case(op, &[(&[3, 7], P)], &[]));
    }
    v
}

fn gen(shape: &[i64], g: Gen, seed: u64, stream: u64) -> Tensor {
    let dims: Vec<usize> = shape.iter().map(|&d| d as usize).collect();
    let t = common::normal(&dims, seed, stream);
    match g {
        Gen::Normal => t,
        Gen::Positive => Tensor::f32(
            &dims,
            t.f().unwrap().iter().map(|x| x.abs() + 0.5).collect(),
        ),
        Gen::Below(n) => {
            let count: usize = dims.iter().product();
            Tensor::i64(
                &dims,
                (0..count as u64)
                    .map(|k| (rng::bits(seed, stream, k) % n as u64) as i64)
                    .collect(),
            )
        }
    }
}

fn named(n: &str, param: bool) -> Attrs {
    let mut a = Attrs::new();
    a.insert("nns.name".into(), AttrValue::Str(n.into()));
    if param {
        a.insert("nns.param".into(), AttrValue::Unit);
    }
    a
}

/// The forward graph of a case, and the names of its inputs in argument order.
fn build(c: &Case) -> (Graph, usize) {
    let loc = SrcLoc::default();
    let mut g = Graph {
        name: "case".into(),
        ..Graph::default()
    };
    let mut xs = Vec::new();
    for (k, (shape, gen)) in c.operands.iter().enumerate() {
        let float = !matches!(gen, Gen::Below(_));
        let elem = if float { Elem::F32 } else { Elem::I64 };
        xs.push(g.add_arg(TensorType::new(shape, elem), named(&format!("x{k}"), float)));
    }
    let attrs: Attrs = c
        .attrs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let ys = g
        .add(c.op, &xs, attrs, &loc)
        .unwrap_or_else(|e| panic!("{}: {e}", c.op));
    let mut loss: Option<ValueId> = None;
    for (k, &y) in ys.iter().enumerate() {
        let ty = g.values[y].clone();
        let w = g.add_arg(ty.clone(), named(&format!("w{k}"), false));
        let p = g.add1("dnn.mul", &[y, w], Attrs::new(), &loc).unwrap();
        let sc = if ty.shape.is_empty() {
            p
        } else {
            let mut a = Attrs::new();
            a.insert(
                "dims".into(),
                AttrValue::Ints((0..ty.shape.len() as i64).collect()),
            );
            g.add1("dnn.sum", &[p], a, &loc).unwrap()
        };
        loss = Some(match loss {
            None => sc,
            Some(l) => g.add1("dnn.add", &[l, sc], Attrs::new(), &loc).unwrap(),
        });
    }
    g.outputs.push(Output {
        value: loss.unwrap(),
        attrs: named("loss", false),
    });
    for (k, &y) in ys.iter().enumerate() {
        g.outputs.push(Output {
            value: y,
            attrs: named(&format!("y{k}"), false),
        });
    }
    (g, ys.len())
}

/// Operand `k` draws from stream `k`, result weight `k` from stream `100 + k`.
fn inputs_for(c: &Case, g: &Graph, seed: u64) -> Vec<Tensor> {
    g.args
        .iter()
        .map(|a| {
            let name = a.name().unwrap();
            let k: u64 = name[1..].parse().unwrap();
            if name.starts_with('w') {
                gen(&g.values[a.value].shape, Gen::Normal, seed, 100 + k)
            } else {
                let (shape, gn) = &c.operands[k as usize];
                gen(shape, *gn, seed, k)
            }
        })
        .collect()
}

fn loss_of(g: &Graph, inputs: &[Tensor]) -> f64 {
    let out = run(g, inputs.to_vec(), &Options::default()).unwrap();
    f64::from(out[0].f().unwrap()[0])
}

/// Central differences of the loss at a few elements of every float operand, against the
/// autodiff gradient. Returns the worst error relative to the gradient's largest magnitude.
fn finite_differences(c: &Case, fwd: &Graph, inputs: &[Tensor], grads: &[(usize, Tensor)]) -> f64 {
    let mut worst = 0.0f64;
    for (arg, grad) in grads {
        let gv = grad.f().unwrap();
        let scale = gv
            .iter()
            .map(|x| f64::from(x.abs()))
            .fold(0.0, f64::max)
            .max(1e-3);
        let n = gv.len();
        let picks: Vec<usize> = (0..n.min(5))
            .map(|j| (rng::bits(9, *arg as u64, j as u64) % n as u64) as usize)
            .collect();
        for j in picks {
            let x = inputs[*arg].f().unwrap()[j];
            let h = 1e-2f32 * x.abs().max(1.0);
            let at = |d: f32| {
                let mut ins = inputs.to_vec();
                if let Data::F32(v) = &mut ins[*arg].data {
                    v[j] = x + d;
                }
                loss_of(fwd, &ins)
            };
            let (up, mid, down) = (at(h), at(0.0), at(-h));
            let (right, left) = ((up - mid) / f64::from(h), (mid - down) / f64::from(h));
            if (right - left).abs() > 0.05 * right.abs().max(left.abs()).max(1e-2 * scale) {
                // A kink (relu at 0, a max switching): no derivative to compare against.
                continue;
            }
            let fd = (up - down) / (2.0 * f64::from(h));
            let err = (fd - f64::from(gv[j])).abs() / scale;
            assert!(
                err < 2e-2,
                "{} {:?}: d loss / d x{arg}[{j}]: finite difference {fd}, autodiff {}",
                c.op,
                c.attrs,
                gv[j]
            );
            worst = worst.max(err);
        }
    }
    worst
}

#[test]
fn ops_match_pytorch_and_finite_differences() {
    let dir = common::scratch("oracle_ops");
    let cases = cases();
    let mut manifest = Vec::new();
    let mut ours: Vec<Vec<(String, Tensor)>> = Vec::new();
    let mut fd_worst = 0.0f64;
    for (id, c) in cases.iter().enumerate() {
        let (fwd, _nres) = build(c);
        let bwd = differentiate(&fwd).unwrap_or_else(|(_, m)| panic!("{}: {m}", c.op));
        // Through MLIR text and back: what nnscaler-opt --autodiff prints must parse.
        let inputs = inputs_for(c, &fwd, 1000 + id as u64);
        let outs = run(
            &bwd,
            inputs.clone(),
            &Options {
                check_finite: true,
                ..Options::default()
            },
        )
        .unwrap_or_else(|e| panic!("{} {:?}: {}", c.op, c.attrs, e.message));
        let named: Vec<(String, Tensor)> = bwd
            .outputs
            .iter()
            .zip(outs)
            .map(|(o, t)| (o.name().unwrap().to_string(), t))
            .collect();
        let grads: Vec<(usize, Tensor)> = named
            .iter()
            .filter_map(|(n, t)| {
                n.strip_prefix("grad.x")
                    .map(|k| (k.parse().unwrap(), t.clone()))
            })
            .collect();
        fd_worst = fd_worst.max(finite_differences(c, &fwd, &inputs, &grads));
        let files: Vec<(String, Elem, &Tensor)> = fwd
            .args
            .iter()
            .zip(&inputs)
            .map(|(a, t)| (a.name().unwrap().to_string(), fwd.values[a.value].elem, t))
            .collect();
        std::fs::write(
            dir.join(format!("case{id}.in.safetensors")),
            io::to_bytes(&files).unwrap(),
        )
        .unwrap();
        let attrs: serde_json::Map<String, serde_json::Value> = c
            .attrs
            .iter()
            .map(|(k, v)| {
                let j = match v {
                    AttrValue::Int(n) => serde_json::json!(n),
                    AttrValue::Float(x) => serde_json::json!(x),
                    AttrValue::Bool(x) => serde_json::json!(x),
                    AttrValue::Str(x) => serde_json::json!(x),
                    AttrValue::Ints(x) => serde_json::json!(x),
                    other => panic!("attribute {other:?} has no JSON form"),
                };
                (k.to_string(), j)
            })
            .collect();
        manifest.push(
            serde_json::json!({"id": id, "op": c.op, "attrs": attrs, "operands": c.operands.len()}),
        );
        ours.push(named);
    }
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string(&manifest).unwrap(),
    )
    .unwrap();
    common::run_oracle("ops.py", &[&dir]);
    let mut worst = (0.0f64, String::new());
    let mut failures = Vec::new();
    for (id, (c, named)) in cases.iter().zip(&ours).enumerate() {
        let torch = io::load(&dir.join(format!("case{id}.torch.safetensors"))).unwrap();
        for (name, t) in named {
            let r = torch
                .iter()
                .find(|s| &s.name == name)
                .unwrap_or_else(|| panic!("{}: torch did not produce '{name}'", c.op));
            let err = t.rel_err(&r.tensor).unwrap_or_else(|| {
                panic!(
                    "{} {name}: ours {} vs torch {}",
                    c.op,
                    t.describe(),
                    r.tensor.describe()
                )
            });
            if err > worst.0 {
                worst = (err, format!("{} {:?} {name}", c.op, c.attrs));
            }
            if err > 1e-5 {
                failures.push(format!(
                    "{} {:?} {name}: relative error {err:.2e}",
                    c.op, c.attrs
                ));
            }
        }
    }
    println!(
        "oracle: {} op cases vs PyTorch, worst relative error {:.2e} ({}); finite differences worst {:.2e}",
        cases.len(),
        worst.0,
        worst.1,
        fd_worst
    );
    assert!(
        failures.is_empty(),
        "ops disagree with PyTorch:\n{}",
        failures.join("\n")
    );
}

#[test]
fn dropout_is_seeded_scaled_and_differentiates_with_its_mask() {
    let c = case(
        "dnn.dropout",
        &[(&[64, 50], N)],
        &[("p", f(0.25)), ("seed", i(7))],
    );
    let (fwd, _) = build(&c);
    let bwd = differentiate(&fwd).unwrap();
    let inputs = inputs_for(&c, &fwd, 5);
    let a = run(&bwd, inputs.clone(), &Options::default()).unwrap();
    let b2 = run(&bwd, inputs.clone(), &Options::default()).unwrap();
    assert_eq!(a, b2, "same seed, same mask");
    let (x, w) = (inputs[0].f().unwrap(), inputs[1].f().unwrap());
    let y = a[1].f().unwrap();
    let g = a[2].f().unwrap();
    let mut kept = 0;
    for k in 0..x.len() {
        if y[k] != 0.0 {
            kept += 1;
            assert!((y[k] - x[k] / 0.75).abs() < 1e-6);
            assert!(
                (g[k] - w[k] / 0.75).abs() < 1e-6,
                "kept elements pass dy / (1 - p)"
            );
        } else {
            assert_eq!(g[k], 0.0, "dropped elements get no gradient");
        }
    }
    let frac = f64::from(kept) / x.len() as f64;
    assert!((frac - 0.75).abs() < 0.03, "kept fraction {frac}");
    let grads = vec![(0usize, a[2].clone())];
    finite_differences(&c, &fwd, &inputs, &grads);
}

/// The attribute sets that choose each form of a formula op (an op with attributes must be
/// listed here, so that a new form is not left untested).
fn formula_forms(op: &str) -> Vec<Attrs> {
    let with = |k: &str, v: &str| {
        let mut a = Attrs::new();
        a.insert(k.into(), s(v));
        a
    };
    match op {
        "dnn.gelu" | "dnn.gelu_grad" => vec![Attrs::new(), with("approximate", "tanh")],
        "dnn.cast" => vec![with("to", "f32"), with("to", "bf16")],
        _ => {
            let spec = nnscaler_dialects::dnn::spec(op).unwrap();
            assert!(
                spec.attrs.is_empty(),
                "{op} has attributes: list its forms in formula_forms"
            );
            vec![Attrs::new()]
        }
    }
}

#[test]
fn every_formula_written_in_torch_matches_its_f32_instantiation() {
    // emit-torch writes an elementwise op without a line of its own as its formula in torch
    // (`torch_formula`); every formula op, in every form, evaluated that way by PyTorch
    // agrees with the CPU runtime's kernel (the formula's f32 instantiation).
    let dir = common::scratch("oracle_formulas");
    let mut manifest = Vec::new();
    let mut ours = Vec::new();
    for spec in nnscaler_dialects::dnn::SPECS {
        let Some(rule) = spec.traits.scalar else {
            continue;
        };
        for attrs in formula_forms(spec.name) {
            let id = ours.len();
            let inputs: Vec<Tensor> = (0..rule.arity())
                .map(|k| {
                    let positive = matches!(spec.name, "dnn.log" | "dnn.sqrt" | "dnn.rsqrt")
                        || (spec.name == "dnn.div" && k == 1);
                    gen(
                        &[4, 33],
                        if positive { P } else { N },
                        11,
                        (id * 2 + k) as u64,
                    )
                })
                .collect();
            let slices: Vec<&[f32]> = inputs.iter().map(|t| t.f().unwrap()).collect();
            let mut out = vec![0.0f32; 4 * 33];
            rule.eval(&attrs, &slices, &mut out).unwrap();
            let names: Vec<String> = (0..rule.arity()).map(|k| format!("x{k}")).collect();
            let expr =
                nnscaler_tools::emit_torch::torch_formula(&rule.expr(&attrs).unwrap(), &names);
            let files: Vec<(String, Elem, &Tensor)> = names
                .iter()
                .cloned()
                .zip(&inputs)
                .map(|(n, t)| (n, Elem::F32, t))
                .collect();
            std::fs::write(
                dir.join(format!("case{id}.in.safetensors")),
                io::to_bytes(&files).unwrap(),
            )
            .unwrap();
            manifest.push(serde_json::json!({"id": id, "expr": expr}));
            ours.push((spec.name, attrs, expr, Tensor::f32(&[4, 33], out)));
        }
    }
    assert!(ours.len() >= 20, "only {} formula cases", ours.len());
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string(&manifest).unwrap(),
    )
    .unwrap();
    common::run_oracle("formulas.py", &[&dir]);
    let mut failures = Vec::new();
    for (id, (op, attrs, expr, t)) in ours.iter().enumerate() {
        let torch = io::load(&dir.join(format!("case{id}.torch.safetensors"))).unwrap();
        let y = &torch
            .iter()
            .find(|s| s.name == "y")
            .expect("torch wrote y")
            .tensor;
        let err = t.rel_err(y).unwrap_or(f64::INFINITY);
        if err.is_nan() || err > 1e-5 {
            failures.push(format!("{op} {attrs:?}: {err:e} ({expr})"));
        }
    }
    assert!(
        failures.is_empty(),
        "formulas in torch differ:\n{}",
        failures.join("\n")
    );
}
