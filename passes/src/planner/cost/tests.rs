//! Unit tests of `cost`.

use super::*;

#[test]
fn plans_get_the_memory_less_the_runtimes_reserve_and_margin() {
    let h = preset("dgx-h100").unwrap().device;
    // (80 GiB - 1.5 GiB) x 0.92.
    let want = ((80 * GIB - 3 * GIB / 2) as f64 * 0.92) as u64;
    assert_eq!(h.usable_memory(), want);
    assert_eq!(h.memory_limit(None), want);
    assert_eq!(h.memory_limit(Some(60 * GIB)), 60 * GIB);
    assert_eq!(h.memory_limit(Some(100 * GIB)), want);
    // The CPU runtime holds nothing outside the program: its figures are unchanged.
    let c = preset("cpu").unwrap().device;
    assert_eq!(c.usable_memory(), c.memory);
    // A cluster file without the fields reserves nothing.
    let mut t = preset("dgx-h100").unwrap();
    t.device.reserved = 0;
    t.device.fragmentation = 0.0;
    let back = parse(&t.to_toml().unwrap()).unwrap();
    assert_eq!(back.device.usable_memory(), 80 * GIB);
}

#[test]
fn presets_round_trip_and_efficiency_interpolates() {
    for name in PRESETS {
        let c = preset(name).unwrap();
        assert_eq!(parse(&c.to_toml().unwrap()).unwrap(), c, "{name}");
    }
    let d = preset("dgx-h100").unwrap().device;
    assert_eq!(d.efficiency(1.0), 0.02);
    assert_eq!(d.efficiency(1e15), 0.8);
    let mid = d.efficiency(1e9);
    assert!((mid - 0.4).abs() < 1e-9, "{mid}");
    // A large product is compute-bound, a copy memory-bound.
    let t = d.op_time(1e12, 1e6, true);
    assert!((t - (4e-6 + 1e12 / (67e12 * 0.8))).abs() < 1e-12);
    let t = d.op_time(0.0, 3.35e9, false);
    assert!((t - (4e-6 + 1e-3)).abs() < 1e-12);
}

#[test]
fn collectives_take_the_level_their_group_spans() {
    let c = preset("dgx-h100").unwrap();
    // 8 devices of a node: NVLink; 16 spanning two nodes: the fabric.
    assert_eq!(c.level(8).unwrap().name, "nvlink");
    assert_eq!(c.level(16).unwrap().name, "infiniband");
    // An all_reduce of 8 takes the tree's 2 x 3 latency steps, not the ring's 14; a
    // level without trees keeps the ring, and so do gathers. On NVLink 4 all_reduce moves
    // at NVLink SHARP's rate, the others at the ring's (the bytes below take a second).
    use super::presets::{NCCL_NDR, NCCL_NVLINK_H100, NCCL_NVLS_ALL_REDUCE};
    let (ar, ring, ndr) = (NCCL_NVLS_ALL_REDUCE, NCCL_NVLINK_H100, NCCL_NDR);
    let t = c.collective_time("nns.all_reduce", 8, 8, ar, 1e9);
    assert!((t - (6.0 * 5e-6 + 1.0)).abs() < 1e-9, "{t}");
    let t = c.collective_time("nns.all_reduce", 2, 2, ar, 1e9);
    assert!((t - (2.0 * 5e-6 + 1.0)).abs() < 1e-9, "{t}");
    let t = c.collective_time("nns.all_reduce", 5, 8, ar, 1e9);
    assert!((t - (6.0 * 5e-6 + 1.0)).abs() < 1e-9, "{t}");
    let mut rings = c.clone();
    rings.network[0].tree = false;
    let t = rings.collective_time("nns.all_reduce", 8, 8, ar, 1e9);
    assert!((t - (14.0 * 5e-6 + 1.0)).abs() < 1e-9, "{t}");
    let t = c.collective_time("nns.all_gather", 8, 8, ring, 1e9);
    assert!((t - (7.0 * 5e-6 + 1.0)).abs() < 1e-9, "{t}");
    let t = c.collective_time("nns.all_gather", 2, 9, ndr, 1e9);
    assert!((t - (10e-6 + 1.0)).abs() < 1e-9, "{t}");
    // A collective with a rate of its own at a level moves its bytes at that rate;
    // the others keep the level's.
    let mut own = c.clone();
    own.network[0]
        .bandwidths
        .insert("nns.all_gather".into(), ring / 2.0);
    let t = own.collective_time("nns.all_gather", 8, 8, ring, 1e9);
    assert!((t - (7.0 * 5e-6 + 2.0)).abs() < 1e-9, "{t}");
    let t = own.collective_time("nns.reduce_scatter", 8, 8, ring, 1e9);
    assert!((t - (7.0 * 5e-6 + 1.0)).abs() < 1e-9, "{t}");
    assert_eq!(parse(&own.to_toml().unwrap()).unwrap(), own);
    own.network[0].bandwidths.insert("nns.gather".into(), 1e9);
    let e = parse(&own.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("'nns.gather'"), "{e}");
    own.network[0].bandwidths.remove("nns.gather");
    own.network[0]
        .bandwidths
        .insert("nns.all_gather".into(), 0.0);
    let e = parse(&own.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("bandwidths") && e.contains("positive"), "{e}");
}

