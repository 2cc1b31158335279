//! Every covered op against the reference kernels (generated and team kernels, math edges).

use super::*;

/// The op cases: every elementwise op with broadcasting shapes, and the others' forms.
pub(super) fn op_cases() -> Vec<Case> {
    [
        formula_cases(),
        row_and_token_cases(),
        product_and_data_cases(),
        attention_cases(),
        team_cases(),
    ]
    .concat()
}

/// Every elementwise op with a formula, in each of its forms, on broadcasting shapes.
fn formula_cases() -> Vec<Case> {
    use AttrValue::Str;
    let mut cases: Vec<(&str, Attrs, Vec<TensorType>)> = Vec::new();
    for s in dnn::SPECS.iter().filter(|s| s.traits.scalar.is_some()) {
        let shapes: Vec<Vec<TensorType>> = if s.operands.len() == 1 {
            vec![vec![ty(&[7, 129])]]
        } else if s.grad_of.is_some() {
            vec![vec![ty(&[7, 129]); 2]]
        } else {
            vec![
                vec![ty(&[7, 129]), ty(&[7, 129])],
                vec![ty(&[7, 129]), ty(&[129])],
                vec![ty(&[3, 1, 5]), ty(&[4, 1])],
                vec![ty(&[]), ty(&[6, 2])],
            ]
        };
        let forms: Vec<Attrs> = if s.attrs.iter().any(|a| a.name == "approximate") {
            vec![Attrs::new(), attrs(&[("approximate", Str("tanh".into()))])]
        } else if s.name == "dnn.cast" {
            vec![
                attrs(&[("to", Str("bf16".into()))]),
                attrs(&[("to", Str("f32".into()))]),
            ]
        } else {
            vec![Attrs::new()]
        };
        for a in &forms {
            for sh in &shapes {
                cases.push((s.name, a.clone(), sh.clone()));
            }
        }
    }
    cases
}

/// Fill, reductions, the softmax family, transposes, norms and the token-indexed ops, on short lines.
fn row_and_token_cases() -> Vec<Case> {
    use AttrValue::{Float, Int, Ints};
    let mut cases: Vec<Case> = Vec::new();
    let x3 = ty(&[4, 5, 6]);
    cases.extend([
        (
            "dnn.fill",
            attrs(&[("shape", Ints(vec![3, 4])), ("value", Float(2.5))]),
            vec![],
        ),
        (
            "dnn.sum",
            attrs(&[("dims", Ints(vec![1]))]),
            vec![x3.clone()],
        ),
        (
            "dnn.sum",
            attrs(&[("dims", Ints(vec![0, 2]))]),
            vec![x3.clone()],
        ),
        (
            "dnn.sum",
            attrs(&[("dims", Ints(vec![0, 1, 2]))]),
            vec![x3.clone()],
        ),
        (
            "dnn.mean",
            attrs(&[("dims", Ints(vec![-1])), ("keepdim", AttrValue::Bool(true))]),
            vec![x3.clone()],
        ),
        (
            "dnn.max",
            attrs(&[("dims", Ints(vec![0, 1]))]),
            vec![x3.clone()],
        ),
        ("dnn.softmax", attrs(&[("dim", Int(-1))]), vec![x3.clone()]),
        ("dnn.softmax", attrs(&[("dim", Int(1))]), vec![x3.clone()]),
        (
            "dnn.log_softmax",
            attrs(&[("dim", Int(-1))]),
            vec![x3.clone()],
        ),
        (
            "dnn.log_softmax",
            attrs(&[("dim", Int(0))]),
            vec![x3.clone()],
        ),
        (
            "dnn.softmax_grad",
            attrs(&[("dim", Int(-1))]),
            vec![x3.clone(), x3.clone()],
        ),
        (
            "dnn.log_softmax_grad",
            attrs(&[("dim", Int(1))]),
            vec![x3.clone(), x3.clone()],
        ),
        (
            "dnn.transpose",
            attrs(&[("perm", Ints(vec![0, 2, 1, 3]))]),
            vec![ty(&[2, 3, 4, 5])],
        ),
        (
            "dnn.transpose",
            attrs(&[("perm", Ints(vec![1, 0]))]),
            vec![ids(&[3, 7])],
        ),
        (
            "dnn.layer_norm",
            Attrs::new(),
            vec![ty(&[6, 32]), ty(&[32]), ty(&[32])],
        ),
        (
            "dnn.rms_norm",
            attrs(&[("eps", Float(1e-6))]),
            vec![ty(&[2, 3, 32]), ty(&[32])],
        ),
        (
            "dnn.layer_norm_grad",
            Attrs::new(),
            vec![ty(&[6, 32]), ty(&[6, 32]), ty(&[32])],
        ),
        (
            "dnn.rms_norm_grad",
            Attrs::new(),
            vec![ty(&[2, 3, 32]), ty(&[2, 3, 32]), ty(&[32])],
        ),
        (
            "dnn.embedding",
            Attrs::new(),
            vec![ids(&[2, 5]), ty(&[11, 8])],
        ),
        (
            "dnn.embedding_grad",
            attrs(&[("vocab", Int(11))]),
            vec![ty(&[2, 5, 8]), ids(&[2, 5])],
        ),
        (
            "dnn.cross_entropy",
            Attrs::new(),
            vec![ty(&[10, 11]), ids(&[10])],
        ),
        (
            "dnn.cross_entropy_grad",
            Attrs::new(),
            vec![ty(&[]), ty(&[10, 11]), ids(&[10])],
        ),
        ("dnn.pick", Attrs::new(), vec![ty(&[10, 11]), ids(&[10])]),
        (
            "dnn.pick_grad",
            attrs(&[("classes", Int(11))]),
            vec![ty(&[10]), ids(&[10])],
        ),
        (
            "dnn.softmax_xent_grad",
            attrs(&[("count", Int(20))]),
            vec![ty(&[]), ty(&[10, 11]), ids(&[10]), ty(&[10, 1])],
        ),
    ]);
    cases
}

