//! `nnscaler calibrate --device cpu [-o CLUSTER.toml]`: the cost model's device entries
//! measured by microbenchmarks on this machine, one thread (the CPU runtime's kernels):
//! a chain of 1,998 small ops (add, transpose, matmul, reshape, sum, subtract on 8 x 8)
//! run by the interpreter (the per-op overhead), matrix products in the three forms of a
//! training step (A B, A B^T, A^T B; one side four times the others, as token rows are)
//! from 8 to 512 run by the interpreter (the efficiency curve and the peak, each
//! product's time less that overhead, which the model charges every op besides), with
//! products of every shape of sides 8, 32, 128 and 512 besides (the products' terms by
//! shape, `Device::matrix_terms`, which the model uses in place of the curve, and the
//! forms' factors on them, `Device::matrix_forms`), an
//! elementwise op on 4M floats (memory bandwidth), gelu on 1M floats (the vector rate,
//! counted by the op spec's FLOPs), and
//! all_reduces between two simulated devices, one thread each: a chain of 16 floats (the
//! latency of a step) and twenty of 1M floats on operands of their own, cold (the
//! bandwidth), and twenty all_reduces, reduce_scatters, all_gathers and all_to_alls the
//! same way at each message size from 16 KiB to 4 MiB (their rates by size,
//! `Level::rates`): the in-process network; groups of 2 and 4 simulated devices running
//! stretches of products with and without an all_reduce between them (how far they
//! drift apart between collectives, `Device::sync_jitter`, see `sync_jitter`); and
//! per op of two synthetic models' training steps, its kernel at two sizes run by the
//! interpreter (`Device::kernels`, see `kernel_factors`), except attention and its
//! gradient, fitted by their heads' shapes over a grid (`Device::head_kernels`, see
//! `head_terms`).
//! Each figure is the median of repeated runs, timed by the wall clock or (`--timing
//! serial`, as `nnscaler run --timing serial` times a run) by the thread's CPU time and,
//! for the network, the simulated devices' serial clock. Never
//! an end-to-end model timing: those check the model (bench/cost.sh), they do not fit it.
//!
//! `--device gpu` (a machine with only nnscaler-rt): `--prepare DIR` writes benchmark
//! artifacts and their manifest (`nnscaler_rt::bench`), `nnscaler-rt bench` times them
//! there, `--timings FILE` fits the device's entries from what it wrote.

use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::types::{AttrValue, Attrs, Elem, TensorType};
use nnscaler_frontends::{build_module, preset};
use nnscaler_passes::planner::cost::{self, Cluster};
use nnscaler_passes::transforms::autodiff::differentiate;
use nnscaler_runtime::kernels::{kernel, set_threads, Ctx};
use nnscaler_runtime::tensor::Tensor;
use nnscaler_runtime::{rng, Options};
use std::collections::BTreeMap;

mod fit;
mod gpu;
use fit::{dot, efficiency_curve, fit_heads, nonnegative_fit};
use gpu::{fit_gpu, prepare_gpu};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Whether the microbenchmarks are timed by this thread's CPU time (`--timing serial`)
/// rather than the wall clock.
static CPU_CLOCK: AtomicBool = AtomicBool::new(false);

/// Seconds on the clock the microbenchmarks are timed by (see [`CPU_CLOCK`]), from an
/// arbitrary origin.
fn clock(origin: Instant) -> f64 {
    if CPU_CLOCK.load(Ordering::Relaxed) {
        nnscaler_runtime::spmd::thread_cpu_seconds()
    } else {
        origin.elapsed().as_secs_f64()
    }
}

/// `nnscaler calibrate`'s command line.
#[derive(clap::Args, Debug)]
#[command(
    about = "Measure this machine's entries of the cost model (a cluster TOML for --print-stats=cluster=...)",
    long_about = "Measure this machine's entries of the cost model by microbenchmarks, one \
        thread: matrix-product efficiency by size, cost by shape (on cold operands, and \
        on hot ones for programs that fit in the L2) and factor by form (A B, A B^T, \
        A^T B), the vector and memory rates, the per-op \
        overhead, the in-process network (each collective's rate by message size, \
        16 KiB to 4 MiB) and how far simulated devices drift apart \
        between collectives, per op how the runtime's kernel compares \
        with that roofline (AdamW's on cold operands), and attention's cost by its heads' shapes. Prints them and writes a cluster TOML that \
        --print-stats=cluster=FILE, nnscaler plan --cluster FILE and \
        --plan=\"tp-search cluster=FILE\" read. Takes about half a minute.\n\n\
        A GPU (--device gpu) is measured where only nnscaler-rt runs: --prepare DIR writes \
        benchmark artifacts and DIR/calibrate.json, 'nnscaler-rt bench DIR/calibrate.json \
        --backend cuda -o timings.json' times them on the GPU's machine, and --timings \
        timings.json fits the device's rates, efficiency curves (f32 products, and bf16 \
        products on the tensor cores), per-kernel cost, the optimizer's (AdamW over many \
        small and a few large parameters) and attention's cost by its heads' \
        shapes (f32 and bf16) here, on --base's other entries (memory, network; the bf16 \
        rate too for timings without bf16 products)."
)]
pub struct CalibrateArgs {
    /// The device to measure: cpu (here), or gpu (in two steps: --prepare DIR writes
    /// benchmarks that 'nnscaler-rt bench DIR/calibrate.json' times on the GPU's machine,
    /// and --timings FILE fits its output here).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "gpu"])]
    pub device: String,
    /// gpu: write the benchmark artifacts and their manifest (calibrate.json) into DIR.
    #[arg(long, value_name = "DIR", conflicts_with = "timings")]
    pub prepare: Option<String>,
    /// gpu: the largest matrix product's side (and the streams' size: 4 x its square
    /// floats, at most 64M).
    #[arg(long, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(16..=16384))]
    pub max_size: u64,
    /// gpu: fit the device's entries from the manifest 'nnscaler-rt bench' timed.
    #[arg(long, value_name = "FILE")]
    pub timings: Option<String>,
    /// gpu: the cluster whose other entries (memory, bf16 rate, network) the fitted one
    /// keeps (a preset or a TOML file).
    #[arg(long, default_value = "h200", value_name = "CLUSTER")]
    pub base: String,
    /// Where to write the cluster TOML ('-': standard output).
    #[arg(short = 'o', long = "output", value_name = "FILE", default_value = "-")]
    pub output: String,
    /// cpu: how the microbenchmarks are timed, as `nnscaler run --timing` times a run:
    /// wall (the wall clock; the in-process network's two threads at once) or serial (the
    /// thread's CPU time, so time the host takes away is not counted; the network's two
    /// devices taking turns on a virtual clock). Calibrate with the timing the
    /// predictions are to be checked against.
    #[arg(long, value_name = "MODE", default_value = "wall", value_parser = ["wall", "serial"])]
    pub timing: String,
}

