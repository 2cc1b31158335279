//! A function compiled to an `.nnsx` artifact (the format: `nnscaler_rt::artifact`):
//! its launches, PTX for the GPU, the same kernels as a host shared object, and a memory
//! plan that gives every buffer an offset in one arena, reusing the space of buffers no
//! later step reads.

use crate::kernel::{Body, Buf, Elt, Kernel};
use crate::program::{compile_on, BufId, Devices, Program, Work};
use crate::target::{host_shared_object, ptx, Gpu};
use nnscaler_dialects::domain::Domain;
use nnscaler_dialects::graph::{Graph, ValueId};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::scalar::{x, Bin, Expr};
use nnscaler_dialects::sharding::Sharding;
use nnscaler_dialects::types::{AttrValue, Attrs};
use nnscaler_rt::artifact as nx;
use std::collections::HashMap;

/// Offsets are multiples of this.
const ALIGN: u64 = 256;

fn elt(e: Elt) -> nx::Elt {
    match e {
        Elt::F32 => nx::Elt::F32,
        Elt::I64 => nx::Elt::I64,
        Elt::Bf16 => nx::Elt::Bf16,
    }
}

/// The memory plan: each buffer's `[first, last]` step, then first-fit offsets among the
/// buffers alive at the same time (a buffer is free only after the step that last reads
/// it, so no launch writes over its own inputs). Returns offsets and the arena's size.
fn plan(sizes: &[u64], live: &[(usize, usize)]) -> (Vec<u64>, u64) {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&b| (live[b].0, std::cmp::Reverse(sizes[b])));
    let mut offsets = vec![0u64; sizes.len()];
    let mut active: Vec<usize> = Vec::new();
    let mut arena = 0u64;
    for b in order {
        active.retain(|&a| live[a].1 >= live[b].0);
        let size = sizes[b].div_ceil(ALIGN).max(1) * ALIGN;
        let mut taken: Vec<(u64, u64)> = active
            .iter()
            .map(|&a| {
                (
                    offsets[a],
                    offsets[a] + sizes[a].div_ceil(ALIGN).max(1) * ALIGN,
                )
            })
            .collect();
        taken.sort_unstable();
        let mut at = 0u64;
        for (lo, hi) in taken {
            if at + size <= lo {
                break;
            }
            at = at.max(hi);
        }
        offsets[b] = at;
        arena = arena.max(at + size);
        active.push(b);
    }
    (offsets, arena)
}

fn attr_text(v: Option<&AttrValue>) -> Option<String> {
    match v {
        Some(AttrValue::Str(s)) => Some(s.clone()),
        Some(v) => v.nns_parts().map(|(_, body)| body),
        None => None,
    }
}

/// A port's whole shape and each device's block of it, from its `nns.layout` on `mesh`.
type Shards = (Vec<u64>, Vec<Vec<[u64; 2]>>);

fn shards(
    attrs: &Attrs,
    local: &[usize],
    mesh: Option<&Mesh>,
    what: &str,
) -> Result<Shards, String> {
    let Some(mesh) = mesh else {
        let shape: Vec<u64> = local.iter().map(|&d| d as u64).collect();
        let whole = shape.iter().map(|&n| [0, n]).collect();
        return Ok((shape, vec![whole]));
    };
    let sizes: Vec<i64> = mesh.axes.iter().map(|a| a.size).collect();
    let l = match attrs.get("nns.layout") {
        None => Sharding::replicated(local.len(), mesh.axes.len()),
        Some(v) => Sharding::from_attr(v, mesh, local.len()).map_err(|e| format!("{what}: {e}"))?,
    };
    if l.partial.iter().any(Option::is_some) {
        return Err(format!(
            "{what} is partial (V): its layout must be whole or split"
        ));
    }
    let global: Vec<i64> = local
        .iter()
        .zip(&l.split)
        .map(|(&n, axes)| n as i64 * axes.iter().map(|&a| sizes[a]).product::<i64>())
        .collect();
    let devices: usize = sizes.iter().map(|&s| s as usize).product();
    let per_device = (0..devices)
        .map(|d| {
            l.shard(&global, &sizes, d)
                .ranges
                .iter()
                .map(|r| [r.start as u64, r.end as u64])
                .collect()
        })
        .collect();
    Ok((global.iter().map(|&n| n as u64).collect(), per_device))
}

