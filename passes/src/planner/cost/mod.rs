//! The cost model: devices and networks as data, op and step time
//! as a roofline with a calibrated matrix-product efficiency curve.
//!
//! A [`Cluster`] (TOML, or a built-in preset: `dgx-a100`, `dgx-h100`, `h200`, `cpu`) gives a
//! device's peak rates and memory, and the network as levels (GPUs per node over NVLink,
//! nodes over the fabric). `nnscaler calibrate --device cpu` measures the CPU's entries
//! (matrix-product efficiency by size, vector and memory rates, the per-op overhead) from
//! microbenchmarks, never from end-to-end timings.
//!
//! An op's time is `overhead + max(compute, memory)`: compute is its FLOPs (the op specs')
//! at the matrix rate times the efficiency of a product of its size (ops with
//! [`nnscaler_dialects::spec::Traits::matrix`]) or at the vector rate; memory is the bytes
//! of its operands and results at the memory bandwidth. A program's step time is the sum
//! over its ops (the CPU runtime and a GPU stream both run ops one at a time) and, for one
//! device's share of a partitioned program, its collectives: ring (or, for an all_reduce
//! on a level that allows it, tree) steps of the network level the group spans plus the
//! bytes each device sends (the collectives' own
//! `sent_bytes`) at that level's bandwidth, not overlapped with compute.

use crate::transforms::place::op_flops;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::{self, Mesh};
use nnscaler_dialects::sharding::{Step, StepPrice};
use nnscaler_dialects::types::{AttrValue, Elem};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::Arc;

mod presets;
pub use presets::{preset, GPU_FRAGMENTATION, GPU_RESERVED, PRESETS};

/// Devices and the network between them.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    /// Its name.
    pub name: String,
    /// One device (all are alike).
    pub device: Device,
    /// The network, innermost level first (e.g. NVLink within a node, then the fabric).
    #[serde(default)]
    pub network: Vec<Level>,
}

/// One device.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Device {
    /// What it is.
    pub name: String,
    /// Peak f32 matrix-product rate, FLOP/s.
    pub matrix_flops: f64,
    /// Peak bf16 matrix-product rate (tensor cores), FLOP/s, when it has one.
    #[serde(default)]
    pub matrix_flops_bf16: Option<f64>,
    /// Rate of the other ops' FLOPs (elementwise math, reductions), FLOP/s.
    pub vector_flops: f64,
    /// Memory, bytes.
    pub memory: u64,
    /// Memory bandwidth, bytes/s.
    pub memory_bandwidth: f64,
    /// Matrix-product efficiency by size: `[FLOPs of one product, fraction of the peak]`,
    /// ascending in FLOPs; interpolated log-linearly, flat beyond the ends (empty: 1).
    #[serde(default)]
    pub matrix_efficiency: Vec<[f64; 2]>,
    /// The same for bf16 products against `matrix_flops_bf16` (the tensor cores fill up
    /// at other sizes than the f32 units), as `nnscaler calibrate --device gpu` measures
    /// it; empty: `matrix_efficiency`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub matrix_efficiency_bf16: Vec<[f64; 2]>,
    /// A matrix product's time by its shape, for a kernel whose cost FLOPs alone do not
    /// describe (the CPU runtime's `gemm`: packing its operands and writing its result
    /// cost per element, which products with a short side feel most): `[per product, per
    /// FLOP, per element of the result, per element of the operands]` in seconds, one `m x
    /// k` by `k x n` product taking `c0 + c1 2mkn + c2 mn + c3 (mk + kn)` (its FLOPs at
    /// the bf16 rate scaled by `matrix_flops / matrix_flops_bf16`). `nnscaler calibrate
    /// --device cpu` fits the four over products of many shapes; when present, the
    /// products' compute time comes from them instead of `matrix_efficiency`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matrix_terms: Option<[f64; 4]>,
    /// `matrix_terms` measured on operands already in the cache, for a program whose
    /// values all fit in `cache_bytes` ([`Cluster::for_program`]): `matrix_terms` are
    /// measured on cold operands, as a larger program's products find theirs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matrix_terms_hot: Option<[f64; 4]>,
    /// Factors on `matrix_terms` (or `matrix_terms_hot`) by the product's form: `[A B, A
    /// B^T, A^T B]` (`matmul`; `linear` and a `matmul` with `transpose_b`; the weight's
    /// gradient and a `matmul` with `transpose_a`), averaging 1: the terms are fitted to
    /// the forms' average, and a `gemm` packs a transposed operand at another cost.
    /// `nnscaler calibrate --device cpu` measures them; absent, every form costs the
    /// terms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub matrix_forms: Option<[f64; 3]>,
    /// Bytes a program's values may take and still stay in the cache between their uses
    /// (one core's L2 on a CPU); 0: none do.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub cache_bytes: u64,
    /// Fixed cost of running one op (a kernel launch, an interpreter dispatch), seconds.
    #[serde(default)]
    pub op_overhead: f64,
    /// How far devices drift apart between synchronisations, in seconds per square root of
    /// a second: a device's time for `T` seconds of compute varies by `sync_jitter x
    /// sqrt(T)` (one standard deviation; independent noise per op adds up that way), and
    /// a collective waits for the slowest of its group, on average `c(n) x sync_jitter x
    /// sqrt(T)` past the mean for a group of `n` ([`expected_max_normal`]), `T` the
    /// compute since the group last met ([`Drift`]). `nnscaler calibrate --device cpu`
    /// measures it on simulated devices; 0 (the GPU presets, not measured): no drift.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub sync_jitter: f64,
    /// Per op, its kernel against the roofline above: `[fixed seconds, factor]`, the op
    /// taking `fixed + factor x roofline` (`fixed` in place of `op_overhead`), measured by
    /// `nnscaler calibrate` on a small and a training-sized instance: kernels the rates do
    /// not describe (the CPU runtime's attention, cross-entropy, strided reductions and
    /// transposes, views that move nothing). Ops not listed: `op_overhead + roofline`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub kernels: BTreeMap<String, [f64; 2]>,
    /// Per op that runs one attention head at a time (the CPU runtime's `dnn.attention`
    /// and `dnn.attention_grad`): `[per head, per query row, per score, per score and
    /// head dim]` in seconds, the op taking `op_overhead + heads x (c0 + c1 s + c2 s t +
    /// c3 s t (d + e))` for `s` queries, `t` keys, head dims `d` (queries and keys) and
    /// `e` (values). Such a kernel's time at small heads is per head and row more than per
    /// FLOP, which no roofline carries; `nnscaler calibrate` fits the four over a grid of
    /// head shapes. Takes precedence over a `kernels` entry.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub head_kernels: BTreeMap<String, [f64; 4]>,
    /// Bytes the runtime holds on the device outside the program's values: the CUDA
    /// context, the matrix library's workspace, the communicators' buffers. A plan gets
    /// [`Device::usable_memory`]: the memory less this, less `fragmentation` of the rest.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub reserved: u64,
    /// Share of the memory left after `reserved` that the allocator loses (a caching
    /// allocator's rounding of blocks and the splits it cannot reuse), in [0, 1).
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub fragmentation: f64,
    /// Where the figures come from (a datasheet, a calibration and its date).
    #[serde(default)]
    pub source: String,
}