#[test]
fn collective_rates_follow_the_message_size() {
    let mut c = preset("cpu").unwrap();
    c.network[0].latency = 0.0;
    c.network[0].bandwidth = 1e9;
    c.network[0].bandwidths.clear();
    c.network[0].rates.clear();
    c.network[0].bandwidths.insert("nns.all_gather".into(), 2e9);
    // all_reduces: 4 GB/s on 64 KiB messages, 1 GB/s on 4 MiB ones, log-linear
    // between (2.5 GB/s at 512 KiB, halfway in the log), flat beyond.
    c.network[0].rates.insert(
        "nns.all_reduce".into(),
        vec![[65536.0, 4e9], [4194304.0, 1e9]],
    );
    let l = &c.network[0];
    assert_eq!(l.rate("nns.all_reduce", 1024.0), 4e9);
    assert_eq!(l.rate("nns.all_reduce", 65536.0), 4e9);
    assert!((l.rate("nns.all_reduce", 524288.0) - 2.5e9).abs() < 1.0);
    assert_eq!(l.rate("nns.all_reduce", 1e9), 1e9);
    // The others keep their own rate or the level's.
    assert_eq!(l.rate("nns.all_gather", 65536.0), 2e9);
    assert_eq!(l.rate("nns.reduce_scatter", 65536.0), 1e9);
    // Two devices each send their operand once: 4e9 bytes at 4 GB/s on small
    // messages, at 1 GB/s on large ones.
    let t = c.collective_time("nns.all_reduce", 2, 2, 4e9, 1024.0);
    assert!((t - 1.0).abs() < 1e-9, "{t}");
    let t = c.collective_time("nns.all_reduce", 2, 2, 4e9, 8e6);
    assert!((t - 4.0).abs() < 1e-9, "{t}");
    assert_eq!(parse(&c.to_toml().unwrap()).unwrap(), c);
    // Sizes must ascend and rates be positive, on collectives.
    for bad in [
        vec![[4194304.0, 1e9], [65536.0, 4e9]],
        vec![[65536.0, 0.0]],
        vec![],
    ] {
        let mut b = c.clone();
        b.network[0].rates.insert("nns.all_reduce".into(), bad);
        let e = parse(&b.to_toml().unwrap()).unwrap_err();
        assert!(e.contains("rates: 'nns.all_reduce'"), "{e}");
    }
    let mut b = c.clone();
    b.network[0]
        .rates
        .insert("dnn.add".into(), vec![[1.0, 1.0]]);
    let e = parse(&b.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("'dnn.add'"), "{e}");
}

#[test]
fn measured_kernels_replace_the_roofline() {
    let mut d = preset("cpu").unwrap().device;
    d.kernels.clear();
    let plain = d.kernel_time("dnn.attention", 1e-3);
    assert!((plain - (d.op_overhead + 1e-3)).abs() < 1e-15);
    d.kernels.insert("dnn.attention".into(), [2e-6, 4.0]);
    assert!((d.kernel_time("dnn.attention", 1e-3) - (2e-6 + 4e-3)).abs() < 1e-15);
    assert_eq!(d.kernel_time("dnn.add", 1e-3), plain);
    let mut c = preset("cpu").unwrap();
    c.device.kernels.insert("dnn.sum".into(), [0.0, -1.0]);
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("device.kernels: 'dnn.sum'"), "{e}");
}