/// The kernels of every program, each distinct kernel once: ops that compute the same
/// thing on buffers of the same shapes (a repeated layer, a fragment run for every
/// micro-batch) share one.
#[derive(Default)]
struct Kernels {
    list: Vec<Kernel>,
    by_body: HashMap<String, usize>,
}

impl Kernels {
    /// The index of `k` (added under `prefix` + its name unless an equal one is there).
    fn add(&mut self, k: &Kernel, prefix: &str) -> usize {
        let key = format!("{:?}|{:?}|{:?}|{}", k.body, k.inputs, k.outputs, k.len);
        *self.by_body.entry(key).or_insert_with(|| {
            let mut k = k.clone();
            k.name = format!("{prefix}{}", k.name);
            self.list.push(k);
            self.list.len() - 1
        })
    }
}

/// One program to compile: its function, the devices running it, and for each of its
/// arguments and results the index of the step's port it is.
struct Unit<'a> {
    g: &'a Graph,
    devs: Devices,
    arg_ports: Vec<usize>,
    result_ports: Vec<usize>,
}

/// Per device of a program, its piece's `[start, end)` per dim of the whole tensor.
type Pieces = Vec<Vec<[u64; 2]>>;

/// A port (an argument or result with buffer `buf` and `attrs`): the step's port and this
/// program's devices' pieces of it (`dmesh`: the devices' mesh).
fn port_of(
    buf: &Buf,
    attrs: &Attrs,
    fallback: String,
    dmesh: Option<&Mesh>,
    devs: &Devices,
) -> Result<(nx::Port, Pieces), String> {
    let name = match attrs.get("nns.name") {
        Some(AttrValue::Str(s)) => s.clone(),
        _ => fallback,
    };
    let (global_shape, all) = shards(attrs, &buf.shape, dmesh, &format!("'{name}'"))?;
    let shards = devs.ids.iter().map(|&d| all[d].clone()).collect();
    let port = nx::Port {
        global_shape,
        elt: elt(buf.elt),
        layout: attr_text(attrs.get("nns.layout")),
        param: matches!(
            attrs.get("nns.param"),
            Some(AttrValue::Unit | AttrValue::Bool(true))
        ),
        domain: None,
        name,
    };
    Ok((port, shards))
}