/// One level of the network.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Level {
    /// Its name (`nvlink`, `infiniband`, `in-process`).
    pub name: String,
    /// Devices in one group at this level (8 GPUs in a node; nodes x 8 at the next).
    pub devices: u64,
    /// Bytes per second one device sends into it.
    pub bandwidth: f64,
    /// Seconds per message.
    pub latency: f64,
    /// Whether an all_reduce here may run as a tree (NCCL's double binary tree, which
    /// NCCL picks over the ring where it is faster): `2 ceil(log2 n)` steps of latency
    /// instead of the ring's `2 (n - 1)`, the same bytes per device (two trees, each
    /// carrying half). Off: rings only (the CPU runtime's in-process collectives, whose
    /// latency the calibration fits as ring steps).
    #[serde(default)]
    pub tree: bool,
    /// Per collective (`nns.reduce_scatter`, ...), the bytes per second it moves where
    /// that differs from `bandwidth` (which the others take). The CPU runtime's
    /// in-process collectives are copies and sums in memory, not a ring: an all_gather
    /// only copies, a reduce_scatter copies its whole operand and sums a piece, so each
    /// moves the ring's bytes at its own rate; `nnscaler calibrate --device cpu` measures
    /// them.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub bandwidths: BTreeMap<String, f64>,
    /// Per collective, its rate by message size where one rate does not describe it:
    /// `[bytes, bytes per second]` pairs ascending in bytes, the bytes the larger of one
    /// device's operand and result, the rate that of the ring's bytes (as `bandwidth`);
    /// interpolated log-linearly in the size, flat beyond the ends. The in-process
    /// collectives copy and sum through the caches, so a gradient of 256 KiB moves
    /// several times as fast as one of 4 MiB; NCCL's rate likewise grows with the
    /// message. Takes precedence over `bandwidths` and `bandwidth` for that collective;
    /// `nnscaler calibrate --device cpu` measures the curves.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rates: BTreeMap<String, Vec<[f64; 2]>>,
}

/// `points` (`[x, y]` ascending in `x`) at `x`: interpolated linearly in `ln x`, flat
/// beyond the ends; `None` for no points.
fn log_linear(points: &[[f64; 2]], x: f64) -> Option<f64> {
    Some(match points {
        [] => return None,
        [first, ..] if x <= first[0] => first[1],
        [.., last] if x >= last[0] => last[1],
        _ => {
            let k = points
                .iter()
                .position(|p| p[0] >= x)
                .unwrap_or(points.len() - 1);
            let ([x0, y0], [x1, y1]) = (points[k - 1], points[k]);
            let t = (x.ln() - x0.ln()) / (x1.ln() - x0.ln());
            y0 + t * (y1 - y0)
        }
    })
}

impl Level {
    /// Bytes per second collective `op` moves (of the ring's bytes) on messages of
    /// `message` bytes (the larger of a device's operand and result): its `rates` curve,
    /// else its `bandwidths` entry, else `bandwidth`.
    pub fn rate(&self, op: &str, message: f64) -> f64 {
        self.rates
            .get(op)
            .and_then(|c| log_linear(c, message))
            .or_else(|| self.bandwidths.get(op).copied())
            .unwrap_or(self.bandwidth)
    }
}

const GIB: u64 = 1 << 30;