/// Writes `c` as TOML to `output` ('-': returns it for the report); what to add to the
/// report.
fn write_cluster(c: &Cluster, output: &str) -> Result<String, String> {
    let toml = c.to_toml()?;
    if output == "-" {
        return Ok(toml);
    }
    crate::write_one(output, toml.into_bytes())?;
    Ok(format!("wrote {output}\n"))
}

/// Median seconds of `f`, repeated until 0.3 s have passed (3 to 200 runs).
fn median_secs(mut f: impl FnMut()) -> f64 {
    let mut ts = Vec::new();
    let start = Instant::now();
    while ts.len() < 3 || (start.elapsed().as_secs_f64() < 0.3 && ts.len() < 200) {
        let t = clock(start);
        f();
        ts.push(clock(start) - t);
    }
    ts.sort_by(f64::total_cmp);
    ts[ts.len() / 2]
}

fn random(shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::f32(
        shape,
        (0..n as u64)
            .map(|i| rng::normal(seed, 0, i) as f32)
            .collect(),
    )
}

fn ty(shape: &[usize]) -> TensorType {
    let s: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
    TensorType::new(&s, Elem::F32)
}

/// Seconds of one call of kernel `op` on operands like `ins` with results `out`, with
/// cold caches as in a model (where an op reads what earlier ops wrote, not what it read
/// last time): the calls cycle through copies of the operands filling 64 MiB.
fn time_kernel(op: &str, attrs: &Attrs, ins: &[Tensor], out: &[TensorType]) -> Result<f64, String> {
    let f = kernel(op).ok_or_else(|| format!("no kernel for {op}"))?;
    let ctx = Ctx {
        op,
        attrs,
        out,
        device: None,
    };
    let bytes: usize = ins.iter().map(|t| t.numel() * 4).sum::<usize>().max(1);
    let copies = cold_sets(bytes);
    let sets: Vec<Vec<Tensor>> = (0..copies).map(|_| ins.to_vec()).collect();
    let refs: Vec<Vec<&Tensor>> = sets.iter().map(|s| s.iter().collect()).collect();
    f(&ctx, &refs[0])?;
    let mut k = 0;
    Ok(median_secs(|| {
        let _ = f(&ctx, &refs[k % copies]);
        k += 1;
    }))
}

/// Runs the command; returns the report to print.
pub fn main(a: &CalibrateArgs) -> Result<String, String> {
    if a.device == "gpu" && a.timing != "wall" {
        return Err("--timing applies to --device cpu (the in-process network)".into());
    }
    match (a.device.as_str(), &a.prepare, &a.timings) {
        ("gpu", Some(dir), _) => return prepare_gpu(a, dir),
        ("gpu", None, Some(t)) => return fit_gpu(a, t),
        ("gpu", None, None) => {
            return Err("--device gpu runs in two steps: --prepare DIR (here; then nnscaler-rt bench DIR/calibrate.json where the GPU is), then --timings FILE (here)".into())
        }
        (_, Some(_), _) | (_, _, Some(_)) => {
            return Err("--prepare and --timings apply to --device gpu".into())
        }
        _ => {}
    }
    set_threads(1);
    let serial = a.timing == "serial";
    CPU_CLOCK.store(serial, Ordering::Relaxed);
    let mut report = format!(
        "calibrating the CPU, one thread, timed by {}\n",
        if serial {
            "its CPU time"
        } else {
            "the wall clock"
        }
    );
    // Memory: an add of two 4M-float tensors (three 16 MiB streams).
    let n = 4 << 20;
    let t = time_kernel(
        "dnn.add",
        &Attrs::new(),
        &[random(&[n], 3), random(&[n], 4)],
        &[ty(&[n])],
    )?;
    let bandwidth = 3.0 * 4.0 * n as f64 / t;
    report += &format!("  add of 4M floats: {:.2} GB/s\n", bandwidth / 1e9);
    // Vector math: gelu on 1M floats, at the spec's 8 FLOPs an element.
    let n = 1 << 20;
    let t = time_kernel("dnn.gelu", &Attrs::new(), &[random(&[n], 5)], &[ty(&[n])])?;
    let vector = 8.0 * n as f64 / t;
    report += &format!(
        "  gelu of 1M floats: {:.2} GFLOP/s (8 per element)\n",
        vector / 1e9
    );
    let overhead = interpreter_overhead()?;
    report += &format!("  interpreter: {:.2} us per op\n", overhead * 1e6);
    // Matrix products in the three forms a training step runs, timed ([`time_products`]).
    let sides = [8usize, 16, 32, 64, 128, 256, 512];
    let (products, shaped) = time_products(&sides)?;
    let (peak, efficiency) = efficiency_curve(&products, overhead);
    for ((s, &(_, t)), [_, e]) in sides.iter().zip(&products).zip(&efficiency) {
        report += &format!(
            "  matmul {:>4} x {s:>3} x {s:>3}: {:>6.2} us a product, {:>6.2} GFLOP/s after the dispatch (A B, A B^T, A^T B)\n",
            4 * s,
            t * 1e6,
            e * peak / 1e9
        );
    }
    let (terms, forms, lines) = matrix_terms(shaped, &[8, 32, 128, 512], true, overhead)?;
    report += &lines;
    // Hot: the products of a program whose values all stay in the cache (one core's
    // L2), which only small products make up. (The forms' factors are the cold grid's,
    // whose sides reach 512.)
    let (hot, _, lines) = matrix_terms(Vec::new(), &[8, 32, 128], false, overhead)?;
    report += &lines;
    let cache = l2_bytes();
    report += &match cache {
        0 => "  L2 cache: not found (the hot terms go unused)\n".to_string(),
        b => format!(
            "  L2 cache: {} KiB a core (programs within it take the hot terms)\n",
            b >> 10
        ),
    };
    // The in-process network, timed as the devices run ([`network`]).
    let (latency, net_bandwidth, rates, lines) = network(serial)?;
    report += &lines;
    let mut c: Cluster = cost::preset("cpu").expect("the cpu preset");
    if let Some(l) = c.network.first_mut() {
        l.latency = sig(latency);
        l.bandwidth = sig(net_bandwidth);
        l.bandwidths.clear();
        l.rates = rates;
    }
    let (jitter, lines) = sync_jitter(serial, latency)?;
    report += &lines;
    c.device.sync_jitter = sig(jitter);
    c.device.matrix_flops = sig(peak);
    c.device.vector_flops = sig(vector);
    c.device.memory_bandwidth = sig(bandwidth);
    c.device.matrix_efficiency = efficiency.iter().map(|&[f, e]| [f, sig(e)]).collect();
    c.device.matrix_terms = Some(terms.map(sig));
    c.device.matrix_terms_hot = Some(hot.map(sig));
    c.device.matrix_forms = Some(forms.map(sig));
    c.device.cache_bytes = cache;
    c.device.op_overhead = sig(overhead);
    c.device.kernels.clear();
    let (heads, lines) = head_terms()?;
    report += &lines;
    c.device.head_kernels = heads;
    let (kernels, lines) = kernel_factors(&c)?;
    report += &lines;
    c.device.kernels = kernels;
    c.device.source = format!(
        "nnscaler calibrate --device cpu{}, {}",
        if serial { " --timing serial" } else { "" },
        chrono_free_date()
    );
    report += &write_cluster(&c, &a.output)?;
    Ok(report)
}

