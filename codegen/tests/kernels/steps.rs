//! Whole training steps: fused and whole GPT/Llama steps against the interpreter, bf16 storage and rounding.

use super::*;

/// A training step of preset `name`, with `bf16`: mixed precision (`--autocast=bf16`).
pub(super) fn training_step_in(name: &str, bf16: bool) -> Graph {
    training_step_cast(name, bf16.then_some("bf16"))
}

/// A training step of preset `name` after `--autocast` with these options, if any.
pub(super) fn training_step_cast(name: &str, autocast: Option<&str>) -> Graph {
    let mut c = preset(name).unwrap();
    if name == "llama-tiny" {
        c.set("heads", "4").unwrap();
        c.set("kv-heads", "2").unwrap();
    }
    let text = build_module(&c).unwrap();
    let ir = IrContext::new();
    let mut m = ir.parse(&text, "model.mlir").unwrap();
    let mut steps = vec![
        nnscaler_passes::registry::step("autodiff", "").unwrap(),
        nnscaler_passes::registry::step("optimizer", "clip=1.0").unwrap(),
    ];
    if let Some(options) = autocast {
        steps.insert(
            0,
            nnscaler_passes::registry::step("autocast", options).unwrap(),
        );
    }
    pipeline::run(&ir, &mut m, &steps, &mut |_, _| {}, "model.mlir")
        .unwrap_or_else(|d| panic!("{d}"));
    let all: Vec<Graph> = Graph::all_in(&m).into_iter().map(|g| g.unwrap()).collect();
    all.into_iter().find(|g| g.name == "train").unwrap()
}

/// Evaluates a group's ops one by one with the reference kernels.
pub(super) fn reference_group(g: &Graph, gr: &Group, ins: &[Tensor]) -> Vec<f32> {
    let mut vals: HashMap<nnscaler_dialects::graph::ValueId, Tensor> =
        gr.inputs.iter().copied().zip(ins.iter().cloned()).collect();
    for &k in &gr.nodes {
        let n = &g.nodes[k];
        let f = kernel(&n.op).unwrap();
        let out: Vec<TensorType> = n.outputs.iter().map(|&v| g.values[v].clone()).collect();
        let ctx = Ctx {
            op: &n.op,
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
pub(super) fn check_step(name: &str) -> (usize, usize) {
    check_step_in(name, false)
}

pub(super) fn check_step_in(name: &str, bf16: bool) -> (usize, usize) {
    let g = training_step_in(name, bf16);
    let groups = fuse(&g).unwrap();
    let elementwise = g
        .nodes
        .iter()
        .filter(|n| n.op.spec().is_some_and(|s| s.traits.scalar.is_some()))
        .count();
    let fused: usize = groups.iter().map(|gr| gr.nodes.len()).sum();
    assert_eq!(
        fused, elementwise,
        "{name}: every elementwise op is in one kernel"
    );
    assert!(groups.len() < elementwise, "{name}: nothing fused");
    let kernels: Vec<Kernel> = groups.iter().map(|gr| gr.kernel.clone()).collect();
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
            .map(|(i, b)| {
                Tensor::f32(
                    &b.shape,
                    values(b.len(), (1000 + c * 10 + i) as u64, lo, hi),
                )
            })
            .collect();
        let want = reference_group(&g, gr, &ins);
        let datas: Vec<Data> = ins.iter().map(data).collect();
        let refs: Vec<&Data> = datas.iter().collect();
        let got = host.run(&gr.kernel.name, &refs).unwrap();
        let err = error(got[0].f32().unwrap(), &want);
        assert!(
            err <= 1e-5,
            "{name}: {} differs by {err:.2e}",
            gr.kernel.name
        );
    }
    (elementwise, groups.len())
}

#[test]
pub(super) fn fused_gpt_step_matches_the_reference() {
    let (ops, kernels) = check_step("nanogpt-cpu");
    println!("codegen: nanogpt-cpu step: {ops} elementwise ops in {kernels} fused kernels, each equal to the reference");
}

/// With mixed precision the casts fuse with their neighbours, and every bf16 value a
/// kernel stores is rounded as the reference rounds it.
#[test]
pub(super) fn fused_bf16_gpt_step_matches_the_reference() {
    let (ops, kernels) = check_step_in("nanogpt-cpu", true);
    println!("codegen: nanogpt-cpu bf16 step: {ops} elementwise ops in {kernels} fused kernels, each equal to the reference");
}

#[test]
pub(super) fn fused_llama_step_matches_the_reference() {
    let (ops, kernels) = check_step("llama-tiny");
    println!("codegen: llama-tiny step: {ops} elementwise ops in {kernels} fused kernels, each equal to the reference");
}

/// Arguments of a training step: the batch (ids below `vocab`), parameters and moments
/// (normal, v >= 0), lr 1e-3 and step 5.
pub(super) fn step_inputs(g: &Graph, vocab: i64) -> Vec<Tensor> {
    g.args
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let t = &g.values[a.value];
            let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
            let n: usize = shape.iter().product();
            let name = a.name().unwrap_or("");
            if !t.elem.is_float() {
                return operand(t, 100 + i as u64, 0.0, 1.0, vocab);
            }
            match name {
                "lr" => Tensor::scalar(1e-3),
                "step" => Tensor::scalar(5.0),
                _ if name.starts_with("adam.v.") => {
                    Tensor::f32(&shape, values(n, 200 + i as u64, 0.0, 1e-4))
                }
                _ => Tensor::f32(
                    &shape,
                    (0..n as u64)
                        .map(|j| 0.1 * rng::normal(300 + i as u64, 1, j) as f32)
                        .collect(),
                ),
            }
        })
        .collect()
}

