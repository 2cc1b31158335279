//! Compile speed (criterion): parsing, each pass of the partitioning pipeline, and the whole
//! pipeline, on llama3-70b and gpt3-175b (batch 8) over an 8x8 mesh (dp-megatron dp=8
//! tp=8). The baseline, in the same run, is a bare parse + verify + print of each pass's own
//! output: what any MLIR tool pays to read and write that IR. A pass's time includes the
//! verifier that nnscaler-opt runs after it.
//!
//!   cargo bench -p nnscaler-tools --bench compile
//!
//! After criterion's report a summary prints, per pass, the median of 7 interleaved runs of
//! the pass and of its baseline and their ratio (single-threaded, as this process is).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion};
use melior::ir::Module;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::verify::verify_module;
use nnscaler_passes::pipeline::{self, Step};
use nnscaler_passes::registry::parse_pipeline;
use std::time::{Duration, Instant};

const PRESETS: &[&str] = &["llama3-70b", "gpt3-175b"];
/// Under `cargo test --all-targets` (no `--bench`), criterion runs each benchmark once: the
/// small presets keep that check quick in a debug build.
const TEST_PRESETS: &[&str] = &["llama-tiny", "gpt-tiny"];

/// Whether this is a real benchmark run (`cargo bench`), not `cargo test`'s check.
fn benchmarking() -> bool {
    std::env::args().any(|a| a == "--bench")
}
const PIPELINE: &str =
    "autodiff,plan{dp-megatron dp=8 tp=8},propagate-layouts,split-tensor,lower-relayouts,localize";
/// The small presets' pipeline (their sizes divide by 2, not by 8).
const TEST_PIPELINE: &str =
    "autodiff,plan{dp-megatron dp=2 tp=2},propagate-layouts,split-tensor,lower-relayouts,localize";

/// One model: the text before each pass and after the last.
struct Stages {
    name: &'static str,
    steps: Vec<Step>,
    /// `texts[i]` is the input of step `i`; the last is the pipeline's output.
    texts: Vec<String>,
}

fn print(m: &Module<'_>) -> String {
    m.as_operation().to_string()
}

fn stages(name: &'static str) -> Stages {
    let mut config = nnscaler_frontends::preset(name).expect("preset");
    config.set("batch", "8").expect("batch");
    let text = nnscaler_frontends::build_module(&config).expect("builds");
    let pipeline = if benchmarking() {
        PIPELINE
    } else {
        TEST_PIPELINE
    };
    let steps = parse_pipeline(pipeline).expect("pipeline");
    let ir = IrContext::new();
    let mut texts = vec![text];
    for step in &steps {
        let mut m = ir
            .parse(texts.last().expect("text"), "m.mlir")
            .expect("parses");
        run_step(&ir, &mut m, step);
        texts.push(print(&m));
    }
    Stages { name, steps, texts }
}

fn run_step<'c>(ir: &'c IrContext, m: &mut Module<'c>, step: &Step) {
    pipeline::run(ir, m, std::slice::from_ref(step), &mut |_, _| {}, "m.mlir")
        .expect("the pass succeeds");
}

/// The baseline: parse, verify and print `text`.
fn bare(ir: &IrContext, text: &str) -> usize {
    let m = ir.parse(text, "m.mlir").expect("parses");
    assert!(!verify_module(&m).has_errors());
    print(&m).len()
}

fn bench(c: &mut Criterion) {
    let presets = if benchmarking() {
        PRESETS
    } else {
        TEST_PRESETS
    };
    let models: Vec<Stages> = presets.iter().map(|p| stages(p)).collect();
    let ir = IrContext::new();
    for s in &models {
        let mut g = c.benchmark_group(s.name);
        g.sample_size(10)
            .warm_up_time(Duration::from_millis(500))
            .measurement_time(Duration::from_secs(3));
        g.bench_function("parse", |b| {
            b.iter(|| ir.parse(&s.texts[0], "m.mlir").expect("parses"))
        });
        for (i, step) in s.steps.iter().enumerate() {
            g.bench_function(format!("pass/{}", step.info.name), |b| {
                b.iter_batched(
                    || ir.parse(&s.texts[i], "m.mlir").expect("parses"),
                    |mut m| run_step(&ir, &mut m, step),
                    BatchSize::PerIteration,
                )
            });
            g.bench_function(format!("baseline/{}", step.info.name), |b| {
                b.iter(|| bare(&ir, &s.texts[i + 1]))
            });
        }
        g.bench_function("pipeline", |b| {
            b.iter(|| {
                let mut m = ir.parse(&s.texts[0], "m.mlir").expect("parses");
                pipeline::run(&ir, &mut m, &s.steps, &mut |_, _| {}, "m.mlir").expect("runs");
                print(&m).len()
            })
        });
        g.finish();
    }
    summary(&models, &ir);
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Per pass: median of interleaved runs of the pass and of its baseline, and the ratio.
fn summary(models: &[Stages], ir: &IrContext) {
    let runs = if benchmarking() { 7 } else { 1 };
    println!("\ncompile speed: pass (with its verify) against parse + verify + print of its output, medians of {runs}");
    for s in models {
        for (i, step) in s.steps.iter().enumerate() {
            let (mut a, mut b) = (Vec::new(), Vec::new());
            for _ in 0..runs {
                let mut m = ir.parse(&s.texts[i], "m.mlir").expect("parses");
                let t = Instant::now();
                run_step(ir, &mut m, step);
                a.push(t.elapsed());
                let t = Instant::now();
                bare(ir, &s.texts[i + 1]);
                b.push(t.elapsed());
            }
            let (a, b) = (median(a), median(b));
            println!(
                "{:<11} {:<18} pass {:>8.1} ms   baseline {:>8.1} ms   ratio {:.2}",
                s.name,
                step.info.name,
                a.as_secs_f64() * 1e3,
                b.as_secs_f64() * 1e3,
                a.as_secs_f64() / b.as_secs_f64()
            );
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
