//! The optimizer ops against PyTorch: `--optimizer` (AdamW, weight decay on matrices only,
//! global-norm clipping) run for 10 steps on the CPU runtime equals `torch.optim.AdamW`
//! with `clip_grad_norm_` given the same gradients (`test/oracle/adamw.py`), every step,
//! within 1e-6 relative to each parameter's largest magnitude.

use crate::common;

use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::types::Elem;
use nnscaler_passes::pipeline;
use nnscaler_runtime::tensor::Tensor;
use nnscaler_runtime::{io, run, Options};

/// A "training step" whose gradients are its inputs: the optimizer sees exactly the
/// gradients the oracle gets.
const STEP: &str = r#"
func.func @train(%w: tensor<8x16xf32> {nns.name = "w", nns.param},
                 %b: tensor<8xf32> {nns.name = "b", nns.param},
                 %gw: tensor<8x16xf32> {nns.name = "gw"}, %gb: tensor<8xf32> {nns.name = "gb"})
    -> (tensor<f32> {nns.name = "loss"}, tensor<8x16xf32> {nns.name = "grad.w"},
        tensor<8xf32> {nns.name = "grad.b"}) {
  %l = "dnn.fill"() {shape = array<i64>, value = 0.0 : f64} : () -> tensor<f32>
  return %l, %gw, %gb : tensor<f32>, tensor<8x16xf32>, tensor<8xf32>
}
"#;

fn check(clip: f64) -> f64 {
    let (beta1, beta2, eps, wd) = (0.9, 0.95, 1e-8, 0.1);
    let steps = 10;
    let lrs: Vec<f64> = (0..steps).map(|t| 1e-2 * (1.0 - t as f64 / 20.0)).collect();
    let ir = IrContext::new();
    let mut m = ir
        .parse(STEP, "step.mlir")
        .unwrap_or_else(|d| panic!("{d}"));
    let opts = format!("beta1={beta1} beta2={beta2} eps={eps} weight_decay={wd} clip={clip}");
    pipeline::run(
        &ir,
        &mut m,
        &[nnscaler_passes::registry::step("optimizer", &opts).unwrap()],
        &mut |_, _| {},
        "step.mlir",
    )
    .unwrap_or_else(|d| panic!("{d}"));
    let g: Graph = Graph::all_in(&m).remove(0).unwrap();
    let by_name = |n: &str| {
        g.args
            .iter()
            .position(|a| a.name() == Some(n))
            .unwrap_or_else(|| panic!("no argument {n}"))
    };
    let out_index = |n: &str| {
        g.outputs
            .iter()
            .position(|o| o.name() == Some(n))
            .unwrap_or_else(|| panic!("no result {n}"))
    };
    let shapes = [("w", vec![8usize, 16]), ("b", vec![8])];
    let mut state: Vec<Tensor> = vec![Tensor::zeros(&[]); g.args.len()];
    for (k, (n, s)) in shapes.iter().enumerate() {
        state[by_name(n)] = common::normal(s, 1, k as u64);
        state[by_name(&format!("adam.m.{n}"))] = Tensor::zeros(s);
        state[by_name(&format!("adam.v.{n}"))] = Tensor::zeros(s);
    }
    let dir = common::scratch(&format!("oracle_adamw_{clip}"));
    let initial: Vec<(String, Elem, &Tensor)> = shapes
        .iter()
        .map(|(n, _)| (n.to_string(), Elem::F32, &state[by_name(n)]))
        .collect();
    std::fs::write(
        dir.join("params.safetensors"),
        io::to_bytes(&initial).unwrap(),
    )
    .unwrap();
    let mut grads: Vec<(String, Tensor)> = Vec::new();
    let mut ours: Vec<(String, Tensor)> = Vec::new();
    for t in 1..=steps {
        for (k, (n, s)) in shapes.iter().enumerate() {
            // Gradients large enough that clipping at 1 binds on some steps.
            let gt = common::normal(s, 2 + t as u64, k as u64);
            state[by_name(&format!("g{n}"))] = gt.clone();
            grads.push((format!("{t}.{n}"), gt));
        }
        state[by_name("step")] = Tensor::f32(&[], vec![t as f32]);
        state[by_name("lr")] = Tensor::f32(&[], vec![lrs[t - 1] as f32]);
        let outs = run(
            &g,
            state.clone(),
            &Options {
                check_finite: true,
                ..Options::default()
            },
        )
        .unwrap_or_else(|e| panic!("{}", e.message));
        for (n, _) in &shapes {
            for prefix in ["", "adam.m.", "adam.v."] {
                let name = format!("{prefix}{n}");
                state[by_name(&name)] = outs[out_index(&format!("next.{name}"))].clone();
            }
            ours.push((format!("{t}.{n}"), state[by_name(n)].clone()));
        }
    }
    let gr: Vec<(String, Elem, &Tensor)> = grads
        .iter()
        .map(|(n, t)| (n.clone(), Elem::F32, t))
        .collect();
    std::fs::write(dir.join("grads.safetensors"), io::to_bytes(&gr).unwrap()).unwrap();
    let config = serde_json::json!({
        "steps": steps, "beta1": beta1, "beta2": beta2, "eps": eps,
        "weight_decay": wd, "clip": clip, "lr": lrs,
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    common::run_oracle("adamw.py", &[&dir]);
    let torch = io::load(&dir.join("torch.safetensors")).unwrap();
    let mut worst = 0.0f64;
    for (n, t) in &ours {
        let r = torch
            .iter()
            .find(|s| &s.name == n)
            .unwrap_or_else(|| panic!("torch has no '{n}'"));
        let err = t.rel_err(&r.tensor).unwrap();
        assert!(
            err <= 1e-6,
            "clip {clip}: parameter {n} differs from torch.optim.AdamW by {err:.2e}"
        );
        worst = worst.max(err);
    }
    println!("oracle: AdamW clip={clip}, {steps} steps: worst relative error {worst:.2e}");
    worst
}

#[test]
fn adamw_matches_pytorch() {
    check(0.0);
}

#[test]
fn adamw_with_clipping_matches_pytorch() {
    check(1.0);
}
