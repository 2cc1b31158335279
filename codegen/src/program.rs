//! A whole function as kernel launches: every op lowered ([`crate::kernel::lower`]),
//! elementwise chains fused ([`crate::kernel::fuse`]), one buffer per value that a launch
//! reads or writes, temporaries per op. The launch plan an artifact will carry; on the
//! host it runs through [`crate::target::HostKernels::run_program`].
//!
//! Calls of functions with bodies are inlined first ([`inline`]): a pipeline rank's
//! program (`--schedule-*`) becomes one launch plan with its fragments' ops in the
//! schedule's order, each at its micro-batch (what a shard's per-device offsets, and so
//! dropout's masks, depend on); its `nns.microbatch` cuts become copy kernels and its
//! `nns.send` / `nns.recv` become [`Work::Send`] / [`Work::Recv`] steps.

use crate::kernel::{
    fuse, lower, lower_attention_kept, rotary_table, Body, Buf, ConstValues, Elt, Kernel, Slot,
};
use nnscaler_dialects::graph::{Graph, Node, ValueId};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::scalar::{c, x};
use nnscaler_dialects::types::{AttrValue, Elem};
pub use nnscaler_rt::Collective;
use nnscaler_runtime::spmd::collective_of;
use std::collections::HashMap;

/// A buffer of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufId {
    /// The buffer of a function value.
    Value(ValueId),
    /// Temporary `k` of [`Program::temps`].
    Temp(usize),
    /// Constant `k` of [`Program::consts`].
    Const(usize),
}

/// What a step does.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Work {
    /// Launches [`Program::kernels`]`[k]`.
    Kernel(usize),
    /// A collective among the devices of a mesh (buffers: input, output): each group (the
    /// devices that agree on every axis but `axes`) combines the input pieces of its
    /// members, ordered by their coordinates on `axes` (row-major, in `axes`' order).
    Collective {
        /// What it does.
        op: Collective,
        /// The mesh axes (indices) of a group.
        axes: Vec<usize>,
    },
    /// Sends its buffer to the same device of pipeline rank `peer` (buffers: the value).
    Send {
        /// The receiving rank.
        peer: usize,
        /// Matches the receive.
        tag: String,
    },
    /// Receives its buffer from pipeline rank `peer` (buffers: the value).
    Recv {
        /// The sending rank.
        peer: usize,
        /// Matches the send.
        tag: String,
    },
}

/// One step: a kernel launch or a collective.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// What it does.
    pub work: Work,
    /// Its buffers: the kernel's inputs, then its outputs (a collective: in, out).
    pub bufs: Vec<BufId>,
    /// The ops it computes (indices into the function's nodes).
    pub nodes: Vec<usize>,
}