/// More token-indexed forms, the optimizer, matrix products, data movement, dropout and rotary.
fn product_and_data_cases() -> Vec<Case> {
    use AttrValue::{Float, Int, Ints};
    let x3 = ty(&[4, 5, 6]);
    let mut cases: Vec<Case> = Vec::new();
    cases.extend([
        // [tokens.., classes] logits: a batch and its positions.
        (
            "dnn.cross_entropy",
            Attrs::new(),
            vec![ty(&[2, 5, 11]), ids(&[2, 5])],
        ),
        (
            "dnn.cross_entropy_grad",
            Attrs::new(),
            vec![ty(&[]), ty(&[2, 5, 11]), ids(&[2, 5])],
        ),
        (
            "dnn.pick",
            Attrs::new(),
            vec![ty(&[2, 5, 11]), ids(&[2, 5])],
        ),
        (
            "dnn.pick_grad",
            attrs(&[("classes", Int(11))]),
            vec![ty(&[2, 5]), ids(&[2, 5])],
        ),
        (
            "dnn.softmax_xent_grad",
            attrs(&[("count", Int(20))]),
            vec![ty(&[]), ty(&[2, 5, 11]), ids(&[2, 5]), ty(&[2, 5, 1])],
        ),
        (
            "dnn.adamw",
            attrs(&[
                ("beta1", Float(0.9)),
                ("beta2", Float(0.99)),
                ("eps", Float(1e-8)),
                ("weight_decay", Float(0.1)),
            ]),
            vec![
                x3.clone(),
                x3.clone(),
                x3.clone(),
                x3.clone(),
                ty(&[]),
                ty(&[]),
            ],
        ),
        (
            "dnn.adamw",
            attrs(&[
                ("beta1", Float(0.8)),
                ("beta2", Float(0.999)),
                ("eps", Float(1e-6)),
                ("weight_decay", Float(0.0)),
            ]),
            vec![
                x3.clone(),
                x3.clone(),
                x3.clone(),
                x3.clone(),
                ty(&[]),
                ty(&[]),
                ty(&[]),
            ],
        ),
        (
            "dnn.clip_scale",
            attrs(&[("max_norm", Float(1.0))]),
            vec![ty(&[])],
        ),
        (
            "dnn.clip_scale",
            attrs(&[("max_norm", Float(100.0))]),
            vec![ty(&[])],
        ),
        (
            "dnn.reshape",
            attrs(&[("shape", Ints(vec![20, 6]))]),
            vec![x3.clone()],
        ),
        (
            "dnn.reshape",
            attrs(&[("shape", Ints(vec![21]))]),
            vec![ids(&[3, 7])],
        ),
        (
            "dnn.linear",
            Attrs::new(),
            vec![ty(&[2, 3, 16]), ty(&[24, 16]), ty(&[24])],
        ),
        ("dnn.linear", Attrs::new(), vec![ty(&[5, 16]), ty(&[8, 16])]),
        (
            "dnn.linear_weight_grad",
            Attrs::new(),
            vec![ty(&[2, 3, 24]), ty(&[2, 3, 16])],
        ),
        (
            "dnn.matmul",
            Attrs::new(),
            vec![ty(&[3, 5, 16]), ty(&[16, 7])],
        ),
        (
            "dnn.matmul",
            attrs(&[("transpose_b", AttrValue::Bool(true))]),
            vec![ty(&[3, 5, 16]), ty(&[3, 7, 16])],
        ),
        (
            "dnn.matmul",
            attrs(&[("transpose_a", AttrValue::Bool(true))]),
            vec![ty(&[3, 16, 5]), ty(&[3, 16, 7])],
        ),
    ]);
    cases.extend([
        (
            "dnn.max_grad",
            attrs(&[("dims", Ints(vec![1]))]),
            vec![ty(&[4, 6]), x3.clone()],
        ),
        (
            "dnn.max_grad",
            attrs(&[
                ("dims", Ints(vec![0, 2])),
                ("keepdim", AttrValue::Bool(true)),
            ]),
            vec![ty(&[1, 5, 1]), x3.clone()],
        ),
        (
            "dnn.slice",
            attrs(&[("dim", Int(1)), ("start", Int(1)), ("end", Int(4))]),
            vec![x3.clone()],
        ),
        (
            "dnn.slice",
            attrs(&[("dim", Int(0)), ("start", Int(2)), ("end", Int(3))]),
            vec![ids(&[3, 7])],
        ),
        (
            "dnn.pad",
            attrs(&[("dim", Int(2)), ("before", Int(2)), ("after", Int(1))]),
            vec![x3.clone()],
        ),
        (
            "dnn.pad",
            attrs(&[("dim", Int(0)), ("before", Int(0)), ("after", Int(2))]),
            vec![ids(&[3, 7])],
        ),
        (
            "dnn.concat",
            attrs(&[("dim", Int(1))]),
            vec![x3.clone(), ty(&[4, 2, 6]), x3.clone()],
        ),
        (
            "dnn.concat",
            attrs(&[("dim", Int(0))]),
            vec![ids(&[3, 7]), ids(&[1, 7])],
        ),
        (
            "dnn.split",
            attrs(&[("dim", Int(2)), ("sizes", Ints(vec![1, 3, 2]))]),
            vec![x3.clone()],
        ),
        (
            "dnn.broadcast_to",
            attrs(&[("shape", Ints(vec![3, 4, 5, 6]))]),
            vec![ty(&[4, 1, 6])],
        ),
        (
            "dnn.dropout",
            attrs(&[("p", Float(0.3)), ("seed", Int(7))]),
            vec![ty(&[6, 50])],
        ),
        (
            "dnn.dropout",
            attrs(&[("p", Float(0.1)), ("seed", Int(-3))]),
            vec![ty(&[6, 50]), ty(&[])],
        ),
        ("dnn.rotary", Attrs::new(), vec![ty(&[2, 3, 5, 8])]),
        (
            "dnn.rotary",
            attrs(&[("theta", Float(5e5))]),
            vec![ty(&[2, 3, 5, 8])],
        ),
        ("dnn.rotary_grad", Attrs::new(), vec![ty(&[2, 3, 5, 8])]),
    ]);
    cases
}