/// The in-process network's entries: all_reduces between two simulated devices, small
/// (a chain: the latency) and large (each on an operand of its own: the bandwidth),
/// then each collective a step runs, by message size (`Level::rates`). Returns the
/// latency a step, the bandwidth, the rates and the report's lines.
fn network(serial: bool) -> Result<Network, String> {
    let mut report = String::new();
    let small = time_collective("nns.all_reduce", 16, 400, false, serial)?;
    let big_floats = 1 << 20;
    let big = time_collective("nns.all_reduce", big_floats, 20, true, serial)?;
    // A ring all_reduce of two devices: two latency steps, each device sending its bytes
    // once (nns::sent_bytes).
    let latency = small / 2.0;
    let sent = nnscaler_dialects::nns::sent_bytes(
        "nns.all_reduce",
        2.0,
        4.0 * big_floats as f64,
        4.0 * big_floats as f64,
    );
    let net_bandwidth = sent / (big - 2.0 * latency).max(1e-9);
    report += &format!(
        "  all_reduce between 2 simulated devices ({} timing): {:.2} us latency a step, {:.2} GB/s\n",
        if serial { "serial" } else { "wall" },
        latency * 1e6,
        net_bandwidth / 1e9
    );
    // Each collective a step runs, by message size (`Level::rates`): on cold operands of
    // their own as the all_reduces above, from 16 KiB to 4 MiB (a small model's
    // gradients and activations to a large one's): the ring's bytes (nns::sent_bytes)
    // over the time less the latency steps. The rate moves with the size (the copies and
    // sums run through the caches; on one 2026-12-04 run, an all_reduce moved 5.5 GB/s
    // at 256 KiB and 1.0 at 4 MiB), so one rate priced a small model's gradient sync at
    // 3 times its time.
    let mut rates = BTreeMap::new();
    for op in [
        "nns.all_reduce",
        "nns.reduce_scatter",
        "nns.all_gather",
        "nns.all_to_all",
    ] {
        let mut curve = Vec::new();
        let mut line = format!("  {op:<18} by message:");
        for message in [4096usize, 16384, 65536, 262144, 1 << 20] {
            // The operand that makes a message (the larger of operand and result) of
            // `message` floats.
            let floats = if op == "nns.all_gather" {
                message / 2
            } else {
                message
            };
            let t = time_collective(op, floats, 20, true, serial)?;
            let result = result_floats(op, floats);
            let sent = nnscaler_dialects::nns::sent_bytes(
                op,
                2.0,
                4.0 * floats as f64,
                4.0 * result as f64,
            );
            let steps = if op == "nns.all_reduce" { 2.0 } else { 1.0 };
            // At least half the time is the bytes': a latency step measured high would
            // otherwise pass for an unbounded rate on the smallest messages.
            let rate = sent / (t - steps * latency).max(t / 2.0);
            curve.push([4.0 * message as f64, sig(rate)]);
            line += &format!(" {} KiB {:.2} GB/s,", message * 4 / 1024, rate / 1e9);
        }
        report += line.trim_end_matches(',');
        report += "\n";
        rates.insert(op.to_string(), curve);
    }
    Ok((latency, net_bandwidth, rates, report))
}

/// What [`network`] measures: latency, bandwidth, rates by message size, report lines.
type Network = (f64, f64, BTreeMap<String, Vec<[f64; 2]>>, String);

/// The median time of `op` between two simulated devices (one thread each) on operands
/// of `floats` (its result `result_floats`; a chain needs them equal): a chain of
/// `chain`, each on the last one's result (`cold` false), or each on an operand of its
/// own (`cold`: as a step's gradient sync reads cold data; a chain's operand is in the
/// cache, and measured 2-3 times as fast), timed as the devices run (`serial`: each by
/// its CPU time).
fn time_collective(
    op: &str,
    floats: usize,
    chain: usize,
    cold: bool,
    serial: bool,
) -> Result<f64, String> {
    let t = format!("tensor<{floats}xf32>");
    // A reduce_scatter or an all_to_all leaves each device its own piece.
    let split = "nns.layout = #nns.layout<@world, dp = D(0)>, ";
    let (attrs, layout) = match op {
        "nns.reduce_scatter" => ("dim = 0 : i64", split),
        "nns.all_to_all" => ("split_dim = 0 : i64, concat_dim = 0 : i64", split),
        "nns.all_gather" => ("dim = 0 : i64", ""),
        _ => ("reduce = \"max\"", ""),
    };
    let rt = format!("tensor<{}xf32>", result_floats(op, floats));
    let mut text = String::from(
        "\"nns.mesh\"() {sym_name = \"world\", axes = #nns.axes<dp = 2>} : () -> ()\n",
    );
    let args: Vec<String> = (0..if cold { chain } else { 1 })
        .map(|k| format!("%x{k}: {t} {{nns.name = \"x{k}\"}}"))
        .collect();
    text += &format!(
        "func.func @f({}) -> ({rt} {{{layout}nns.name = \"y\"}}) attributes {{nns.localized = #nns.axes<dp = 2>}} {{\n",
        args.join(", ")
    );
    let mut last = "%x0".to_string();
    for k in 0..chain {
        let operand = if cold { format!("%x{k}") } else { last };
        text += &format!(
            "  %r{k} = \"{op}\"({operand}) {{axes = [\"dp\"], {attrs}}} : ({t}) -> {rt}\n"
        );
        last = format!("%r{k}");
    }
    text += &format!("  return {last} : {rt}\n}}\n");
    let (g, mesh) = localized(&text)?;
    let x = random(&[floats], 7);
    let inputs: Vec<Tensor> = (0..if cold { chain } else { 1 })
        .map(|_| x.clone())
        .collect();
    let opts = Options {
        serial_devices: serial,
        ..Options::default()
    };
    // The median of 21 runs: the in-process network's time is the scheduler's too.
    let mut ts = Vec::new();
    for _ in 0..21 {
        nnscaler_runtime::spmd::run_spmd(&g, &mesh, inputs.clone(), &opts)
            .map_err(|e| e.message)?;
        ts.push(nnscaler_runtime::spmd::device_seconds() / chain as f64);
    }
    ts.sort_by(f64::total_cmp);
    Ok(ts[ts.len() / 2])
}