#[test]
fn attention_costs_per_head_by_its_head_kernel_entry() {
    use nnscaler_dialects::context::IrContext;
    let ir = IrContext::new();
    // 2 x 4 query heads of 8 positions, dim 4; 2 key/value heads with value dim 6.
    let src = r#"func.func @f(%q: tensor<2x4x8x4xf32> {nns.name = "q"}, %k: tensor<2x2x16x4xf32> {nns.name = "k"}, %v: tensor<2x2x16x6xf32> {nns.name = "v"}) -> tensor<2x4x8x6xf32> {
  %0 = "dnn.attention"(%q, %k, %v) {causal = true} : (tensor<2x4x8x4xf32>, tensor<2x2x16x4xf32>, tensor<2x2x16x6xf32>) -> tensor<2x4x8x6xf32>
  return %0 : tensor<2x4x8x6xf32>
}"#;
    let m = ir.parse(src, "a.mlir").unwrap();
    let g = Graph::all_in(&m).remove(0).unwrap();
    let n = &g.nodes[0];
    assert_eq!(head_shape(&g, n), Some([8.0, 8.0, 16.0, 4.0, 6.0]));
    let mut c = preset("cpu").unwrap();
    c.device.head_kernels.clear();
    c.device.kernels.clear();
    let roofline = node_cost(&g, n, &c, None).unwrap().seconds;
    c.device
        .head_kernels
        .insert("dnn.attention".into(), [1e-6, 1e-7, 1e-9, 1e-11]);
    let per_head = 1e-6 + 8.0 * 1e-7 + 128.0 * 1e-9 + 128.0 * 10.0 * 1e-11;
    let t = node_cost(&g, n, &c, None).unwrap().seconds;
    assert!(
        (t - (c.device.op_overhead + 8.0 * per_head)).abs() < 1e-15,
        "{t}"
    );
    assert!(t != roofline);
    // Negative or all-zero terms are refused.
    c.device
        .head_kernels
        .insert("dnn.attention".into(), [0.0; 4]);
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("device.head_kernels: 'dnn.attention'"), "{e}");
    c.device
        .head_kernels
        .insert("dnn.attention".into(), [1e-6, -1.0, 0.0, 0.0]);
    assert!(parse(&c.to_toml().unwrap()).is_err());
}