/// Attention and its gradient: the row kernels' shapes, several tiles, long keys.
fn attention_cases() -> Vec<Case> {
    use AttrValue::Float;
    let mut cases: Vec<Case> = Vec::new();
    let (q, kv) = (ty(&[2, 4, 9, 8]), ty(&[2, 2, 9, 8]));
    for a in [
        attrs(&[("causal", AttrValue::Bool(true))]),
        Attrs::new(),
        attrs(&[("causal", AttrValue::Bool(true)), ("scale", Float(0.5))]),
    ] {
        cases.push((
            "dnn.attention",
            a.clone(),
            vec![q.clone(), kv.clone(), kv.clone()],
        ));
        cases.push((
            "dnn.attention_grad",
            a,
            vec![q.clone(), q.clone(), kv.clone(), kv.clone()],
        ));
    }
    cases.push((
        "dnn.attention",
        Attrs::new(),
        vec![ty(&[1, 2, 5, 4]), ty(&[1, 2, 7, 4]), ty(&[1, 2, 7, 6])],
    ));
    // Tiled attention over several tiles (the last ones short), and rows wide enough to
    // halve the shared tiles.
    let causal = attrs(&[("causal", AttrValue::Bool(true))]);
    for (q, kv, a) in [
        (ty(&[1, 4, 100, 8]), ty(&[1, 2, 100, 8]), causal.clone()),
        (ty(&[1, 1, 70, 128]), ty(&[1, 1, 70, 128]), causal.clone()),
    ] {
        cases.push((
            "dnn.attention",
            a.clone(),
            vec![q.clone(), kv.clone(), kv.clone()],
        ));
        cases.push(("dnn.attention_grad", a, vec![q.clone(), q, kv.clone(), kv]));
    }
    // Long keys: many key tiles folded into the online softmax. (The row kernels, left
    // for rows wider than ATTN_TILE_WIDTH, are checked with the tiles below.)
    let (q, kv) = (ty(&[1, 2, 3, 4]), ty(&[1, 2, 1100, 4]));
    cases.push((
        "dnn.attention",
        Attrs::new(),
        vec![q.clone(), kv.clone(), kv.clone()],
    ));
    cases.push((
        "dnn.attention_grad",
        Attrs::new(),
        vec![q.clone(), q, kv.clone(), kv],
    ));
    cases
}

