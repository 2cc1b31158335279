//! Every collective of the runtime's table ([`Collective::TABLE`]), with every value of its
//! parameters, as the `nns` op of a localized program on 2 and 3 devices (f32, and i64 for
//! those that do not reduce): the simulated devices (the reference), the compiled artifact
//! on the host backend in lockstep, and the same artifact as ranks (a thread per device,
//! NCCL's calls in-process) give the same bits. Nothing here names a collective: one added to the tables (`docs/extending.md`) is
//! run by this test as it is.

use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::verify::Meshes;
use nnscaler_rt::{Collective, Param};
use nnscaler_runtime::interp::Options;
use nnscaler_runtime::spmd::run_spmd;
use nnscaler_runtime::tensor::{Data, Tensor};

/// `tensor<AxBxf32>` (or `xi64`).
fn ty(shape: &[u64], int: bool) -> String {
    let dims: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!(
        "tensor<{}x{}>",
        dims.join("x"),
        if int { "i64" } else { "f32" }
    )
}

/// The program: argument `x` (this device's piece, dim 0 split over `tp`) through the
/// collective `op`, its result also read as split along dim 0 (so that each device's
/// piece is kept, whatever the collective leaves there).
fn program(op: &Collective, n: usize, local: &[u64], out: &[u64], int: bool) -> String {
    let mut attrs = vec![r#"axes = ["tp"]"#.to_string()];
    for (k, p) in op.params() {
        attrs.push(match p {
            Param::Index(v) => format!("{k} = {v} : i64"),
            Param::Flag(max) => format!(r#"reduce = "{}""#, if max { "max" } else { "sum" }),
        });
    }
    let (i, o) = (ty(local, int), ty(out, int));
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

/// Collective `op` on `n` devices, each with a `local` piece, f32 or i64: the artifact on
/// the host backend (lockstep and ranks) against the simulated devices, bit for bit.
fn check(op: &Collective, n: usize, local: &[u64], out: &[u64], int: bool) {
    let src = program(op, n, local, out, int);
    let ir = IrContext::new();
    let m = ir
        .parse(&src, "collective.mlir")
        .unwrap_or_else(|d| panic!("{src}\n{d:?}"));
    let mut d = Diagnostics::default();
    let mesh = Meshes::collect(&m.as_operation(), &mut d).0.remove(0);
    let g = Graph::all_in(&m).remove(0).unwrap();
    let mut whole = local.to_vec();
    whole[0] *= n as u64;
    let len: u64 = whole.iter().product();
    let shape: Vec<usize> = whole.iter().map(|&d| d as usize).collect();
    let ints: Vec<i64> = (0..len)
        .map(|i| ((i * 7919 + 13) % 101) as i64 - 50)
        .collect();
    let x = if int {
        Tensor::i64(&shape, ints)
    } else {
        Tensor::f32(&shape, ints.iter().map(|&i| i as f32 * 0.37).collect())
    };
    let what = format!(
        "{op:?} over {n} on {local:?}{}",
        if int { " (i64)" } else { "" }
    );
    let input = [x];
    let want = run_spmd(&g, &mesh, input.to_vec(), &Options::default())
        .unwrap_or_else(|e| panic!("{what}: {}", e.message));
    let art = nnscaler_codegen::artifact(&g, "collectives", Some(&mesh), Default::default())
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let host = nnscaler_rt::HostProgram::load(art).unwrap();
    let lockstep = host.run(&input).unwrap();
    let ranks = host.run_ranks_timed(&input, 1).unwrap().0;
    for (how, got) in [("lockstep", &lockstep), ("ranks", &ranks)] {
        let same = match (&got[0].data, &want[0].data) {
            (Data::F32(v), Data::F32(w)) => {
                v.len() == w.len() && v.iter().zip(w).all(|(a, b)| a.to_bits() == b.to_bits())
            }
            (Data::I64(v), Data::I64(w)) => v == w,
            _ => false,
        };
        assert!(
            same,
            "{what} ({how}): the artifact differs from the simulated devices"
        );
    }
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
                check(&op, n, &local, &out, false);
                cases += 1;
                // What only moves data moves integers too.
                if !op.reduces() {
                    check(&op, n, &local, &out, true);
                    cases += 1;
                }
                seen.insert(op.name());
            }
        }
    }
    let all: std::collections::BTreeSet<&str> =
        Collective::TABLE.iter().map(|(name, _)| *name).collect();
    assert_eq!(seen, all, "a collective no case could run");
    println!("collectives: {cases} cases, the artifact equal to the simulated devices");
}
