//! `nnscaler calibrate --device gpu`, in two steps around `nnscaler-rt` (all a GPU machine
//! has): `--prepare DIR` writes the benchmark artifacts and their manifest
//! (`nnscaler_rt::bench`: matrix products by size, a stream, a vector op, a chain of tiny
//! kernels, and attention by its heads' shapes in f32 and bf16), `nnscaler-rt bench` times
//! them there, and `--timings FILE` fits the device's entries from what it wrote, on a
//! base cluster's other entries.

use super::{
    chrono_free_date, efficiency_curve, first_function, fit_heads, nonnegative_fit, sig,
    write_cluster, CalibrateArgs,
};
use nnscaler_passes::planner::cost::{self, Cluster};
use std::collections::BTreeMap;

/// The matrix product sides `--prepare` times, up to `max`.
fn gemm_sides(max: u64) -> Vec<u64> {
    let mut v: Vec<u64> = [256u64, 512, 1024, 2048, 4096, 8192, 16384]
        .into_iter()
        .filter(|&n| n <= max)
        .collect();
    if v.last() != Some(&max) {
        v.push(max);
    }
    v
}

/// Products in the longer bf16 chain of each size ([`bf16_chain`]).
const BF16_CHAIN: u64 = 9;

/// A function of `chain` products of `n x n` bf16 matrices, each the last one's result
/// times `b`: `a` and `b` cast to bf16 first, the last product cast back to f32.
fn bf16_chain(n: u64, chain: u64) -> String {
    let (t, h) = (
        format!("tensor<{n}x{n}xf32>"),
        format!("tensor<{n}x{n}xbf16>"),
    );
    let mut text = format!(
        "func.func @f(%a: {t} {{nns.name = \"a\"}}, %b: {t} {{nns.name = \"b\"}}) -> ({t} {{nns.name = \"c\"}}) {{\n  %p = \"dnn.cast\"(%a) {{to = \"bf16\"}} : ({t}) -> {h}\n  %q = \"dnn.cast\"(%b) {{to = \"bf16\"}} : ({t}) -> {h}\n"
    );
    let mut last = "%p".to_string();
    for k in 0..chain {
        text += &format!("  %m{k} = \"dnn.matmul\"({last}, %q) : ({h}, {h}) -> {h}\n");
        last = format!("%m{k}");
    }
    text += &format!(
        "  %c = \"dnn.cast\"({last}) {{to = \"f32\"}} : ({h}) -> {t}\n  return %c : {t}\n}}\n"
    );
    text
}

/// One bf16 product's `(FLOPs, seconds)` per size, from the two chains of each
/// ([`bf16_chain`]: their difference over their extra products; at least a quarter of the
/// longer chain's time a product, where timing noise would leave less).
pub(super) fn bf16_products(entries: &[(f64, u64, f64)]) -> Vec<(f64, f64)> {
    let mut by_size: BTreeMap<u64, Vec<(u64, f64)>> = BTreeMap::new();
    for &(flops, products, t) in entries {
        let one = flops / products.max(1) as f64;
        by_size.entry(one as u64).or_default().push((products, t));
    }
    by_size
        .into_iter()
        .filter_map(|(one, mut chains)| {
            chains.sort_by_key(|c| c.0);
            let (&(k0, t0), &(k1, t1)) = (chains.first()?, chains.last()?);
            (k1 > k0).then(|| {
                let per = ((t1 - t0) / (k1 - k0) as f64).max(t1 / k1 as f64 / 4.0);
                (one as f64, per)
            })
        })
        .collect()
}

/// `--device gpu --prepare DIR`: the benchmark artifacts (compiled as `nnscaler
/// compile` would) and their manifest, written together or not at all.
pub(super) fn prepare_gpu(a: &CalibrateArgs, dir: &str) -> Result<String, String> {
    // A directory made here is removed again when anything fails.
    let made = !std::path::Path::new(dir).exists();
    if made {
        std::fs::create_dir_all(dir).map_err(|e| format!("{dir}: {e}"))?;
    }
    let r = prepare_into(a, dir);
    if r.is_err() && made {
        let _ = std::fs::remove_dir_all(dir);
    }
    r
}