/// Floats of the result of collective `op` over two devices on an operand of `floats`:
/// half for a reduce_scatter, twice for an all_gather, as many for an all_reduce or an
/// all_to_all (whose pieces trade places).
fn result_floats(op: &str, floats: usize) -> usize {
    match op {
        "nns.reduce_scatter" => floats / 2,
        "nns.all_gather" => floats * 2,
        _ => floats,
    }
}

/// A localized function and its mesh, from IR text.
fn localized(text: &str) -> Result<(Graph, nnscaler_dialects::nns::Mesh), String> {
    let ir = IrContext::new();
    let m = ir
        .parse(text, "calibrate-network")
        .map_err(|d| d.render_limited(Some(text), 5))?;
    let mut d = nnscaler_dialects::diag::Diagnostics::default();
    let mesh = nnscaler_dialects::verify::Meshes::collect(&m.as_operation(), &mut d)
        .0
        .first()
        .cloned()
        .ok_or("no mesh")?;
    let g = Graph::all_in(&m)
        .into_iter()
        .next()
        .ok_or("no function")?
        .map_err(|e| e.message)?;
    Ok((g, mesh))
}

/// How far simulated devices drift apart between collectives (`Device::sync_jitter`),
/// with `latency` the network's per step: groups of 2 and 4 devices each run `S = 12`
/// segments of `k` products of 128 x 128 (k = 2, 8, 32: about 0.1, 0.5 and 2 ms), once
/// with an all_reduce of 16 floats after every segment and once without, the two
/// interleaved, 11 runs each, timed as the devices run. With `T` a segment's compute and
/// `c` the group's expected largest normal draw, the model puts the first at `S (T + c J
/// sqrt(T) + collective)` and the second at `S T + c J sqrt(S T)` (its devices meet only
/// at the end), so `J = (difference - S collective) / (c sqrt(T) (S - sqrt(S)))`. The
/// median of the six `J`s.
fn sync_jitter(serial: bool, latency: f64) -> Result<(f64, String), String> {
    const SEGMENTS: usize = 12;
    let side = 128;
    let t = format!("tensor<{side}x{side}xf32>");
    let s16 = "tensor<16xf32>";
    let program = |devices: usize, k: usize, meet: bool| {
        let mut text = format!(
            "\"nns.mesh\"() {{sym_name = \"world\", axes = #nns.axes<dp = {devices}>}} : () -> ()\n\
             func.func @f(%x: {t} {{nns.name = \"x\"}}, %w: {t} {{nns.name = \"w\"}}, %s: {s16} {{nns.name = \"s\"}}) -> ({t} {{nns.name = \"y\"}}, {s16} {{nns.name = \"z\"}}) attributes {{nns.localized = #nns.axes<dp = {devices}>}} {{\n"
        );
        let (mut a, mut r) = ("%x".to_string(), "%s".to_string());
        for seg in 0..SEGMENTS {
            for j in 0..k {
                text += &format!("  %a{seg}_{j} = \"dnn.matmul\"({a}, %w) : ({t}, {t}) -> {t}\n");
                a = format!("%a{seg}_{j}");
            }
            if meet {
                text += &format!(
                    "  %r{seg} = \"nns.all_reduce\"({r}) {{axes = [\"dp\"], reduce = \"max\"}} : ({s16}) -> {s16}\n"
                );
                r = format!("%r{seg}");
            }
        }
        text += &format!("  return {a}, {r} : {t}, {s16}\n}}\n");
        localized(&text)
    };
    // A weight of variance 1 / side keeps a row's norm, so 32 products in a row stay
    // finite.
    let x = random(&[side, side], 8);
    let w = Tensor::f32(
        &[side, side],
        (0..(side * side) as u64)
            .map(|i| (rng::normal(9, 0, i) / (side as f64).sqrt()) as f32)
            .collect(),
    );
    let s = random(&[16], 10);
    let opts = Options {
        serial_devices: serial,
        ..Options::default()
    };
    let mut report = String::new();
    let mut js = Vec::new();
    for devices in [2usize, 4] {
        for k in [2usize, 8, 32] {
            let (meet, mesh) = program(devices, k, true)?;
            let (apart, _) = program(devices, k, false)?;
            let (mut ta, mut tb) = (Vec::new(), Vec::new());
            for _ in 0..11 {
                for (g, into) in [(&meet, &mut ta), (&apart, &mut tb)] {
                    nnscaler_runtime::spmd::run_spmd(
                        g,
                        &mesh,
                        vec![x.clone(), w.clone(), s.clone()],
                        &opts,
                    )
                    .map_err(|e| e.message)?;
                    into.push(nnscaler_runtime::spmd::device_seconds());
                }
            }
            let median = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                v[v.len() / 2]
            };
            let (a, b) = (median(&mut ta), median(&mut tb));
            let n = SEGMENTS as f64;
            let segment = b / n;
            let collective = 2.0 * (devices - 1) as f64 * latency;
            let c = cost::expected_max_normal(devices as u64);
            let j = (a - b - n * collective) / (c * segment.sqrt() * (n - n.sqrt()));
            report += &format!(
                "  drift: {devices} devices, segments of {:.2} ms: {:.1} us a collective past the compute, J = {:.2e} s^0.5\n",
                segment * 1e3,
                (a - b) / n * 1e6,
                j
            );
            js.push(j);
        }
    }
    js.sort_by(f64::total_cmp);
    let j = js[js.len() / 2].max(0.0);
    report += &format!(
        "  devices' drift between collectives: sync_jitter {:.2e} s^0.5 (the median; a collective after 1 ms of compute waits {:.1} us for the slower of 2)\n",
        j,
        cost::expected_max_normal(2) * j * 1e-3f64.sqrt() * 1e6
    );
    Ok((j, report))
}

/// The training step (forward and backward) of zoo preset `name` resized by `sets`.
fn step_of(name: &str, sets: &[(&str, &str)]) -> Result<Graph, String> {
    let mut cfg = preset(name).ok_or("a zoo preset")?;
    for (k, v) in sets {
        cfg.set(k, v)?;
    }
    let text = build_module(&cfg).map_err(|e| e.to_string())?;
    differentiate(&first_function(&text, name)?).map_err(|(_, e)| e)
}

/// A function of one AdamW update per parameter shape in `shapes` (lr and step scalar
/// arguments), for the update's kernel entry.
fn adamw_step(shapes: &[&[usize]]) -> Result<Graph, String> {
    first_function(&adamw_text(shapes, false), "adamw")
}