fn is_zero_f64(v: &f64) -> bool {
    *v == 0.0
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A cluster from a preset name or a TOML file.
pub fn load(spec: &str) -> Result<Cluster, String> {
    if let Some(c) = preset(spec) {
        return Ok(c);
    }
    let text = std::fs::read_to_string(spec).map_err(|e| {
        format!(
            "cluster '{spec}': not a preset ({}) and not a readable file: {e}",
            PRESETS.join(", ")
        )
    })?;
    parse(&text).map_err(|e| format!("{spec}: {e}"))
}

/// The module attribute naming the cluster a plan was chosen for (a preset or a TOML
/// file, as `cluster=` gave it): `--plan=tp-search` and auto write it,
/// `--lower-relayouts` without `cluster=` prices relayouts on it.
pub const CLUSTER_ATTR: &str = "nns.cluster";

/// A cluster from TOML.
pub fn parse(text: &str) -> Result<Cluster, String> {
    let c: Cluster = toml_parse(text)?;
    let d = &c.device;
    for (what, v) in [
        ("matrix_flops", d.matrix_flops),
        ("vector_flops", d.vector_flops),
        ("memory_bandwidth", d.memory_bandwidth),
    ] {
        if !(v.is_finite() && v > 0.0) {
            return Err(format!("device.{what} must be a positive rate, got {v}"));
        }
    }
    if d.memory == 0 {
        return Err("device.memory must be bytes > 0, got 0".into());
    }
    if d.reserved >= d.memory {
        return Err(format!(
            "device.reserved ({} bytes) must be less than device.memory ({} bytes)",
            d.reserved, d.memory
        ));
    }
    if !(0.0..1.0).contains(&d.fragmentation) {
        return Err(format!(
            "device.fragmentation must be a share in [0, 1), got {}",
            d.fragmentation
        ));
    }
    if let Some(r) = d.matrix_flops_bf16.filter(|r| !(r.is_finite() && *r > 0.0)) {
        return Err(format!(
            "device.matrix_flops_bf16 must be a positive rate, got {r}"
        ));
    }
    for (what, curve) in [
        ("matrix_efficiency", &d.matrix_efficiency),
        ("matrix_efficiency_bf16", &d.matrix_efficiency_bf16),
    ] {
        if curve.windows(2).any(|w| w[1][0] <= w[0][0])
            || curve
                .iter()
                .any(|[f, e]| !(*f > 0.0 && *e > 0.0 && *e <= 1.0))
        {
            return Err(format!(
                "device.{what} must be [flops, fraction] pairs, flops ascending, fractions in (0, 1]"
            ));
        }
    }
    for (what, terms) in [
        ("matrix_terms", d.matrix_terms),
        ("matrix_terms_hot", d.matrix_terms_hot),
    ] {
        if let Some(t) =
            terms.filter(|t| t.iter().any(|c| !(c.is_finite() && *c >= 0.0)) || t[1] <= 0.0)
        {
            return Err(format!(
                "device.{what} must be four seconds >= 0 (per product, FLOP, result and operand element), the FLOP's > 0, got {t:?}"
            ));
        }
    }
    if let Some(f) = d
        .matrix_forms
        .filter(|f| f.iter().any(|x| !(x.is_finite() && *x > 0.0)))
    {
        return Err(format!(
            "device.matrix_forms must be three factors > 0 (A B, A B^T, A^T B), got {f:?}"
        ));
    }
    if let Some((op, [fixed, factor])) = d
        .kernels
        .iter()
        .find(|(_, [a, f])| !(a.is_finite() && *a >= 0.0 && f.is_finite() && *f > 0.0))
    {
        return Err(format!(
            "device.kernels: '{op}' must be [fixed seconds >= 0, factor > 0], got [{fixed}, {factor}]"
        ));
    }
    if let Some((op, terms)) = d.head_kernels.iter().find(|(_, t)| {
        t.iter().any(|x| !(x.is_finite() && *x >= 0.0)) || t.iter().all(|x| *x == 0.0)
    }) {
        return Err(format!(
            "device.head_kernels: '{op}' must be four seconds >= 0 (per head, row, score, score and dim), not all 0, got {terms:?}"
        ));
    }
    if !(d.sync_jitter.is_finite() && d.sync_jitter >= 0.0) {
        return Err(format!(
            "device.sync_jitter must be seconds per square root of a second >= 0, got {}",
            d.sync_jitter
        ));
    }
    if !(d.op_overhead.is_finite() && d.op_overhead >= 0.0) {
        return Err(format!(
            "device.op_overhead must be seconds >= 0, got {}",
            d.op_overhead
        ));
    }
    for l in &c.network {
        if !(l.bandwidth.is_finite() && l.bandwidth > 0.0) {
            return Err(format!(
                "network level '{}': bandwidth must be a positive rate, got {}",
                l.name, l.bandwidth
            ));
        }
        if let Some((op, b)) = l
            .bandwidths
            .iter()
            .find(|(op, b)| nns::collective(op).is_none() || !(b.is_finite() && **b > 0.0))
        {
            return Err(format!(
                "network level '{}': bandwidths: '{op}' must be a collective with a positive rate, got {b}",
                l.name
            ));
        }
        if let Some(op) = l.rates.iter().find_map(|(op, c)| {
            let bad = nns::collective(op).is_none()
                || c.is_empty()
                || c.windows(2).any(|w| w[1][0] <= w[0][0])
                || c.iter()
                    .any(|&[x, r]| !(x.is_finite() && x > 0.0 && r.is_finite() && r > 0.0));
            bad.then_some(op)
        }) {
            return Err(format!(
                "network level '{}': rates: '{op}' must be a collective with [bytes, bytes per second] pairs, bytes ascending, both positive",
                l.name
            ));
        }
        if !(l.latency.is_finite() && l.latency >= 0.0) || l.devices == 0 {
            return Err(format!(
                "network level '{}': latency must be seconds >= 0 and devices at least 1",
                l.name
            ));
        }
    }
    Ok(c)
}

fn toml_parse(text: &str) -> Result<Cluster, String> {
    toml::from_str(text).map_err(|e| e.to_string())
}

impl Cluster {
    /// This cluster as it runs program `g` (one device's): with `matrix_terms_hot` for
    /// the matrix products where the device has them and `g`'s values ([`footprint`])
    /// fit in its `cache_bytes`, else as it is (borrowed: no copy on the GPU presets,
    /// which have no hot terms, nor for a program too large for the cache).
    pub fn for_program(&self, g: &Graph) -> std::borrow::Cow<'_, Cluster> {
        let d = &self.device;
        match d.matrix_terms_hot {
            Some(hot) if d.matrix_terms.is_some() && footprint(g) <= d.cache_bytes => {
                let mut c = self.clone();
                c.device.matrix_terms = Some(hot);
                std::borrow::Cow::Owned(c)
            }
            _ => std::borrow::Cow::Borrowed(self),
        }
    }

    /// As TOML.
    pub fn to_toml(&self) -> Result<String, String> {
        toml::to_string_pretty(self).map_err(|e| e.to_string())
    }
}