/// Lines long enough for team kernels (one block per row, `Kernel::team`).
fn team_cases() -> Vec<Case> {
    use AttrValue::{Float, Int, Ints};
    let mut cases: Vec<Case> = Vec::new();
    let long = ty(&[4, 300]);
    let (h, ln) = (ty(&[96]), ty(&[100, 96]));
    cases.extend([
        (
            "dnn.sum",
            attrs(&[("dims", Ints(vec![-1]))]),
            vec![ty(&[5, 300])],
        ),
        (
            "dnn.sum",
            attrs(&[("dims", Ints(vec![0]))]),
            vec![ty(&[300, 7])],
        ),
        (
            "dnn.mean",
            attrs(&[("dims", Ints(vec![1, 2]))]),
            vec![ty(&[3, 20, 10])],
        ),
        (
            "dnn.max",
            attrs(&[("dims", Ints(vec![-1]))]),
            vec![ty(&[4, 130])],
        ),
        // A table above EMBED_ROWS_MAX: zeroed, then each id's list of tokens summed by
        // its first token's threads (80 tokens over 11 ids: lists of several tokens).
        (
            "dnn.embedding_grad",
            attrs(&[("vocab", Int(4097))]),
            vec![ty(&[2, 40, 512]), ids(&[2, 40])],
        ),
        // Few outputs over long lines: split into parts (the last one short).
        (
            "dnn.sum",
            attrs(&[("dims", Ints(vec![0, 1]))]),
            vec![ty(&[300, 300])],
        ),
        (
            "dnn.sum",
            attrs(&[("dims", Ints(vec![0, 1]))]),
            vec![ty(&[600, 500])],
        ),
        (
            "dnn.mean",
            attrs(&[("dims", Ints(vec![1]))]),
            vec![ty(&[2, 70001])],
        ),
        (
            "dnn.max",
            attrs(&[("dims", Ints(vec![0]))]),
            vec![ty(&[70000])],
        ),
        (
            "dnn.softmax",
            attrs(&[("dim", Int(-1))]),
            vec![long.clone()],
        ),
        (
            "dnn.softmax",
            attrs(&[("dim", Int(1))]),
            vec![ty(&[2, 100, 3])],
        ),
        (
            "dnn.log_softmax",
            attrs(&[("dim", Int(-1))]),
            vec![ty(&[3, 257])],
        ),
        (
            "dnn.softmax_grad",
            attrs(&[("dim", Int(-1))]),
            vec![long.clone(), long.clone()],
        ),
        (
            "dnn.log_softmax_grad",
            attrs(&[("dim", Int(-1))]),
            vec![long.clone(), long],
        ),
        (
            "dnn.layer_norm",
            Attrs::new(),
            vec![ty(&[6, 384]), ty(&[384]), ty(&[384])],
        ),
        (
            "dnn.rms_norm",
            attrs(&[("eps", Float(1e-6))]),
            vec![ty(&[2, 3, 96]), h.clone()],
        ),
        ("dnn.layer_norm_grad", Attrs::new(), vec![ln.clone(), ln, h]),
        // Norms' weight gradients over rows cut into parts (300 rows: 4 parts of 75),
        // the last column tile short (40 columns).
        (
            "dnn.layer_norm_grad",
            Attrs::new(),
            vec![ty(&[3, 100, 40]), ty(&[3, 100, 40]), ty(&[40])],
        ),
        (
            "dnn.rms_norm_grad",
            Attrs::new(),
            vec![ty(&[300, 40]), ty(&[300, 40]), ty(&[40])],
        ),
        // Reductions over leading dims (a bias's gradient) by column tiles: one part
        // (100 rows), and parts (200 rows: 3 parts, the last short; 70 columns: the last
        // tile short).
        (
            "dnn.sum",
            attrs(&[("dims", Ints(vec![0]))]),
            vec![ty(&[100, 40])],
        ),
        (
            "dnn.sum",
            attrs(&[("dims", Ints(vec![0, 1]))]),
            vec![ty(&[4, 50, 70])],
        ),
        (
            "dnn.mean",
            attrs(&[
                ("dims", Ints(vec![0, 1])),
                ("keepdim", AttrValue::Bool(true)),
            ]),
            vec![ty(&[4, 50, 70])],
        ),
        (
            "dnn.max",
            attrs(&[("dims", Ints(vec![0]))]),
            vec![ty(&[260, 33])],
        ),
        // An embedding's gradient over parts of the tokens (1200 tokens: 4 parts), the
        // parts' tables then summed.
        (
            "dnn.embedding_grad",
            attrs(&[("vocab", Int(11))]),
            vec![ty(&[4, 300, 24]), ids(&[4, 300])],
        ),
        (
            "dnn.rms_norm_grad",
            Attrs::new(),
            vec![ty(&[2, 50, 128]), ty(&[2, 50, 128]), ty(&[128])],
        ),
        (
            "dnn.cross_entropy",
            Attrs::new(),
            vec![ty(&[70, 300]), ids(&[70])],
        ),
        (
            "dnn.cross_entropy_grad",
            Attrs::new(),
            vec![ty(&[]), ty(&[70, 300]), ids(&[70])],
        ),
        (
            "dnn.softmax_xent_grad",
            attrs(&[("count", Int(70))]),
            vec![ty(&[]), ty(&[70, 300]), ids(&[70]), ty(&[70, 1])],
        ),
    ]);
    cases
}