#[test]
fn matrix_terms_price_each_product_by_its_shape() {
    use nnscaler_dialects::context::IrContext;
    let ir = IrContext::new();
    // A linear folding 2 x 8 rows ([16, 32] x [32, 24]^T), its weight's gradient
    // (a [24, 16] x [16, 32] product over the rows), and 3 batched [8, 32] x [32, 4].
    let src = r#"func.func @f(%x: tensor<2x8x32xf32> {nns.name = "x"}, %w: tensor<24x32xf32> {nns.name = "w"}, %dy: tensor<2x8x24xf32> {nns.name = "dy"}, %a: tensor<3x8x32xf32> {nns.name = "a"}, %b: tensor<3x32x4xf32> {nns.name = "b"}) -> (tensor<2x8x24xf32>, tensor<24x32xf32>, tensor<3x8x4xf32>) {
  %0 = "dnn.linear"(%x, %w) : (tensor<2x8x32xf32>, tensor<24x32xf32>) -> tensor<2x8x24xf32>
  %1 = "dnn.linear_weight_grad"(%dy, %x) : (tensor<2x8x24xf32>, tensor<2x8x32xf32>) -> tensor<24x32xf32>
  %2 = "dnn.matmul"(%a, %b) : (tensor<3x8x32xf32>, tensor<3x32x4xf32>) -> tensor<3x8x4xf32>
  return %0, %1, %2 : tensor<2x8x24xf32>, tensor<24x32xf32>, tensor<3x8x4xf32>
}"#;
    let m = ir.parse(src, "m.mlir").unwrap();
    let g = Graph::all_in(&m).remove(0).unwrap();
    let mut c = preset("cpu").unwrap();
    c.device.kernels.clear();
    c.device.memory_bandwidth = 1e30;
    c.device.matrix_forms = None;
    let terms = [1e-7, 1e-11, 4e-10, 3e-10];
    c.device.matrix_terms = Some(terms);
    let one = |[m, k, n]: [f64; 3]| {
        terms[0] + terms[1] * 2.0 * m * k * n + terms[2] * m * n + terms[3] * (m * k + k * n)
    };
    for (node, products, shape) in [
        (0, 1.0, [16.0, 32.0, 24.0]),
        (1, 1.0, [24.0, 16.0, 32.0]),
        (2, 3.0, [8.0, 32.0, 4.0]),
    ] {
        let t = node_cost(&g, &g.nodes[node], &c, None).unwrap().seconds;
        let want = c.device.op_overhead + products * one(shape);
        assert!((t - want).abs() < 1e-15, "node {node}: {t} against {want}");
    }
    // The forms' factors: the linear is A B^T, its weight's gradient A^T B, the
    // batched matmul A B.
    let forms = [0.9, 1.05, 1.1];
    c.device.matrix_forms = Some(forms);
    for (node, form, products, shape) in [
        (0, 1, 1.0, [16.0, 32.0, 24.0]),
        (1, 2, 1.0, [24.0, 16.0, 32.0]),
        (2, 0, 3.0, [8.0, 32.0, 4.0]),
    ] {
        assert_eq!(product_form(&g.nodes[node]), Some(form));
        let t = node_cost(&g, &g.nodes[node], &c, None).unwrap().seconds;
        let want = c.device.op_overhead + forms[form] * products * one(shape);
        assert!((t - want).abs() < 1e-15, "node {node}: {t} against {want}");
    }
    c.device.matrix_forms = None;
    // A program whose values fit in the cache takes the hot terms; a larger one, or
    // a device without a cache size, keeps the cold ones.
    let hot = [0.0, 5e-12, 1e-10, 1e-10];
    c.device.matrix_terms_hot = Some(hot);
    c.device.cache_bytes = footprint(&g);
    // The five arguments and three results, f32.
    let elems = 2 * 8 * 32 + 24 * 32 + 2 * 8 * 24 + 3 * 8 * 32 + 3 * 32 * 4;
    assert_eq!(
        footprint(&g),
        4 * (elems + 2 * 8 * 24 + 24 * 32 + 3 * 8 * 4)
    );
    assert_eq!(c.for_program(&g).device.matrix_terms, Some(hot));
    let t = node_cost(&g, &g.nodes[0], &c.for_program(&g), None)
        .unwrap()
        .seconds;
    let want = c.device.op_overhead
        + 5e-12 * 2.0 * 16.0 * 32.0 * 24.0
        + 1e-10 * (16.0 * 24.0 + 16.0 * 32.0 + 32.0 * 24.0);
    assert!((t - want).abs() < 1e-15, "{t} against {want}");
    c.device.cache_bytes = footprint(&g) - 1;
    assert_eq!(c.for_program(&g).device.matrix_terms, Some(terms));
    c.device.cache_bytes = 0;
    assert_eq!(*c.for_program(&g), c);
    c.device.matrix_terms_hot = None;
    // At equal FLOPs a product with a short side costs more than a square one.
    let d = &c.device;
    let thin = d.matrix_seconds(1.0, [8.0, 512.0, 512.0], false, None);
    let square = d.matrix_seconds(1.0, [128.0, 128.0, 128.0], false, None);
    assert!(thin > square * 1.5, "{thin} against {square}");
    // Without terms: the FLOPs at the curve's efficiency.
    c.device.matrix_terms = None;
    let d = &c.device;
    let flops = 2.0 * 128.0f64.powi(3);
    let t = d.matrix_seconds(2.0, [128.0, 128.0, 128.0], false, None);
    assert!((t - 2.0 * flops / (d.matrix_flops * d.efficiency(flops))).abs() < 1e-15);
    // bf16 products by the bf16 curve where the device has one (the tensor cores fill up
    // later than the f32 units), by the f32 curve where it has none.
    let mut g = preset("dgx-h100").unwrap().device;
    let one = 2.0 * 1024.0f64.powi(3);
    let f32_curve = g.matrix_seconds(1.0, [1024.0; 3], true, None);
    assert!((f32_curve - one / (989e12 * g.efficiency(one))).abs() < 1e-15);
    g.matrix_efficiency_bf16 = vec![[1e6, 0.01], [1e12, 0.5]];
    let e = g.efficiency_in(one, true);
    assert!(
        (e - (0.01 + 0.49 * (one / 1e6).ln() / 1e6f64.ln())).abs() < 1e-12,
        "{e}"
    );
    assert_eq!(g.efficiency_in(one, false), g.efficiency(one));
    let t = g.matrix_seconds(1.0, [1024.0; 3], true, None);
    assert!((t - one / (989e12 * e)).abs() < 1e-15);
    let p = preset("dgx-h100").unwrap();
    let mut c2 = p.clone();
    c2.device = g;
    assert_eq!(parse(&c2.to_toml().unwrap()).unwrap(), c2);
    assert!(!p.to_toml().unwrap().contains("matrix_efficiency_bf16"));
    c2.device.matrix_efficiency_bf16 = vec![[1e9, 0.5], [1e6, 0.2]];
    let e = parse(&c2.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("device.matrix_efficiency_bf16 must be"), "{e}");
    // A TOML with them reads back; a negative term or a free FLOP is refused.
    let mut c = preset("cpu").unwrap();
    c.device.matrix_terms = Some(terms);
    assert_eq!(parse(&c.to_toml().unwrap()).unwrap(), c);
    for bad in [[1e-7, 1e-11, -1.0, 0.0], [1e-7, 0.0, 1e-10, 1e-10]] {
        c.device.matrix_terms = Some(bad);
        let e = parse(&c.to_toml().unwrap()).unwrap_err();
        assert!(e.contains("device.matrix_terms"), "{e}");
    }
    c.device.matrix_terms = Some(terms);
    c.device.matrix_terms_hot = Some([0.0, 1e-11, f64::NAN, 0.0]);
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("device.matrix_terms_hot"), "{e}");
    c.device.matrix_terms_hot = None;
    c.device.matrix_forms = Some([0.9, 1.05, 1.1]);
    assert_eq!(parse(&c.to_toml().unwrap()).unwrap(), c);
    c.device.matrix_forms = Some([0.9, 0.0, 1.1]);
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("device.matrix_forms"), "{e}");
}

