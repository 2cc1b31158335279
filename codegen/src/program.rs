//! A whole function as kernel launches: every op lowered ([`crate::kernel::lower`]),
//! elementwise chains fused ([`crate::kernel::fuse`]), one buffer per value that a launch
//! reads or writes, temporaries per op. The launch plan an artifact will carry; on the
//! host it runs through [`crate::target::HostKernels::run_program`].

use crate::kernel::{fuse, lower, Buf, Kernel, Slot};
use nnscaler_dialects::graph::{Graph, ValueId};
use std::collections::HashMap;

/// A buffer of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufId {
    /// The buffer of a function value.
    Value(ValueId),
    /// Temporary `k` of [`Program::temps`].
    Temp(usize),
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// Index into [`Program::kernels`].
    pub kernel: usize,
    /// Its buffers: the kernel's inputs, then its outputs.
    pub bufs: Vec<BufId>,
    /// The ops it computes (indices into the function's nodes).
    pub nodes: Vec<usize>,
}

/// A function as launches.
#[derive(Clone, Debug)]
pub struct Program {
    /// Every kernel, named uniquely.
    pub kernels: Vec<Kernel>,
    /// Each value's buffer (`None` for values only a fused kernel sees).
    pub values: Vec<Option<Buf>>,
    /// Temporaries of the ops that need them.
    pub temps: Vec<Buf>,
    /// Launches in program order.
    pub launches: Vec<Launch>,
    /// The function's arguments' values, in order.
    pub inputs: Vec<ValueId>,
    /// The function's results' values, in order.
    pub outputs: Vec<ValueId>,
}

/// Lowers every op of `g` to launches; an op without kernels is an error naming it and
/// its location.
pub fn compile(g: &Graph) -> Result<Program, String> {
    let groups = fuse(g)?;
    // The launch of each group goes where its last op (its output's producer) stood.
    let mut group_at: HashMap<usize, usize> = HashMap::new();
    let mut in_group = vec![false; g.nodes.len()];
    for (k, gr) in groups.iter().enumerate() {
        for &n in &gr.nodes {
            in_group[n] = true;
        }
        group_at.insert(*gr.nodes.last().expect("a group has ops"), k);
    }
    let mut p = Program {
        kernels: Vec::new(),
        values: vec![None; g.values.len()],
        temps: Vec::new(),
        launches: Vec::new(),
        inputs: g.args.iter().map(|a| a.value).collect(),
        outputs: g.outputs.iter().map(|o| o.value).collect(),
    };
    let touch = |p: &mut Program, v: ValueId| {
        p.values[v].get_or_insert_with(|| Buf::of(&g.values[v]));
    };
    for &v in p.inputs.clone().iter().chain(&p.outputs.clone()) {
        touch(&mut p, v);
    }
    for (k, n) in g.nodes.iter().enumerate() {
        if let Some(&gi) = group_at.get(&k) {
            let gr = &groups[gi];
            let mut bufs: Vec<BufId> = gr.inputs.iter().map(|&v| BufId::Value(v)).collect();
            bufs.push(BufId::Value(gr.output));
            for &v in gr.inputs.iter().chain([&gr.output]) {
                touch(&mut p, v);
            }
            p.launches.push(Launch {
                kernel: p.kernels.len(),
                bufs,
                nodes: gr.nodes.clone(),
            });
            p.kernels.push(gr.kernel.clone());
            continue;
        }
        if in_group[k] {
            continue;
        }
        let ins: Vec<Buf> = n.inputs.iter().map(|&v| Buf::of(&g.values[v])).collect();
        let outs: Vec<Buf> = n.outputs.iter().map(|&v| Buf::of(&g.values[v])).collect();
        let name = format!("n{k}_{}", n.op.trim_start_matches("dnn.").replace('.', "_"));
        let l =
            lower(&name, &n.op, &n.attrs, &ins, &outs).map_err(|e| format!("{}: {e}", n.loc))?;
        let base = p.kernels.len();
        let temp0 = p.temps.len();
        p.temps.extend(l.temps.iter().cloned());
        for &v in n.inputs.iter().chain(&n.outputs) {
            touch(&mut p, v);
        }
        for (kernel, slots) in &l.launches {
            let bufs = slots
                .iter()
                .map(|s| match *s {
                    Slot::In(j) => BufId::Value(n.inputs[j]),
                    Slot::Out(j) => BufId::Value(n.outputs[j]),
                    Slot::Temp(j) => BufId::Temp(temp0 + j),
                })
                .collect();
            p.launches.push(Launch {
                kernel: base + kernel,
                bufs,
                nodes: vec![k],
            });
        }
        p.kernels.extend(l.kernels);
    }
    Ok(p)
}