/// Compiles one program: its memory plan and steps, its kernels added to `kernels` and
/// its constants' bytes to `consts`; `ports` are the step's (inputs, outputs), checked
/// against what this program binds.
fn program(
    u: &Unit<'_>,
    rank: Option<usize>,
    mesh: Option<&Mesh>,
    kernels: &mut Kernels,
    consts: &mut Vec<u8>,
    ports: (&mut [Option<nx::Port>], &mut [Option<nx::Port>]),
) -> Result<nx::Program, String> {
    let g = u.g;
    let p: Program = compile_on(g, mesh, &u.devs)?;
    let prefix = rank.map_or(String::new(), |r| format!("r{r}_"));

    // Buffers: the values launches touch, then the temporaries and constants.
    let mut index: HashMap<BufId, usize> = HashMap::new();
    let mut bufs: Vec<Buf> = Vec::new();
    for (v, b) in p.values.iter().enumerate() {
        if let Some(b) = b {
            index.insert(BufId::Value(ValueId::new(v)), bufs.len());
            bufs.push(b.clone());
        }
    }
    for (t, b) in p.temps.iter().enumerate() {
        index.insert(BufId::Temp(t), bufs.len());
        bufs.push(b.clone());
    }
    for (c, (b, _)) in p.consts.iter().enumerate() {
        index.insert(BufId::Const(c), bufs.len());
        bufs.push(b.clone());
    }
    let steps = p.launches.len();
    let mut live: Vec<Option<(usize, usize)>> = vec![None; bufs.len()];
    let mut touch = |b: usize, s: usize| {
        let l = live[b].get_or_insert((s, s));
        l.0 = l.0.min(s);
        l.1 = l.1.max(s);
    };
    for &v in &p.inputs {
        touch(index[&BufId::Value(v)], 0);
    }
    for &v in &p.outputs {
        touch(index[&BufId::Value(v)], steps);
    }
    // Constants are written before the first step and read later: alive throughout.
    for c in 0..p.consts.len() {
        touch(index[&BufId::Const(c)], 0);
        touch(index[&BufId::Const(c)], steps);
    }
    for (s, l) in p.launches.iter().enumerate() {
        for b in &l.bufs {
            touch(index[b], s);
        }
    }
    let live: Vec<(usize, usize)> = live.into_iter().map(|l| l.unwrap_or((0, 0))).collect();
    let sizes: Vec<u64> = bufs
        .iter()
        .map(|b| b.len() as u64 * elt(b.elt).size())
        .collect();
    let (offsets, arena_bytes) = plan(&sizes, &live);

    // Where the step's tensors are (`v`: a value of the program after inlining; every
    // argument and result has a buffer).
    let dmesh = mesh.map(Mesh::device_mesh);
    let buf_of = |v: ValueId| {
        p.values[v]
            .as_ref()
            .ok_or_else(|| format!("@{}: value {v} has no buffer", g.name))
    };
    let bind = |vals: &[(ValueId, &Attrs)],
                which: &[usize],
                table: &mut [Option<nx::Port>],
                what: &str|
     -> Result<Vec<nx::Binding>, String> {
        vals.iter()
            .zip(which)
            .map(|(&(v, attrs), &k)| {
                let (port, shards) = port_of(
                    buf_of(v)?,
                    attrs,
                    format!("{what}{k}"),
                    dmesh.as_ref(),
                    &u.devs,
                )?;
                match &table[k] {
                    Some(seen) if *seen != port => {
                        return Err(format!(
                            "'{}' is {:?} {:?} in one program and {:?} {:?} in @{}",
                            port.name,
                            seen.elt,
                            seen.global_shape,
                            port.elt,
                            port.global_shape,
                            g.name
                        ))
                    }
                    Some(_) => {}
                    None => table[k] = Some(port),
                }
                Ok(nx::Binding {
                    port: k,
                    buffer: index[&BufId::Value(v)],
                    shards,
                })
            })
            .collect()
    };
    let args: Vec<(ValueId, &Attrs)> = g.args.iter().map(|a| (a.value, &a.attrs)).collect();
    let results: Vec<(ValueId, &Attrs)> = p
        .outputs
        .iter()
        .zip(&g.outputs)
        .map(|(&v, o)| (v, &o.attrs))
        .collect();
    let inputs = bind(&args, &u.arg_ports, ports.0, "arg")?;
    let outputs = bind(&results, &u.result_ports, ports.1, "out")?;

    let constants = p
        .consts
        .iter()
        .enumerate()
        .map(|(c, (_, values))| nx::Constant {
            buffer: index[&BufId::Const(c)],
            offsets: values
                .iter()
                .map(|v| {
                    let at = consts.len() as u64;
                    consts.extend_from_slice(v);
                    at
                })
                .collect(),
        })
        .collect();
    let kernel_ids: Vec<usize> = p.kernels.iter().map(|k| kernels.add(k, &prefix)).collect();
    let dsizes: Vec<i64> = dmesh
        .as_ref()
        .map_or(Vec::new(), |m| m.axes.iter().map(|a| a.size).collect());
    let steps = p
        .launches
        .iter()
        .map(|l| {
            let bufs: Vec<usize> = l.bufs.iter().map(|b| index[b]).collect();
            Ok(match &l.work {
                Work::Kernel(kernel) => nx::Step::Launch {
                    kernel: kernel_ids[*kernel],
                    buffers: bufs,
                },
                Work::Send { peer, tag } => nx::Step::Send {
                    buffer: bufs[0],
                    to: *peer,
                    tag: tag.clone(),
                },
                Work::Recv { peer, tag } => nx::Step::Recv {
                    buffer: bufs[0],
                    from: *peer,
                    tag: tag.clone(),
                },
                Work::Collective { op, axes } => {
                    let (input, output) = (bufs[0], bufs[1]);
                    // The groups among this program's devices.
                    let groups: Vec<Vec<usize>> =
                        nnscaler_dialects::sharding::groups(&dsizes, axes)
                            .into_iter()
                            .filter(|gr| gr.iter().any(|d| u.devs.ids.contains(d)))
                            .collect();
                    if groups.iter().flatten().any(|d| !u.devs.ids.contains(d)) {
                        return Err(format!(
                            "a collective over {axes:?} spans devices of other pipeline ranks"
                        ));
                    }
                    nx::Step::Collective {
                        op: *op,
                        input,
                        output,
                        groups,
                    }
                }
            })
        })
        .collect::<Result<_, String>>()?;
    Ok(nx::Program {
        name: g.name.clone(),
        devices: u.devs.ids.clone(),
        inputs,
        outputs,
        buffers: bufs
            .iter()
            .zip(&offsets)
            .map(|(b, &offset)| nx::Buffer {
                shape: b.shape.iter().map(|&d| d as u64).collect(),
                elt: elt(b.elt),
                offset,
            })
            .collect(),
        arena_bytes,
        constants,
        steps,
    })
}