#[test]
fn product_forms_follow_the_transposes() {
    use nnscaler_dialects::context::IrContext;
    let ir = IrContext::new();
    let src = r#"func.func @f(%a: tensor<4x4xf32> {nns.name = "a"}) -> (tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>) {
  %0 = "dnn.matmul"(%a, %a) : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
  %1 = "dnn.matmul"(%a, %a) {transpose_b = true} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
  %2 = "dnn.matmul"(%a, %a) {transpose_a = true} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
  %3 = "dnn.matmul"(%a, %a) {transpose_a = true, transpose_b = true} : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
  %4 = "dnn.add"(%a, %a) : (tensor<4x4xf32>, tensor<4x4xf32>) -> tensor<4x4xf32>
  return %0, %1, %2, %3, %4 : tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>, tensor<4x4xf32>
}"#;
    let m = ir.parse(src, "m.mlir").unwrap();
    let g = Graph::all_in(&m).remove(0).unwrap();
    let forms: Vec<Option<usize>> = g.nodes[..5].iter().map(product_form).collect();
    assert_eq!(forms, [Some(0), Some(1), Some(2), None, None]);
}

#[test]
fn bf16_attention_takes_its_own_fit_where_there_is_one() {
    use nnscaler_dialects::context::IrContext;
    let ir = IrContext::new();
    let (f, b) = ("tensor<1x4x64x32xf32>", "tensor<1x4x64x32xbf16>");
    let src = format!(
        r#"func.func @f(%q: {f} {{nns.name = "q"}}, %qb: {b} {{nns.name = "qb"}}) -> ({f}, {b}) {{
  %0 = "dnn.attention"(%q, %q, %q) {{causal = true}} : ({f}, {f}, {f}) -> {f}
  %1 = "dnn.attention"(%qb, %qb, %qb) {{causal = true}} : ({b}, {b}, {b}) -> {b}
  return %0, %1 : {f}, {b}
}}"#
    );
    let m = ir.parse(&src, "m.mlir").unwrap();
    let g = Graph::all_in(&m).remove(0).unwrap();
    let mut c = preset("h200").unwrap();
    c.device.op_overhead = 0.0;
    c.device
        .head_kernels
        .insert("dnn.attention".into(), [1e-6, 0.0, 0.0, 0.0]);
    let t = |c: &Cluster, i: usize| node_cost(&g, &g.nodes[i], c, None).unwrap().seconds;
    // Without a bf16 entry both take the op's; with one, the bf16 op takes it.
    assert_eq!((t(&c, 0), t(&c, 1)), (4e-6, 4e-6));
    c.device
        .head_kernels
        .insert("dnn.attention.bf16".into(), [2.5e-7, 0.0, 0.0, 0.0]);
    assert_eq!((t(&c, 0), t(&c, 1)), (4e-6, 1e-6));
}

