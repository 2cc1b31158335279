//! `nnscaler-bench`: timing probes for bench/compare.py, which runs them interleaved with
//! the same work in numpy/PyTorch and prints medians and ratios.
//!
//! * `nnscaler-bench gemm N REPS`: REPS products of two random NxN f32 matrices;
//! * `nnscaler-bench step PRESET REPS`: REPS forward+backward steps of a zoo preset
//!   (differentiated by autodiff, weights from --init-seed 0, random tokens).
//!
//! Prints one line of JSON: `{"times": [seconds per repetition, ...]}`. Single-threaded.

use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::graph::Graph;
use nnscaler_frontends::{build_module, preset};
use nnscaler_passes::transforms::autodiff::differentiate;
use nnscaler_runtime::kernels::{gemm, linalg::Mat};
use nnscaler_runtime::tensor::{dims, Tensor};
use nnscaler_runtime::{init, rng, run, run_profiled, Options, Profile};
use std::process::ExitCode;
use std::time::Instant;

fn gemm_times(n: usize, reps: usize) -> Vec<f64> {
    nnscaler_runtime::alloc::keep_freed_memory();
    let a: Vec<f32> = (0..n * n)
        .map(|i| rng::normal(1, 0, i as u64) as f32)
        .collect();
    let b: Vec<f32> = (0..n * n)
        .map(|i| rng::normal(1, 1, i as u64) as f32)
        .collect();
    let mut c = vec![0.0f32; n * n];
    gemm(
        (n, n, n),
        &mut c,
        Mat::rows(&a, n),
        Mat::rows(&b, n),
        1.0,
        0.0,
    );
    (0..reps)
        .map(|_| {
            let t = Instant::now();
            gemm(
                (n, n, n),
                &mut c,
                Mat::rows(&a, n),
                Mat::rows(&b, n),
                1.0,
                0.0,
            );
            t.elapsed().as_secs_f64()
        })
        .collect()
}

fn step_times(name: &str, reps: usize) -> Result<Vec<f64>, String> {
    let cfg = preset(name).ok_or(format!("unknown preset '{name}'"))?;
    let text = build_module(&cfg).map_err(|e| e.to_string())?;
    let ir = IrContext::new();
    let module = ir.parse(&text, name).map_err(|d| d.to_string())?;
    let fwd = Graph::all_in(&module).remove(0).map_err(|e| e.message)?;
    let g = differentiate(&fwd).map_err(|(_, m)| m)?;
    let vocab = match &cfg {
        nnscaler_frontends::ModelConfig::Gpt(c) => c.vocab,
        nnscaler_frontends::ModelConfig::Llama(c) => c.vocab,
        nnscaler_frontends::ModelConfig::Mlp(c) => c.classes,
    } as u64;
    let mut values = Vec::new();
    for (i, a) in fwd.args.iter().enumerate() {
        let ty = &fwd.values[a.value];
        let shape = dims(ty);
        let n: usize = shape.iter().product();
        values.push(if a.is_param() {
            init::init_param(&fwd, i, 0)?
        } else if ty.elem.is_float() {
            Tensor::f32(
                &shape,
                (0..n as u64)
                    .map(|k| rng::normal(2, i as u64, k) as f32)
                    .collect(),
            )
        } else {
            Tensor::i64(
                &shape,
                (0..n as u64)
                    .map(|k| (rng::bits(2, i as u64, k) % vocab) as i64)
                    .collect(),
            )
        });
    }
    run(&g, values.clone(), &Options::default()).map_err(|e| e.message)?;
    let mut times = Vec::new();
    let mut prof = Profile::default();
    let want_profile = std::env::var_os("NNSCALER_BENCH_PROFILE").is_some();
    for _ in 0..reps {
        let t = Instant::now();
        let p = if want_profile { Some(&mut prof) } else { None };
        run_profiled(&g, values.clone(), &Options::default(), p).map_err(|e| e.message)?;
        times.push(t.elapsed().as_secs_f64());
    }
    if want_profile {
        eprint!("{}", prof.report());
    }
    Ok(times)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let num = |i: usize| -> Result<usize, String> {
        argv.get(i)
            .ok_or(
                "missing argument (usage: nnscaler-bench gemm N REPS | step PRESET REPS)"
                    .to_string(),
            )?
            .parse()
            .map_err(|_| format!("'{}' is not a number", argv[i]))
    };
    let r = match argv.first().map(String::as_str) {
        Some("gemm") => num(1).and_then(|n| Ok(gemm_times(n, num(2)?))),
        Some("step") => num(2).and_then(|r| step_times(argv.get(1).map_or("", String::as_str), r)),
        _ => Err("usage: nnscaler-bench gemm N REPS | step PRESET REPS".into()),
    };
    match r {
        Ok(times) => {
            let t: Vec<String> = times.iter().map(|x| format!("{x:.6e}")).collect();
            println!("{{\"times\": [{}]}}", t.join(", "));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("nnscaler-bench: error: {e}");
            ExitCode::FAILURE
        }
    }
}
