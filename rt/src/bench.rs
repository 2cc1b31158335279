//! Microbenchmarks for calibrating the cost model on a machine that has only this
//! runtime (a GPU machine): `nnscaler calibrate --device gpu --prepare DIR` writes the
//! artifacts and a manifest ([`Manifest`]), `nnscaler-rt bench DIR/calibrate.json` times
//! them ([`run`]) and writes the manifest back with each entry's seconds, and `nnscaler
//! calibrate --device gpu --timings FILE` fits the device's entries from it. The timing
//! happens where the device is; the fitting, which needs the cost model, here.

use crate::artifact::{Artifact, Elt};
use crate::tensor::{Data, Tensor};
use serde::{Deserialize, Serialize};

/// What a benchmark measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// A matrix product (`flops` of it).
    Gemm,
    /// A chain of matrix products on bf16 values (`flops` in all; `ops`: the products
    /// and the three casts around them, the operands' in and the result's out), for the
    /// tensor cores' rate: two chains of one size, of different lengths, differ by their
    /// extra products alone.
    #[serde(rename = "gemm-bf16")]
    GemmBf16,
    /// An elementwise add streaming `bytes` (memory bandwidth).
    Stream,
    /// An elementwise op of `flops` vector FLOPs.
    Vector,
    /// A chain of `ops` tiny kernels (the cost of one launch).
    Launch,
    /// `ops` AdamW updates of `flops` FLOPs moving `bytes` in all (the optimizer's kernel
    /// entry, fitted over two sets of parameters: many small, a few large).
    Optimizer,
    /// An attention op (`op`: `dnn.attention` or `dnn.attention_grad`, `.bf16` when on
    /// bf16 values) over `heads` (`[heads, queries, keys, query/key dim, value dim]`):
    /// the cost model's attention family, fitted by its heads' shapes.
    Attention,
}

/// One benchmark.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Entry {
    /// Its name (`gemm-1024`).
    pub name: String,
    /// The artifact, relative to the manifest.
    pub artifact: String,
    /// What it measures.
    pub kind: Kind,
    /// FLOPs of one run.
    #[serde(default)]
    pub flops: f64,
    /// Bytes one run moves.
    #[serde(default)]
    pub bytes: f64,
    /// Kernels one run launches.
    #[serde(default)]
    pub ops: u64,
    /// Median seconds of a run (written by [`run`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seconds: Option<f64>,
    /// For [`Kind::Attention`]: the cost model's key for the op (`dnn.attention`,
    /// `dnn.attention_grad.bf16`, ...).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub op: Option<String>,
    /// For [`Kind::Attention`]: `[heads, queries, keys, query/key dim, value dim]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<[f64; 5]>,
}

/// The benchmarks, and where they were timed.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// What made it.
    pub source: String,
    /// The backend that timed it (written by [`run`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// The benchmarks.
    pub entries: Vec<Entry>,
}

/// Deterministic arguments for an artifact: small floats (`(i mod 17 - 8) / 100`) and
/// zero integers.
pub fn inputs(a: &Artifact) -> Vec<Tensor> {
    a.header
        .inputs
        .iter()
        .map(|p| {
            let n: u64 = p.global_shape.iter().product();
            let data = match p.elt {
                // (The reader refuses bf16 ports.)
                Elt::F32 | Elt::Bf16 => {
                    Data::F32((0..n).map(|i| ((i % 17) as f32 - 8.0) / 100.0).collect())
                }
                Elt::I64 => Data::I64(vec![0; n as usize]),
            };
            Tensor {
                shape: crate::tensor::shape(&p.global_shape),
                data,
            }
        })
        .collect()
}

/// Runs an artifact on its arguments a number of times; each run's seconds.
pub type Timer<'a> = dyn FnMut(Artifact, &[Tensor], usize) -> Result<Vec<f64>, String> + 'a;

/// Times every entry of `m` (artifacts under `dir`) with `time(artifact, inputs, runs)`,
/// which returns each run's seconds; the first run is a warm-up and left out, the median
/// of the rest is the entry's `seconds`. `progress` hears each result.
pub fn run(
    m: &mut Manifest,
    dir: &std::path::Path,
    runs: usize,
    time: &mut Timer<'_>,
    progress: &mut dyn FnMut(&Entry),
) -> Result<(), String> {
    for e in &mut m.entries {
        let path = dir.join(&e.artifact);
        let what = path.display().to_string();
        let bytes = std::fs::read(&path).map_err(|err| format!("{what}: {err}"))?;
        let a = Artifact::from_bytes(&bytes, &what)?;
        let args = inputs(&a);
        let mut ts = time(a, &args, runs.max(1) + 1).map_err(|err| format!("{}: {err}", e.name))?;
        ts.remove(0);
        ts.sort_by(f64::total_cmp);
        e.seconds = Some(ts[ts.len() / 2]);
        progress(e);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manifest round-trips; the warm-up run is left out and the median taken; a missing
    /// artifact is named.
    #[test]
    fn entries_are_timed_by_the_median_after_a_warm_up() {
        let dir = std::env::temp_dir().join(format!("nnscaler-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let art = crate::artifact::tests_support::sample();
        std::fs::write(dir.join("a.nnsx"), art.to_bytes().unwrap()).unwrap();
        let mut m = Manifest {
            source: "test".into(),
            backend: None,
            entries: vec![Entry {
                name: "a".into(),
                artifact: "a.nnsx".into(),
                kind: Kind::Gemm,
                flops: 128.0,
                bytes: 0.0,
                ops: 1,
                seconds: None,
                op: None,
                heads: None,
            }],
        };
        let asked = std::cell::Cell::new(0);
        let mut time = |a: Artifact, args: &[Tensor], n: usize| {
            asked.set(n);
            assert_eq!(args.len(), a.header.inputs.len());
            assert_eq!(args[0].data, Data::F32(vec![-0.08, -0.07, -0.06, -0.05]));
            // The warm-up is slow; the rest 3, 1, 2.
            Ok(vec![9.0, 3.0, 1.0, 2.0])
        };
        run(&mut m, &dir, 3, &mut time, &mut |_| {}).unwrap();
        assert_eq!(asked.get(), 4);
        assert_eq!(m.entries[0].seconds, Some(2.0));
        let back: Manifest = serde_json::from_str(&serde_json::to_string(&m).unwrap()).unwrap();
        assert_eq!(back, m);
        m.entries[0].artifact = "none.nnsx".into();
        let e = run(&mut m, &dir, 3, &mut time, &mut |_| {}).unwrap_err();
        assert!(e.contains("none.nnsx"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