impl Device {
    /// Bytes a plan's values may take: the memory less what the runtime holds
    /// (`reserved`), less the allocator's margin (`fragmentation`) of the rest.
    pub fn usable_memory(&self) -> u64 {
        let rest = self.memory.saturating_sub(self.reserved);
        (rest as f64 * (1.0 - self.fragmentation)) as u64
    }

    /// The memory a plan may use under `cap` (the user's or a mesh's), at most the
    /// usable memory.
    pub fn memory_limit(&self, cap: Option<u64>) -> u64 {
        cap.map_or(self.usable_memory(), |c| c.min(self.usable_memory()))
    }

    /// The fraction of the matrix peak a product of `flops` reaches.
    pub fn efficiency(&self, flops: f64) -> f64 {
        log_linear(&self.matrix_efficiency, flops).unwrap_or(1.0)
    }

    /// The fraction of the peak a product of `flops` reaches in bf16 (`bf16`, by
    /// `matrix_efficiency_bf16` where the device has that curve) or in f32.
    pub fn efficiency_in(&self, flops: f64, bf16: bool) -> f64 {
        match bf16 && !self.matrix_efficiency_bf16.is_empty() {
            true => log_linear(&self.matrix_efficiency_bf16, flops).unwrap_or(1.0),
            false => self.efficiency(flops),
        }
    }

    /// The peak matrix-product rate for products in bf16 (`bf16`: the tensor-core rate,
    /// where the device has one) or in f32; [`Device::efficiency_in`] the fraction of it
    /// a product reaches.
    pub fn matrix_rate(&self, bf16: bool) -> f64 {
        match (bf16, self.matrix_flops_bf16) {
            (true, Some(r)) => r,
            _ => self.matrix_flops,
        }
    }

    /// Seconds of op `op` whose roofline (compute or memory, whichever is slower) is
    /// `roofline` seconds: its measured fixed cost and factor (`kernels`), else the
    /// per-op overhead plus the roofline.
    pub fn kernel_time(&self, op: &str, roofline: f64) -> f64 {
        match self.kernels.get(op) {
            Some([fixed, factor]) => fixed + factor * roofline,
            None => self.op_overhead + roofline,
        }
    }

    /// Seconds of op `op` over `heads` attention heads of `s` queries and `t` keys, head
    /// dims `d` (queries, keys) and `e` (values), by its `head_kernels` entry (`None`
    /// without one).
    pub fn head_kernel_time(&self, op: &str, shape: [f64; 5]) -> Option<f64> {
        let c = self.head_kernels.get(op)?;
        let x = head_terms(shape);
        Some(self.op_overhead + x.iter().zip(c).map(|(x, c)| x * c).sum::<f64>())
    }

    /// Seconds of non-matrix op `op` of `flops` moving `bytes`: its roofline at the vector
    /// rate and the memory bandwidth, through its kernel entry ([`Device::kernel_time`]).
    pub fn vector_op_time(&self, op: &str, flops: f64, bytes: f64) -> f64 {
        self.kernel_time(op, self.op_time(flops, bytes, false) - self.op_overhead)
    }

    /// Compute seconds of `products` matrix products of `m x k` by `k x n` each (`bf16`:
    /// at the bf16 rate) in `form` (0 `A B`, 1 `A B^T`, 2 `A^T B`; `None`: another, or
    /// unknown): by `matrix_terms` (times the form's `matrix_forms` factor) where the
    /// device has them, else their FLOPs at the matrix rate times the efficiency of one
    /// product's FLOPs.
    pub fn matrix_seconds(
        &self,
        products: f64,
        [m, k, n]: [f64; 3],
        bf16: bool,
        form: Option<usize>,
    ) -> f64 {
        let one = 2.0 * m * k * n;
        match self.matrix_terms {
            Some([c0, c1, c2, c3]) => {
                let per_flop = c1 * self.matrix_flops / self.matrix_rate(bf16);
                let factor = match (self.matrix_forms, form) {
                    (Some(f), Some(i)) if i < 3 => f[i],
                    _ => 1.0,
                };
                let x = product_terms([m, k, n]);
                factor * products * (c0 * x[0] + per_flop * x[1] + c2 * x[2] + c3 * x[3])
            }
            None => products * one / (self.matrix_rate(bf16) * self.efficiency_in(one, bf16)),
        }
    }

