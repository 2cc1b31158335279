//! The built-in clusters (`dgx-a100`, `dgx-h100`, `h200`, `cpu`): where each figure comes
//! from, and what a GPU's runtime holds outside a program.

use super::{Cluster, Device, Level, GIB};
use std::collections::BTreeMap;

/// What a GPU's runtime holds outside the program's values (the GPU presets' `reserved`):
/// the CUDA context with lazy module loading (about 0.5 GiB), the matrix library's
/// workspace (PyTorch's default cuBLAS workspace on Hopper, 8 x 4 MiB) and the NCCL
/// communicators' buffers (NCCL_BUFFSIZE, 4 MiB, per channel and peer direction: about
/// 1 GiB for a plan's dp, tp and pp communicators). Assumed until measured:
/// bench/gpu/check.sh prints what a GPU's context, cuBLAS and NCCL take.
pub const GPU_RESERVED: u64 = 3 * GIB / 2;

/// The share of the rest a caching allocator loses (the GPU presets' `fragmentation`):
/// PyTorch's allocator typically reserves 5-10% more than it hands out in training; 8%.
pub const GPU_FRAGMENTATION: f64 = 0.08;

const GPU_MEMORY_NOTE: &str = "1.5 GiB reserved (CUDA context, cuBLAS workspace, NCCL buffers) and an 8% allocator margin, assumed until measured (bench/gpu/check.sh)";

/// NCCL's bus bandwidth over NVLink 4 (H100, H200: 450 GB/s each way) for every collective
/// but all_reduce: about 370 GB/s, the line rate less NCCL's protocol overhead of about
/// 20% (NCCL's maintainer, NVIDIA/nccl-tests issue 212, 2024-05-06: "NCCL can get an
/// effective NVLink bandwidth of 370GB/s", the bus bandwidth of non-allreduce operations
/// or of a ring all_reduce).
pub const NCCL_NVLINK_H100: f64 = 370e9;

/// NCCL's all_reduce bus bandwidth on 8 H100s or H200s, through NVLink SHARP (NVLS, NCCL's
/// default there): about 480 GB/s at large sizes (the same comment of issue 212: "On 8
/// GPUs, you should reach a peak busBw of ~480GB/s"; 475 GB/s measured on 8 H200s with
/// NCCL 2.20, NVIDIA/nccl-tests issue 272).
pub const NCCL_NVLS_ALL_REDUCE: f64 = 480e9;

/// NCCL's bus bandwidth over NVLink 3 (A100: 300 GB/s each way): the line rate less the
/// same 20% protocol overhead, 240 GB/s (users measure 200-208 GB/s for all_reduce on 8
/// A100s, NVIDIA/nccl-tests issues 149 and 178; A100 has no NVLink SHARP).
pub const NCCL_NVLINK_A100: f64 = 240e9;

/// NCCL's bus bandwidth across nodes through one 200 Gb/s HDR InfiniBand NIC per GPU
/// (DGX A100): 24 GB/s (NCCL's maintainer, NVIDIA/nccl issue 412, 2023-04-24: "at a size
/// of 8G, you should get ... 24GB/s inter-node" per HDR NIC).
pub const NCCL_HDR: f64 = 24e9;

/// The same through one 400 Gb/s NDR NIC per GPU (DGX H100): twice HDR's, by line rate
/// (no published figure found; to be measured).
pub const NCCL_NDR: f64 = 48e9;