/// [`adamw_step`]'s function as text; with `fixed`, lr and step are constants in it (1e-3
/// and 1) rather than arguments, for a benchmark whose arguments are drawn at random.
pub(super) fn adamw_text(shapes: &[&[usize]], fixed: bool) -> String {
    let mut args = Vec::new();
    let mut body = String::new();
    if fixed {
        body += "  %lr = \"dnn.fill\"() {shape = array<i64>, value = 1.0e-3 : f64} : () -> tensor<f32>\n";
        body += "  %step = \"dnn.fill\"() {shape = array<i64>, value = 1.0 : f64} : () -> tensor<f32>\n";
    } else {
        args.push("%lr: tensor<f32> {nns.name = \"lr\"}".to_string());
        args.push("%step: tensor<f32> {nns.name = \"step\"}".to_string());
    }
    let mut results = Vec::new();
    for (i, shape) in shapes.iter().enumerate() {
        let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
        let t = format!("tensor<{}xf32>", dims.join("x"));
        for p in ["p", "g", "m", "v"] {
            args.push(format!("%{p}{i}: {t} {{nns.name = \"{p}{i}\"}}"));
        }
        body += &format!(
            "  %u{i}:3 = \"dnn.adamw\"(%p{i}, %g{i}, %m{i}, %v{i}, %lr, %step) {{beta1 = 0.9 : f64, beta2 = 0.999 : f64, eps = 1.0e-8 : f64, weight_decay = 0.01 : f64}} : ({t}, {t}, {t}, {t}, tensor<f32>, tensor<f32>) -> ({t}, {t}, {t})\n"
        );
        results.push((format!("%u{i}#0"), t));
    }
    let (names, types): (Vec<String>, Vec<String>) = results.into_iter().unzip();
    format!(
        "func.func @adamw({}) -> ({}) {{\n{body}  return {} : {}\n}}\n",
        args.join(", "),
        types.join(", "),
        names.join(", "),
        types.join(", ")
    )
}

/// The first function of module `text` (named `name` in messages), as a graph.
fn first_function(text: &str, name: &str) -> Result<Graph, String> {
    let ir = IrContext::new();
    let m = ir
        .parse(text, name)
        .map_err(|d| d.render_limited(Some(text), 5))?;
    Graph::all_in(&m)
        .into_iter()
        .next()
        .ok_or("no function")?
        .map_err(|e| e.message)
}

/// An op's instance: (roofline seconds, step, node).
type Instance<'a> = (f64, &'a Graph, usize);

/// Per op, its instances in `steps` of distinct rooflines (within 1%), largest first.
fn instances<'a>(steps: &'a [Graph], c: &Cluster) -> BTreeMap<String, Vec<Instance<'a>>> {
    let mut all: BTreeMap<String, Vec<Instance<'a>>> = BTreeMap::new();
    for step in steps {
        for (k, n) in step.nodes.iter().enumerate() {
            if matches!(
                n.op.as_str(),
                "dnn.matmul" | "dnn.linear" | "dnn.linear_weight_grad"
            ) || kernel(&n.op).is_none()
                || c.device.head_kernels.contains_key(n.op.as_str())
            {
                continue;
            }
            let Some(cost) = cost::node_cost(step, n, c, None) else {
                continue;
            };
            let roofline = cost.seconds - c.device.op_overhead;
            let seen = all.entry(n.op.to_string()).or_default();
            if !seen
                .iter()
                .any(|(r, _, _)| (roofline - r).abs() <= 0.01 * r.abs().max(1e-12))
            {
                seen.push((roofline, step, k));
            }
        }
    }
    for v in all.values_mut() {
        v.sort_by(|a, b| b.0.total_cmp(&a.0));
    }
    all
}

/// Seconds of node `k` of `g` run by the interpreter (its dispatch, any shortcut it
/// takes such as a reshape that moves nothing, and the kernel): a function of `copies`
/// copies of the op on the same operands (floats drawn at random, integers such as
/// token ids zero), the median of 7 runs over `copies`.
fn time_node(g: &Graph, k: usize, copies: usize) -> Result<f64, String> {
    time_node_over(g, k, copies, 1)
}

/// [`time_node`], the copies cycling through `sets` copies of the operands (cold caches
/// when they are many, as in [`time_kernel`]).
fn time_node_over(g: &Graph, k: usize, copies: usize, sets: usize) -> Result<f64, String> {
    let n = &g.nodes[k];
    let mut f = Graph {
        name: "calibrate".into(),
        ..Graph::default()
    };
    let mut ins: Vec<Tensor> = Vec::new();
    let sets = sets.clamp(1, copies.max(1));
    let args: Vec<Vec<ValueId>> = (0..sets)
        .map(|set| {
            n.inputs
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    let t = g.values[v].clone();
                    let shape: Vec<usize> = t.shape.iter().map(|&d| d as usize).collect();
                    ins.push(if n.op == "dnn.adamw" && i >= 4 {
                        // lr and step (which counts from 1).
                        Tensor::scalar([1e-3, 3.0, 1.0][i - 4])
                    } else if t.elem.is_float() {
                        random(&shape, 10 + i as u64)
                    } else {
                        Tensor::i64(&shape, vec![0; shape.iter().product()])
                    });
                    let mut attrs = Attrs::new();
                    attrs.insert("nns.name".into(), AttrValue::Str(format!("in{set}_{i}")));
                    f.add_arg(t, attrs)
                })
                .collect()
        })
        .collect();
    for c in 0..copies.max(1) {
        let mut m = n.clone();
        m.inputs = args[c % sets].clone();
        m.outputs = n
            .outputs
            .iter()
            .map(|&v| f.new_value(g.values[v].clone()))
            .collect();
        m.origin = None;
        f.nodes.push(m);
    }
    let last = f.nodes.last().map(|m| m.outputs[0]).ok_or("no op")?;
    f.outputs = vec![nnscaler_dialects::graph::Output {
        value: last,
        attrs: Attrs::new(),
    }];
    let opts = Options::default();
    nnscaler_runtime::run(&f, ins.clone(), &opts).map_err(|e| e.message)?;
    let mut ts: Vec<f64> = (0..7)
        .map(|_| {
            let set = ins.clone();
            let origin = Instant::now();
            let t = clock(origin);
            let _ = nnscaler_runtime::run(&f, set, &opts);
            (clock(origin) - t) / copies.max(1) as f64
        })
        .collect();
    ts.sort_by(f64::total_cmp);
    Ok(ts[3])
}