#[test]
fn accumulation_adds_stream_past_the_cache() {
    use nnscaler_dialects::context::IrContext;
    let ir = IrContext::new();
    let src = r#"func.func @f(%a: tensor<64x64xf32> {nns.name = "a"}) -> (tensor<64x64xf32>, tensor<64x64xf32>) {
  %0 = "dnn.add"(%a, %a) : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
  %1 = "dnn.add"(%0, %a) {nns.accumulate} : (tensor<64x64xf32>, tensor<64x64xf32>) -> tensor<64x64xf32>
  return %0, %1 : tensor<64x64xf32>, tensor<64x64xf32>
}"#;
    let m = ir.parse(src, "m.mlir").unwrap();
    let g = Graph::all_in(&m).remove(0).unwrap();
    let mut c = preset("cpu").unwrap();
    c.device.kernels.insert("dnn.add".into(), [1e-6, 0.5]);
    let (flops, bytes) = (4096.0, 3.0 * 4.0 * 4096.0);
    let plain = node_cost(&g, &g.nodes[0], &c, None).unwrap().seconds;
    let acc = node_cost(&g, &g.nodes[1], &c, None).unwrap().seconds;
    // A step's add takes its kernel entry; an accumulation's the streaming roofline.
    let roofline = c.device.op_time(flops, bytes, false) - c.device.op_overhead;
    assert!((plain - (1e-6 + 0.5 * roofline)).abs() < 1e-15, "{plain}");
    assert!(
        (acc - c.device.op_time(flops, bytes, false)).abs() < 1e-15,
        "{acc}"
    );
    assert_eq!(acc, accumulate_seconds(&c.device, flops, bytes));
}

#[test]
fn the_expected_largest_normal_draw() {
    // Closed forms for two and three: 1 / sqrt(pi) and 3 / (2 sqrt(pi)).
    let pi = std::f64::consts::PI;
    assert_eq!(expected_max_normal(1), 0.0);
    assert!((expected_max_normal(2) - 1.0 / pi.sqrt()).abs() < 1e-6);
    assert!((expected_max_normal(3) - 1.5 / pi.sqrt()).abs() < 1e-6);
    // Tabulated: 1.02938 for four, 1.42360 for eight, 3.24144 for a thousand.
    assert!((expected_max_normal(4) - 1.02938).abs() < 1e-5);
    assert!((expected_max_normal(8) - 1.42360).abs() < 1e-5);
    assert!((expected_max_normal(1000) - 3.24144).abs() < 1e-4);
}