/// A team kernel's form: its body's variant, and the reduction, line function or RMS flag.
pub(super) fn team_form(b: &Body) -> String {
    match b {
        Body::Reduce { op, .. } => format!(
            "Reduce {}",
            format!("{op:?}").split('(').next().unwrap_or("")
        ),
        Body::Lines { op, .. } => format!("Lines {op:?}"),
        Body::Norm { rms, .. } => format!("Norm {rms}"),
        Body::NormGradRows { rms, .. } => format!("NormGradRows {rms}"),
        Body::NormGradCols { rms } => format!("NormGradCols {rms}"),
        Body::XentRows => "XentRows".into(),
        Body::MeanOf { .. } => "MeanOf".into(),
        Body::XentGrad { .. } => "XentGrad".into(),
        Body::XentGradLse { .. } => "XentGradLse".into(),
        Body::ReducePart { op, .. } => format!("ReducePart {op:?}"),
        Body::EmbeddingGradRows { parts } => format!("EmbeddingGradRows {}", *parts > 1),
        Body::ColReduce { op, parts, .. } => format!(
            "ColReduce {} {}",
            format!("{op:?}").split('(').next().unwrap_or(""),
            *parts > 1
        ),
        Body::NormGradColTiles { rms, parts } => format!("NormGradColTiles {rms} {}", *parts > 1),
        Body::AttnTiles(_) => "AttnTiles".into(),
        Body::AttnTilesBack(_) => "AttnTilesBack".into(),
        Body::AttnTilesKv(_) => "AttnTilesKv".into(),
        other => format!("{other:?}"),
    }
}