fn prepare_into(a: &CalibrateArgs, dir: &str) -> Result<String, String> {
    use nnscaler_rt::bench::{Entry, Kind, Manifest};
    let mut out = crate::output::Outputs::new();
    let mut entries = Vec::new();
    type Head = Option<(String, [f64; 5])>;
    let mut add = |name: String,
                   text: String,
                   kind: Kind,
                   (flops, bytes, ops): (f64, f64, u64),
                   head: Head| {
        let g = first_function(&text, &name)?;
        let art =
            nnscaler_codegen::artifact(&g, &format!("calibrate {name}"), None, Default::default())?;
        let file = format!("{name}.nnsx");
        out.stage(
            &std::path::Path::new(dir).join(&file).to_string_lossy(),
            art.to_bytes()?,
        )?;
        entries.push(Entry {
            name,
            artifact: file,
            kind,
            flops,
            bytes,
            ops,
            seconds: None,
            op: head.as_ref().map(|h| h.0.clone()),
            heads: head.map(|h| h.1),
        });
        Ok::<(), String>(())
    };
    for n in gemm_sides(a.max_size) {
        let t = format!("tensor<{n}x{n}xf32>");
        add(
            format!("gemm-{n}"),
            format!("func.func @f(%a: {t} {{nns.name = \"a\"}}, %b: {t} {{nns.name = \"b\"}}) -> ({t} {{nns.name = \"c\"}}) {{\n  %c = \"dnn.matmul\"(%a, %b) : ({t}, {t}) -> {t}\n  return %c : {t}\n}}\n"),
            Kind::Gemm,
            (2.0 * (n * n * n) as f64, 0.0, 1),
            None,
        )?;
    }
    // bf16 products on the tensor cores, by size: a chain of one product and one of
    // BF16_CHAIN, the operands cast in and the last result out (arguments are f32), so
    // that the two differ by their extra products alone.
    for n in gemm_sides(a.max_size) {
        for chain in [1, BF16_CHAIN] {
            add(
                format!("gemm-bf16-{n}-x{chain}"),
                bf16_chain(n, chain),
                Kind::GemmBf16,
                (2.0 * (chain * n * n * n) as f64, 0.0, chain + 3),
                None,
            )?;
        }
    }
    let n = (4 * a.max_size * a.max_size).min(1 << 26);
    let t = format!("tensor<{n}xf32>");
    add(
        "add".into(),
        format!("func.func @f(%a: {t} {{nns.name = \"a\"}}, %b: {t} {{nns.name = \"b\"}}) -> ({t} {{nns.name = \"c\"}}) {{\n  %c = \"dnn.add\"(%a, %b) : ({t}, {t}) -> {t}\n  return %c : {t}\n}}\n"),
        Kind::Stream,
        (0.0, 3.0 * 4.0 * n as f64, 1),
        None,
    )?;
    // gelu (tanh form) at the op spec's 8 FLOPs an element, as the CPU calibration counts.
    add(
        "gelu".into(),
        format!("func.func @f(%a: {t} {{nns.name = \"a\"}}) -> ({t} {{nns.name = \"c\"}}) {{\n  %c = \"dnn.gelu\"(%a) : ({t}) -> {t}\n  return %c : {t}\n}}\n"),
        Kind::Vector,
        (8.0 * n as f64, 0.0, 1),
        None,
    )?;
    // The optimizer: AdamW over many small parameters (its fixed cost a tensor) and over a
    // few large ones (its rate), its FLOPs and bytes as the cost model counts them.
    let m = (a.max_size / 4).max(16) as usize;
    let many: Vec<[usize; 2]> = vec![[16, 16]; 96];
    let large: Vec<[usize; 2]> = vec![[m, m]; 4];
    for (name, shapes) in [("adamw-many", many), ("adamw-large", large)] {
        let shapes: Vec<&[usize]> = shapes.iter().map(|s| &s[..]).collect();
        let text = super::adamw_text(&shapes, true);
        let g = first_function(&text, name)?;
        let updates: Vec<_> = g.nodes.iter().filter(|n| n.op == "dnn.adamw").collect();
        let flops: f64 = updates
            .iter()
            .map(|n| nnscaler_passes::transforms::place::op_flops(&g, n))
            .sum();
        let bytes: f64 = updates
            .iter()
            .flat_map(|n| n.inputs.iter().chain(&n.outputs))
            .map(|&v| g.values[v].bytes() as f64)
            .sum();
        add(
            name.into(),
            text,
            Kind::Optimizer,
            (flops, bytes, updates.len() as u64),
            None,
        )?;
    }
    // A chain of tiny kernels: each add depends on the last (no fusion across a
    // transpose), so each is one launch.
    let t8 = "tensor<8x8xf32>";
    let mut text =
        format!("func.func @f(%x: {t8} {{nns.name = \"x\"}}) -> ({t8} {{nns.name = \"y\"}}) {{\n");
    let mut last = "%x".to_string();
    let links = 100;
    for k in 0..links {
        text += &format!(
            "  %a{k} = \"dnn.add\"({last}, %x) : ({t8}, {t8}) -> {t8}\n  %t{k} = \"dnn.transpose\"(%a{k}) {{perm = array<i64: 1, 0>}} : ({t8}) -> {t8}\n"
        );
        last = format!("%t{k}");
    }
    text += &format!("  return {last} : {t8}\n}}\n");
    add(
        "launches".into(),
        text,
        Kind::Launch,
        (0.0, 0.0, 2 * links),
        None,
    )?;
    // Attention as its own family: forward and gradient, causal, f32 and on bf16 values
    // (cast in and out, so the compiled kernels are the tensor-core ones mixed precision
    // gets), over a grid of heads' shapes the cost model's `head_kernels` are fitted to.
    for (heads, s, d) in attention_grid(a.max_size) {
        for bf16 in [false, true] {
            for grad in [false, true] {
                let (key, text) = attention_benchmark(heads, s, d, grad, bf16);
                let causal_products = if grad { 5.0 } else { 2.0 };
                let flops = causal_products * (heads * s * s * d) as f64;
                let name = format!(
                    "{}-h{heads}-s{s}-d{d}{}",
                    if grad { "attention-grad" } else { "attention" },
                    if bf16 { "-bf16" } else { "" }
                );
                let shape = [heads as f64, s as f64, s as f64, d as f64, d as f64];
                add(
                    name,
                    text,
                    Kind::Attention,
                    (flops, 0.0, 1),
                    Some((key, shape)),
                )?;
            }
        }
    }
    let m = Manifest {
        source: format!(
            "nnscaler calibrate --device gpu --prepare {dir} --max-size {}, {}",
            a.max_size,
            chrono_free_date()
        ),
        backend: None,
        entries,
    };
    let count = m.entries.len();
    let json = serde_json::to_string_pretty(&m).map_err(|e| e.to_string())?;
    let manifest = std::path::Path::new(dir).join("calibrate.json");
    out.stage(&manifest.to_string_lossy(), json.into_bytes())?;
    out.commit()?;
    Ok(format!(
        "wrote {count} benchmarks and {}; time them where the GPU is with: nnscaler-rt bench {} --backend cuda -o timings.json\nthen fit here: nnscaler calibrate --device gpu --timings timings.json -o gpu.toml\n",
        manifest.display(),
        manifest.display()
    ))
}