/// The collective of an `nns` op, with its axes as indices into the devices' mesh (the
/// module's mesh without its micro-batch axis).
fn collective(n: &Node, mesh: Option<&Mesh>) -> Result<Option<(Collective, Vec<usize>)>, String> {
    let kind = n.op.as_str();
    let Some(op) = collective_of(n) else {
        return Ok(None);
    };
    let op = op.map_err(|e| format!("'{kind}' {e}"))?;
    let mesh = mesh
        .ok_or_else(|| format!("'{kind}' needs the module's mesh"))?
        .device_mesh();
    let axes: Vec<usize> = match n.attrs.get("axes") {
        Some(AttrValue::Strs(names)) => names
            .iter()
            .map(|a| {
                mesh.axes.iter().position(|x| &x.name == a).ok_or_else(|| {
                    format!("'{kind}' names '{a}', which is not an axis of the devices' mesh (a pipeline accumulates micro-batches with dnn.add, not collectives)")
                })
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(format!("'{kind}' requires 'axes'")),
    };
    Ok(Some((op, axes)))
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
    /// Constants (buffers with compile-time values), live for the whole program: per
    /// constant its buffer and its bytes, one value for every device or one per device
    /// (row-major over the mesh).
    pub consts: Vec<(Buf, Vec<Vec<u8>>)>,
    /// Launches in program order.
    pub launches: Vec<Launch>,
    /// The function's arguments' values, in order.
    pub inputs: Vec<ValueId>,
    /// The function's results' values, in order.
    pub outputs: Vec<ValueId>,
}

/// The devices a program runs on: their numbers on the devices' mesh (the module's mesh
/// without its micro-batch axis) and their coordinates on the module's whole mesh (the
/// micro-batch axis, if any, at 0: an op inlined from a pipeline fragment sees its
/// micro-batch there).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Devices {
    /// Sizes of the whole mesh's axes (empty: one device, no mesh).
    pub sizes: Vec<i64>,
    /// The micro-batch axis, an index into `sizes`.
    pub microbatch_axis: Option<usize>,
    /// Row-major numbers on the devices' mesh, increasing.
    pub ids: Vec<usize>,
    /// Per device, its coordinates on the whole mesh.
    pub coords: Vec<Vec<usize>>,
}

impl Devices {
    /// Every device of `mesh`'s devices (one without a mesh).
    pub fn all(mesh: Option<&Mesh>) -> Self {
        Self::select(mesh, |_| true)
    }

    /// The devices of `mesh` at rank `rank` of axis `axis` (an index into the devices'
    /// mesh, `mesh` without its micro-batch axis).
    pub fn rank(mesh: &Mesh, axis: usize, rank: usize) -> Self {
        Self::select(Some(mesh), |c| c[axis] == rank)
    }

    /// The devices whose coordinates on the devices' mesh pass `keep`.
    fn select(mesh: Option<&Mesh>, keep: impl Fn(&[usize]) -> bool) -> Self {
        let Some(mesh) = mesh else {
            return Devices {
                sizes: Vec::new(),
                microbatch_axis: None,
                ids: vec![0],
                coords: vec![Vec::new()],
            };
        };
        let sizes: Vec<i64> = mesh.axes.iter().map(|a| a.size).collect();
        let mb = mesh.axes.iter().position(|a| a.microbatches);
        let dsizes: Vec<i64> = mesh
            .axes
            .iter()
            .filter(|a| !a.microbatches)
            .map(|a| a.size)
            .collect();
        let n: usize = dsizes.iter().map(|&s| s as usize).product();
        let (mut ids, mut coords) = (Vec::new(), Vec::new());
        for d in 0..n {
            let c = nnscaler_dialects::sharding::coords(&dsizes, d);
            if !keep(&c) {
                continue;
            }
            let mut full = c;
            if let Some(m) = mb {
                full.insert(m, 0);
            }
            ids.push(d);
            coords.push(full);
        }
        Devices {
            sizes,
            microbatch_axis: mb,
            ids,
            coords,
        }
    }
}

/// A constant's bytes: one value, or one per device of `devs` (the device at micro-batch
/// `mb` when the op is a fragment's).
fn const_bytes(
    v: &ConstValues,
    mesh: Option<&Mesh>,
    devs: &Devices,
    mb: Option<usize>,
) -> Result<Vec<Vec<u8>>, String> {
    match v {
        ConstValues::F32(x) => Ok(vec![x.iter().flat_map(|f| f.to_le_bytes()).collect()]),
        ConstValues::Offsets(dims) => {
            // Each dim's offsets, then per device the dims' values side by side.
            let per_dim: Vec<Vec<Vec<u8>>> = dims
                .iter()
                .map(|(axes, len)| {
                    const_bytes(
                        &ConstValues::Offset {
                            axes: axes.clone(),
                            len: *len,
                        },
                        mesh,
                        devs,
                        mb,
                    )
                })
                .collect::<Result<_, _>>()?;
            let devices = per_dim.iter().map(Vec::len).max().unwrap_or(1);
            Ok((0..devices)
                .map(|d| {
                    per_dim
                        .iter()
                        .flat_map(|v| v[if v.len() > 1 { d } else { 0 }].clone())
                        .collect()
                })
                .collect())
        }
        ConstValues::Rotary {
            axes,
            s,
            d,
            theta,
            sign,
            sin,
        } => {
            // Each device's block start, then its tables.
            let starts = const_bytes(
                &ConstValues::Offset {
                    axes: axes.clone(),
                    len: *s,
                },
                mesh,
                devs,
                mb,
            )?;
            Ok(starts
                .iter()
                .map(|b| {
                    let p0 = i64::from_le_bytes(b[..8].try_into().expect("8 bytes")) as usize;
                    let (c, sn) = rotary_table(p0, *s, *d, *theta, *sign);
                    let t = if *sin { sn } else { c };
                    t.iter().flat_map(|f| f.to_le_bytes()).collect()
                })
                .collect())
        }
        ConstValues::Offset { axes, .. } if axes.is_empty() => {
            Ok(vec![0i64.to_le_bytes().to_vec()])
        }
        ConstValues::Offset { axes, len } => {
            let mesh = mesh.ok_or("a shard's offset needs the module's mesh")?;
            let idx: Vec<usize> = axes
                .iter()
                .map(|a| {
                    mesh.axes
                        .iter()
                        .position(|x| &x.name == a)
                        .ok_or_else(|| format!("unknown mesh axis '{a}'"))
                })
                .collect::<Result<_, _>>()?;
            Ok(devs
                .coords
                .iter()
                .map(|c| {
                    let mut c = c.clone();
                    if let (Some(m), Some(j)) = (devs.microbatch_axis, mb) {
                        c[m] = j;
                    }
                    let block = idx
                        .iter()
                        .fold(0usize, |b, &a| b * devs.sizes[a] as usize + c[a]);
                    ((block * len) as i64).to_le_bytes().to_vec()
                })
                .collect())
        }
    }
}

/// `g` with every call of a function with a body (in `g.callees`: [`Graph::link`])
/// replaced by the callee's ops, recursively; and per op of the result, the micro-batch
/// of the pipeline fragment it came from (`nns.fragment = "<stage><F|B|W><mb>"` on the
/// call). Calls of declarations (user ops with C kernels) stay calls.
pub fn inline(g: &Graph) -> Result<(Graph, Vec<Option<usize>>), String> {
    let mut out = Graph {
        nodes: Vec::new(),
        ..g.clone()
    };
    let mut mbs = Vec::new();
    let map: Vec<ValueId> = ValueId::all(g.values.len()).collect();
    let results = inline_into(g, &mut out, &mut mbs, map, None, 0)?;
    for (o, v) in out.outputs.iter_mut().zip(results) {
        o.value = v;
    }
    Ok((out, mbs))
}

/// Appends `f`'s ops to `out`, its values renamed by `map` (its arguments' already set).
fn inline_into(
    f: &Graph,
    out: &mut Graph,
    mbs: &mut Vec<Option<usize>>,
    mut map: Vec<ValueId>,
    mb: Option<usize>,
    depth: usize,
) -> Result<Vec<ValueId>, String> {
    if depth > 16 {
        return Err(format!("@{}: calls nest more than 16 deep", f.name));
    }
    let outer = out.callees.clone();
    for n in &f.nodes {
        let callee = (n.op == "func.call")
            .then(|| nnscaler_dialects::userop::callee(&n.attrs))
            .flatten()
            .and_then(|name| f.callees.get(name).or_else(|| outer.get(name)))
            .filter(|c| !c.nodes.is_empty() || !c.outputs.is_empty());
        let Some(c) = callee else {
            let mut m = n.clone();
            m.inputs = n.inputs.iter().map(|&v| map[v]).collect();
            m.outputs = n.outputs.iter().map(|&v| map[v]).collect();
            if depth > 0 {
                // Not an op of `g`'s IR (the result is for code generation, not written
                // back).
                m.origin = None;
            }
            out.nodes.push(m);
            mbs.push(mb);
            continue;
        };
        if c.args.len() != n.inputs.len() || c.outputs.len() != n.outputs.len() {
            return Err(format!(
                "{}: @{} takes {} arguments and returns {} results; the call has {} and {}",
                n.loc,
                c.name,
                c.args.len(),
                c.outputs.len(),
                n.inputs.len(),
                n.outputs.len()
            ));
        }
        let frag_mb = match n.attrs.get("nns.fragment") {
            Some(AttrValue::Str(t)) => t
                .rfind(['F', 'B', 'W'])
                .and_then(|k| t[k + 1..].parse::<usize>().ok()),
            _ => None,
        };
        // The callee's values get fresh ids; its arguments are the call's operands.
        let mut cmap: Vec<ValueId> = c.values.iter().map(|t| out.new_value(t.clone())).collect();
        for (a, &v) in c.args.iter().zip(&n.inputs) {
            cmap[a.value] = map[v];
        }
        let results = inline_into(c, out, mbs, cmap, frag_mb.or(mb), depth + 1)?;
        for (&v, r) in n.outputs.iter().zip(results) {
            map[v] = r;
        }
    }
    Ok(f.outputs.iter().map(|o| map[o.value]).collect())
}

/// Lowers every op of `g` to launches; an op without kernels is an error naming it and
/// its location. `mesh` is the module's mesh, for a per-device program's collectives.
pub fn compile(g: &Graph, mesh: Option<&Mesh>) -> Result<Program, String> {
    compile_on(g, mesh, &Devices::all(mesh))
}

/// [`compile`] for the devices `devs` of `mesh` (a pipeline rank's), with calls of
/// functions with bodies inlined ([`inline`]; `g` linked to its callees).
pub fn compile_on(g: &Graph, mesh: Option<&Mesh>, devs: &Devices) -> Result<Program, String> {
    compile_stored(g, mesh, devs, Some(true))
}

/// [`compile`] with every bf16 value in an f32 buffer (no [`store_bf16`]): the program
/// 2-byte storage must compute the same bits as (where attention keeps its register
/// tiles: [`compile_register_attention`]).
pub fn compile_f32_storage(g: &Graph, mesh: Option<&Mesh>) -> Result<Program, String> {
    compile_stored(g, mesh, &Devices::all(mesh), None)
}

/// [`compile`] with attention's forward on the f32 register tiles even where its operands
/// are 2-byte bf16 (no tensor cores): 2-byte storage then changes no bit of the results
/// ([`compile_f32_storage`]), where the tensor cores round `P` to bf16 for its product.
pub fn compile_register_attention(g: &Graph, mesh: Option<&Mesh>) -> Result<Program, String> {
    compile_stored(g, mesh, &Devices::all(mesh), Some(false))
}

/// `bf16_storage`: none keeps bf16 values in f32 buffers; `Some(tensor_cores)` stores
/// them in 2-byte buffers ([`store_bf16`]), attention's forward on tensor cores where its
/// operands are stored so and `tensor_cores` holds.
fn compile_stored(
    g: &Graph,
    mesh: Option<&Mesh>,
    devs: &Devices,
    bf16_storage: Option<bool>,
) -> Result<Program, String> {
    let (g, mbs) = inline(g)?;
    let g = &g;
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
        consts: Vec::new(),
        launches: Vec::new(),
        inputs: g.args.iter().map(|a| a.value).collect(),
        outputs: g.outputs.iter().map(|o| o.value).collect(),
    };
    let touch = |p: &mut Program, v: ValueId| {
        p.values[v].get_or_insert_with(|| Buf::of(&g.values[v]));
    };
    let kept = kept_attention(g, &in_group);
    // A kept forward's statistics temporary, by its node.
    let mut kept_temp: HashMap<usize, usize> = HashMap::new();
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
                work: Work::Kernel(p.kernels.len()),
                bufs,
                nodes: gr.nodes.clone(),
            });
            p.kernels.push(gr.kernel.clone());
            continue;
        }
        if in_group[k] {
            continue;
        }
        let at = |e: String| format!("{}: {e}", n.loc);
        if let Some((op, axes)) = collective(n, mesh).map_err(at)? {
            // What only moves data moves any element type; a reduction's f32 sum is rounded
            // back to bf16 after it.
            let moves_only = !op.reduces();
            if moves_only || g.values[n.inputs[0]].elem.is_float() {
                touch(&mut p, n.inputs[0]);
                touch(&mut p, n.outputs[0]);
                p.launches.push(Launch {
                    work: Work::Collective { op, axes },
                    bufs: vec![BufId::Value(n.inputs[0]), BufId::Value(n.outputs[0])],
                    nodes: vec![k],
                });
                if !moves_only {
                    round_bf16(&mut p, g, k, n.outputs[0]);
                }
                continue;
            }
            return Err(at(format!("'{}' of integers has no GPU path yet", n.op)));
        }
        let int_attr = |key: &str| match n.attrs.get(key) {
            Some(AttrValue::Int(i)) if *i >= 0 => Ok(*i as usize),
            _ => Err(at(format!("'{}' requires '{key}'", n.op))),
        };
        if n.op == "nns.microbatch" {
            let kernel =
                microbatch_kernel(g, k, int_attr("dim")?, int_attr("index")?).map_err(at)?;
            unary_launch(&mut p, g, k, kernel);
            continue;
        }
        if n.op == "nns.send" || n.op == "nns.recv" {
            let peer = int_attr("peer")?;
            let tag = match n.attrs.get("tag") {
                Some(AttrValue::Str(t)) => t.clone(),
                _ => return Err(at(format!("'{}' requires 'tag'", n.op))),
            };
            let (v, work) = if n.op == "nns.send" {
                (n.inputs[0], Work::Send { peer, tag })
            } else {
                (n.outputs[0], Work::Recv { peer, tag })
            };
            touch(&mut p, v);
            p.launches.push(Launch {
                work,
                bufs: vec![BufId::Value(v)],
                nodes: vec![k],
            });
            continue;
        }
        if n.op == "nns.partition" {
            let kernel = partition_kernel(g, k, mesh).map_err(at)?;
            unary_launch(&mut p, g, k, kernel);
            continue;
        }
        let mut ins: Vec<Buf> = n.inputs.iter().map(|&v| Buf::of(&g.values[v])).collect();
        let outs: Vec<Buf> = n.outputs.iter().map(|&v| Buf::of(&g.values[v])).collect();
        let name = format!("n{k}_{}", n.op.trim_start_matches("dnn.").replace('.', "_"));
        // A backward paired with its forward reads the forward's output and statistics:
        // two operands after its own.
        let mut more: Vec<BufId> = Vec::new();
        let l = if let Some(&f) = kept.backward.get(&k) {
            let out = g.nodes[f].outputs[0];
            let t = *kept_temp
                .get(&f)
                .ok_or_else(|| at("a kept attention's backward before its forward".into()))?;
            ins.push(Buf::of(&g.values[out]));
            ins.push(p.temps[t].clone());
            more = vec![BufId::Value(out), BufId::Temp(t)];
            lower_attention_kept(&name, &n.op, &n.attrs, &ins, &outs, None, true)
        } else if kept.forward.contains(&k) {
            lower_attention_kept(&name, &n.op, &n.attrs, &ins, &outs, None, true)
        } else {
            lower(&name, &n.op, &n.attrs, &ins, &outs)
        }
        .map_err(|e| format!("{}: {e}", n.loc))?;
        let base = p.kernels.len();
        let temp0 = p.temps.len();
        if kept.forward.contains(&k) {
            kept_temp.insert(k, temp0);
        }
        p.temps.extend(l.temps.iter().cloned());
        let const0 = p.consts.len();
        for (b, v) in &l.consts {
            p.consts
                .push((b.clone(), const_bytes(v, mesh, devs, mbs[k]).map_err(at)?));
        }
        for &v in n.inputs.iter().chain(&n.outputs) {
            touch(&mut p, v);
        }
        for (kernel, slots) in &l.launches {
            let bufs = slots
                .iter()
                .map(|s| match *s {
                    Slot::In(j) if j >= n.inputs.len() => more[j - n.inputs.len()],
                    Slot::In(j) => BufId::Value(n.inputs[j]),
                    Slot::Out(j) => BufId::Value(n.outputs[j]),
                    Slot::Temp(j) => BufId::Temp(temp0 + j),
                    Slot::Const(j) => BufId::Const(const0 + j),
                })
                .collect();
            p.launches.push(Launch {
                work: Work::Kernel(base + kernel),
                bufs,
                nodes: vec![k],
            });
        }
        p.kernels.extend(l.kernels);
        if n.op.spec().is_none_or(|s| s.traits.scalar.is_none()) {
            // An elementwise op rounds in its formula; the others store f32 results.
            for &v in &n.outputs {
                round_bf16(&mut p, g, k, v);
            }
        }
    }
    if let Some(tensor_cores) = bf16_storage {
        store_bf16(&mut p, g, tensor_cores);
    }
    elide_reshapes(&mut p, g);
    fuse_adamw(&mut p);
    Ok(p)
}