#[test]
fn collectives_wait_for_the_drift_since_their_group_met() {
    let mut d = preset("cpu").unwrap().device;
    d.sync_jitter = 1e-3;
    let c2 = expected_max_normal(2);
    let c4 = expected_max_normal(4);
    let tp = ["tp".to_string()];
    let dp = ["dp".to_string()];
    let both = ["dp".to_string(), "tp".to_string()];
    let close = |a: f64, b: f64| assert!((a - b).abs() < 1e-12, "{a} vs {b}");
    let mut drift = Drift::default();
    drift.compute(1.0);
    close(drift.meet(&d, &tp, 2), c2 * 1e-3);
    drift.compute(3.0);
    // tp met a second ago; dp never did: the whole 4 s of compute.
    close(drift.meet(&d, &tp, 2), c2 * 1e-3 * 3f64.sqrt());
    close(drift.meet(&d, &dp, 2), c2 * 1e-3 * 2.0);
    drift.compute(9.0);
    // dp x tp met nobody before; it meets both groups, so tp then waits for nothing.
    close(drift.meet(&d, &both, 4), c4 * 1e-3 * 13f64.sqrt());
    close(drift.meet(&d, &tp, 2), 0.0);
    // A group of one (a slice) waits for nothing and meets nobody; a device without
    // jitter waits for nothing.
    drift.compute(1.0);
    close(drift.meet(&d, &dp, 1), 0.0);
    close(drift.meet(&d, &dp, 2), c2 * 1e-3);
    drift.compute(1.0);
    d.sync_jitter = 0.0;
    close(drift.meet(&d, &tp, 2), 0.0);

    // In a prediction: two all_reduces over tp = 2 after two and one products.
    let ir = nnscaler_dialects::context::IrContext::new();
    let t = "tensor<64x64xf32>";
    let src = format!(
        "func.func @f(%x: {t}) -> {t} {{\n\
             \x20 %a = \"dnn.matmul\"(%x, %x) : ({t}, {t}) -> {t}\n\
             \x20 %b = \"dnn.matmul\"(%a, %x) : ({t}, {t}) -> {t}\n\
             \x20 %r = \"nns.all_reduce\"(%b) {{axes = [\"tp\"]}} : ({t}) -> {t}\n\
             \x20 %c = \"dnn.matmul\"(%r, %x) : ({t}, {t}) -> {t}\n\
             \x20 %s = \"nns.all_reduce\"(%c) {{axes = [\"tp\"]}} : ({t}) -> {t}\n\
             \x20 return %s : {t}\n}}\n"
    );
    let m = ir.parse(&src, "d.mlir").unwrap();
    let g = Graph::all_in(&m).into_iter().next().unwrap().unwrap();
    let mesh = Mesh {
        name: "world".into(),
        axes: vec![nnscaler_dialects::nns::Axis {
            name: "tp".into(),
            size: 2,
            microbatches: false,
        }],
        memory_cap: None,
    };
    let mut c = preset("cpu").unwrap();
    c.device.sync_jitter = 0.0;
    let still = predict(&g, &c, Some(&mesh));
    c.device.sync_jitter = 2e-3;
    let drifting = predict(&g, &c, Some(&mesh));
    let product = node_cost(&g, &g.nodes[0], &c, None).unwrap().seconds;
    let waits = c2 * 2e-3 * ((2.0 * product).sqrt() + product.sqrt());
    assert!(
        (drifting.comm - still.comm - waits).abs() < 1e-12,
        "{} {} {waits}",
        drifting.comm,
        still.comm
    );
    assert_eq!(drifting.matrix, still.matrix);
    assert!((drifting.wait - waits).abs() < 1e-12 && still.wait == 0.0);
    // It round-trips, and a negative one is refused.
    assert_eq!(parse(&c.to_toml().unwrap()).unwrap(), c);
    c.device.sync_jitter = -1.0;
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("device.sync_jitter"), "{e}");
}

#[test]
fn bad_clusters_are_named() {
    let mut c = preset("cpu").unwrap();
    c.device.matrix_flops = 0.0;
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("device.matrix_flops"), "{e}");
    let mut c = preset("cpu").unwrap();
    c.device.matrix_efficiency = vec![[10.0, 0.5], [5.0, 0.6]];
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("ascending"), "{e}");
    let mut c = preset("cpu").unwrap();
    c.network[0].bandwidth = 0.0;
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("in-process") && e.contains("bandwidth"), "{e}");
    let mut c = preset("cpu").unwrap();
    c.device.memory = 0;
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("device.memory"), "{e}");
    let mut c = preset("dgx-h100").unwrap();
    c.device.reserved = c.device.memory;
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("device.reserved"), "{e}");
    let mut c = preset("dgx-h100").unwrap();
    c.device.fragmentation = 1.0;
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("device.fragmentation"), "{e}");
    let mut c = preset("dgx-h100").unwrap();
    c.device.matrix_flops_bf16 = Some(-1.0);
    let e = parse(&c.to_toml().unwrap()).unwrap_err();
    assert!(e.contains("device.matrix_flops_bf16"), "{e}");
    let e = parse("[device]\nname = 1").unwrap_err();
    assert!(!e.is_empty());
    assert!(load("no-such-cluster")
        .unwrap_err()
        .contains("not a preset"));
}