/// Seconds of one matrix product `A B` (`attrs`: `{transpose_a = true}` or
/// `{transpose_b = true}` for the other forms) of `flops` on `a` and `b` giving `out`,
/// run by the interpreter ([`time_node_over`]) in copies enough to take about 2 ms, on
/// operands with cold caches (`cold`) or on one set of operands, hot.
fn time_matmul(
    attrs: &str,
    a: [usize; 2],
    b: [usize; 2],
    out: [usize; 2],
    flops: f64,
    cold: bool,
) -> Result<f64, String> {
    let t = |s: [usize; 2]| format!("tensor<{}x{}xf32>", s[0], s[1]);
    let (ta, tb, to) = (t(a), t(b), t(out));
    let text = format!(
        "func.func @f(%a: {ta} {{nns.name = \"a\"}}, %b: {tb} {{nns.name = \"b\"}}) -> ({to} {{nns.name = \"y\"}}) {{\n\
         \x20 %r = \"dnn.matmul\"(%a, %b) {attrs} : ({ta}, {tb}) -> {to}\n\
         \x20 return %r : {to}\n}}\n"
    );
    let g = first_function(&text, "calibrate")?;
    // Roughly: a microsecond of dispatch and 20 GFLOP/s.
    let guess = 1e-6 + flops / 20e9;
    // Operands cold as in a model (a weight was last read a step ago): as many sets as
    // fill 64 MiB, at most one a copy; or (not `cold`) one set, in the cache.
    let sets = if cold {
        cold_sets(4 * (a[0] * a[1] + b[0] * b[1]))
    } else {
        1
    };
    time_node_over(&g, 0, ((2e-3 / guess) as usize).clamp(1, 400), sets)
}

/// Seconds of one `m x k` by `k x n` product (`shape`) in form `form`: 0 `A B`, 1 `A
/// B^T`, 2 `A^T B` (the three a training step runs), as [`time_matmul`] times it.
fn time_form(form: usize, [m, k, n]: [usize; 3], cold: bool) -> Result<f64, String> {
    let flops = 2.0 * (m * k * n) as f64;
    match form {
        0 => time_matmul("", [m, k], [k, n], [m, n], flops, cold),
        1 => time_matmul("{transpose_b = true}", [m, k], [n, k], [m, n], flops, cold),
        _ => time_matmul("{transpose_a = true}", [k, m], [k, n], [m, n], flops, cold),
    }
}

/// The matrix products' terms by shape (`Device::matrix_terms`, or with `cold` false
/// `matrix_terms_hot`) and the forms' factors (`Device::matrix_forms`): besides the
/// products already `timed` (`(form, [m, k, n], seconds)`: the efficiency curve's), every
/// product of `sides` in each of the three forms, on cold operands or hot ones. The
/// terms are fitted to each shape's forms averaged, as `c0 + c1 2mkn + c2 mn + c3 (mk +
/// kn)` by non-negative least squares on the relative error of the whole time, `c0`
/// then less the per-op `dispatch` (which the model charges every op); each form's
/// factor is the geometric mean, over the grid's shapes with every side at least 32, of
/// its time over the shape's average, the three scaled to average 1. Returns the terms,
/// the factors and the report's lines.
fn matrix_terms(
    mut timed: Vec<(usize, [usize; 3], f64)>,
    sides: &[usize],
    cold: bool,
    dispatch: f64,
) -> Result<([f64; 4], [f64; 3], String), String> {
    for &m in sides {
        for &k in sides {
            for &n in sides {
                for form in 0..3 {
                    timed.push((form, [m, k, n], time_form(form, [m, k, n], cold)?));
                }
            }
        }
    }
    let largest = timed.iter().flat_map(|(_, s, _)| *s).max().unwrap_or(0);
    // Each shape's forms averaged: the terms have no form, and the forms differ by up to
    // a factor of 3 at a side of 8 (by 0.8-1.25 of their average at sides of 32 and more).
    let mut by_shape: BTreeMap<[usize; 3], Vec<(usize, f64)>> = BTreeMap::new();
    for &(form, shape, t) in &timed {
        by_shape.entry(shape).or_default().push((form, t));
    }
    let mean = |ts: &[(usize, f64)]| ts.iter().map(|(_, t)| t).sum::<f64>() / ts.len() as f64;
    let rows: Vec<([f64; 4], f64)> = by_shape
        .iter()
        .map(|(&[m, k, n], ts)| {
            let x = cost::product_terms([m as f64, k as f64, n as f64]);
            (x, mean(ts))
        })
        .collect();
    let mut c = nonnegative_fit(&rows)
        .filter(|c| c[1] > 0.0)
        .ok_or("the matrix products' times fit no terms with a positive cost per FLOP")?;
    let mut ratios: Vec<f64> = rows.iter().map(|(x, t)| dot(x, &c) / t).collect();
    // The forms' factors, from the shapes timed in all three (the grid's).
    let mut logs = [0.0f64; 3];
    let mut shapes = 0usize;
    for (s, ts) in &by_shape {
        let full = (0..3).all(|f| ts.iter().filter(|(g, _)| *g == f).count() == 1);
        if !full || s.iter().any(|&d| d < 32) {
            continue;
        }
        let avg = mean(ts);
        for &(f, t) in ts {
            logs[f] += (t / avg).ln();
        }
        shapes += 1;
    }
    let mut forms = [1.0f64; 3];
    if shapes > 0 {
        forms = logs.map(|l| (l / shapes as f64).exp());
        let norm = forms.iter().sum::<f64>() / 3.0;
        forms = forms.map(|f| f / norm);
    }
    // Each product's own time against the terms times its form's factor (and without).
    let fits: Vec<(f64, usize, f64)> = by_shape
        .iter()
        .flat_map(|(&[m, k, n], ts)| {
            let fit = dot(&cost::product_terms([m as f64, k as f64, n as f64]), &c);
            ts.iter().map(move |&(f, t)| (fit, f, t))
        })
        .collect();
    let mut each: Vec<f64> = fits.iter().map(|&(fit, f, t)| fit * forms[f] / t).collect();
    let mut plain: Vec<f64> = fits.iter().map(|&(fit, _, t)| fit / t).collect();
    // The model charges the dispatch as `op_overhead`: the fixed term keeps the rest.
    c[0] = (c[0] - dispatch).max(0.0);
    let at = |v: &mut Vec<f64>, q: f64| {
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * q).round() as usize]
    };
    let lines = format!(
        "  matmul by shape, {} operands ({} products, sides 8-{largest}): the dispatch + {:.3} us + 2mkn / {:.2} GFLOP/s + {:.3} ns x mn + {:.3} ns x (mk + kn); fitted / measured {:.2} (10%), {:.2} (median), {:.2} (90%)\n",
        if cold { "cold" } else { "hot" },
        rows.len(),
        c[0] * 1e6,
        1.0 / c[1] / 1e9,
        c[2] * 1e9,
        c[3] * 1e9,
        at(&mut ratios, 0.1),
        at(&mut ratios, 0.5),
        at(&mut ratios, 0.9)
    ) + &if cold {
        format!(
            "  matmul by form ({shapes} shapes, sides >= 32): A B x{:.3}, A B^T x{:.3}, A^T B x{:.3}; each of {} products, fitted x form / measured {:.2} (10%), {:.2} (median), {:.2} (90%); without the factors {:.2}, {:.2}, {:.2}\n",
            forms[0],
            forms[1],
            forms[2],
            each.len(),
            at(&mut each, 0.1),
            at(&mut each, 0.5),
            at(&mut each, 0.9),
            at(&mut plain, 0.1),
            at(&mut plain, 0.5),
            at(&mut plain, 0.9)
        )
    } else {
        String::new()
    };
    Ok((c, forms, lines))
}