/// `nns.microbatch` (node `k`): micro-batch `index` of a data input, a window of its
/// output's length along `dim`.
fn microbatch_kernel(g: &Graph, k: usize, dim: usize, index: usize) -> Result<Kernel, String> {
    let n = &g.nodes[k];
    let (i, o) = (
        Buf::of(&g.values[n.inputs[0]]),
        Buf::of(&g.values[n.outputs[0]]),
    );
    let Some(&len) = o.shape.get(dim) else {
        return Err(format!("'nns.microbatch' dim {dim} is beyond its rank"));
    };
    if i.shape
        .get(dim)
        .is_none_or(|&whole| (index + 1) * len > whole)
    {
        return Err(format!(
            "'nns.microbatch' {index} of length {len} lies outside its input {:?}",
            i.shape
        ));
    }
    Ok(Kernel {
        name: format!("n{k}_microbatch"),
        body: Body::Window {
            dim,
            start: index * len,
        },
        inputs: vec![i],
        len: o.len(),
        outputs: vec![o],
    })
}

/// `nns.partition` (node `k`), R -> V(sum): each device keeps value / n, as the CPU
/// devices compute it.
fn partition_kernel(g: &Graph, k: usize, mesh: Option<&Mesh>) -> Result<Kernel, String> {
    let n = &g.nodes[k];
    let mesh = mesh.ok_or("'nns.partition' needs the module's mesh")?;
    let size: i64 = match n.attrs.get("axes") {
        Some(AttrValue::Strs(names)) => names
            .iter()
            .map(|a| {
                mesh.axis(a)
                    .ok_or_else(|| format!("unknown mesh axis '{a}'"))
            })
            .product::<Result<i64, String>>()?,
        _ => return Err("'nns.partition' requires 'axes'".into()),
    };
    let b = Buf::of(&g.values[n.inputs[0]]);
    if b.elt != Elt::F32 {
        return Err("'nns.partition' of integers has no GPU path".into());
    }
    Ok(Kernel {
        name: format!("n{k}_partition"),
        body: Body::Map(vec![x(0) * c(1.0 / size as f32)]),
        inputs: vec![b.clone()],
        len: b.len(),
        outputs: vec![b],
    })
}