/// The kernels collectives reduce with (`nx::Reducers`): `acc = acc + x` and
/// `acc = max(acc, x)` on `(acc, x, acc)`, element-wise on buffers of one shape, so a
/// launch covers any number of elements.
pub fn reducers() -> [Kernel; 2] {
    let k = |f: Expr, what: &str| Kernel {
        name: format!("{}{what}", crate::kernel::ANY_LEN_PREFIX),
        body: Body::Map(vec![f]),
        inputs: vec![Buf::f32(&[1]), Buf::f32(&[1])],
        outputs: vec![Buf::f32(&[1])],
        len: 1,
    };
    [
        k(x(0) + x(1), "sum"),
        k(Expr::Bin(Bin::Max, Box::new(x(0)), Box::new(x(1))), "max"),
    ]
}

/// Compiles `units` (one SPMD program, or a pipeline's ranks in order) into an artifact
/// with `inputs` and `outputs` ports.
fn build(
    units: &[Unit<'_>],
    ports: (usize, usize),
    source: &str,
    mesh: Option<&Mesh>,
    pipeline_axis: Option<String>,
    gpu: Gpu,
) -> Result<nx::Artifact, String> {
    let mut kernels = Kernels::default();
    let mut consts = Vec::new();
    let mut ins: Vec<Option<nx::Port>> = vec![None; ports.0];
    let mut outs: Vec<Option<nx::Port>> = vec![None; ports.1];
    let rank = |r: usize| pipeline_axis.as_ref().map(|_| r);
    let programs = units
        .iter()
        .enumerate()
        .map(|(r, u)| {
            program(
                u,
                rank(r),
                mesh,
                &mut kernels,
                &mut consts,
                (&mut ins, &mut outs),
            )
            .map_err(|e| {
                if pipeline_axis.is_some() {
                    format!("@{}: {e}", u.g.name)
                } else {
                    e
                }
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let reduces = programs
        .iter()
        .flat_map(|p| &p.steps)
        .any(|s| matches!(s, nx::Step::Collective { op, .. } if op.reduces()));
    // The kernel adding each biased product's bias, for a runtime whose BLAS call does
    // not (`nx::Gemm::bias`): in place on `(C, bias, C)`.
    let mut bias_adds = HashMap::new();
    for i in 0..kernels.list.len() {
        let k = &kernels.list[i];
        if let Body::Gemm(m) = &k.body {
            if m.bias {
                let (c, bias) = (k.outputs[0].clone(), k.inputs[2].clone());
                let add = Kernel {
                    name: format!("{}_bias", k.name),
                    body: Body::Map(vec![x(0) + x(1)]),
                    len: c.len(),
                    inputs: vec![c.clone(), bias],
                    outputs: vec![c],
                };
                bias_adds.insert(i, kernels.add(&add, "") as u64);
            }
        }
    }
    let reducers = reduces.then(|| {
        let [sum, max] = reducers();
        nx::Reducers {
            sum: kernels.add(&sum, ""),
            max: kernels.add(&max, ""),
        }
    });
    // What each argument may hold, read from its uses in every program (the largest id
    // bound: a program may see only its piece of a table).
    for u in units {
        for (k, &port) in u.arg_ports.iter().enumerate() {
            let found = match nnscaler_dialects::domain::of_arg(u.g, k) {
                Some(Domain::Below(n)) => nx::Domain::Below(n.max(0) as u64),
                Some(Domain::AtLeast(m)) => nx::Domain::AtLeast(m.ceil() as i64),
                None => continue,
            };
            if let Some(p) = ins[port].as_mut() {
                p.domain = Some(match (p.domain, found) {
                    (Some(nx::Domain::Below(a)), nx::Domain::Below(b)) => {
                        nx::Domain::Below(a.max(b))
                    }
                    (Some(d), _) => d,
                    (None, d) => d,
                });
            }
        }
    }
    let complete = |t: Vec<Option<nx::Port>>, what: &str| -> Result<Vec<nx::Port>, String> {
        t.into_iter()
            .enumerate()
            .map(|(k, p)| p.ok_or_else(|| format!("no program has the step's {what} {k}")))
            .collect()
    };
    let header = nx::Header {
        target: nx::Target {
            sm: gpu.sm,
            ptx: gpu.ptx,
        },
        source: source.to_string(),
        mesh: mesh.map_or(Vec::new(), |m| {
            m.device_mesh()
                .axes
                .iter()
                .map(|a| nx::MeshAxis {
                    name: a.name.clone(),
                    size: a.size as u64,
                })
                .collect()
        }),
        pipeline_axis,
        inputs: complete(ins, "argument")?,
        outputs: complete(outs, "result")?,
        kernels: kernels
            .list
            .iter()
            .enumerate()
            .map(|(i, k)| nx::Kernel {
                name: k.name.clone(),
                len: k.len as u64,
                grid: match k.team() {
                    1 => (k.len as u64).div_ceil(u64::from(nx::BLOCK)),
                    _ => k.len as u64,
                },
                block: match k.team() {
                    1 => nx::BLOCK,
                    t => t as u32,
                },
                team: k.team() > 1,
                buffers: k.inputs.len() + k.outputs.len(),
                outputs: k.outputs.len(),
                gemm: match &k.body {
                    Body::Gemm(m) => Some(nx::Gemm {
                        batch: m.batch as u64,
                        m: m.m as u64,
                        n: m.n as u64,
                        k: m.k as u64,
                        ta: m.ta,
                        tb: m.tb,
                        b_batched: m.b_batched,
                        bias: bias_adds.get(&i).copied(),
                    }),
                    _ => None,
                },
                sizes: if k.any_len() {
                    Vec::new()
                } else {
                    k.inputs
                        .iter()
                        .chain(&k.outputs)
                        .map(|b| b.bytes() as u64)
                        .collect()
                },
            })
            .collect(),
        reducers,
        programs,
        sections: Vec::new(),
    };
    let ptx_text = ptx(&kernels.list, gpu)?;
    let so = host_shared_object(&kernels.list)?;
    Ok(nx::Artifact {
        header,
        sections: [
            ("ptx".to_string(), ptx_text.into_bytes()),
            ("host.so".to_string(), so),
        ]
        .into_iter()
        .chain((!consts.is_empty()).then(|| ("consts".to_string(), consts)))
        .collect(),
    })
}

/// Compiles `g` (a whole program, or one device's with its module's `mesh`, run by every
/// device) for `gpu`; `source` names it. Calls of functions with bodies are inlined when
/// `g` is linked to them.
pub fn artifact(
    g: &Graph,
    source: &str,
    mesh: Option<&Mesh>,
    gpu: Gpu,
) -> Result<nx::Artifact, String> {
    if mesh.is_some_and(|m| m.microbatch_axis().is_some()) {
        return Err(format!(
            "@{} is cut into micro-batches, which only a pipeline schedule runs: compile the pipeline's programs (a --schedule-* pass)",
            g.name
        ));
    }
    let unit = Unit {
        g,
        devs: Devices::all(mesh),
        arg_ports: (0..g.args.len()).collect(),
        result_ports: (0..g.outputs.len()).collect(),
    };
    build(
        std::slice::from_ref(&unit),
        (g.args.len(), g.outputs.len()),
        source,
        mesh,
        None,
        gpu,
    )
}

/// Compiles a pipeline: `programs[r]` (localized, linked to its fragments: the programs
/// of a `--schedule-*` pass, `nns.pipeline_rank = r`) runs on the devices at rank `r` of
/// `mesh`'s axis `axis`. The step's ports are the original function's arguments and
/// results (`nns.arg`, `nns.result` on the programs' own), in their order.
pub fn pipeline_artifact(
    programs: &[Graph],
    source: &str,
    mesh: &Mesh,
    axis: &str,
    gpu: Gpu,
) -> Result<nx::Artifact, String> {
    let dmesh = mesh.device_mesh();
    let ai = dmesh
        .axes
        .iter()
        .position(|a| a.name == axis)
        .ok_or_else(|| format!("mesh '@{}' has no pipeline axis '{axis}'", mesh.name))?;
    if programs.len() != dmesh.axes[ai].size as usize {
        return Err(format!(
            "{} programs for the {} ranks of '{axis}'",
            programs.len(),
            dmesh.axes[ai].size
        ));
    }
    let index = |attrs: &Attrs, key: &str, what: &str| match attrs.get(key) {
        Some(AttrValue::Int(i)) if *i >= 0 => Ok(*i as usize),
        _ => Err(format!("a pipeline program's {what} carries no '{key}'")),
    };
    // The step's arguments and results: the indices the programs name, in order.
    let mut arg_ids = std::collections::BTreeSet::new();
    let mut res_ids = std::collections::BTreeSet::new();
    let mut units = Vec::new();
    for (r, g) in programs.iter().enumerate() {
        let at = |e: String| format!("@{}: {e}", g.name);
        let arg_ports = g
            .args
            .iter()
            .map(|a| index(&a.attrs, "nns.arg", "argument").map_err(at))
            .collect::<Result<Vec<_>, _>>()?;
        let result_ports = g
            .outputs
            .iter()
            .map(|o| index(&o.attrs, "nns.result", "result").map_err(at))
            .collect::<Result<Vec<_>, _>>()?;
        arg_ids.extend(arg_ports.iter().copied());
        res_ids.extend(result_ports.iter().copied());
        units.push(Unit {
            g,
            devs: Devices::rank(mesh, ai, r),
            arg_ports,
            result_ports,
        });
    }
    // Dense port numbers in the original order.
    let dense = |ids: &std::collections::BTreeSet<usize>, k: usize| {
        ids.iter().position(|&i| i == k).expect("collected above")
    };
    for u in &mut units {
        u.arg_ports = u.arg_ports.iter().map(|&k| dense(&arg_ids, k)).collect();
        u.result_ports = u.result_ports.iter().map(|&k| dense(&res_ids, k)).collect();
    }
    build(
        &units,
        (arg_ids.len(), res_ids.len()),
        source,
        Some(mesh),
        Some(axis.to_string()),
        gpu,
    )
}

#[cfg(test)]
mod tests {
    use super::plan;

    #[test]
    fn buffers_alive_together_never_overlap_and_dead_space_is_reused() {
        // a (0..1), b (1..2), c (2..3): a's space is free again for c, not for b.
        let sizes = [1000, 1000, 1000];
        let live = [(0, 1), (1, 2), (2, 3)];
        let (off, arena) = plan(&sizes, &live);
        assert_ne!(off[0], off[1]);
        assert_ne!(off[1], off[2]);
        assert_eq!(off[2], off[0], "a is dead when c is made");
        assert_eq!(arena, 2 * 1024);
        for o in off {
            assert_eq!(o % 256, 0);
        }
    }
}
