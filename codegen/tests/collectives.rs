//! Every collective of the runtime's table ([`Collective::TABLE`]), with every value of its
//! parameters, as the `nns` op of a localized program on 2 and 3 devices: the simulated
//! devices (the reference), the compiled artifact on the host backend in lockstep, and the
//! same artifact as ranks (a thread per device, NCCL's calls in-process) give the same
//! bits. Nothing here names a collective: one added to the tables (`docs/extending.md`) is
//! run by this test as it is.

use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::verify::Meshes;
use nnscaler_rt::{Collective, Param};
use nnscaler_runtime::interp::Options;
use nnscaler_runtime::spmd::run_spmd;
use nnscaler_runtime::tensor::Tensor;

/// `tensor<AxBxf32>`.
fn ty(shape: &[u64]) -> String {
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!("tensor<{}xf32>", dims.join("x"))
}

/// The program: argument `x` (this device's piece, dim 0 split over `tp`) through the
/// collective `op`, its result also read as split along dim 0 (so that each device's
/// piece is kept, whatever the collective leaves there).
fn program(op: &Collective, n: usize, local: &[u64], out: &[u64]) -> String {
    let mut attrs = vec![r#"axes = ["tp"]"#.to_string()];
    for (k, p) in op.params() {
        attrs.push(match p {
            Param::Index(v) => format!("{k} = {v} : i64"),
            Param::Flag(max) => format!(r#"reduce = "{}""#, if max { "max" } else { "sum" }),
        });
    }
    let (i, o) = (ty(local), ty(out));
    let split = "#nns.layout<@world, tp = D(0)>";
    format!(
        r#""nns.mesh"() {{sym_name = "world", axes = #nns.axes<tp = {n}>}} : () -> ()
func.func @f(%x: {i} {{nns.layout = {split}, nns.name = "x"}}) -> ({o} {{nns.layout = {split}, nns.name = "y"}}) attributes {{nns.localized = #nns.axes<tp = {n}>}} {{
  %0 = "nns.{name}"(%x) {{{attrs}}} : ({i}) -> {o}
  return %0 : {o}
}}"#,
        name = op.name(),
        attrs = attrs.join(", ")
    )
}

#[test]
fn every_collective_compiles_to_what_the_simulated_devices_compute() {
    let mut seen = std::collections::BTreeSet::new();
    let mut cases = 0;
    for n in [2usize, 3] {
        let n64 = n as u64;
        for local in [vec![2 * n64, 6], vec![2, 2 * n64, 3]] {
            for op in Collective::every(local.len(), n) {
                let Ok(out) = op.out_shape(&local, n64) else {
                    continue;
                };
                let src = program(&op, n, &local, &out);
                let ir = IrContext::new();
                let m = ir
                    .parse(&src, "collective.mlir")
                    .unwrap_or_else(|d| panic!("{src}\n{d:?}"));
                let mut d = Diagnostics::default();
                let mesh = Meshes::collect(&m.as_operation(), &mut d).0.remove(0);
                let g = Graph::all_in(&m).remove(0).unwrap();
                let mut whole = local.clone();
                whole[0] *= n64;
                let len: u64 = whole.iter().product();
                let x: Vec<f32> = (0..len)
                    .map(|i| ((i * 7919 + 13) % 101) as f32 * 0.37 - 18.0)
                    .collect();
                let shape: Vec<usize> = whole.iter().map(|&d| d as usize).collect();
                let want = run_spmd(
                    &g,
                    &mesh,
                    vec![Tensor::f32(&shape, x.clone())],
                    &Options::default(),
                )
                .unwrap_or_else(|e| panic!("{op:?} over {n}: {}", e.message));
                let art =
                    nnscaler_codegen::artifact(&g, "collectives", Some(&mesh), Default::default())
                        .unwrap_or_else(|e| panic!("{op:?} over {n}: {e}"));
                let host = nnscaler_rt::HostProgram::load(art).unwrap();
                let input = nnscaler_rt::Tensor {
                    shape: whole.clone(),
                    data: nnscaler_rt::Values::F32(x),
                };
                let lockstep = host.run(std::slice::from_ref(&input)).unwrap();
                let ranks = host
                    .run_ranks_timed(std::slice::from_ref(&input), 1)
                    .unwrap()
                    .0;
                let want = want[0].f().unwrap();
                for (how, got) in [("lockstep", &lockstep), ("ranks", &ranks)] {
                    let nnscaler_rt::Values::F32(v) = &got[0].data else {
                        panic!("{op:?}: not f32")
                    };
                    let same = v.len() == want.len()
                        && v.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{op:?} over {n} on {local:?} ({how}): the artifact differs from the simulated devices");
                }
                seen.insert(op.name());
                cases += 1;
            }
        }
    }
    let all: std::collections::BTreeSet<&str> =
        Collective::TABLE.iter().map(|(name, _)| *name).collect();
    assert_eq!(seen, all, "a collective no case could run");
    println!("collectives: {cases} cases, the artifact equal to the simulated devices");
}
