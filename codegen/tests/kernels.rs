//! The generated kernels, JIT-compiled for this CPU, against the CPU runtime's reference
//! kernels: every op with a scalar formula (with broadcasting and edge values), and every
//! fused kernel of GPT and Llama training steps (forward + backward + AdamW). And every
//! generated PTX module passes `ptxas` for sm_90.

use nnscaler_codegen::{fuse, ptx, Elementwise, Gpu, Group, HostKernels};
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::dnn;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::types::{AttrValue, Attrs, Elem, TensorType};
use nnscaler_frontends::{build_module, preset};
use nnscaler_passes::pipeline::{self, Step};
use nnscaler_runtime::kernels::{kernel, Ctx};
use nnscaler_runtime::rng;
use nnscaler_runtime::tensor::Tensor;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Command;

/// Relative error of `got` against `want`: per element, against the element's magnitude
/// (at least 1e-3 of the tensor's largest, so a value that cancels to near zero is judged
/// against the scale of its tensor); NaN and infinities must agree exactly.
fn error(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want
        .iter()
        .filter(|w| w.is_finite())
        .fold(0.0f64, |m, &w| m.max(f64::from(w).abs()));
    let mut worst = 0.0f64;
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        if !w.is_finite() || !g.is_finite() {
            assert!(
                (w.is_nan() && g.is_nan()) || g == w,
                "element {i}: got {g}, want {w}"
            );
            continue;
        }
        let (g, w) = (f64::from(g), f64::from(w));
        worst = worst.max((g - w).abs() / w.abs().max(1e-3 * scale).max(1e-30));
    }
    worst
}

fn values(n: usize, seed: u64, lo: f32, hi: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| lo + (hi - lo) * rng::uniform(seed, 7, i) as f32)
        .collect()
}

fn reference(op: &str, attrs: &Attrs, ins: &[Tensor], out: &[usize]) -> Vec<f32> {
    let f = kernel(op).unwrap();
    let shape: Vec<i64> = out.iter().map(|&d| d as i64).collect();
    let ty = [TensorType::new(&shape, Elem::F32)];
    let ctx = Ctx {
        attrs,
        out: &ty,
        device: None,
    };
    let refs: Vec<&Tensor> = ins.iter().collect();
    f(&ctx, &refs).unwrap()[0].f().unwrap().to_vec()
}

/// Inputs where an op is defined: positive for log, sqrt and rsqrt.
fn domain(op: &str) -> (f32, f32) {
    match op {
        "dnn.log" | "dnn.sqrt" | "dnn.rsqrt" => (1e-3, 30.0),
        "dnn.exp" => (-90.0, 88.0),
        _ => (-6.0, 6.0),
    }
}

#[test]
fn every_scalar_op_matches_the_reference() {
    // (kernel name, op, attributes, operand shapes, result shape)
    type Case = (String, &'static str, Attrs, Vec<Vec<usize>>, Vec<usize>);
    let mut cases: Vec<Case> = Vec::new();
    let tanh = Attrs::from([("approximate".to_string(), AttrValue::Str("tanh".into()))]);
    for s in dnn::SPECS.iter().filter(|s| s.traits.scalar.is_some()) {
        let n = s.operands.len();
        let shapes: Vec<(Vec<Vec<usize>>, Vec<usize>)> = if n == 1 {
            vec![(vec![vec![7, 129]], vec![7, 129])]
        } else if s.grad_of.is_some() {
            vec![(vec![vec![7, 129]; 2], vec![7, 129])]
        } else {
            vec![
                (vec![vec![7, 129], vec![7, 129]], vec![7, 129]),
                (vec![vec![7, 129], vec![129]], vec![7, 129]),
                (vec![vec![3, 1, 5], vec![4, 1]], vec![3, 4, 5]),
                (vec![vec![], vec![6, 2]], vec![6, 2]),
            ]
        };
        let attrs: Vec<Attrs> = if s.attrs.iter().any(|a| a.name == "approximate") {
            vec![Attrs::new(), tanh.clone()]
        } else {
            vec![Attrs::new()]
        };
        for (j, a) in attrs.iter().enumerate() {
            for (k, (ins, out)) in shapes.iter().enumerate() {
                let name = format!("{}_{j}_{k}", s.name.trim_start_matches("dnn."));
                cases.push((name, s.name, a.clone(), ins.clone(), out.clone()));
            }
        }
    }
    let kernels: Vec<Elementwise> = cases
        .iter()
        .map(|(name, op, a, ins, out)| {
            Elementwise::of_op(name, op, a, ins.clone(), out.clone()).unwrap()
        })
        .collect();
    let host = HostKernels::new(&kernels).unwrap();
    let mut worst = 0.0f64;
    for (c, (name, op, attrs, ins, out)) in cases.iter().enumerate() {
        let (lo, hi) = domain(op);
        let tensors: Vec<Tensor> = ins
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n: usize = s.iter().product();
                Tensor::f32(s, values(n, (c * 10 + i) as u64, lo, hi))
            })
            .collect();
        let want = reference(op, attrs, &tensors, out);
        let slices: Vec<&[f32]> = tensors.iter().map(|t| t.f().unwrap()).collect();
        let got = host.run(name, &slices).unwrap();
        let err = error(&got, &want);
        assert!(err <= 1e-5, "{name} ({op}): relative error {err:.2e}");
        worst = worst.max(err);
    }
    println!(
        "codegen: {} op kernels (host JIT) equal the reference within {worst:.2e}",
        cases.len()
    );
}