/// The kernels of each case (named `c<case>_<op>`), with its result types.
pub(super) fn lower_cases(cases: &[Case]) -> Vec<(nnscaler_codegen::Lowered, Vec<TensorType>)> {
    cases
        .iter()
        .enumerate()
        .map(|(c, (op, a, tys))| {
            let spec = dnn::spec(op).unwrap();
            let opt: Vec<Option<TensorType>> = tys.iter().cloned().map(Some).collect();
            let ctx = nnscaler_dialects::spec::OpCtx {
                operands: &opt,
                attrs: a,
            };
            let (outs, _, _) = spec.check(&ctx).unwrap_or_else(|e| panic!("{op}: {e}"));
            let name = format!("c{c}_{}", op.trim_start_matches("dnn."));
            let bufs: Vec<Buf> = tys.iter().map(Buf::of).collect();
            let out_bufs: Vec<Buf> = outs.iter().map(Buf::of).collect();
            assert!(covered(op), "{op} is not covered");
            let l = lower(&name, op, a, &bufs, &out_bufs).unwrap_or_else(|e| panic!("{op}: {e}"));
            (l, outs)
        })
        .collect()
}

/// Every covered op: its kernels (lowered, JIT-compiled for the host) against the
/// reference kernel, on random operands.
#[test]
pub(super) fn every_covered_op_matches_the_reference() {
    let cases = op_cases();
    // Every op has kernels.
    for s in dnn::SPECS.iter() {
        assert!(covered(s.name), "{} has no kernels", s.name);
    }
    for s in dnn::SPECS.iter().filter(|s| covered(s.name)) {
        assert!(
            cases.iter().any(|(op, _, _)| *op == s.name),
            "{} has kernels but no case here",
            s.name
        );
    }
    let (lowered, results): (Vec<_>, Vec<Vec<TensorType>>) =
        lower_cases(&cases).into_iter().unzip();
    let mut operands = Vec::new();
    let mut repeats = HashMap::new();
    for (op, a, tys) in cases.iter() {
        let seed = case_seed(&format!("{op} {a:?} {tys:?}"), &mut repeats);
        let (lo, hi) = domain(op);
        let mut ins: Vec<Tensor> = tys
            .iter()
            .enumerate()
            .map(|(i, t)| operand(t, seed.wrapping_add(i as u64), lo, hi, 11))
            .collect();
        if *op == "dnn.adamw" {
            // v >= 0, lr 1e-3, step 7, a clipping factor below 1.
            ins[3] = Tensor::f32(&ins[3].shape.clone(), values(120, 5, 0.0, 2.0));
            ins[4] = Tensor::scalar(1e-3);
            ins[5] = Tensor::scalar(7.0);
            if ins.len() > 6 {
                ins[6] = Tensor::scalar(0.37);
            }
        }
        if *op == "dnn.clip_scale" {
            ins[0] = Tensor::scalar(23.0);
        }
        if *op == "dnn.max_grad" {
            // Small integers: many ties, which share the gradient.
            let t = &ins[1];
            let v: Vec<f32> = t
                .f()
                .unwrap()
                .iter()
                .map(|x| (x.abs() as i32 % 3) as f32)
                .collect();
            ins[1] = Tensor::f32(&t.shape.clone(), v);
        }
        if *op == "dnn.log_softmax_grad" {
            // y is a log-softmax: log-probabilities, <= 0.
            let t = &ins[1];
            let v: Vec<f32> = t.f().unwrap().iter().map(|x| -x.abs()).collect();
            ins[1] = Tensor::f32(&t.shape.clone(), v);
        }
        if *op == "dnn.dropout" && ins.len() > 1 {
            ins[1] = Tensor::scalar(9.0);
        }
        operands.push(ins);
    }
    let kernels: Vec<Kernel> = lowered.iter().flat_map(|l| l.kernels.clone()).collect();
    // Every team form is among them (the long-line cases above).
    let teams: Vec<&Kernel> = kernels.iter().filter(|k| k.team() > 1).collect();
    let forms: std::collections::HashSet<String> =
        teams.iter().map(|k| team_form(&k.body)).collect();
    for f in [
        "Reduce Sum",
        "Reduce Mean",
        "Reduce Max",
        "Lines Softmax",
        "Lines LogSoftmax",
        "Lines SoftmaxGrad",
        "Lines LogSoftmaxGrad",
        "Norm false",
        "Norm true",
        "NormGradRows false",
        "NormGradRows true",
        "NormGradColTiles false false",
        "NormGradColTiles true false",
        "NormGradColTiles false true",
        "NormGradColTiles true true",
        "ColReduce Sum false",
        "ColReduce Sum true",
        "ColReduce Mean false",
        "ColReduce Max true",
        "XentRows",
        "MeanOf",
        "XentGrad",
        "XentGradLse",
        "ReducePart Sum",
        "ReducePart Max",
        "EmbeddingGradRows false",
        "EmbeddingGradRows true",
        "AttnTiles",
        "AttnTilesBack",
        "AttnTilesKv",
    ] {
        assert!(forms.contains(f), "no team kernel for {f} (has {forms:?})");
    }
    let host = HostKernels::new(&kernels).unwrap();
    let mut worst = 0.0f64;
    for (c, (op, a, _)) in cases.iter().enumerate() {
        let f = kernel(op).unwrap();
        let ctx = Ctx {
            op,
            attrs: a,
            out: &results[c],
            device: None,
        };
        let refs: Vec<&Tensor> = operands[c].iter().collect();
        let want = f(&ctx, &refs).unwrap();
        let ins: Vec<Data> = operands[c].iter().map(data).collect();
        let ins: Vec<&Data> = ins.iter().collect();
        let got = host.run_lowered(&lowered[c], &ins).unwrap();
        assert_eq!(got.len(), want.len(), "{op}: result count");
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            if let Data::I64(g) = g {
                assert_eq!(g.as_slice(), w.ints().unwrap(), "case {c} {op}: result {k}");
                continue;
            }
            // Sums of products (in another order than the reference's blocked GEMM):
            // judged against the tensor's scale; everything else per element.
            // The softmax gradients too: `dy - exp(y) sum(dy)` cancels, and a team
            // kernel's sum (f64, rounded once) differs from the reference's sequential
            // f32 sum by that sum's rounding (a few ulps of it: 1.8e-4 of an element that
            // cancels on a row of 300, 2e-7 of the tensor's scale).
            let dots = matches!(
                *op,
                "dnn.linear"
                    | "dnn.linear_weight_grad"
                    | "dnn.matmul"
                    | "dnn.attention"
                    | "dnn.attention_grad"
                    | "dnn.softmax_grad"
                    | "dnn.log_softmax_grad"
            );
            // An embedding's gradient over parts of the tokens sums each part in f64: more
            // exact than the reference's sequential f32 sum, whose rounding (up to 6e-5
            // of an element that cancels) is then the difference: judged as the issue's
            // fp32 tolerance reads, against the tensor's scale, and against float64 below.
            let parted = *op == "dnn.embedding_grad" && lowered[c].kernels.len() > 1;
            if parted {
                let (dy, ids) = (operands[c][0].f().unwrap(), operands[c][1].ints().unwrap());
                let w = dy.len() / ids.len();
                let n = g.f32().unwrap().len();
                let (mut exact, mut mass, mut count) =
                    (vec![0f64; n], vec![0f64; n], vec![0f64; n]);
                for (t, &id) in ids.iter().enumerate() {
                    for j in 0..w {
                        let (k, v) = (id as usize * w + j, f64::from(dy[t * w + j]));
                        exact[k] += v;
                        mass[k] += v.abs();
                        count[k] += 1.0;
                    }
                }
                // Summation in f32, in any order and grouping, is within
                // (terms - 1) * 2^-24 * sum|terms| of the exact sum, element by element.
                for (k, &got) in g.f32().unwrap().iter().enumerate() {
                    let bound = (count[k] - 1.0).max(0.0) * f64::from(f32::EPSILON) / 2.0 * mass[k];
                    let e = (f64::from(got) - exact[k]).abs();
                    assert!(
                        e <= bound,
                        "case {c} {op}: element {k} is {e:.2e} from float64 (bound {bound:.2e})"
                    );
                }
                let e64 = error_f64(g.f32().unwrap(), &exact);
                assert!(e64 <= 1e-6, "case {c} {op}: {e64:.2e} from float64");
            }
            let floor = if dots || parted { 1.0 } else { 1e-3 };
            let err = error_floor(g.f32().unwrap(), w.f().unwrap(), floor);
            // An embedding's gradient sums each row's tokens in token order from 0, as
            // the reference does: the same bits, by rows in one part or by lists (parts
            // of the tokens, summed after, agree within the tolerance).
            if *op == "dnn.embedding_grad" && lowered[c].kernels.len() == 1 {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(g.f32().unwrap()),
                    bits(w.f().unwrap()),
                    "case {c} {op}: not the reference's bits"
                );
            }
            assert!(
                err <= 1e-5,
                "case {c} {op} {a:?} result {k}: relative error {err:.2e}"
            );
            worst = worst.max(err);
        }
    }
    println!(
        "codegen: {} op cases ({} kernels, {} of them team kernels, host JIT) equal the reference within {worst:.2e}",
        cases.len(),
        kernels.len(),
        teams.len()
    );
}

