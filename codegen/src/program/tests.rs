//! Unit tests of `program`.

use super::*;
use nnscaler_dialects::diag::SrcLoc;
use nnscaler_dialects::types::{Attrs, TensorType};

fn t4() -> TensorType {
    TensorType {
        shape: vec![4],
        elem: Elem::F32,
    }
}

/// `@frag(x, y) = (x + y) * y`, called twice from `@rank` as micro-batches 0 and 1,
/// the second call's result returned straight from the call.
fn pipeline_like() -> Graph {
    let loc = SrcLoc::default();
    let mut f = Graph {
        name: "frag".into(),
        ..Graph::default()
    };
    let x = f.add_arg(t4(), Attrs::new());
    let y = f.add_arg(t4(), Attrs::new());
    let s = f.add1("dnn.add", &[x, y], Attrs::new(), &loc).unwrap();
    let p = f.add1("dnn.mul", &[s, y], Attrs::new(), &loc).unwrap();
    f.outputs.push(nnscaler_dialects::graph::Output {
        value: p,
        attrs: Attrs::new(),
    });
    let mut g = Graph {
        name: "rank".into(),
        ..Graph::default()
    };
    let a = g.add_arg(t4(), Attrs::new());
    let b = g.add_arg(t4(), Attrs::new());
    let call = |g: &mut Graph, ins: &[nnscaler_dialects::graph::ValueId], tag: &str| {
        let mut attrs = Attrs::new();
        attrs.insert("callee".into(), AttrValue::Other("@frag".into()));
        attrs.insert("nns.fragment".into(), AttrValue::Str(tag.into()));
        g.add_raw("func.call", ins, vec![t4()], attrs, &loc)[0]
    };
    let r0 = call(&mut g, &[a, b], "0F0");
    let r1 = call(&mut g, &[r0, b], "0F1");
    g.outputs.push(nnscaler_dialects::graph::Output {
        value: r1,
        attrs: Attrs::new(),
    });
    g.link(&[f]);
    g
}

/// Calls become the callee's ops on the call's operands, each op tagged with its
/// fragment's micro-batch; a result taken straight from a call is the callee's.
#[test]
fn calls_are_inlined_at_their_microbatch() {
    let g = pipeline_like();
    let (flat, mbs) = inline(&g).unwrap();
    let ops: Vec<&str> = flat.nodes.iter().map(|n| n.op.as_str()).collect();
    assert_eq!(ops, ["dnn.add", "dnn.mul", "dnn.add", "dnn.mul"]);
    assert_eq!(mbs, [Some(0), Some(0), Some(1), Some(1)]);
    let (a, b) = (flat.args[0].value, flat.args[1].value);
    assert_eq!(flat.nodes[0].inputs, [a, b]);
    // The second call reads the first's product and returns its own.
    assert_eq!(flat.nodes[2].inputs, [flat.nodes[1].outputs[0], b]);
    assert_eq!(flat.outputs[0].value, flat.nodes[3].outputs[0]);
    assert!(flat.nodes.iter().all(|n| n.origin.is_none()));
    // It compiles, and fusion crosses the inlined calls: the four ops are one kernel.
    let p = compile(&g, None).unwrap();
    assert_eq!(p.launches.len(), 1);
    assert_eq!(p.launches[0].nodes, [0, 1, 2, 3]);
    assert!(p.values[p.outputs[0]].is_some());
}