/// The math functions at their edges: saturation, zeros, negatives, infinities, NaN and
/// subnormals give what the reference (libm where the runtime uses it) gives.
#[test]
fn math_edges_match_the_reference() {
    let edge: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        -1.0,
        1e-30,
        1e-40, // subnormal
        -1e-40,
        0.6249,
        0.6251,
        9.0,
        -9.0,
        20.0,
        -20.0,
        88.7,
        88.8,
        -103.9,
        -104.1,
        -200.0,
        300.0,
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
    ];
    let ops = [
        "dnn.exp",
        "dnn.log",
        "dnn.tanh",
        "dnn.sqrt",
        "dnn.relu",
        "dnn.sigmoid",
        "dnn.gelu",
    ];
    let n = edge.len();
    let kernels: Vec<Elementwise> = ops
        .iter()
        .map(|op| {
            let name = format!("edge_{}", op.trim_start_matches("dnn."));
            Elementwise::of_op(&name, op, &Attrs::new(), vec![vec![n]], vec![n]).unwrap()
        })
        .collect();
    let host = HostKernels::new(&kernels).unwrap();
    for (k, op) in kernels.iter().zip(ops) {
        let want = reference(op, &Attrs::new(), &[Tensor::f32(&[n], edge.clone())], &[n]);
        let got = host.run(&k.name, &[&edge]).unwrap();
        for i in 0..n {
            let (g, w) = (got[i], want[i]);
            let ok = (g.is_nan() && w.is_nan())
                || g == w
                || (g - w).abs() <= 2e-6 * w.abs().max(f32::MIN_POSITIVE);
            assert!(ok, "{op}({}) = {g}, the reference gives {w}", edge[i]);
        }
    }
}

fn training_step(name: &str) -> Graph {
    let mut c = preset(name).unwrap();
    if name == "llama-tiny" {
        c.set("heads", "4").unwrap();
        c.set("kv-heads", "2").unwrap();
    }
    let text = build_module(&c).unwrap();
    let ir = IrContext::new();
    let mut m = ir.parse(&text, "model.mlir").unwrap();
    let steps = [
        Step::new("autodiff", "").unwrap(),
        Step::new("optimizer", "clip=1.0").unwrap(),
    ];
    pipeline::run(&ir, &mut m, &steps, &mut |_, _| {}, "model.mlir")
        .unwrap_or_else(|d| panic!("{d}"));
    let all: Vec<Graph> = Graph::all_in(&m).into_iter().map(|g| g.unwrap()).collect();
    all.into_iter().find(|g| g.name == "train").unwrap()
}

/// Evaluates a group's ops one by one with the reference kernels.
fn reference_group(g: &Graph, gr: &Group, ins: &[Tensor]) -> Vec<f32> {
    let mut vals: HashMap<usize, Tensor> =
        gr.inputs.iter().copied().zip(ins.iter().cloned()).collect();
    for &k in &gr.nodes {
        let n = &g.nodes[k];
        let f = kernel(&n.op).unwrap();
        let out: Vec<TensorType> = n.outputs.iter().map(|&v| g.values[v].clone()).collect();
        let ctx = Ctx {
            attrs: &n.attrs,
            out: &out,
            device: None,
        };
        let refs: Vec<&Tensor> = n.inputs.iter().map(|v| &vals[v]).collect();
        let r = f(&ctx, &refs).unwrap().remove(0);
        vals.insert(n.outputs[0], r);
    }
    vals[&gr.output].f().unwrap().to_vec()
}