/// A case's seed, of its own: FNV-1a of `key` (its op, attributes and types) and which
/// repeat of that key it is, so that adding a case changes no other case's operands.
fn case_seed(key: &str, repeats: &mut HashMap<String, u64>) -> u64 {
    let repeat = repeats.entry(key.to_string()).or_insert(0);
    *repeat += 1;
    key.bytes()
        .chain(repeat.to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
}

/// The math functions at their edges: saturation, zeros, negatives, infinities, NaN and
/// subnormals give what the reference (libm where the runtime uses it) gives.
#[test]
pub(super) fn math_edges_match_the_reference() {
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
        "dnn.abs",
        "dnn.gelu",
    ];
    let n = edge.len();
    let kernels: Vec<Kernel> = ops
        .iter()
        .map(|op| {
            let name = format!("edge_{}", op.trim_start_matches("dnn."));
            let b = Buf::f32(&[n]);
            let one = std::slice::from_ref(&b);
            lower(&name, op, &Attrs::new(), one, one)
                .unwrap()
                .kernels
                .remove(0)
        })
        .collect();
    let host = HostKernels::new(&kernels).unwrap();
    for (k, op) in kernels.iter().zip(ops) {
        let want = reference(op, &Attrs::new(), &[Tensor::f32(&[n], edge.clone())], &[n]);
        let got = host.run(&k.name, &[&Data::F32(edge.clone())]).unwrap();
        let got = got[0].f32().unwrap();
        for i in 0..n {
            let (g, w) = (got[i], want[i]);
            let ok = (g.is_nan() && w.is_nan())
                || g == w
                || (g - w).abs() <= 2e-6 * w.abs().max(f32::MIN_POSITIVE);
            assert!(ok, "{op}({}) = {g}, the reference gives {w}", edge[i]);
        }
    }
}
