//! How much memory a run needs, estimated before anything is allocated, and how much this
//! process may use. `nnscaler run` compares the two and refuses a run that cannot fit with
//! a message naming both, instead of aborting halfway on a failed allocation.
//!
//! The estimate follows the interpreter: arguments stay alive for the whole run (and the
//! tensors read from files exist twice while they are parsed), every other value from the op
//! that makes it to its last use (results to the end), and the largest result of any op is
//! counted once more for kernels' scratch space; then the results' serialized bytes.
//! On simulated devices the whole inputs, every device's shards and its peak are counted.
//! The figure is an upper bound of the tensors' memory, not a prediction.

use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::types::{Elem, TensorType};
use nnscaler_rt::memory::{host_limit, HostLimit};
use std::fmt;

/// Bytes the CPU runtime keeps for a tensor of `ty` (floats as f32, integers as i64).
pub fn runtime_bytes(ty: &TensorType) -> u64 {
    let per = match ty.elem {
        Elem::F32 | Elem::F16 | Elem::BF16 | Elem::F64 => 4,
        _ => 8,
    };
    ty.numel().saturating_mul(per)
}

/// The memory a run is estimated to need.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Estimate {
    /// Parameters (whole), bytes.
    pub params: u64,
    /// Other inputs (whole), bytes.
    pub inputs: u64,
    /// The largest set of intermediate values alive at once, over all devices, bytes.
    pub activations: u64,
    /// Results (whole) and their serialized copy, bytes.
    pub results: u64,
    /// Simulated devices (1 on one device).
    pub devices: u64,
}

impl Estimate {
    /// Everything together.
    pub fn total(&self) -> u64 {
        self.params
            .saturating_mul(2)
            .saturating_add(self.inputs.saturating_mul(2))
            .saturating_add(self.activations)
            .saturating_add(self.results)
    }
}

impl fmt::Display for Estimate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe(0))
    }
}

impl Estimate {
    /// The total and its parts, which add up to it (`stacks`: bytes reserved for threads'
    /// stacks, counted in the total and named when nonzero).
    fn describe(&self, stacks: u64) -> String {
        // Tensors read from files exist twice while they are parsed.
        let twice = |x: u64| {
            if x == 0 {
                human(0)
            } else {
                format!("{} (2 x {})", human(x.saturating_mul(2)), human(x))
            }
        };
        format!(
            "{} (parameters {}, inputs {}, activations {}{}, results {}{})",
            human(self.total().saturating_add(stacks)),
            twice(self.params),
            twice(self.inputs),
            human(self.activations),
            if self.devices > 1 {
                format!(" over {} devices", self.devices)
            } else {
                String::new()
            },
            human(self.results),
            if stacks > 0 {
                format!(", threads' stacks {}", human(stacks))
            } else {
                String::new()
            }
        )
    }
}

/// A byte count for people: `1.5 GiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// The peak bytes of the values of `g` other than arguments alive at once while the
/// interpreter runs it (results stay alive to the end), plus the largest op result once
/// more (kernels' scratch).
fn peak_intermediates(g: &Graph) -> u64 {
    // `None`: never used; `Some(usize::MAX)`: a result, alive to the end.
    let mut last_use: Vec<Option<usize>> = vec![None; g.values.len()];
    for (k, n) in g.nodes.iter().enumerate() {
        for &v in &n.inputs {
            last_use[v] = Some(k);
        }
    }
    for o in &g.outputs {
        last_use[o.value] = Some(usize::MAX);
    }
    let mut is_arg = vec![false; g.values.len()];
    for a in &g.args {
        is_arg[a.value] = true;
    }
    let (mut live, mut peak, mut scratch) = (0u64, 0u64, 0u64);
    for (k, n) in g.nodes.iter().enumerate() {
        for &o in &n.outputs {
            let b = runtime_bytes(&g.values[o]);
            live = live.saturating_add(b);
            scratch = scratch.max(b);
        }
        peak = peak.max(live);
        let mut dead: Vec<nnscaler_dialects::graph::ValueId> = n
            .inputs
            .iter()
            .copied()
            .filter(|&v| !is_arg[v] && last_use[v] == Some(k))
            .collect();
        dead.sort_unstable();
        dead.dedup();
        dead.extend(n.outputs.iter().copied().filter(|&o| last_use[o].is_none()));
        for v in dead {
            live = live.saturating_sub(runtime_bytes(&g.values[v]));
        }
    }
    peak.saturating_add(scratch)
}

