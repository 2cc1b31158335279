//! A function compiled to an `.nnsx` artifact (the format: `nnscaler_rt::artifact`):
//! its launches, PTX for the GPU, the same kernels as a host shared object, and a memory
//! plan that gives every buffer an offset in one arena, reusing the space of buffers no
//! later step reads.

use crate::kernel::{Body, Buf, Elt};
use crate::program::{compile, BufId, Collective, Program, Work};
use crate::target::{host_shared_object, ptx, Gpu};
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::Mesh;
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
        Some(AttrValue::Nns { body, .. }) => Some(body.clone()),
        Some(AttrValue::Str(s)) => Some(s.clone()),
        _ => None,
    }
}

/// The groups of a collective over mesh axes `axes`: per group (the devices agreeing on
/// every other axis), its devices in member order (row-major over `axes` in their order).
fn groups(sizes: &[i64], axes: &[usize]) -> Vec<Vec<usize>> {
    let devices: usize = sizes.iter().map(|&s| s as usize).product();
    let mut by_gid: std::collections::BTreeMap<usize, Vec<(usize, usize)>> = Default::default();
    for d in 0..devices {
        let c = nnscaler_dialects::sharding::coords(sizes, d);
        let (mut gid, mut member) = (0usize, 0usize);
        for (a, &n) in sizes.iter().enumerate() {
            if !axes.contains(&a) {
                gid = gid * n as usize + c[a];
            }
        }
        for &a in axes {
            member = member * sizes[a] as usize + c[a];
        }
        by_gid.entry(gid).or_default().push((member, d));
    }
    by_gid
        .into_values()
        .map(|mut v| {
            v.sort_unstable();
            v.into_iter().map(|(_, d)| d).collect()
        })
        .collect()
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

/// Compiles `g` (a whole program, or one device's with its module's `mesh`) for `gpu`;
/// `source` names it.
pub fn artifact(
    g: &Graph,
    source: &str,
    mesh: Option<&Mesh>,
    gpu: Gpu,
) -> Result<nx::Artifact, String> {
    let p: Program = compile(g, mesh)?;

    // Buffers: the values launches touch, then the temporaries.
    let mut index: HashMap<BufId, usize> = HashMap::new();
    let mut bufs: Vec<Buf> = Vec::new();
    for (v, b) in p.values.iter().enumerate() {
        if let Some(b) = b {
            index.insert(BufId::Value(v), bufs.len());
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
    let port = |v: usize, attrs: &Attrs, fallback: String| -> Result<nx::Port, String> {
        let name = match attrs.get("nns.name") {
            Some(AttrValue::Str(s)) => s.clone(),
            _ => fallback,
        };
        let local: Vec<usize> = g.values[v].shape.iter().map(|&d| d as usize).collect();
        let (global_shape, shards) = shards(attrs, &local, mesh, &format!("'{name}'"))?;
        Ok(nx::Port {
            buffer: index[&BufId::Value(v)],
            global_shape,
            shards,
            layout: attr_text(attrs.get("nns.layout")),
            param: matches!(
                attrs.get("nns.param"),
                Some(AttrValue::Unit | AttrValue::Bool(true))
            ),
            name,
        })
    };
    let sizes: Vec<i64> = mesh.map_or(Vec::new(), |m| m.axes.iter().map(|a| a.size).collect());
    let header = nx::Header {
        target: nx::Target {
            sm: gpu.sm,
            ptx: gpu.ptx,
        },
        source: source.to_string(),
        mesh: mesh.map_or(Vec::new(), |m| {
            m.axes
                .iter()
                .map(|a| nx::MeshAxis {
                    name: a.name.clone(),
                    size: a.size as u64,
                })
                .collect()
        }),
        inputs: g
            .args
            .iter()
            .enumerate()
            .map(|(i, a)| port(a.value, &a.attrs, format!("in{i}")))
            .collect::<Result<_, _>>()?,
        outputs: g
            .outputs
            .iter()
            .enumerate()
            .map(|(i, o)| port(o.value, &o.attrs, format!("out{i}")))
            .collect::<Result<_, _>>()?,

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
        constants: {
            let mut off = 0u64;
            p.consts
                .iter()
                .enumerate()
                .map(|(c, (_, values))| nx::Constant {
                    buffer: index[&BufId::Const(c)],
                    offsets: values
                        .iter()
                        .map(|v| {
                            let at = off;
                            off += v.len() as u64;
                            at
                        })
                        .collect(),
                })
                .collect()
        },
        kernels: p
            .kernels
            .iter()
            .map(|k| nx::Kernel {
                name: k.name.clone(),
                len: k.len as u64,
                grid: (k.len as u64).div_ceil(u64::from(nx::BLOCK)),
                buffers: k.inputs.len() + k.outputs.len(),
                gemm: match &k.body {
                    Body::Gemm(m) => Some(nx::Gemm {
                        batch: m.batch as u64,
                        m: m.m as u64,
                        n: m.n as u64,
                        k: m.k as u64,
                        ta: m.ta,
                        tb: m.tb,
                        b_batched: m.b_batched,
                    }),
                    _ => None,
                },
            })
            .collect(),
        steps: p
            .launches
            .iter()
            .map(|l| {
                let bufs: Vec<usize> = l.bufs.iter().map(|b| index[b]).collect();
                match &l.work {
                    Work::Kernel(kernel) => nx::Step::Launch {
                        kernel: *kernel,
                        buffers: bufs,
                    },
                    Work::Collective(c) => {
                        let (input, output) = (bufs[0], bufs[1]);
                        let groups = groups(&sizes, c.axes());
                        match *c {
                            Collective::AllReduce { max, .. } => nx::Step::AllReduce {
                                input,
                                output,
                                groups,
                                max,
                            },
                            Collective::AllGather { dim, .. } => nx::Step::AllGather {
                                input,
                                output,
                                groups,
                                dim,
                            },
                            Collective::Slice { dim, .. } => nx::Step::Slice {
                                input,
                                output,
                                groups,
                                dim,
                            },
                            Collective::ReduceScatter { dim, max, .. } => nx::Step::ReduceScatter {
                                input,
                                output,
                                groups,
                                dim,
                                max,
                            },
                        }
                    }
                }
            })
            .collect(),
        sections: Vec::new(),
    };
    let ptx_text = ptx(&p.kernels, gpu)?;
    let so = host_shared_object(&p.kernels)?;
    let consts: Vec<u8> = p
        .consts
        .iter()
        .flat_map(|(_, v)| v.iter().flatten().copied())
        .collect();
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

#[cfg(test)]
mod tests {
    use super::plan;

    #[test]
    fn groups_follow_the_mesh() {
        // dp = 2, tp = 2: devices (dp, tp) row-major: 0 = (0,0), 1 = (0,1), 2 = (1,0), 3 = (1,1).
        assert_eq!(super::groups(&[2, 2], &[1]), vec![vec![0, 1], vec![2, 3]]);
        assert_eq!(super::groups(&[2, 2], &[0]), vec![vec![0, 2], vec![1, 3]]);
        assert_eq!(super::groups(&[2, 2], &[0, 1]), vec![vec![0, 1, 2, 3]]);
        assert_eq!(super::groups(&[2, 2], &[1, 0]), vec![vec![0, 2, 1, 3]]);
    }

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