/// Consecutive AdamW launches with the same betas and eps (each its own weight decay) and
/// the same `lr`, `step` and `scale` buffers, every buffer f32, become multi-tensor launches
/// ([`Body::AdamWMulti`], at most [`crate::kernel::ADAMW_TENSORS`] tensors each), where
/// no member reads or writes what an earlier member of the run writes: the same
/// arithmetic per element, so the same bits, in a few launches instead of one per
/// parameter (the nanoGPT GPU config's step had 100; PyTorch's fused AdamW is one).
fn fuse_adamw(p: &mut Program) {
    let key = |l: &Launch, kernels: &[Kernel], values: &[Option<Buf>]| {
        let Work::Kernel(k) = l.work else { return None };
        let kern = &kernels[k];
        let Body::AdamW { b1, b2, eps, .. } = kern.body else {
            return None;
        };
        let f32s = kern
            .inputs
            .iter()
            .chain(&kern.outputs)
            .all(|b| b.elt == Elt::F32);
        let values_f32 = l.bufs.iter().all(|b| match b {
            BufId::Value(v) => values[*v].as_ref().is_some_and(|b| b.elt == Elt::F32),
            _ => true,
        });
        (f32s && values_f32 && l.bufs.len() == kern.inputs.len() + 3).then(|| {
            (
                [b1, b2, eps].map(f64::to_bits),
                l.bufs[4..kern.inputs.len()].to_vec(),
            )
        })
    };
    // Runs of consecutive launches with one key, cut where a member touches what an
    // earlier member writes, or at the size limit.
    let mut runs: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    let mut current_key = None;
    let mut written_in_run: Vec<BufId> = Vec::new();
    for (i, l) in p.launches.iter().enumerate() {
        let k = key(l, &p.kernels, &p.values);
        let joins = k.is_some()
            && k == current_key
            && current.len() < crate::kernel::ADAMW_TENSORS
            && !l.bufs.iter().any(|b| written_in_run.contains(b));
        if !joins {
            if current.len() > 1 {
                runs.push(std::mem::take(&mut current));
            }
            current.clear();
            written_in_run.clear();
            current_key = k.clone();
        }
        if k.is_some() {
            current.push(i);
            let nin = l.bufs.len() - 3;
            written_in_run.extend(l.bufs[nin..].iter().copied());
        }
    }
    if current.len() > 1 {
        runs.push(current);
    }
    if runs.is_empty() {
        return;
    }
    // Each run: one kernel and one launch where its last member stood.
    let mut replace: HashMap<usize, Launch> = HashMap::new();
    let mut gone = vec![false; p.launches.len()];
    let mut new_kernels: Vec<Kernel> = Vec::new();
    for run in &runs {
        let first = &p.launches[run[0]];
        let Work::Kernel(k0) = first.work else {
            continue;
        };
        let Body::AdamW { b1, b2, eps, .. } = p.kernels[k0].body else {
            continue;
        };
        let nin = p.kernels[k0].inputs.len();
        let (mut inputs, mut outputs, mut ins, mut outs) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut lens, mut wds) = (Vec::new(), Vec::new());
        let mut nodes = Vec::new();
        for &i in run {
            let l = &p.launches[i];
            let Work::Kernel(k) = l.work else { continue };
            let kern = &p.kernels[k];
            if let Body::AdamW { wd, .. } = kern.body {
                wds.push(wd);
            }
            inputs.extend(kern.inputs[..4].iter().cloned());
            outputs.extend(kern.outputs.iter().cloned());
            ins.extend(l.bufs[..4].iter().copied());
            outs.extend(l.bufs[nin..].iter().copied());
            lens.push(kern.len);
            nodes.extend(l.nodes.iter().copied());
            gone[i] = true;
        }
        inputs.extend(p.kernels[k0].inputs[4..].iter().cloned());
        ins.extend(first.bufs[4..nin].iter().copied());
        let total: usize = lens.iter().sum();
        let kernel = Kernel {
            name: format!("{}_multi", p.kernels[k0].name),
            body: Body::AdamWMulti {
                b1,
                b2,
                eps,
                wds,
                lens,
            },
            inputs,
            outputs,
            len: total,
        };
        let last = *run.last().unwrap_or(&run[0]);
        gone[last] = false;
        replace.insert(
            last,
            Launch {
                work: Work::Kernel(p.kernels.len() + new_kernels.len()),
                bufs: [ins, outs].concat(),
                nodes,
            },
        );
        new_kernels.push(kernel);
    }
    p.kernels.extend(new_kernels);
    let launches = std::mem::take(&mut p.launches);
    p.launches = launches
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !gone[*i])
        .map(|(i, l)| replace.remove(&i).unwrap_or(l))
        .collect();
    // The members' kernels go (kernels renumbered in order of first use).
    let mut new_index: Vec<Option<usize>> = vec![None; p.kernels.len()];
    let mut old: Vec<Option<Kernel>> = std::mem::take(&mut p.kernels)
        .into_iter()
        .map(Some)
        .collect();
    for l in &mut p.launches {
        if let Work::Kernel(k) = &mut l.work {
            let i = *new_index[*k].get_or_insert_with(|| {
                p.kernels
                    .push(old[*k].take().expect("a kernel launched once"));
                p.kernels.len() - 1
            });
            *k = i;
        }
    }
}

