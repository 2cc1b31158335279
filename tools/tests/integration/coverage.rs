//! Every registered op has a round-trip case in test/dnn/ops.mlir.

use nnscaler_dialects::{dnn, nns};

#[test]
fn every_op_has_a_round_trip_test() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../test/dnn/ops.mlir");
    let text = std::fs::read_to_string(path).expect("read test/dnn/ops.mlir");
    let names = dnn::SPECS
        .iter()
        .map(|s| s.name)
        .chain(nns::COLLECTIVES.iter().map(|c| c.name));
    for name in names {
        assert!(
            text.contains(&format!("// CHECK: \"{name}\"")),
            "{name} has no round-trip case in test/dnn/ops.mlir"
        );
    }
}