    /// The expected wait, past the group's mean, of a collective among `group` devices
    /// after `since` seconds of compute since the group last met ([`Device::sync_jitter`]).
    pub fn skew(&self, group: u64, since: f64) -> f64 {
        if self.sync_jitter == 0.0 || group < 2 || since <= 0.0 {
            return 0.0;
        }
        expected_max_normal(group) * self.sync_jitter * since.sqrt()
    }

    /// Seconds for an op of `flops` (`matrix`: at the matrix rate) moving `bytes`.
    pub fn op_time(&self, flops: f64, bytes: f64, matrix: bool) -> f64 {
        let compute = if matrix {
            flops / (self.matrix_flops * self.efficiency(flops))
        } else {
            flops / self.vector_flops
        };
        self.op_overhead + compute.max(bytes / self.memory_bandwidth)
    }
}

/// The expected largest of `n` independent standard normal draws (0 for one; 0.564 for
/// two, 1.029 for four, 3.248 for 1024): how far past the mean the slowest of `n`
/// devices arrives, in standard deviations. By quadrature of `E = integral of (1 - F^n)
/// over x > 0 minus F^n over x < 0`, `F` the normal CDF; memoised per `n`.
pub fn expected_max_normal(n: u64) -> f64 {
    thread_local! {
        static MEMO: std::cell::RefCell<std::collections::HashMap<u64, f64>> =
            Default::default();
    }
    if n < 2 {
        return 0.0;
    }
    MEMO.with(|m| {
        *m.borrow_mut().entry(n).or_insert_with(|| {
            // E = integral over x > 0 of 1 - F(x)^n - F(-x)^n (the two halves folded
            // into one smooth integrand), by Simpson's rule on [0, 12]: F^n for n up to
            // millions stays within it.
            let steps = 2400;
            let h = 12.0 / steps as f64;
            let f = |x: f64| 1.0 - normal_cdf(x).powf(n as f64) - normal_cdf(-x).powf(n as f64);
            let mut sum = f(0.0) + f(12.0);
            for i in 1..steps {
                let w = if i % 2 == 1 { 4.0 } else { 2.0 };
                sum += w * f(i as f64 * h);
            }
            sum * h / 3.0
        })
    })
}

/// The standard normal CDF.
fn normal_cdf(x: f64) -> f64 {
    0.5 * libm::erfc(-x / std::f64::consts::SQRT_2)
}

/// Tracks a device's drift from the devices it meets, walking its program in order
/// ([`Device::sync_jitter`]): compute since each group of axes last met, so that a
/// collective's expected wait for its slowest member can be added to its time. A
/// collective over axes `X` brings together the devices that differ only on `X`; they
/// last met at the latest earlier collective over `X` or over more axes than `X` (which
/// met them and others), or at the start.
#[derive(Clone, Debug, Default)]
pub struct Drift {
    now: f64,
    met: Vec<(Vec<String>, f64)>,
}

impl Drift {
    /// `seconds` of compute on this device.
    pub fn compute(&mut self, seconds: f64) {
        self.now += seconds;
    }

    /// Op cost `c`'s seconds as the device runs it: compute adds to the drift, a
    /// collective adds its wait for the group's slowest member ([`Drift::meet`]).
    pub fn charge(&mut self, device: &Device, c: &NodeCost) -> f64 {
        match &c.axes {
            Some(axes) => c.seconds + self.meet(device, axes, c.group),
            None => {
                self.compute(c.seconds);
                c.seconds
            }
        }
    }

    /// The expected wait at a collective over `axes` among `group` devices, which then
    /// counts as the group meeting (a group of one, an op that sends nothing, meets
    /// nobody).
    pub fn meet(&mut self, device: &Device, axes: &[String], group: u64) -> f64 {
        if group < 2 {
            return 0.0;
        }
        let last = self
            .met
            .iter()
            .filter(|(a, _)| axes.iter().all(|x| a.contains(x)))
            .map(|&(_, t)| t)
            .fold(0.0, f64::max);
        self.met.retain(|(a, _)| a.as_slice() != axes);
        self.met.push((axes.to_vec(), self.now));
        device.skew(group, self.now - last)
    }
}

/// Bytes of every value of `g` and of the functions it calls: what one run touches.
pub fn footprint(g: &Graph) -> u64 {
    fn walk(g: &Graph, depth: usize) -> u64 {
        let own: u64 = g.values.iter().map(|v| v.bytes()).sum();
        let called: u64 = if depth < 64 {
            g.callees.values().map(|f| walk(f, depth + 1)).sum()
        } else {
            0
        };
        own + called
    }
    walk(g, 0)
}

/// A program's predicted time on one device of a cluster.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Prediction {
    /// Seconds of the matrix-product ops.
    pub matrix: f64,
    /// Seconds of the other ops.
    pub other: f64,
    /// Seconds of the collectives (not overlapped with compute), their waits for their
    /// groups' slowest members included.
    pub comm: f64,
    /// Of `comm`, the waits for the slowest members ([`Drift`]).
    pub wait: f64,
    /// FLOPs of the program.
    pub flops: f64,
    /// Ops counted.
    pub ops: usize,
    /// Whether its matrix products run in bf16 (`--autocast=bf16`): MFU is then relative
    /// to the bf16 peak.
    pub bf16: bool,
}