/// A whole training step (forward, backward, clipping, AdamW) as generated kernels on the
/// host: every result (loss, next parameters, next moments) equals the CPU interpreter's.
pub(super) fn whole_step(name: &str, vocab: i64) {
    whole_step_in(name, vocab, false);
}

pub(super) fn whole_step_in(name: &str, vocab: i64, bf16: bool) {
    whole_step_cast(name, vocab, bf16.then_some("bf16"));
}

/// [`whole_step_in`] after `--autocast` with these options, if any.
pub(super) fn whole_step_cast(name: &str, vocab: i64, autocast: Option<&str>) {
    let bf16 = autocast.is_some();
    let g = training_step_cast(name, autocast);
    let p = nnscaler_codegen::compile(&g, None).unwrap_or_else(|e| panic!("{name}: {e}"));
    // Every layer's attention keeps its statistics for its backward.
    let attentions = g.nodes.iter().filter(|n| n.op == "dnn.attention").count();
    let kept = p
        .kernels
        .iter()
        .filter(|k| matches!(&k.body, Body::AttnTilesBack(a) | Body::AttnMmaBack(a) if a.saved))
        .count();
    assert!(attentions > 0, "{name}: no attention");
    // In mixed precision, attention runs on tensor cores (forward, dq and dk/dv) where its
    // heads take them: a head dim a multiple of 16 (nanoGPT's 64; not llama-tiny's 4).
    let head_dim = g
        .nodes
        .iter()
        .find(|n| n.op == "dnn.attention")
        .and_then(|n| g.values[n.inputs[0]].shape.last().copied())
        .unwrap_or(0);
    let cores = p
        .kernels
        .iter()
        .filter(|k| {
            matches!(
                &k.body,
                Body::AttnMma(_) | Body::AttnMmaBack(_) | Body::AttnMmaKv(_)
            )
        })
        .count();
    assert_eq!(
        cores,
        if bf16 && head_dim % 16 == 0 {
            3 * attentions
        } else {
            0
        },
        "{name}: tensor-core kernels"
    );
    assert_eq!(
        kept, attentions,
        "{name}: backward kernels keeping the forward's statistics"
    );
    // Reshapes take their operand's buffer: no copy launch of one remains.
    let reshapes = g.nodes.iter().filter(|n| n.op == "dnn.reshape").count();
    let copies = p
        .launches
        .iter()
        .filter(|l| l.nodes.iter().any(|&k| g.nodes[k].op == "dnn.reshape"))
        .filter(|l| matches!(l.work, nnscaler_codegen::Work::Kernel(k) if p.kernels[k].body == Body::Copy))
        .count();
    println!("codegen: {name}: {reshapes} reshapes, {copies} copied");
    assert_eq!(copies, 0, "{name}: reshape copies left");
    let host = HostKernels::new(&p.kernels).unwrap();
    let ins = step_inputs(&g, vocab);
    let want = nnscaler_runtime::run(&g, ins.clone(), &Default::default())
        .unwrap_or_else(|e| panic!("{}", e.message));
    let got = host
        .run_program(&p, ins.iter().map(data).collect())
        .unwrap();
    // In mixed precision a value a rounding apart in f32 (the attention's online softmax
    // sums in another order than the reference) can round to the neighbouring bf16, 2^-8
    // relative, and carry on from there: bf16 results are held to one bf16 step of the
    // tensor's scale.
    let tol = if bf16 { 2f64.powi(-8) } else { 1e-5 };
    let mut worst = 0.0f64;
    let mut over = Vec::new();
    assert_eq!(got.len(), want.len(), "{name}: result count");
    for ((o, w), gv) in g.outputs.iter().zip(&want).zip(&got) {
        let err = error_floor(gv.f32().unwrap(), w.f().unwrap(), 1.0);
        if err > tol {
            over.push(format!("{} {err:.2e}", o.name().unwrap_or("?")));
        }
        worst = worst.max(err);
    }
    assert!(over.is_empty(), "{name}: {over:?}");
    let teams = p.kernels.iter().filter(|k| k.team() > 1).count();
    assert!(
        teams > 0,
        "{name}: no team kernel (its norms' rows are 64 or longer)"
    );
    println!(
        "codegen: {name}{} training step as {} launches of {} kernels ({teams} team kernels; host JIT): {} results equal the interpreter's within {worst:.2e}",
        autocast.map(|o| format!(" --autocast=\"{o}\"")).unwrap_or_default(),
        p.launches.len(),
        p.kernels.len(),
        got.len()
    );
}