/// The buffers launch `l` writes.
fn written<'l>(l: &'l Launch, kernels: &[Kernel]) -> &'l [BufId] {
    match &l.work {
        Work::Kernel(k) => &l.bufs[kernels[*k].inputs.len().min(l.bufs.len())..],
        Work::Collective { .. } => &l.bufs[1.min(l.bufs.len())..],
        Work::Recv { .. } => &l.bufs,
        Work::Send { .. } => &[],
    }
}

/// A reshape is the same elements in the same order: where its copy launch is the only
/// writer of its result, nothing writes its operand after it, and both are stored alike,
/// the result takes the operand's buffer (every launch and result naming it is renamed)
/// and the copy goes. On the nanoGPT GPU config's step, 48 copies of 25 MB (about 1 ms on
/// an H200, run 2).
fn elide_reshapes(p: &mut Program, g: &Graph) {
    let mut writers: HashMap<ValueId, Vec<usize>> = HashMap::new();
    for (i, l) in p.launches.iter().enumerate() {
        for b in written(l, &p.kernels) {
            if let BufId::Value(v) = b {
                writers.entry(*v).or_default().push(i);
            }
        }
    }
    let mut rename: HashMap<ValueId, ValueId> = HashMap::new();
    let mut drop = vec![false; p.launches.len()];
    for (i, l) in p.launches.iter().enumerate() {
        let Work::Kernel(k) = l.work else { continue };
        let (&[BufId::Value(a), BufId::Value(b)], [node]) = (l.bufs.as_slice(), l.nodes.as_slice())
        else {
            continue;
        };
        if p.kernels[k].body != Body::Copy || g.nodes[*node].op != "dnn.reshape" || a == b {
            continue;
        }
        let root = *rename.get(&a).unwrap_or(&a);
        let only_writer = writers.get(&b).is_some_and(|w| w == &[i]);
        let a_later = writers.get(&root).is_some_and(|w| w.iter().any(|&j| j > i));
        let alike = match (&p.values[root], &p.values[b]) {
            (Some(x), Some(y)) => x.elt == y.elt && x.len() == y.len(),
            _ => false,
        };
        // A function's result keeps a buffer of its own shape (the artifact's ports take
        // their shapes from their buffers): keep the copy.
        if !only_writer || a_later || !alike || p.inputs.contains(&b) || p.outputs.contains(&b) {
            continue;
        }
        rename.insert(b, root);
        drop[i] = true;
    }
    if rename.is_empty() {
        return;
    }
    let to = |v: ValueId| *rename.get(&v).unwrap_or(&v);
    let launches = std::mem::take(&mut p.launches);
    p.launches = launches
        .into_iter()
        .zip(drop)
        .filter(|(_, d)| !d)
        .map(|(mut l, _)| {
            for b in &mut l.bufs {
                if let BufId::Value(v) = b {
                    *v = to(*v);
                }
            }
            l
        })
        .collect();
    for v in &mut p.outputs {
        *v = to(*v);
    }
    for &b in rename.keys() {
        p.values[b] = None;
    }
    // The copies' kernels go too (kernels renumbered in launch order of first use).
    let mut new_index: Vec<Option<usize>> = vec![None; p.kernels.len()];
    let old = std::mem::take(&mut p.kernels);
    let mut kept: Vec<Option<Kernel>> = old.into_iter().map(Some).collect();
    for l in &mut p.launches {
        if let Work::Kernel(k) = &mut l.work {
            let i = match new_index[*k] {
                Some(i) => i,
                None => {
                    let i = p.kernels.len();
                    p.kernels
                        .push(kept[*k].take().expect("a kernel moved once"));
                    new_index[*k] = Some(i);
                    i
                }
            };
            *k = i;
        }
    }
}