/// Every elementwise op of a whole training step, fused as the generator fuses them, run on
/// random inputs: the fused kernel equals the ops one by one on the reference kernels.
fn check_step(name: &str) -> (usize, usize) {
    let g = training_step(name);
    let groups = fuse(&g).unwrap();
    let elementwise = g
        .nodes
        .iter()
        .filter(|n| dnn::spec(&n.op).is_some_and(|s| s.traits.scalar.is_some()))
        .count();
    let fused: usize = groups.iter().map(|gr| gr.nodes.len()).sum();
    assert_eq!(
        fused, elementwise,
        "{name}: every elementwise op is in one kernel"
    );
    assert!(groups.len() < elementwise, "{name}: nothing fused");
    let kernels: Vec<Elementwise> = groups.iter().map(|gr| gr.kernel.clone()).collect();
    let host = HostKernels::new(&kernels).unwrap();
    for (c, gr) in groups.iter().enumerate() {
        // Positive inputs where a log, sqrt or rsqrt could read them directly.
        let positive = gr
            .nodes
            .iter()
            .any(|&k| matches!(g.nodes[k].op.as_str(), "dnn.log" | "dnn.sqrt" | "dnn.rsqrt"));
        let (lo, hi) = if positive { (0.1, 4.0) } else { (-3.0, 3.0) };
        let ins: Vec<Tensor> = gr
            .kernel
            .inputs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n: usize = s.iter().product();
                Tensor::f32(s, values(n, (1000 + c * 10 + i) as u64, lo, hi))
            })
            .collect();
        let want = reference_group(&g, gr, &ins);
        let slices: Vec<&[f32]> = ins.iter().map(|t| t.f().unwrap()).collect();
        let got = host.run(&gr.kernel.name, &slices).unwrap();
        let err = error(&got, &want);
        assert!(
            err <= 1e-5,
            "{name}: {} differs by {err:.2e}",
            gr.kernel.name
        );
    }
    (elementwise, groups.len())
}

#[test]
fn fused_gpt_step_matches_the_reference() {
    let (ops, kernels) = check_step("nanogpt-cpu");
    println!("codegen: nanogpt-cpu step: {ops} elementwise ops in {kernels} fused kernels, each equal to the reference");
}

#[test]
fn fused_llama_step_matches_the_reference() {
    let (ops, kernels) = check_step("llama-tiny");
    println!("codegen: llama-tiny step: {ops} elementwise ops in {kernels} fused kernels, each equal to the reference");
}

/// `ptxas`: `NNSCALER_PTXAS`, else on `PATH`, else where `scripts/setup` puts it.
fn ptxas() -> PathBuf {
    if let Some(p) = std::env::var_os("NNSCALER_PTXAS") {
        return p.into();
    }
    if Command::new("ptxas")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return "ptxas".into();
    }
    let home = std::env::var_os("HOME").unwrap_or_default();
    let cached = PathBuf::from(home).join(".cache/nnscaler/bin/ptxas");
    assert!(
        cached.exists(),
        "ptxas not found (NNSCALER_PTXAS, PATH, {}): run scripts/setup, which installs it from the nvidia-cuda-nvcc-cu12 wheel",
        cached.display()
    );
    cached
}

#[test]
fn every_ptx_module_passes_ptxas() {
    let mut kernels: Vec<Elementwise> = Vec::new();
    for name in ["nanogpt-cpu", "llama-tiny"] {
        let g = training_step(name);
        for mut gr in fuse(&g).unwrap() {
            gr.kernel.name = format!("{}_{}", name.replace('-', "_"), gr.kernel.name);
            kernels.push(gr.kernel);
        }
    }
    let text = ptx(&kernels, Gpu::default()).unwrap();
    assert!(text.contains(".target sm_90") && text.contains(".version 8.0"));
    assert_eq!(text.matches(".visible .entry").count(), kernels.len());
    assert!(text.contains("ld.global.f32") && text.contains("st.global.f32"));
    assert!(
        !text.contains(".extern"),
        "a kernel calls an external function"
    );
    let dir = std::env::temp_dir().join(format!("nnscaler-ptx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("kernels.ptx");
    std::fs::write(&file, &text).unwrap();
    let out = Command::new(ptxas())
        .args(["--gpu-name", "sm_90", "-o"])
        .arg(dir.join("kernels.cubin"))
        .arg(&file)
        .output()
        .expect("ptxas runs");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "ptxas rejected the PTX: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!(
        "codegen: {} fused kernels of nanogpt-cpu and llama-tiny steps: {} lines of PTX, accepted by ptxas for sm_90",
        kernels.len(),
        text.lines().count()
    );
}