#[test]
pub(super) fn whole_gpt_step_matches_the_interpreter() {
    whole_step("nanogpt-cpu", 65);
}

#[test]
pub(super) fn whole_llama_step_matches_the_interpreter() {
    whole_step("llama-tiny", 11);
}

/// Mixed precision: bf16 values rounded where they are stored (fused formulas, and a
/// rounding launch after attention, reductions), most of them in 2-byte buffers.
#[test]
pub(super) fn whole_bf16_gpt_step_matches_the_interpreter() {
    whole_step_in("nanogpt-cpu", 65, true);
}

/// Every activation in bf16 (`--autocast="bf16 activations=bf16"`): norms, elementwise
/// chains, softmax and cross-entropy's gradients read and write bf16, in 2-byte buffers.
#[test]
pub(super) fn whole_bf16_activations_steps_match_the_interpreter() {
    whole_step_cast("nanogpt-cpu", 65, Some("bf16 activations=bf16"));
    whole_step_cast("llama-tiny", 11, Some("bf16 activations=bf16"));
}

/// 2-byte bf16 storage (`program::store_bf16`) computes the same bits as bf16 values in
/// f32 buffers, with fewer launches (no rounding after a product that stores bf16) and
/// fewer bytes, where attention stays on the register tiles; with its forward on tensor
/// cores (the default), within bf16 rounding.
#[test]
pub(super) fn bf16_storage_gives_the_same_bits_as_f32_storage() {
    let g = training_step_in("nanogpt-cpu", true);
    let p16 = nnscaler_codegen::program::compile_register_attention(&g, None).unwrap();
    let mma = nnscaler_codegen::compile(&g, None).unwrap();
    let on_cores = |p: &nnscaler_codegen::Program| {
        p.kernels
            .iter()
            .filter(|k| matches!(k.body, Body::AttnMma(_)))
            .count()
    };
    assert_eq!(on_cores(&p16), 0);
    assert_eq!(
        on_cores(&mma),
        4,
        "every layer's attention forward on tensor cores"
    );
    let p32 = nnscaler_codegen::program::compile_f32_storage(&g, None).unwrap();
    let stored = |p: &nnscaler_codegen::Program, elt: Elt| -> (usize, usize) {
        let bs: Vec<&Buf> = p.values.iter().flatten().filter(|b| b.elt == elt).collect();
        (bs.len(), bs.iter().map(|b| b.len() * elt.size()).sum())
    };
    let (n16, bytes16) = stored(&p16, Elt::Bf16);
    let (_, f32_16) = stored(&p16, Elt::F32);
    let (_, f32_32) = stored(&p32, Elt::F32);
    assert!(n16 > 0, "no value stored as bf16");
    assert_eq!(stored(&p32, Elt::Bf16).0, 0);
    assert!(
        p16.launches.len() < p32.launches.len(),
        "no rounding launch saved"
    );
    let ins = step_inputs(&g, 65);
    let run = |p: &nnscaler_codegen::Program| {
        HostKernels::new(&p.kernels)
            .unwrap()
            .run_program(p, ins.iter().map(data).collect())
            .unwrap()
    };
    let (a, b) = (run(&p16), run(&p32));
    for ((x, y), o) in a.iter().zip(&b).zip(&g.outputs) {
        let (x, y) = (x.f32().unwrap(), y.f32().unwrap());
        let same = x.len() == y.len() && x.iter().zip(y).all(|(u, v)| u.to_bits() == v.to_bits());
        assert!(same, "{}: 2-byte storage differs", o.name().unwrap_or("?"));
    }
    // The tensor cores: each result within a bf16 rounding step (2^-8 relative) of the
    // tiles' on the tensor's scale, as whole_step_in holds the bf16 step to the
    // interpreter.
    let mut worst = 0.0f64;
    for ((x, y), o) in run(&mma).iter().zip(&b).zip(&g.outputs) {
        let e = error_floor(x.f32().unwrap(), y.f32().unwrap(), 1.0);
        assert!(
            e <= 2f64.powi(-8),
            "{}: tensor cores {e:.2e} from the tiles",
            o.name().unwrap_or("?")
        );
        worst = worst.max(e);
    }
    println!("codegen: nanogpt-cpu bf16 step with attention on tensor cores: within {worst:.2e} of the register tiles");
    println!(
        "codegen: nanogpt-cpu bf16 step: {n16} values stored as bf16 ({bytes16} bytes; {} as f32 before), value buffers {} -> {} bytes, {} -> {} launches; {} results the same bits",
        bytes16 * 2,
        f32_32,
        f32_16 + bytes16,
        p32.launches.len(),
        p16.launches.len(),
        a.len()
    );
}