/// The attention benchmarks' `(heads, positions, head dim)`: the four longest of 16 to
/// 2048 positions up to a quarter of `max_size` at head dim 64, and the next to longest
/// at 128 as well (16 and 32 below a `max_size` of 1024, for a quick run on a host), with
/// heads enough for about `max_size^3 / 8` score FLOPs (1 to 256). Five shapes for the
/// four coefficients of `head_kernels`, as few as that takes: each shape is four
/// artifacts (forward and gradient, f32 and bf16) in the device check's 64 MiB.
fn attention_grid(max_size: u64) -> Vec<(u64, u64, u64)> {
    let top = (max_size / 4).clamp(16, 2048);
    let mut sides: Vec<u64> = [16u64, 32, 64, 128, 256, 512, 1024, 2048]
        .into_iter()
        .filter(|&s| s <= top)
        .collect();
    sides = sides.split_off(sides.len().saturating_sub(4));
    let dims: [u64; 2] = if max_size >= 1024 {
        [64, 128]
    } else {
        [16, 32]
    };
    let budget = max_size.pow(3) / 8;
    let heads = |s: u64, d: u64| (budget / (s * s * d)).clamp(1, 256);
    let mut grid: Vec<(u64, u64, u64)> = sides
        .iter()
        .map(|&s| (heads(s, dims[0]), s, dims[0]))
        .collect();
    if let Some(&s) = sides.iter().rev().nth(1).or(sides.last()) {
        grid.push((heads(s, dims[1]), s, dims[1]));
    }
    grid
}