/// The size of cpu 0's level-2 data (or unified) cache from sysfs; 0 where it says none.
fn l2_bytes() -> u64 {
    let base = "/sys/devices/system/cpu/cpu0/cache";
    let read = |p: String| std::fs::read_to_string(p).map(|s| s.trim().to_string());
    (0..8)
        .filter_map(|i| {
            let dir = format!("{base}/index{i}");
            let level = read(format!("{dir}/level")).ok()?;
            let kind = read(format!("{dir}/type")).ok()?;
            (level == "2" && kind != "Instruction").then_some(())?;
            parse_size(&read(format!("{dir}/size")).ok()?)
        })
        .next()
        .unwrap_or(0)
}

/// `2048K`, `2M` or `512` (bytes) as bytes.
fn parse_size(s: &str) -> Option<u64> {
    let (digits, unit) = match s.strip_suffix(['K', 'k']) {
        Some(d) => (d, 1u64 << 10),
        None => match s.strip_suffix(['M', 'm']) {
            Some(d) => (d, 1 << 20),
            None => (s, 1),
        },
    };
    digits.trim().parse::<u64>().ok().map(|v| v * unit)
}

/// How many copies of operands of `bytes` bytes fill 64 MiB, at most 256: cycled through,
/// they leave each call's operands cold in the cache.
fn cold_sets(bytes: usize) -> usize {
    (64usize << 20).div_ceil(bytes.max(1)).clamp(1, 256)
}

/// Per op, the CPU runtime's kernel against the roofline the rates above give
/// (`Device::kernels`): every op of the training steps (forward and backward) of a GPT,
/// a Llama and an MLP at two sizes unlike the zoo's models (small: width 24, 3 or 4
/// heads, 12 tokens, a vocabulary of 20, batch 3, the MLP 12 -> 24 x 2 -> 6 on batch 5;
/// large: width 256, 8 heads, 128 tokens, a vocabulary of 2048, batch 4, the MLP 192 ->
/// 384 x 2 -> 100 on batch 512; one layer), each run by the interpreter at each of its
/// instances of distinct roofline ([`time_node`]), and `fixed + factor x roofline` fitted
/// to them all by non-negative least squares on the relative error (`fixed` then holds
/// the interpreter's dispatch of that op; through the largest of each size when no fit
/// has a positive factor). Measured on 2026-12-03: the two-point fit through the largest
/// instances it replaced put gpt-tiny's non-matrix ops at 204 us a step where this puts
/// them at 164 (one calibration each, minutes apart; `nnscaler run --profile` has them
/// at about 110 once its own 1.3 us an op is taken out), nanogpt-cpu's and gpt2-124m's
/// 2-8% lower. Matrix products are the terms by shape's.
fn kernel_factors(c: &Cluster) -> Result<(BTreeMap<String, [f64; 2]>, String), String> {
    let gpt = |w: &str, h: &str, t: &str, v: &str, b: &str| {
        step_of(
            "gpt-tiny",
            &[
                ("width", w),
                ("heads", h),
                ("block", t),
                ("vocab", v),
                ("batch", b),
                ("layers", "1"),
            ],
        )
    };
    let llama = |w: &str, h: &str, kv: &str, f: &str, t: &str, v: &str, b: &str| {
        step_of(
            "llama-tiny",
            &[
                ("width", w),
                ("heads", h),
                ("kv-heads", kv),
                ("ffn", f),
                ("seq", t),
                ("vocab", v),
                ("batch", b),
                ("layers", "1"),
            ],
        )
    };
    let mlp = |i: &str, h: &str, c: &str, b: &str| {
        step_of(
            "mlp-tiny",
            &[("inputs", i), ("hidden", h), ("classes", c), ("batch", b)],
        )
    };
    let small = [
        gpt("24", "3", "12", "20", "3")?,
        llama("24", "4", "2", "48", "12", "20", "3")?,
        mlp("12", "24", "6", "5")?,
    ];
    let large = [
        gpt("256", "8", "128", "2048", "4")?,
        llama("256", "8", "4", "512", "128", "2048", "4")?,
        mlp("192", "384", "100", "512")?,
    ];
    // The optimizer's update, which the steps above (gradients only) do not run: AdamW
    // on the parameter shapes of the small and the large gpt (its FLOPs at gelu's vector
    // rate priced it at twice its time).
    let (small, large) = (
        [&small[..], &[adamw_step(&[&[20, 24], &[24, 72], &[24]])?]].concat(),
        [
            &large[..],
            &[adamw_step(&[&[2048, 256], &[256, 768], &[256]])?],
        ]
        .concat(),
    );
    let (small, large) = (instances(&small, c), instances(&large, c));
    let mut kernels = BTreeMap::new();
    let mut lines = String::new();
    for (op, large) in &large {
        let Some(small) = small.get(op) else {
            continue;
        };
        let (r0, r1) = (small[0].0, large[0].0);
        // Too little apart to fit a line: left at the roofline.
        if r1 < 1e-6 || r1 < 4.0 * r0 {
            continue;
        }
        // Every instance of both sizes (the small ones in more copies), `fixed + factor x
        // roofline` fitted to them all on the relative error: the small models' many
        // instances weigh as much as their few large ones, and the zoo's tiny models run
        // instances like theirs.
        let mut rows: Vec<([f64; 2], f64)> = Vec::new();
        for &(r, g, k) in small {
            rows.push(([1.0, r], time_node(g, k, 50)?));
        }
        for &(r, g, k) in large {
            // The update reads each parameter's moments once a step: cold, on operand
            // sets of their own.
            let t = if op == "dnn.adamw" {
                let bytes: u64 = g.nodes[k].inputs.iter().map(|&v| g.values[v].bytes()).sum();
                let sets = cold_sets(bytes as usize);
                time_node_over(g, k, sets.max(2), sets)?
            } else {
                time_node(g, k, 2)?
            };
            rows.push(([1.0, r], t));
        }
        let [fixed, factor] = nonnegative_fit(&rows)
            .filter(|c| c[1] > 0.0)
            .unwrap_or_else(|| {
                // Through the two largest instances when no fit has a positive factor.
                let (t0, t1) = (rows[0].1, rows[small.len()].1);
                let factor = ((t1 - t0) / (r1 - r0)).max(0.05);
                [(t0 - factor * r0).max(0.0), factor]
            });
        let factor = factor.clamp(0.05, 50.0);
        let (lo, hi) = rows
            .iter()
            .map(|(x, t)| (x[0] * fixed + x[1] * factor) / t)
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), r| {
                (lo.min(r), hi.max(r))
            });
        lines += &format!(
            "  {op}: {} instances, rooflines {:.2}-{:.1} us: {:.2} us + x{factor:.2} (fitted / measured {:.2}-{:.2})\n",
            rows.len(),
            // The instances are largest first.
            small[small.len() - 1].0 * 1e6,
            r1 * 1e6,
            fixed * 1e6,
            lo,
            hi
        );
        kernels.insert(op.clone(), [sig(fixed), sig(factor)]);
    }
    Ok((kernels, lines))
}