/// The built-in clusters. GPU figures are datasheet peaks (dense, no sparsity) with an
/// assumed cuBLAS-like efficiency curve (to be replaced by `nnscaler calibrate` on a GPU);
/// `cpu` is this project's development machine, one thread, as one run of `nnscaler
/// calibrate --device cpu --timing serial` measured it on 2026-12-04 (the device, its
/// kernel entries and the in-process network together, so they are consistent).
pub fn preset(name: &str) -> Option<Cluster> {
    let gpu_eff = vec![[1e6, 0.02], [1e8, 0.2], [1e10, 0.6], [1e12, 0.8]];
    // The links at the bandwidth NCCL reaches on them (nccl-tests' bus bandwidth for large
    // messages), not their line rate: see NCCL_NVLINK_A100 and the others below.
    let node = |bw: f64, all_reduce: Option<f64>| Level {
        name: "nvlink".into(),
        devices: 8,
        bandwidth: bw,
        latency: 5e-6,
        tree: true,
        bandwidths: all_reduce
            .map(|r| BTreeMap::from([("nns.all_reduce".to_string(), r)]))
            .unwrap_or_default(),
        rates: BTreeMap::new(),
    };
    let fabric = |bw: f64| Level {
        name: "infiniband".into(),
        devices: 8 * 1024,
        bandwidth: bw,
        latency: 10e-6,
        tree: true,
        bandwidths: BTreeMap::new(),
        rates: BTreeMap::new(),
    };
    Some(match name {
        "dgx-a100" => Cluster {
            name: name.into(),
            device: Device {
                name: "A100 SXM 80GB".into(),
                matrix_flops: 19.5e12,
                matrix_flops_bf16: Some(312e12),
                vector_flops: 19.5e12,
                memory: 80 * GIB,
                memory_bandwidth: 2.039e12,
                matrix_efficiency: gpu_eff,
                matrix_efficiency_bf16: Vec::new(),
                matrix_terms: None,
                matrix_terms_hot: None,
                matrix_forms: None,
                cache_bytes: 0,
                op_overhead: 5e-6,
                sync_jitter: 0.0,
                kernels: BTreeMap::new(),
                head_kernels: BTreeMap::new(),
                reserved: GPU_RESERVED,
                fragmentation: GPU_FRAGMENTATION,
                source: format!("NVIDIA A100 datasheet; NCCL's bus bandwidths from nccl-tests as NCCL's maintainers and users published them (presets.rs); {GPU_MEMORY_NOTE}"),
            },
            // NVLink 3 (300 GB/s each way per GPU) and 8 x 200 Gb/s HDR per node, at
            // NCCL's bandwidth on them.
            network: vec![node(NCCL_NVLINK_A100, None), fabric(NCCL_HDR)],
        },
        "dgx-h100" | "h200" => Cluster {
            name: name.into(),
            device: Device {
                name: if name == "h200" {
                    "H200 SXM 141GB"
                } else {
                    "H100 SXM 80GB"
                }
                .into(),
                matrix_flops: 67e12,
                matrix_flops_bf16: Some(989e12),
                vector_flops: 67e12,
                memory: if name == "h200" { 141 } else { 80 } * GIB,
                memory_bandwidth: if name == "h200" { 4.8e12 } else { 3.35e12 },
                matrix_efficiency: gpu_eff,
                matrix_efficiency_bf16: Vec::new(),
                matrix_terms: None,
                matrix_terms_hot: None,
                matrix_forms: None,
                cache_bytes: 0,
                op_overhead: 4e-6,
                sync_jitter: 0.0,
                kernels: BTreeMap::new(),
                head_kernels: BTreeMap::new(),
                reserved: GPU_RESERVED,
                fragmentation: GPU_FRAGMENTATION,
                source: format!("NVIDIA H100/H200 datasheets; NCCL's bus bandwidths from nccl-tests as NCCL's maintainers and users published them (presets.rs); {GPU_MEMORY_NOTE}"),
            },
            // NVLink 4 (450 GB/s each way per GPU; all_reduce through NVLink SHARP) and
            // 8 x 400 Gb/s NDR per node, at NCCL's bandwidth on them.
            network: vec![
                node(NCCL_NVLINK_H100, Some(NCCL_NVLS_ALL_REDUCE)),
                fabric(NCCL_NDR),
            ],
        },
        "cpu" => Cluster {
            name: name.into(),
            device: Device {
                name: "this machine's CPU, one thread".into(),
                matrix_flops: 100800000000.0,
                matrix_flops_bf16: None,
                vector_flops: 2805000000.0,
                memory: 24 * GIB,
                memory_bandwidth: 21520000000.0,
                // Each product's dispatch taken out (the model adds `op_overhead`).
                matrix_efficiency: vec![
                    [4096.0, 0.1881],
                    [32768.0, 0.4875],
                    [262144.0, 0.7462],
                    [2097152.0, 0.8788],
                    [16777216.0, 0.9916],
                    [134217728.0, 0.9933],
                    [1073741824.0, 1.0],
                ],
                matrix_efficiency_bf16: Vec::new(),
                // Used for the products' time in place of the curve above.
                matrix_terms: Some([0.0, 8.693e-12, 2.065e-10, 1.867e-10]),
                matrix_terms_hot: Some([0.0, 8.088e-12, 2.856e-10, 8.321e-11]),
                matrix_forms: Some([0.941, 1.022, 1.037]),
                cache_bytes: 2097152,
                op_overhead: 3.505e-07,
                // The simulated devices' drift between collectives under serial timing
                // (three calibrations that day: 1.00e-3, 1.04e-3, 1.69e-3).
                sync_jitter: 0.001035,
                kernels: [
                    ("dnn.adamw", [4.757e-07, 0.3883]),
                    ("dnn.add", [1.654e-07, 0.545]),
                    ("dnn.cross_entropy", [3.441e-07, 1.291]),
                    ("dnn.cross_entropy_grad", [3.217e-07, 3.419]),
                    ("dnn.embedding", [4.41e-07, 0.2286]),
                    ("dnn.embedding_grad", [2.31e-07, 0.7043]),
                    ("dnn.gelu", [0.0, 0.4181]),
                    ("dnn.gelu_grad", [0.0, 0.3504]),
                    ("dnn.layer_norm", [4.728e-07, 0.437]),
                    ("dnn.layer_norm_grad", [1.062e-06, 0.7155]),
                    ("dnn.mul", [0.0, 0.6144]),
                    ("dnn.relu", [2.145e-07, 0.6326]),
                    ("dnn.relu_grad", [2.753e-07, 0.1393]),
                    ("dnn.reshape", [2.66e-07, 0.1057]),
                    ("dnn.rms_norm", [2.65e-07, 0.4912]),
                    ("dnn.rms_norm_grad", [6.062e-07, 0.5703]),
                    ("dnn.rotary", [8.198e-07, 0.6723]),
                    ("dnn.rotary_grad", [8.786e-07, 0.6728]),
                    ("dnn.silu", [1.21e-07, 0.5705]),
                    ("dnn.silu_grad", [2.066e-08, 0.3347]),
                    ("dnn.sum", [4.068e-07, 3.053]),
                    ("dnn.transpose", [6.185e-07, 0.6028]),
                ]
                .into_iter()
                .map(|(op, k)| (op.to_string(), k))
                .collect(),
                head_kernels: [
                    ("dnn.attention", [1.217e-07, 7.64e-08, 1.914e-09, 2.918e-11]),
                    ("dnn.attention_grad", [7.767e-07, 7.627e-08, 2.892e-09, 6.742e-11]),
                ]
                .into_iter()
                .map(|(op, k)| (op.to_string(), k))
                .collect(),
                reserved: 0,
                fragmentation: 0.0,
                source: "nnscaler calibrate --device cpu --timing serial, 2026-12-04 (a host of two cores of their own, a 2 MiB L2 each; one run of three, the middle one by its prediction of nanogpt-cpu's step, the three within 0.2%; a shared machine: recalibrate)"
                    .into(),
            },
            // Simulated devices exchange through memory: all_reduces between two
            // simulated devices, the latency from a chain, the bandwidth from all_reduces
            // of 4 MiB operands of their own (cold, as a step's gradients are; what the
            // pipelines' sends take), and each collective's rate by message size from
            // 16 KiB to 4 MiB (`rates`, same run).
            network: vec![Level {
                name: "in-process".into(),
                devices: 64,
                bandwidth: 1625000000.0,
                latency: 4.957e-07,
                tree: false,
                bandwidths: BTreeMap::new(),
                rates: {
                    // Messages of 16 KiB to 4 MiB, and each collective's rate at each.
                    let sizes = [16384.0, 65536.0, 262144.0, 1048576.0, 4194304.0];
                    [
                        ("nns.all_gather", [2.378e9, 3.885e9, 5.169e9, 4.463e9, 2.876e9]),
                        ("nns.all_reduce", [2.785e9, 4.502e9, 5.126e9, 2.815e9, 1.681e9]),
                        ("nns.all_to_all", [1.968e9, 3.132e9, 3.384e9, 2.081e9, 1.198e9]),
                        ("nns.reduce_scatter", [1.985e9, 2.915e9, 3.35e9, 2.193e9, 1.395e9]),
                    ]
                    .into_iter()
                    .map(|(op, rates)| {
                        let curve = sizes.into_iter().zip(rates).map(|(b, r)| [b, r]);
                        (op.to_string(), curve.collect())
                    })
                    .collect()
                },
            }],
        },
        _ => return None,
    })
}

/// The preset names.
pub const PRESETS: &[&str] = &["dgx-a100", "dgx-h100", "h200", "cpu"];