/// `dnn.cast` to bf16 on the host JIT rounds bit for bit as the reference does: ties to
/// even, subnormals, the overflow to infinity past the largest bf16, NaN kept.
#[test]
pub(super) fn bf16_rounding_matches_the_reference() {
    let tie = 2f32.powi(-8);
    let edge: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        1.0 + tie,       // a tie: to the even 1.0
        1.0 + 3.0 * tie, // a tie: to the even 1.0 + 2^-6
        1.0 + 1.5 * tie, // above the tie: up
        -(1.0 + tie),
        1e-40, // subnormal
        -3.0e38,
        3.4e38, // past the largest bf16 (3.3895e38) by more than half a step: infinity
        f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        0.1,
        -123.456,
    ];
    let n = edge.len();
    let a = attrs(&[("to", AttrValue::Str("bf16".into()))]);
    let b = Buf::f32(&[n]);
    let one = std::slice::from_ref(&b);
    let k = lower("edge_cast", "dnn.cast", &a, one, one)
        .unwrap()
        .kernels
        .remove(0);
    let host = HostKernels::new(std::slice::from_ref(&k)).unwrap();
    let want = reference("dnn.cast", &a, &[Tensor::f32(&[n], edge.clone())], &[n]);
    let got = host.run(&k.name, &[&Data::F32(edge.clone())]).unwrap();
    for (i, (g, w)) in got[0].f32().unwrap().iter().zip(&want).enumerate() {
        assert!(
            (g.is_nan() && w.is_nan()) || g.to_bits() == w.to_bits(),
            "cast({}) = {g}, the reference gives {w}",
            edge[i]
        );
    }
    assert_eq!(want[3], 1.0);
    assert_eq!(want[4], 1.0 + 4.0 * tie);
    assert_eq!(want[5], 1.0 + 2.0 * tie);
    assert_eq!(want[9], f32::INFINITY);
}