impl Prediction {
    /// Seconds of one run.
    pub fn seconds(&self) -> f64 {
        self.matrix + self.other + self.comm
    }

    /// Model FLOPs utilization: the program's FLOPs over its time at the device's peak.
    pub fn mfu(&self, d: &Device) -> f64 {
        self.flops / (self.seconds() * d.matrix_rate(self.bf16))
    }
}

impl Cluster {
    /// The network level a collective among `group` devices spanning `span` consecutive
    /// device numbers runs over: the innermost whose groups hold the span (the outermost
    /// when none does), `None` without a network.
    pub fn level(&self, span: u64) -> Option<&Level> {
        self.network
            .iter()
            .find(|l| l.devices >= span)
            .or(self.network.last())
    }

    /// Seconds of a point-to-point message of `bytes` between devices `span` numbers
    /// apart: the latency and bandwidth of the network level the span reaches (none for
    /// an empty message).
    pub fn p2p_time(&self, span: u64, bytes: u64) -> f64 {
        match self.level(span) {
            Some(l) if bytes > 0 => l.latency + bytes as f64 / l.bandwidth,
            _ => 0.0,
        }
    }

    /// Seconds of collective `op` among `group` devices spanning `span` device numbers,
    /// each sending `sent` bytes of messages of `message` bytes (the larger of its
    /// operand and result) (the collectives' own cost model): ring steps of latency (an
    /// all_reduce: the fewer of a ring's and, where the level allows it, a tree's) plus
    /// the bytes at the level's rate for the op and size ([`Level::rate`]).
    pub fn collective_time(&self, op: &str, group: u64, span: u64, sent: f64, message: f64) -> f64 {
        let Some(l) = self.level(span) else {
            return 0.0;
        };
        let ring = group.saturating_sub(1) as f64;
        let steps = if op == "nns.all_reduce" {
            let tree = if l.tree && group > 1 {
                2.0 * (64 - (group - 1).leading_zeros()) as f64
            } else {
                f64::INFINITY
            };
            (2.0 * ring).min(tree)
        } else {
            ring
        };
        steps * l.latency + sent / l.rate(op, message)
    }
}

/// One op's share of a prediction.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct NodeCost {
    /// Its seconds.
    pub seconds: f64,
    /// Its FLOPs (0 for collectives).
    pub flops: f64,
    /// Whether it is a matrix product (`Traits::matrix`).
    pub matrix: bool,
    /// Whether it is a matrix product on bf16 operands (at the device's bf16 rate).
    pub bf16: bool,
    /// For a collective that moves data: the mesh axes its group spans.
    pub axes: Option<Vec<String>>,
    /// For a collective: the devices in its group that it meets (0 otherwise; 1 for one
    /// that sends nothing, such as a slice or a partition).
    pub group: u64,
}

/// Seconds of collective `op` over mesh `axes` of `mesh` whose local operand and result
/// are `input` and `output` bytes on each device; `None` when its group is one device.
/// Device numbers run row-major over the device axes (the micro-batch axis is time, not
/// devices), so the group spans the devices its axes' strides reach.
pub fn collective_seconds(
    cluster: &Cluster,
    mesh: &Mesh,
    op: &str,
    axes: &[String],
    input: f64,
    output: f64,
) -> Option<f64> {
    let (group, span) = group_of(mesh, axes);
    if group < 2 {
        return None;
    }
    Some(collective_op_seconds(
        cluster,
        op,
        (group, span),
        (input, output),
        input.max(output),
    ))
}

/// Seconds of one collective `op` among `group` devices spanning `span` device numbers
/// (`(group, span)`, [`group_of`]) whose local operand and result are `input` and
/// `output` bytes (`(input, output)`), at the link rate of a `message`-byte message: the
/// bytes it sends by the collectives' table (`nns::sent_bytes`) over the cluster's
/// level. What [`predict`] charges a collective op, and what the plan search charges the
/// collectives it prices without compiling them (gradient synchronisation).
pub fn collective_op_seconds(
    cluster: &Cluster,
    op: &str,
    (group, span): (u64, u64),
    (input, output): (f64, f64),
    message: f64,
) -> f64 {
    let sent = nns::sent_bytes(op, group as f64, input, output);
    cluster.collective_time(op, group, span, sent, message)
}

/// Seconds of the `nns` op `op` among `(members, span)` ([`group_of`]) whose local operand
/// and result are `(input, output)` bytes, as [`predict`] charges it: a slice keeps this
/// device's piece (no message, a local copy of the piece), the others are collectives
/// ([`collective_op_seconds`] at the rate of their larger side); `None` for a group of one
/// device (no such op is emitted).
pub fn layout_op_seconds(
    cluster: &Cluster,
    op: &str,
    (members, span): (u64, u64),
    (input, output): (f64, f64),
) -> Option<f64> {
    if members < 2 {
        return None;
    }
    Some(if op == "nns.slice" {
        cluster.device.op_time(0.0, 2.0 * output, false)
    } else {
        collective_op_seconds(
            cluster,
            op,
            (members, span),
            (input, output),
            input.max(output),
        )
    })
}