/// Attention forwards whose backward runs later in the same program on the same `q, k, v`
/// (and the same `causal`, `scale`, `seq_axes`), on the tiled kernels: the forward keeps
/// its row statistics and output for them, so the backward does not run the forward's pass
/// again (as FlashAttention keeps the log-sum-exp). A recomputed forward (`--recompute`)
/// pairs with the backward that reads its clones' values, the latest such forward.
struct Kept {
    /// The forwards that keep their statistics.
    forward: std::collections::HashSet<usize>,
    /// Each paired backward's forward.
    backward: HashMap<usize, usize>,
}

fn kept_attention(g: &Graph, in_group: &[bool]) -> Kept {
    let mut kept = Kept {
        forward: Default::default(),
        backward: HashMap::new(),
    };
    let same = |a: &Node, b: &Node| {
        ["causal", "scale", "seq_axes"]
            .iter()
            .all(|key| a.attrs.get(*key) == b.attrs.get(*key))
    };
    for (k, n) in g.nodes.iter().enumerate() {
        if n.op != "dnn.attention_grad" || in_group[k] || n.inputs.len() != 4 {
            continue;
        }
        let fwd = (0..k).rev().find(|&f| {
            let m = &g.nodes[f];
            m.op == "dnn.attention" && !in_group[f] && m.inputs[..] == n.inputs[1..] && same(m, n)
        });
        let Some(f) = fwd else { continue };
        let m = &g.nodes[f];
        let buf = |i: usize| Buf::of(&g.values[m.inputs[i]]);
        if !crate::kernel::attention_tiles(&m.attrs, &buf(0), &buf(1), &buf(2)) {
            continue;
        }
        kept.forward.insert(f);
        kept.backward.insert(k, f);
    }
    kept
}