/// One attention benchmark: its cost-model key and its function (`grad`: the gradient's
/// op; `bf16`: on bf16 values, cast from the f32 arguments and back).
fn attention_benchmark(heads: u64, s: u64, d: u64, grad: bool, bf16: bool) -> (String, String) {
    let op = if grad {
        "dnn.attention_grad"
    } else {
        "dnn.attention"
    };
    let key = if bf16 {
        format!("{op}.bf16")
    } else {
        op.to_string()
    };
    let shape = format!("1x{heads}x{s}x{d}");
    let f = format!("tensor<{shape}xf32>");
    let e = if bf16 {
        format!("tensor<{shape}xbf16>")
    } else {
        f.clone()
    };
    let ins: &[&str] = if grad {
        &["do", "q", "k", "v"]
    } else {
        &["q", "k", "v"]
    };
    let outs: &[&str] = if grad { &["dq", "dk", "dv"] } else { &["o"] };
    let mut t = format!(
        "func.func @f({}) -> ({}) {{\n",
        ins.iter()
            .map(|n| format!("%{n}: {f} {{nns.name = \"{n}\"}}"))
            .collect::<Vec<_>>()
            .join(", "),
        outs.iter()
            .map(|n| format!("{f} {{nns.name = \"{n}\"}}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut args = Vec::new();
    for n in ins {
        if bf16 {
            t += &format!("  %{n}b = \"dnn.cast\"(%{n}) {{to = \"bf16\"}} : ({f}) -> {e}\n");
            args.push(format!("%{n}b"));
        } else {
            args.push(format!("%{n}"));
        }
    }
    let mut results: Vec<String> = outs.iter().map(|n| format!("%{n}r")).collect();
    let lhs = if grad {
        "%r:3".to_string()
    } else {
        "%r".to_string()
    };
    let types = vec![e.clone(); outs.len()].join(", ");
    t += &format!(
        "  {lhs} = \"{op}\"({}) {{causal = true}} : ({}) -> ({types})\n",
        args.join(", "),
        vec![e.clone(); ins.len()].join(", ")
    );
    for (i, r) in results.iter_mut().enumerate() {
        let v = if grad { format!("%r#{i}") } else { "%r".into() };
        if bf16 {
            t += &format!("  {r} = \"dnn.cast\"({v}) {{to = \"f32\"}} : ({e}) -> {f}\n");
        } else {
            *r = v;
        }
    }
    t += &format!(
        "  return {} : {}\n}}\n",
        results.join(", "),
        vec![f.clone(); outs.len()].join(", ")
    );
    (key, t)
}

/// `--device gpu --timings FILE`: the device's rates, curve and per-launch cost fitted
/// from the timed benchmarks, on `--base`'s other entries.
pub(super) fn fit_gpu(a: &CalibrateArgs, path: &str) -> Result<String, String> {
    use nnscaler_rt::bench::{Kind, Manifest};
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let m: Manifest = serde_json::from_str(&text)
        .map_err(|e| format!("{path}: not a calibration manifest ({e})"))?;
    let backend = m
        .backend
        .clone()
        .ok_or_else(|| format!("{path}: not timed yet (run nnscaler-rt bench on it)"))?;
    let secs = |e: &nnscaler_rt::bench::Entry| {
        e.seconds
            .filter(|s| *s > 0.0 && s.is_finite())
            .ok_or_else(|| format!("{path}: '{}' has no time", e.name))
    };
    let of = |k: Kind| m.entries.iter().filter(move |e| e.kind == k);
    let mut report = format!("fitting {path} (timed on the {backend} backend)\n");
    let one = |k: Kind, what: &str| -> Result<&nnscaler_rt::bench::Entry, String> {
        of(k)
            .next()
            .ok_or_else(|| format!("{path}: no {what} benchmark"))
    };
    let launches = one(Kind::Launch, "launch")?;
    let overhead = secs(launches)? / launches.ops.max(1) as f64;
    let mut products = Vec::new();
    for e in of(Kind::Gemm) {
        products.push((e.flops, secs(e)?));
    }
    if products.is_empty() {
        return Err(format!("{path}: no matrix product benchmark"));
    }
    // Each product's launch is the model's op_overhead: taken out of its rate.
    let (peak, efficiency) = efficiency_curve(&products, overhead);
    for ((e, &(flops, t)), [_, eff]) in of(Kind::Gemm).zip(&products).zip(&efficiency) {
        report += &format!(
            "  {}: {:.2} GFLOP/s ({:.2} after the launch)\n",
            e.name,
            flops / t / 1e9,
            eff * peak / 1e9
        );
    }
    // bf16 products: the tensor cores' peak and curve (the base's rate and f32 curve kept
    // when there are none).
    let mut chains = Vec::new();
    for e in of(Kind::GemmBf16) {
        chains.push((e.flops, e.ops.saturating_sub(3), secs(e)?));
    }
    let bf16 = bf16_products(&chains);
    let bf16_fit = (!bf16.is_empty()).then(|| efficiency_curve(&bf16, overhead));
    if let Some((peak16, curve)) = &bf16_fit {
        for (&(flops, t), [_, eff]) in bf16.iter().zip(curve) {
            report += &format!(
                "  bf16 products of {:.3e} FLOPs: {:.2} GFLOP/s ({:.2} after the launch)\n",
                flops,
                flops / t / 1e9,
                eff * peak16 / 1e9
            );
        }
    }
    let stream = one(Kind::Stream, "memory")?;
    let bandwidth = stream.bytes / secs(stream)?;
    let vector = one(Kind::Vector, "vector")?;
    let vector_rate = vector.flops / secs(vector)?;
    report += &format!(
        "  {}: {:.2} GB/s\n  {}: {:.2} GFLOP/s\n  {}: {:.2} us a kernel\n",
        stream.name,
        bandwidth / 1e9,
        vector.name,
        vector_rate / 1e9,
        launches.name,
        overhead * 1e6
    );
    // Attention by its heads' shapes, one fit per op and precision (the model adds the
    // launch: taken out here).
    let mut attention: BTreeMap<String, Vec<([f64; 4], f64)>> = BTreeMap::new();
    for e in of(Kind::Attention) {
        let (Some(op), Some(shape)) = (&e.op, e.heads) else {
            return Err(format!(
                "{path}: '{}' is an attention benchmark without its op and heads",
                e.name
            ));
        };
        let t = (secs(e)? - overhead).max(1e-9);
        attention
            .entry(op.clone())
            .or_default()
            .push((cost::head_terms(shape), t));
    }
    let mut head_kernels = BTreeMap::new();
    for (op, rows) in &attention {
        let (coef, worst) =
            fit_heads(rows).ok_or_else(|| format!("{path}: {op}: no fit of its heads' times"))?;
        report += &format!(
            "  {op} per head: {:.3} us + {:.2} ns a row + {:.4} ns a score + {:.5} ns a score and dim ({} shapes, worst {:.0}% off)\n",
            coef[0] * 1e6,
            coef[1] * 1e9,
            coef[2] * 1e9,
            coef[3] * 1e9,
            rows.len(),
            worst * 100.0
        );
        head_kernels.insert(op.clone(), coef.map(sig));
    }
    // The optimizer's kernel entry: `fixed` a tensor and `factor` on its roofline (at the
    // rates just fitted), through the two sets' times.
    let mut rows = Vec::new();
    for e in of(Kind::Optimizer) {
        let roofline = (e.flops / vector_rate).max(e.bytes / bandwidth);
        rows.push(([e.ops as f64, roofline], secs(e)?));
    }
    // Timings too noisy for a positive factor leave the update at the roofline (a
    // warning), not the whole calibration undone.
    let fit = (rows.len() >= 2).then(|| nonnegative_fit(&rows)).flatten();
    let optimizer = match fit.filter(|c| c[1] > 0.0) {
        Some([fixed, factor]) => {
            report += &format!(
                "  dnn.adamw: {:.2} us a tensor + x{factor:.2} its roofline ({} sets)\n",
                fixed * 1e6,
                rows.len()
            );
            Some([sig(fixed), sig(factor)])
        }
        None if !rows.is_empty() => {
            let w = format!(
                "the optimizer's {} timings give no fit with a positive factor: dnn.adamw is left at its roofline",
                rows.len()
            );
            eprintln!("nnscaler calibrate: warning: {w}");
            report += &format!("  warning: {w}\n");
            None
        }
        None => None,
    };
    let mut c = cost::load(&a.base)?;
    let kept_factors = c
        .device
        .kernels
        .keys()
        .any(|op| op != "dnn.adamw" || optimizer.is_none());
    c.device.head_kernels.extend(head_kernels);
    if let Some(k) = optimizer {
        c.device.kernels.insert("dnn.adamw".into(), k);
    }
    let fitted = [peak, bandwidth, vector_rate];
    for w in implausible(
        &c,
        &a.base,
        &backend,
        fitted,
        bf16_fit.as_ref().map(|f| f.0),
    ) {
        eprintln!("nnscaler calibrate: warning: {w}");
        report += &format!("  warning: {w}\n");
    }
    if let Some((peak16, curve)) = &bf16_fit {
        c.device.matrix_flops_bf16 = Some(sig(*peak16));
        c.device.matrix_efficiency_bf16 = curve.iter().map(|&[f, e]| [f, sig(e)]).collect();
    }
    c.name = format!("{}-measured", c.name);
    c.device.matrix_flops = sig(peak);
    c.device.matrix_efficiency = efficiency.iter().map(|&[f, e]| [f, sig(e)]).collect();
    c.device.memory_bandwidth = sig(bandwidth);
    c.device.vector_flops = sig(vector_rate);
    c.device.op_overhead = sig(overhead);
    c.device.source = format!(
        "nnscaler calibrate --device gpu --timings {path} ({}; timed on the {backend} backend) on {}, {}",
        m.source,
        a.base,
        chrono_free_date()
    );
    report += &format!(
        "  kept from {}: memory, {}the network{}\n",
        a.base,
        if bf16_fit.is_some() {
            ""
        } else {
            "the bf16 rate, "
        },
        if kept_factors { ", per-op factors" } else { "" }
    );
    report += &write_cluster(&c, &a.output)?;
    Ok(report)
}

/// Fitted figures (`[matrix FLOP/s, memory bytes/s, vector FLOP/s]`, and the bf16
/// products' FLOP/s when timed) a factor of 100 or more from base preset `c`'s (timings
/// from another machine than the base describes, e.g. the host backend's onto a GPU
/// preset), and a bf16 rate kept from the base (none timed) that the fitted f32 rate makes
/// implausible: one warning each.
fn implausible(
    c: &Cluster,
    base: &str,
    backend: &str,
    fitted: [f64; 3],
    bf16: Option<f64>,
) -> Vec<String> {
    const FACTOR: f64 = 100.0;
    let d = &c.device;
    let mut out = Vec::new();
    let mut named = vec![
        ("matrix products", d.matrix_flops, fitted[0], "FLOP/s"),
        ("memory bandwidth", d.memory_bandwidth, fitted[1], "B/s"),
        ("vector ops", d.vector_flops, fitted[2], "FLOP/s"),
    ];
    if let (Some(now), Some(was)) = (bf16, d.matrix_flops_bf16) {
        named.push(("bf16 matrix products", was, now, "FLOP/s"));
    }
    for (what, was, now, unit) in named {
        if was > 0.0 && now > 0.0 && (now / was >= FACTOR || was / now >= FACTOR) {
            out.push(format!(
                "the fitted {what} ({} {unit}) are {} the {base} preset's ({} {unit}){}",
                sig(now),
                if now < was {
                    format!("{:.0}x below", was / now)
                } else {
                    format!("{:.0}x above", now / was)
                },
                sig(was),
                if backend == "host" {
                    ": timed on the host backend, they describe this CPU, not the base's device"
                } else {
                    ": were the timings made on the device the base describes?"
                }
            ));
        }
    }
    if let (Some(b), None) = (d.matrix_flops_bf16, bf16) {
        if fitted[0] > 0.0 && b / fitted[0] >= FACTOR {
            out.push(format!(
                "the bf16 rate kept from {base} ({} FLOP/s) is {:.0}x the fitted f32 rate ({} FLOP/s); a step in bf16 would be predicted on the base's device, the rest on the timed one",
                sig(b),
                b / fitted[0],
                sig(fitted[0])
            ));
        }
    }
    out
}