/// Per attention op (`dnn.attention`, `dnn.attention_grad`; causal), the CPU runtime's
/// kernel as a function of its heads' shapes (`Device::head_kernels`): timed by
/// [`time_kernel`] on a grid of heads (queries = keys from 6 to 192, head dims 6, 20 and
/// 56: sizes unlike the zoo's), each call over enough heads to take tens of
/// microseconds, and `[per head, per row, per score, per score and dim]` fitted to the
/// grid by least squares on the relative error with every coefficient >= 0 (the best of
/// the non-negative solutions over the subsets of the four terms). The report gives the
/// fit's largest relative error over the grid.
fn head_terms() -> Result<(BTreeMap<String, [f64; 4]>, String), String> {
    let mut terms = BTreeMap::new();
    let mut lines = String::new();
    let mut attrs = Attrs::new();
    attrs.insert("causal".into(), AttrValue::Bool(true));
    for op in ["dnn.attention", "dnn.attention_grad"] {
        let mut rows: Vec<([f64; 4], f64)> = Vec::new();
        for s in [6usize, 12, 24, 48, 96, 192] {
            for d in [6usize, 20, 56] {
                let heads = ((1usize << 20) / (s * s * d)).clamp(1, 64);
                let shape = [1, heads, s, d];
                let qkv = [random(&shape, 21), random(&shape, 22), random(&shape, 23)];
                let (ins, out): (Vec<Tensor>, Vec<TensorType>) = if op == "dnn.attention" {
                    (qkv.to_vec(), vec![ty(&shape)])
                } else {
                    let mut ins = vec![random(&shape, 24)];
                    ins.extend(qkv);
                    (ins, vec![ty(&shape); 3])
                };
                let t = time_kernel(op, &attrs, &ins, &out)?;
                let (h, s, d) = (heads as f64, s as f64, d as f64);
                rows.push((cost::head_terms([h, s, s, d, d]), t));
            }
        }
        let (coef, worst) =
            fit_heads(&rows).ok_or_else(|| format!("{op}: no fit of its heads' times"))?;
        lines += &format!(
            "  {op} per head: {:.3} us + {:.1} ns a row + {:.2} ns a score + {:.3} ns a score and dim ({} shapes, worst {:.0}% off)\n",
            coef[0] * 1e6,
            coef[1] * 1e9,
            coef[2] * 1e9,
            coef[3] * 1e9,
            rows.len(),
            worst * 100.0
        );
        terms.insert(op.to_string(), coef.map(sig));
    }
    Ok((terms, lines))
}

/// `x` to four significant digits (what a timing on a shared machine supports), so that
/// the written TOML reads `2.4e-7`, not `2.4000000000000003e-7`.
fn sig(x: f64) -> f64 {
    format!("{x:.3e}").parse().unwrap_or(x)
}

/// Today's date (UTC) from the system clock, as YYYY-MM-DD.
fn chrono_free_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let days = (secs / 86_400) as i64;
    // Civil from days (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    format!("{}-{m:02}-{d:02}", if m <= 2 { y + 1 } else { y })
}

/// The interpreter's cost per op: a chain of small ops of the kinds models run
/// (add, transpose, matmul, reshape, sum and broadcast back, on [8, 8]), whose
/// arithmetic is negligible.
fn interpreter_overhead() -> Result<f64, String> {
    let ops = 2000;
    let t8 = "tensor<8x8xf32>";
    let mut text =
        format!("func.func @f(%x: {t8} {{nns.name = \"x\"}}) -> ({t8} {{nns.name = \"y\"}}) {{\n");
    let mut last = "%x".to_string();
    for k in 0..ops / 6 {
        text += &format!(
            "  %a{k} = \"dnn.add\"({last}, %x) : ({t8}, {t8}) -> {t8}\n\
             \x20 %t{k} = \"dnn.transpose\"(%a{k}) {{perm = array<i64: 1, 0>}} : ({t8}) -> {t8}\n\
             \x20 %m{k} = \"dnn.matmul\"(%t{k}, %x) : ({t8}, {t8}) -> {t8}\n\
             \x20 %r{k} = \"dnn.reshape\"(%m{k}) {{shape = array<i64: 64>}} : ({t8}) -> tensor<64xf32>\n\
             \x20 %s{k} = \"dnn.sum\"(%m{k}) {{dims = array<i64: 1>, keepdim = true}} : ({t8}) -> tensor<8x1xf32>\n\
             \x20 %b{k} = \"dnn.sub\"(%m{k}, %s{k}) : ({t8}, tensor<8x1xf32>) -> {t8}\n"
        );
        last = format!("%b{k}");
    }
    let ops = ops / 6 * 6;
    text += &format!("  return {last} : {t8}\n}}\n");
    let g = first_function(&text, "calibrate")?;
    let x = random(&[8, 8], 6);
    let t = median_secs(|| {
        let _ = nnscaler_runtime::run(&g, vec![x.clone()], &Options::default());
    });
    Ok(t / ops as f64)
}

/// Per side, `(FLOPs, seconds)` of a product; and every product timed, `(form, [m, k, n],
/// seconds)`.
type Products = (Vec<(f64, f64)>, Vec<(usize, [usize; 3], f64)>);

/// Matrix products in the three forms a training step runs (forward A B, the input's
/// gradient A B^T, the weight's gradient A^T B), each with one long side four times
/// the others (rows are tokens), from s = 8 to 512 (a GPT-2 layer's products are
/// 1-5 GFLOP; below s = 512 the rate still grows, and a curve that stopped at 256 took
/// the rate there for the peak); each run by the interpreter as a model runs it
/// ([`time_node`]), its dispatch then taken out ([`efficiency_curve`]): the peak and
/// the curve (the model's for a device without terms by shape), and with
/// [`matrix_terms`]' grid the terms by shape the model charges a product besides
/// `op_overhead`.
fn time_products(sides: &[usize]) -> Result<Products, String> {
    let mut products = Vec::new();
    // Every product timed, by shape `[m, k, n]`, for the terms by shape below.
    let mut shaped = Vec::new();
    for &s in sides {
        let l = 4 * s;
        let mut t = 0.0;
        for (form, shape) in [(0, [l, s, s]), (1, [l, s, s]), (2, [s, l, s])] {
            let one = time_form(form, shape, true)?;
            shaped.push((form, shape, one));
            t += one;
        }
        products.push((2.0 * (l * s * s) as f64, t / 3.0));
    }
    Ok((products, shaped))
}

#[cfg(test)]
mod tests;