/// Stores bf16 values in 2 bytes ([`Elt::Bf16`]) where nothing needs their 4: a value of
/// type bf16 that is not an argument or a result of the function (the tensor files hold
/// f32), not a collective's or a message's operand (collectives reduce f32s; both ends of
/// a message must agree), and whose writer is an elementwise formula, a matrix product, a
/// transpose or a copy: kernels that store each element once, so rounding on store is
/// the one rounding the f32 emulation applies afterwards, and the in-place rounding
/// launch that followed the value's producer ([`round_bf16`]) goes. Kernels widen the 2
/// bytes back to the same f32 on load, so the results are the same bits as with f32
/// storage, and the value takes half the memory and bandwidth (on a GPU the matrix
/// products read it as bf16). With `tensor_cores`, an attention forward whose operands
/// are all stored so then runs on tensor cores ([`to_tensor_cores`]): within bf16
/// rounding of the register tiles, not their bits.
pub(crate) fn store_bf16(p: &mut Program, g: &Graph, tensor_cores: bool) {
    let n = g.values.len();
    let mut ok: Vec<bool> = (0..n)
        .map(|v| p.values[v].is_some() && g.values[v].elem == Elem::BF16)
        .collect();
    for &v in p.inputs.iter().chain(&p.outputs) {
        ok[v] = false;
    }
    // The in-place rounding launches: (launch, value).
    let rounding = |l: &Launch, kernels: &[Kernel]| -> Option<ValueId> {
        let Work::Kernel(k) = l.work else { return None };
        match (&kernels[k].body, l.bufs.as_slice()) {
            (Body::Map(e), [BufId::Value(a), BufId::Value(b)])
                if a == b && *e == vec![x(0).round_bf16()] =>
            {
                Some(*a)
            }
            _ => None,
        }
    };
    for l in &p.launches {
        if rounding(l, &p.kernels).is_some() {
            continue;
        }
        let Work::Kernel(k) = l.work else {
            // Collectives, sends and receives keep f32.
            for b in &l.bufs {
                if let BufId::Value(v) = b {
                    ok[*v] = false;
                }
            }
            continue;
        };
        let kern = &p.kernels[k];
        let stores_once = matches!(
            kern.body,
            Body::Map(_) | Body::Gemm(_) | Body::Transpose(_) | Body::Copy
        );
        let nin = kern.inputs.len();
        for (j, b) in l.bufs.iter().enumerate() {
            if let BufId::Value(v) = b {
                let writes = j >= nin;
                if writes && (!stores_once || l.bufs[..nin].contains(b)) {
                    ok[*v] = false;
                }
            }
        }
    }
    // A kernel's buffer types are set per launch, so each kernel must have one launch
    // (as compile_on makes them); else keep f32 everywhere.
    let mut launched = vec![0usize; p.kernels.len()];
    for l in &p.launches {
        if let Work::Kernel(k) = l.work {
            launched[k] += 1;
        }
    }
    if !ok.iter().any(|&b| b) || launched.iter().any(|&c| c > 1) {
        return;
    }
    let launches = std::mem::take(&mut p.launches);
    for l in launches {
        if rounding(&l, &p.kernels).is_some_and(|v| ok[v]) {
            continue;
        }
        if let Work::Kernel(k) = l.work {
            let kern = &mut p.kernels[k];
            let nin = kern.inputs.len();
            for (j, b) in l.bufs.iter().enumerate() {
                if let BufId::Value(v) = b {
                    if ok[*v] {
                        let buf = if j < nin {
                            &mut kern.inputs[j]
                        } else {
                            &mut kern.outputs[j - nin]
                        };
                        buf.elt = Elt::Bf16;
                    }
                }
            }
        }
        p.launches.push(l);
    }
    for (v, b) in p.values.iter_mut().enumerate() {
        if let Some(b) = b {
            if ok[v] {
                b.elt = Elt::Bf16;
            }
        }
    }
    // The dropped rounding launches' kernels go too (launched kernels renumbered).
    let mut keep = vec![None; p.kernels.len()];
    let mut kernels = Vec::with_capacity(p.kernels.len());
    for l in &mut p.launches {
        if let Work::Kernel(k) = &mut l.work {
            let new = *keep[*k].get_or_insert_with(|| {
                kernels.push(p.kernels[*k].clone());
                kernels.len() - 1
            });
            *k = new;
        }
    }
    p.kernels = kernels;
    if tensor_cores {
        for k in &mut p.kernels {
            to_tensor_cores(k);
        }
    }
}