/// How `--lower-relayouts cluster=...` and the split search price a relayout's steps on
/// `mesh`: each step's [`layout_op_seconds`] on `cluster` (0 for a step among one device,
/// which is not emitted). So the path a relayout takes is the one [`predict`] finds
/// cheapest on the cluster.
pub fn relayout_price(cluster: &Cluster, mesh: &Mesh) -> StepPrice {
    let (cluster, mesh) = (cluster.clone(), mesh.clone());
    Arc::new(move |step: &Step, here: f64, after: f64| {
        let axes: Vec<String> = step
            .axes()
            .iter()
            .map(|&a| mesh.axes[a].name.clone())
            .collect();
        layout_op_seconds(
            &cluster,
            step.op_name(),
            group_of(&mesh, &axes),
            (here, after),
        )
        .unwrap_or(0.0)
    })
}

/// Whether collective `op` sends data (so it meets its group: not a slice or a
/// partition).
pub fn sends_data(op: &str) -> bool {
    nns::sent_bytes(op, 2.0, 1.0, 1.0) > 0.0
}

/// The devices in a group over mesh `axes` and the device numbers it spans (numbered
/// row-major over the device axes; the micro-batch axis is time, not devices).
pub fn group_of(mesh: &Mesh, axes: &[String]) -> (u64, u64) {
    let devs: Vec<&nnscaler_dialects::nns::Axis> =
        mesh.axes.iter().filter(|a| !a.microbatches).collect();
    let mut group = 1u64;
    let mut span = 1u64;
    for a in axes {
        let Some(k) = devs.iter().position(|x| &x.name == a) else {
            continue;
        };
        let stride: i64 = devs[k + 1..].iter().map(|x| x.size).product();
        group *= devs[k].size as u64;
        span += (devs[k].size as u64 - 1) * stride as u64;
    }
    (group, span)
}

/// The predicted time of op `n` of `g` on a device of `cluster` (see [`predict`]); `None`
/// for what takes no time: the return, and collectives without a group of two or more.
pub fn node_cost(
    g: &Graph,
    n: &nnscaler_dialects::graph::Node,
    cluster: &Cluster,
    mesh: Option<&Mesh>,
) -> Option<NodeCost> {
    let device = &cluster.device;
    if n.op == "func.return" {
        return None;
    }
    if n.op.starts_with("nns.") {
        let (Some(mesh), Some(AttrValue::Strs(axes))) = (mesh, n.attrs.get("axes")) else {
            return None;
        };
        let input = n.inputs.first().map_or(0, |&v| g.values[v].bytes()) as f64;
        let output = n.outputs.first().map_or(0, |&v| g.values[v].bytes()) as f64;
        let (members, span) = group_of(mesh, axes);
        let seconds = layout_op_seconds(cluster, &n.op, (members, span), (input, output))?;
        // Only an op that sends data meets its group (not a slice or a partition).
        let group = if sends_data(&n.op) { members } else { 1 };
        return Some(NodeCost {
            seconds,
            axes: Some(axes.clone()),
            group,
            ..NodeCost::default()
        });
    }
    let flops = op_flops(g, n);
    let bytes: f64 = n
        .inputs
        .iter()
        .chain(&n.outputs)
        .map(|&v| g.values[v].bytes() as f64)
        .sum();
    let matrix = n.op.spec().is_some_and(|s| s.traits.matrix);
    let bf16 = matrix
        && n.inputs
            .iter()
            .all(|&v| !g.values[v].elem.is_float() || g.values[v].elem == Elem::BF16);
    let seconds = if matrix {
        // Batched products run one at a time: their efficiency is that of one product
        // (the result's leading dims when operand 1 has leading dims too). A rank-2
        // operand 1 folds the rows into one product (`linear`), and so does a rank-2
        // result (`linear_weight_grad`: the leading dims are the contraction's).
        let products: f64 = match (n.inputs.get(1), n.outputs.first()) {
            (Some(&b), Some(&r)) if g.values[b].rank() > 2 => {
                let s = &g.values[r].shape;
                s[..s.len().saturating_sub(2)]
                    .iter()
                    .product::<i64>()
                    .max(1) as f64
            }
            _ => 1.0,
        };
        if let Some(t) = head_shape(g, n)
            .and_then(|shape| device.head_kernel_time(&head_key(g, n, device), shape))
        {
            t
        } else {
            device.kernel_time(
                &n.op,
                device
                    .matrix_seconds(
                        products,
                        product_shape(g, n, products, flops),
                        bf16,
                        product_form(n),
                    )
                    .max(bytes / device.memory_bandwidth),
            )
        }
    } else if n.attrs.contains_key("nns.accumulate") {
        accumulate_seconds(device, flops, bytes)
    } else {
        device.vector_op_time(&n.op, flops, bytes)
    };
    Some(NodeCost {
        seconds,
        flops,
        matrix,
        bf16,
        axes: None,
        group: 0,
    })
}

/// Seconds of a gradient accumulation's add (`nns.accumulate`: a micro-batch's gradient
/// added to the sum of the earlier ones) of `flops` moving `bytes`: the sum was last
/// touched a micro-batch earlier and has left the cache, so the add streams at
/// `memory_bandwidth` (a streaming add's, measured beyond the cache) rather than at its
/// kernel entry's rate, fitted to adds whose operands a step had just written.
pub fn accumulate_seconds(device: &Device, flops: f64, bytes: f64) -> f64 {
    device.op_time(flops, bytes, false)
}