/// The estimate for running `g` (whose arguments have the types of `whole`, the same graph
/// on one device or its global view when localized) on `devices` simulated devices.
pub fn estimate(g: &Graph, whole: &Graph, devices: u64) -> Estimate {
    let (mut params, mut inputs) = (0u64, 0u64);
    for a in &whole.args {
        let b = runtime_bytes(&whole.values[a.value]);
        if a.is_param() {
            params = params.saturating_add(b);
        } else {
            inputs = inputs.saturating_add(b);
        }
    }
    // The serialized copy, and on devices the whole tensors assembled from the shards
    // (the result tensors themselves are alive to the end of the run: activations).
    let results: u64 = whole
        .outputs
        .iter()
        .map(|o| runtime_bytes(&whole.values[o.value]))
        .fold(0u64, u64::saturating_add)
        .saturating_mul(if devices > 1 { 2 } else { 1 });
    let mut activations = peak_intermediates(g).saturating_mul(devices);
    if devices > 1 {
        // Each device holds its shards of the arguments besides the whole tensors.
        let shards: u64 = g
            .args
            .iter()
            .map(|a| runtime_bytes(&g.values[a.value]))
            .fold(0u64, u64::saturating_add);
        activations = activations.saturating_add(shards.saturating_mul(devices));
    }
    Estimate {
        params,
        inputs,
        activations,
        results,
        devices,
    }
}

/// Address space each extra thread reserves besides tensors (its stack, 2 MiB, and the
/// malloc arena glibc gives it, 64 MiB): counts against `ulimit -v`, not against memory.
pub const THREAD_RESERVE: u64 = 66 << 20;

/// Checks that `need` fits in `limit` (a given byte count) or in what [`available`] finds;
/// `threads` is how many threads the run adds (simulated devices and matrix-product
/// threads), which reserve address space. The error names the estimate and the limit.
pub fn check(need: &Estimate, limit: Option<u64>, threads: u64) -> Result<(), String> {
    let (limit, what) = match limit {
        Some(l) => (l, None),
        None => match host_limit() {
            Some((b, l)) => (b, Some(l)),
            None => return Ok(()),
        },
    };
    // Under an address-space limit, threads' stacks count too.
    let stacks = if what == Some(HostLimit::AddressSpace) {
        threads.saturating_mul(THREAD_RESERVE)
    } else {
        0
    };
    let what = what.map_or("--memory-limit".to_string(), |l| l.to_string());
    if need.total().saturating_add(stacks) > limit {
        return Err(format!(
            "the run needs an estimated {}, but {what} leaves {}; use fewer or smaller \
             tensors (a smaller --batch), more devices, or a machine with more memory",
            need.describe(stacks),
            human(limit)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use nnscaler_dialects::context::IrContext;
    use nnscaler_dialects::graph::Graph;

    fn graph(src: &str) -> Graph {
        let ir = IrContext::new();
        let m = ir.parse(src, "t.mlir").unwrap();
        Graph::all_in(&m).remove(0).unwrap()
    }

    #[test]
    fn counts_arguments_live_values_and_results() {
        // a: 4 KiB input, w: 4 KiB param; %0 and %1 are 4 KiB each and %0 dies at %1.
        let g = graph(
            r#"func.func @f(%a: tensor<32x32xf32> {nns.name = "a"}, %w: tensor<32x32xf32> {nns.name = "w", nns.param}) -> (tensor<f32> {nns.name = "r"}) {
  %0 = "dnn.matmul"(%a, %w) : (tensor<32x32xf32>, tensor<32x32xf32>) -> tensor<32x32xf32>
  %1 = "dnn.relu"(%0) : (tensor<32x32xf32>) -> tensor<32x32xf32>
  %2 = "dnn.sum"(%1) {dims = array<i64: 0, 1>} : (tensor<32x32xf32>) -> tensor<f32>
  return %2 : tensor<f32>
}"#,
        );
        let e = estimate(&g, &g, 1);
        assert_eq!((e.params, e.inputs, e.results), (4096, 4096, 4));
        // Peak: %0 and %1 alive together (8 KiB), plus the largest result as scratch.
        assert_eq!(e.activations, 8192 + 4096);
        assert_eq!(e.total(), 2 * 4096 + 2 * 4096 + e.activations + 4);
        let err = check(&e, Some(1000), 0).unwrap_err();
        assert!(err.contains("needs an estimated 28.0 KiB"), "{err}");
        assert!(
            err.contains(
                "(parameters 8.0 KiB (2 x 4.0 KiB), inputs 8.0 KiB (2 x 4.0 KiB), activations 12.0 KiB, results 4 B)"
            ),
            "{err}"
        );
        assert!(err.contains("--memory-limit leaves 1000 B"), "{err}");
        assert!(check(&e, Some(1 << 20), 0).is_ok());
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(12), "12 B");
        assert_eq!(human(3 << 30), "3.0 GiB");
        assert_eq!(human(1 << 42), "4.0 TiB");
    }
}