/// An attention kernel on the register tiles whose operands are now 2-byte bf16 buffers
/// goes to the tensor cores where its shape takes them ([`Body::AttnMma`],
/// [`Body::AttnMmaBack`] for a backward reading the kept statistics, [`Body::AttnMmaKv`]):
/// the same operands, outputs and statistics, blocks of [`crate::kernel::MMA_ROWS`]
/// queries (keys).
fn to_tensor_cores(k: &mut Kernel) {
    // The forward's q, k, v are its first three inputs; the backward's dout, q, k, v its
    // first four.
    let (a, ops) = match &k.body {
        Body::AttnTiles(a) => (*a, 3),
        Body::AttnTilesBack(a) | Body::AttnTilesKv(a) => (*a, 4),
        _ => return,
    };
    if k.inputs.len() < ops || k.inputs[..ops].iter().any(|b| b.elt != Elt::Bf16) {
        return;
    }
    let mut a = a;
    a.bf16 = true;
    a.tf32x3 = false;
    let rows = crate::kernel::MMA_ROWS;
    match k.body {
        Body::AttnTiles(_) if a.mma_keys().is_some() => {
            k.len = a.b * a.h * a.s.div_ceil(rows);
            k.body = Body::AttnMma(a);
        }
        Body::AttnTilesBack(_) if a.mma_dq().is_some() => {
            k.len = a.b * a.h * a.s.div_ceil(rows);
            k.body = Body::AttnMmaBack(a);
        }
        Body::AttnTilesKv(_) if a.mma_kv().is_some() => {
            k.len = a.b * a.g * a.t.div_ceil(rows);
            k.body = Body::AttnMmaKv(a);
        }
        _ => {}
    }
}

/// A launch of `kernel` on node `k`'s first operand and its result.
fn unary_launch(p: &mut Program, g: &Graph, k: usize, kernel: Kernel) {
    let n = &g.nodes[k];
    let (i, o) = (n.inputs[0], n.outputs[0]);
    for v in [i, o] {
        p.values[v].get_or_insert_with(|| Buf::of(&g.values[v]));
    }
    p.launches.push(Launch {
        work: Work::Kernel(p.kernels.len()),
        bufs: vec![BufId::Value(i), BufId::Value(o)],
        nodes: vec![k],
    });
    p.kernels.push(kernel);
}

/// When `v` is a bf16 value: a launch after its producer (node `k`) that rounds its buffer
/// in place. bf16 values live in f32 buffers (the CPU runtime's emulation: f32 arithmetic,
/// one rounding per result), so a kernel whose body is not a formula (a GEMM, attention, a
/// reduction, a collective's sum) is followed by this one.
fn round_bf16(p: &mut Program, g: &Graph, k: usize, v: ValueId) {
    if g.values[v].elem != Elem::BF16 {
        return;
    }
    let b = Buf::of(&g.values[v]);
    p.launches.push(Launch {
        work: Work::Kernel(p.kernels.len()),
        bufs: vec![BufId::Value(v), BufId::Value(v)],
        nodes: vec![k],
    });
    p.kernels.push(Kernel {
        name: format!("n{k}_round_bf16_v{v}"),
        body: Body::Map(vec![x(0).round_bf16()]),
        inputs: vec![b.clone()],
        outputs: vec![b.clone()],
        len: b.len(),
    });
}

#[cfg(test)]
mod tests;