/// One product's `[m, k, n]` of matrix op `n` of `flops` in `products` products: `n` the
/// result's last dim, `m` the rest of one product's result (the rows a `linear` folds
/// into one product; a `linear_weight_grad`'s output rows), `k` what the FLOPs leave
/// (`2 m k n` a product: a `linear_weight_grad` sums over the rows).
fn product_shape(
    g: &Graph,
    n: &nnscaler_dialects::graph::Node,
    products: f64,
    flops: f64,
) -> [f64; 3] {
    let Some(r) = n.outputs.first().map(|&v| &g.values[v]) else {
        return [1.0, flops / 2.0, 1.0];
    };
    let cols = r.shape.last().map_or(1, |&d| d.max(1)) as f64;
    let elems = (r.shape.iter().product::<i64>().max(1)) as f64;
    let rows = (elems / products / cols).max(1.0);
    [rows, flops / (2.0 * elems), cols]
}

/// What each `matrix_terms` coefficient multiplies for one `m x k` by `k x n` product:
/// 1, its FLOPs `2mkn`, the result's elements `mn` and the operands' `mk + kn`
/// (`nnscaler calibrate` fits the coefficients on the same terms).
pub fn product_terms([m, k, n]: [f64; 3]) -> [f64; 4] {
    [1.0, 2.0 * m * k * n, m * n, m * k + k * n]
}

/// The form of matrix op `n`'s products, as [`Device::matrix_seconds`] takes it: 0 `A
/// B`, 1 `A B^T`, 2 `A^T B`; `None` for both operands transposed and other ops.
pub fn product_form(n: &nnscaler_dialects::graph::Node) -> Option<usize> {
    let flag = |k: &str| nnscaler_dialects::types::flag(&n.attrs, k);
    match n.op.as_str() {
        "dnn.linear" => Some(1),
        "dnn.linear_weight_grad" => Some(2),
        "dnn.matmul" => match (flag("transpose_a"), flag("transpose_b")) {
            (false, false) => Some(0),
            (false, true) => Some(1),
            (true, false) => Some(2),
            (true, true) => None,
        },
        _ => None,
    }
}

/// What each `head_kernels` coefficient multiplies for attention of shape `[heads, s,
/// t, d, e]` ([`head_shape`]): heads, query rows, scores, and scores times `d + e`
/// (`nnscaler calibrate` fits the coefficients on the same terms).
pub fn head_terms([heads, s, t, d, e]: [f64; 5]) -> [f64; 4] {
    [heads, heads * s, heads * s * t, heads * s * t * (d + e)]
}

/// The `head_kernels` key of attention op `n`: `dnn.attention.bf16` (or the gradient's)
/// when its queries are bf16 and `device` has that entry (the tensor-core kernels, timed
/// apart by `nnscaler calibrate --device gpu`), else the op's name.
pub fn head_key(g: &Graph, n: &nnscaler_dialects::graph::Node, device: &Device) -> String {
    let q = usize::from(n.op == "dnn.attention_grad");
    let bf16 = n
        .inputs
        .get(q)
        .is_some_and(|&v| g.values[v].elem == nnscaler_dialects::types::Elem::BF16);
    let key = format!("{}.bf16", n.op);
    if bf16 && device.head_kernels.contains_key(&key) {
        key
    } else {
        n.op.to_string()
    }
}

/// An attention op's heads: `[heads, queries, keys, query/key head dim, value head dim]`
/// from its operands (`q [b, h, s, d]`, `k [b, g, t, d]`, `v [b, g, t, e]`; the
/// gradient's after `dout`); `None` for other ops.
pub fn head_shape(g: &Graph, n: &nnscaler_dialects::graph::Node) -> Option<[f64; 5]> {
    let first = match n.op.as_str() {
        "dnn.attention" => 0,
        "dnn.attention_grad" => 1,
        _ => return None,
    };
    let shape = |i: usize| {
        let s = &g.values[*n.inputs.get(first + i)?].shape;
        (s.len() == 4).then(|| s.iter().map(|&x| x as f64).collect::<Vec<f64>>())
    };
    let (q, k, v) = (shape(0)?, shape(1)?, shape(2)?);
    Some([q[0] * q[1], q[2], k[2], q[3], v[3]])
}

/// The predicted time of running `g` once on a device of `cluster` (its ops one after
/// another; ops of other dialects and data-free ones such as reshapes count their
/// overhead and bytes); a per-device program's collectives over `mesh` (devices numbered
/// row-major) at the network level their groups span, each with its expected wait for
/// the group's slowest member ([`Drift`]).
pub fn predict(g: &Graph, cluster: &Cluster, mesh: Option<&Mesh>) -> Prediction {
    let mut p = Prediction::default();
    let mut drift = Drift::default();
    for n in &g.nodes {
        let Some(c) = node_cost(g, n, cluster, mesh) else {
            continue;
        };
        let seconds = drift.charge(&cluster.device, &c);
        if c.axes.is_some() {
            p.comm += seconds;
            p.wait += seconds - c.seconds;
            continue;
        }
        if c.matrix {
            p.matrix += c.seconds;
            p.bf16 |= c.bf16;
        } else {
            p.other += c.seconds;
        }
        p.flops += c.flops;
        p.ops += 1;
    }
    p
}

#[cfg(test)]
mod tests;
