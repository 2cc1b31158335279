//! `nnscaler emit-torch LOCALIZED.mlir -o DIR`: a localized program (or the per-rank
//! programs of a pipeline schedule) as readable PyTorch, one file per rank, plus the
//! `train.py` that `torchrun --nproc-per-node N DIR/train.py` starts and the small runtime
//! both import (`nns_runtime.py`: the ops without a one-line torch spelling, the mesh's
//! process groups and collectives, tensor files).
//!
//! Each rank file is the rank's program statement by statement: one line per op, named
//! after the op, with the source line it came from; a comment before each collective says
//! which layout it changes and how; the header lists the mesh, the rank's coordinates, the
//! arguments' layouts (the plan) and, for a pipeline rank, its schedule. Everything a rank
//! computes differently from its peers (the offsets of its shard in vocabulary-, context-
//! and class-parallel ops, its piece of a slice or micro-batch, its peers in the pipeline)
//! is a constant in its own file, so the file reads as what that rank does.
//!
//! The collectives' semantics are nnscaler's (runtime/src/spmd/): a group's members are
//! ordered by their coordinates along the collective's axes, in the order it names them;
//! `nns_runtime.Comm` maps that order onto torch's groups. Pipeline messages are received
//! in the order their sender sends them (the receiving rank holds early ones), so the same
//! code is correct on NCCL, which matches point-to-point messages in order, and on gloo.

mod ops;

pub use ops::torch_formula;

use crate::Outputs;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::sharding::{coords, Sharding};
use nnscaler_dialects::types::{AttrValue, Elem, TensorType};
use nnscaler_dialects::verify::Meshes;
use nnscaler_runtime::spmd::{global_view, layout_of, pipeline_programs};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::ops::Range;

/// The runtime the emitted files import, written into DIR as `nns_runtime.py`.
const RUNTIME: &str = include_str!("../../../frontends/torch/nnscaler_torch/runtime.py");

/// `nnscaler emit-torch`.
#[derive(clap::Args, Debug)]
#[command(
    about = "Write a localized program as per-rank PyTorch code that torchrun runs",
    long_about = "Write a localized program (nnscaler-opt ... --lower-relayouts --localize; \
        pipelines: after a --schedule-* pass) as readable PyTorch: DIR/rankR.py for each rank \
        R (its program, one statement per op, each with its source line; a comment where a \
        layout changes and why; the plan in the header), DIR/train.py (loads the whole \
        inputs and parameters, cuts each rank's pieces, runs one step, writes the whole \
        results) and DIR/nns_runtime.py (the ops without a one-line torch spelling, the \
        mesh's process groups and collectives over torch.distributed: NCCL with CUDA, gloo \
        otherwise).\n\n\
        Run it as: torchrun --nproc-per-node N DIR/train.py --inputs BATCH.safetensors \
        --params PARAMS.safetensors -o RESULTS.safetensors (the same tensor files as \
        'nnscaler run'). The files are written only when all of them can be."
)]
pub struct EmitArgs {
    /// The localized module (`-`: standard input).
    #[arg(value_name = "LOCALIZED.mlir")]
    pub model: String,
    /// The directory to write (created if missing).
    #[arg(short = 'o', long = "output", value_name = "DIR")]
    pub output: String,
    /// The function (or pipeline) to emit (default: the only one, else @train).
    #[arg(long, value_name = "NAME")]
    pub func: Option<String>,
}

/// One argument a rank's program takes: the whole tensor's name, shape and element type,
/// and the index ranges of this rank's piece.
struct ArgPiece {
    name: String,
    whole: Vec<i64>,
    elem: Elem,
    ranges: Vec<Range<usize>>,
    /// The layout, as written (for the header).
    layout: String,
}

/// One result of the step: name, whole shape, element type, and the distinct pieces (the
/// first rank holding each, and where it goes).
struct ResultPieces {
    name: String,
    whole: Vec<i64>,
    elem: Elem,
    pieces: Vec<(usize, Vec<Range<usize>>)>,
}

/// What one rank runs.
struct Rank<'g> {
    program: &'g Graph,
    /// Its coordinates in the full mesh (a micro-batch axis at 0).
    coords: Vec<usize>,
    /// Its pipeline rank, in a pipeline.
    stage: Option<usize>,
    args: Vec<ArgPiece>,
    /// The names of its program's results, in order.
    results: Vec<String>,
}

/// Everything the emitted files are made from.
pub(crate) struct Plan<'g> {
    source: String,
    name: String,
    /// The full mesh (micro-batch axis included), if the program is localized.
    mesh: Mesh,
    /// The device mesh (micro-batch axis left out); ranks are row-major over it.
    dmesh: Mesh,
    /// The pipeline axis's index in `dmesh`, in a pipeline.
    pp: Option<usize>,
    ranks: Vec<Rank<'g>>,
    results: Vec<ResultPieces>,
    /// The sets of mesh axes collectives run over (`"dp"`, `"dp,tp"`), in first use order.
    groups: Vec<String>,
}

/// Runs `nnscaler emit-torch`.
pub fn main(a: &EmitArgs, error_limit: usize) -> Result<(), String> {
    let model = a.model.clone();
    let ir = IrContext::new();
    let (source, module) = crate::load_module(&ir, &model, error_limit)?;
    let render =
        |d: Diagnostics| -> String { d.in_file(&model).render_limited(Some(&source), error_limit) };
    let mut all = Vec::new();
    for f in Graph::all_in(&module) {
        match f {
            Ok(g) => all.push(g),
            Err(e) => {
                let mut d = Diagnostics::default();
                d.error(&e.loc, e.message);
                return Err(render(d));
            }
        }
    }
    let mut d = Diagnostics::default();
    let meshes = Meshes::collect(&module.as_operation(), &mut d);
    let file = std::path::Path::new(&model)
        .file_name()
        .map(|f| f.to_string_lossy().to_string())
        .unwrap_or_else(|| model.clone());
    let pipeline = crate::compile::pipeline_named(all.iter(), a.func.as_deref());
    let (programs, name) = match pipeline {
        Some(p) => (
            pipeline_programs(&all, &p).map_err(|e| format!("{model}: {e}"))?,
            p,
        ),
        None => {
            let mut g = pick(&all, a.func.as_deref(), &model)?.clone();
            g.link(&all);
            let name = g.name.clone();
            (vec![g], name)
        }
    };
    let localized = programs.iter().any(Graph::is_localized);
    let mesh = if localized {
        meshes
            .resolve(None)
            .map_err(|e| format!("{model}: {e}"))?
            .clone()
    } else {
        Mesh {
            name: "world".into(),
            axes: Vec::new(),
            memory_cap: None,
        }
    };
    let plan = Plan::new(&programs, &name, &mesh, file).map_err(|e| format!("{model}: {e}"))?;
    let mut files: Vec<(String, String)> = Vec::new();
    for r in 0..plan.ranks.len() {
        let text = plan
            .rank_file(r)
            .map_err(|e| format!("{model}: rank {r}: {e}"))?;
        files.push((format!("rank{r}.py"), text));
    }
    files.push(("train.py".into(), plan.train_file()));
    files.push(("nns_runtime.py".into(), RUNTIME.to_string()));
    write_dir(&a.output, files, plan.ranks.len())?;
    eprintln!(
        "emit-torch: {} rank{} of @{} -> {}/ (run: torchrun --nproc-per-node {} {}/train.py --inputs ... --params ... -o ...)",
        plan.ranks.len(),
        if plan.ranks.len() == 1 { "" } else { "s" },
        plan.name,
        a.output,
        plan.ranks.len(),
        a.output
    );
    Ok(())
}

/// The function `--func` names, else the only public one, else `@train`.
fn pick<'g>(all: &'g [Graph], func: Option<&str>, model: &str) -> Result<&'g Graph, String> {
    let list = || {
        all.iter()
            .map(|g| format!("@{}", g.name))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if let Some(f) = func {
        return all
            .iter()
            .find(|g| g.name == f)
            .ok_or_else(|| format!("{model}: no function @{f} (functions: {})", list()));
    }
    let public: Vec<&Graph> = all
        .iter()
        .filter(|g| {
            !matches!(g.func_attrs.get("sym_visibility"), Some(AttrValue::Str(v)) if v == "private")
                && !g.func_attrs.contains_key("nns.fragment")
        })
        .collect();
    match public.as_slice() {
        [one] => Ok(one),
        [] => Err(format!("{model}: the module has no function to emit")),
        _ => public
            .iter()
            .find(|g| g.name == "train")
            .copied()
            .ok_or_else(|| format!("{model}: several functions ({}); give --func", list())),
    }
}

/// Writes `files` into `dir` (created if missing), all of them or none; rank files of an
/// earlier emit with more ranks are removed.
fn write_dir(dir: &str, files: Vec<(String, String)>, ranks: usize) -> Result<(), String> {
    let path = std::path::Path::new(dir);
    if path.exists() && !path.is_dir() {
        return Err(format!("-o {dir}: exists and is not a directory"));
    }
    let made = !path.exists();
    std::fs::create_dir_all(path).map_err(|e| format!("-o {dir}: cannot create it: {e}"))?;
    let staged = (|| {
        let mut out = Outputs::new();
        for (name, text) in files {
            out.stage(&path.join(name).to_string_lossy(), text.into_bytes())?;
        }
        out.commit()
    })();
    if let Err(e) = staged {
        // Nothing half-written: a directory made here goes again.
        if made {
            let _ = std::fs::remove_dir_all(path);
        }
        return Err(e);
    }
    for e in std::fs::read_dir(path)
        .map_err(|e| format!("{dir}: {e}"))?
        .flatten()
    {
        let n = e.file_name().to_string_lossy().to_string();
        let stale = n
            .strip_prefix("rank")
            .and_then(|r| r.strip_suffix(".py"))
            .and_then(|r| r.parse::<usize>().ok())
            .is_some_and(|r| r >= ranks);
        if stale {
            std::fs::remove_file(e.path()).map_err(|err| format!("{}: {err}", n))?;
        }
    }
    Ok(())
}

/// `layout` as the header shows it: the axes after the mesh name, or "replicated".
fn layout_text(s: &Sharding, mesh: &Mesh) -> String {
    let t = s.to_layout(mesh).to_string();
    match t.split_once(", ") {
        Some((_, rest)) => rest.to_string(),
        None => "replicated".into(),
    }
}

fn sizes(m: &Mesh) -> Vec<i64> {
    m.axes.iter().map(|a| a.size).collect()
}

impl<'g> Plan<'g> {
    fn new(programs: &'g [Graph], name: &str, mesh: &Mesh, source: String) -> Result<Self, String> {
        let dmesh = mesh.device_mesh();
        let dsizes = sizes(&dmesh);
        let world = dmesh.devices().max(1) as usize;
        let pipelined = programs
            .first()
            .is_some_and(|g| g.func_attrs.contains_key("nns.pipeline"));
        let pp = if pipelined {
            let axis = crate::compile::pipeline_axis(programs);
            let i = dmesh
                .axes
                .iter()
                .position(|a| a.name == axis)
                .ok_or_else(|| format!("mesh '@{}' has no pipeline axis '{axis}'", mesh.name))?;
            if programs.len() != dsizes[i] as usize {
                return Err(format!(
                    "{} programs for the {} ranks of '{axis}'",
                    programs.len(),
                    dsizes[i]
                ));
            }
            Some(i)
        } else {
            if let Some(mb) = mesh.microbatch_axis() {
                return Err(format!(
                    "@{name} is cut into {} micro-batches (mesh axis '{}'), which only a pipeline schedule runs; add a --schedule-* pass before --lower-relayouts",
                    mb.size, mb.name
                ));
            }
            None
        };
        let mbi = mesh.axes.iter().position(|a| a.microbatches);
        let views = programs
            .iter()
            .map(|p| global_view(p, &dmesh).map_err(|e| format!("@{}: {e}", p.name)))
            .collect::<Result<Vec<_>, _>>()?;
        let mut ranks = Vec::with_capacity(world);
        for r in 0..world {
            let c = coords(&dsizes, r);
            let pi = pp.map_or(0, |i| c[i]);
            let (p, view) = (&programs[pi], &views[pi]);
            let mut full = c.clone();
            if let Some(m) = mbi {
                full.insert(m, 0);
            }
            let mut args = Vec::new();
            for (i, (a, va)) in p.args.iter().zip(&view.args).enumerate() {
                let ty = &view.values[va.value];
                let l = layout_of(&a.attrs, &dmesh, ty.rank())
                    .map_err(|e| format!("@{} argument {i}: {e}", p.name))?;
                if l.partial.iter().any(Option::is_some) {
                    return Err(format!(
                        "@{} argument {i} has a partial layout; inputs must be whole",
                        p.name
                    ));
                }
                let index = match a.attrs.get("nns.arg") {
                    Some(AttrValue::Int(k)) => *k as usize,
                    _ => i,
                };
                args.push(ArgPiece {
                    name: a
                        .name()
                        .map(str::to_string)
                        .unwrap_or_else(|| format!("arg{index}")),
                    whole: ty.shape.clone(),
                    elem: ty.elem,
                    ranges: l.shard(&ty.shape, &dsizes, r).ranges,
                    layout: layout_text(&l, &dmesh),
                });
            }
            let results = p
                .outputs
                .iter()
                .enumerate()
                .map(|(j, o)| result_name(o, j))
                .collect();
            ranks.push(Rank {
                program: p,
                coords: full,
                stage: pp.map(|_| pi),
                args,
                results,
            });
        }
        // The step's results, in the original function's order, from their pieces.
        let mut by_index: BTreeMap<usize, ResultPieces> = BTreeMap::new();
        for (pi, (p, view)) in programs.iter().zip(&views).enumerate() {
            for (j, (o, vo)) in p.outputs.iter().zip(&view.outputs).enumerate() {
                let k = match (pp, o.attrs.get("nns.result")) {
                    (None, _) => j,
                    (Some(_), Some(AttrValue::Int(k))) => *k as usize,
                    (Some(_), _) => {
                        return Err(format!("@{} result {j} has no 'nns.result'", p.name))
                    }
                };
                let ty = &view.values[vo.value];
                let l = layout_of(&o.attrs, &dmesh, ty.rank())
                    .map_err(|e| format!("@{} result {j}: {e}", p.name))?;
                if l.partial.iter().any(Option::is_some) {
                    return Err(format!(
                        "@{} result {j} is partial; its layout must not contain V",
                        p.name
                    ));
                }
                let mut pieces: Vec<(usize, Vec<Range<usize>>)> = Vec::new();
                for r in 0..world {
                    if pp.is_some_and(|i| coords(&dsizes, r)[i] != pi) {
                        continue;
                    }
                    let ranges = l.shard(&ty.shape, &dsizes, r).ranges;
                    if !pieces.iter().any(|(_, q)| *q == ranges) {
                        pieces.push((r, ranges));
                    }
                }
                by_index.insert(
                    k,
                    ResultPieces {
                        name: result_name(o, k),
                        whole: ty.shape.clone(),
                        elem: ty.elem,
                        pieces,
                    },
                );
            }
        }
        let mut groups = Vec::new();
        let mut seen = BTreeSet::new();
        for p in programs {
            for g in std::iter::once(p).chain(p.callees.values()) {
                for n in &g.nodes {
                    if let Some(AttrValue::Strs(axes)) = n.attrs.get("axes") {
                        if n.op.starts_with("nns.") && n.op != "nns.microbatch" {
                            for a in axes {
                                if dmesh.axis(a).is_none() {
                                    return Err(format!(
                                        "{}: '{}' runs over axis '{a}', which is not a device axis of mesh '@{}'",
                                        n.loc, n.op, mesh.name
                                    ));
                                }
                            }
                            let key = axes.join(",");
                            if seen.insert(key.clone()) {
                                groups.push(key);
                            }
                        }
                    }
                }
            }
        }
        Ok(Plan {
            source,
            name: name.to_string(),
            mesh: mesh.clone(),
            dmesh,
            pp,
            ranks,
            results: by_index.into_values().collect(),
            groups,
        })
    }

    /// Global rank of the pipeline rank `peer` with rank `r`'s other coordinates.
    fn peer(&self, r: usize, peer: usize) -> Result<usize, String> {
        let i = self
            .pp
            .ok_or("a send or receive outside a pipeline (the programs of a --schedule-* pass)")?;
        let ds = sizes(&self.dmesh);
        if peer >= ds[i] as usize {
            return Err(format!("peer {peer} of {} pipeline ranks", ds[i]));
        }
        let mut c = coords(&ds, r);
        c[i] = peer;
        Ok(nnscaler_dialects::sharding::device(&ds, &c))
    }

    /// The messages each peer sends rank `r`, in the order it sends them: (tag, shape,
    /// dtype).
    fn receives(&self, r: usize) -> Result<BTreeMap<usize, Vec<(String, TensorType)>>, String> {
        let mut out: BTreeMap<usize, Vec<(String, TensorType)>> = BTreeMap::new();
        if self.pp.is_none() {
            return Ok(out);
        }
        for (s, rank) in self.ranks.iter().enumerate() {
            let g = rank.program;
            for n in &g.nodes {
                if n.op != "nns.send" {
                    continue;
                }
                let peer = match n.attrs.get("peer") {
                    Some(AttrValue::Int(p)) if *p >= 0 => *p as usize,
                    _ => return Err(format!("{}: 'nns.send' requires 'peer'", n.loc)),
                };
                if self.peer(s, peer)? != r {
                    continue;
                }
                let tag = match n.attrs.get("tag") {
                    Some(AttrValue::Str(t)) => t.clone(),
                    _ => return Err(format!("{}: 'nns.send' requires 'tag'", n.loc)),
                };
                out.entry(s)
                    .or_default()
                    .push((tag, g.values[n.inputs[0]].clone()));
            }
        }
        Ok(out)
    }

    /// `rankR.py`.
    fn rank_file(&self, r: usize) -> Result<String, String> {
        let rank = &self.ranks[r];
        let g = rank.program;
        let mut s = String::new();
        let place: Vec<String> = self
            .mesh
            .axes
            .iter()
            .zip(&rank.coords)
            .filter(|(a, _)| !a.microbatches)
            .map(|(a, c)| format!("{} = {c}", a.name))
            .collect();
        let axes: Vec<String> = self
            .mesh
            .axes
            .iter()
            .map(|a| {
                if a.microbatches {
                    format!("{} = {} (micro-batches)", a.name, a.size)
                } else {
                    format!("{} = {}", a.name, a.size)
                }
            })
            .collect();
        let _ = writeln!(
            s,
            "# Rank {r} of {}: @{} of {}, written by `nnscaler emit-torch`.",
            self.ranks.len(),
            self.name,
            self.source
        );
        if axes.is_empty() {
            let _ = writeln!(s, "# One device: the program is not partitioned.");
        } else {
            let _ = writeln!(
                s,
                "# Mesh @{}: {}; this rank: {}.",
                self.mesh.name,
                axes.join(", "),
                place.join(", ")
            );
        }
        if let Some(stage) = rank.stage {
            let sched = match g.func_attrs.get("nns.schedule") {
                Some(AttrValue::Str(t)) => t.clone(),
                _ => "(no schedule recorded)".into(),
            };
            let _ = writeln!(s, "# Pipeline rank {stage}, schedule {sched}");
        }
        let _ = writeln!(
            s,
            "# Plan (each argument: this rank's piece, the whole, the layout):"
        );
        for a in &rank.args {
            let local: Vec<usize> = a.ranges.iter().map(Range::len).collect();
            let _ = writeln!(
                s,
                "#   {:<28} {:?} of {:?}: {}",
                a.name, local, a.whole, a.layout
            );
        }
        s.push_str(
            "\nimport torch\nimport torch.nn.functional as F\n\nfrom nns_runtime import ops\n\n",
        );
        // The argument pieces train.py cuts, and the messages this rank receives.
        s.push_str(
            "# (name, whole shape, dtype, this rank's [start, end) of each dim)\nARGS = [\n",
        );
        for a in &rank.args {
            let ranges: Vec<String> = a
                .ranges
                .iter()
                .map(|x| format!("({}, {})", x.start, x.end))
                .collect();
            let _ = writeln!(
                s,
                "    ({:?}, {:?}, {:?}, [{}]),",
                a.name,
                a.whole,
                elem_name(a.elem),
                ranges.join(", ")
            );
        }
        s.push_str("]\n");
        let quoted: Vec<String> = rank.results.iter().map(|r| format!("{r:?}")).collect();
        s.push_str(&ops::wrap_call("RESULTS = [", &quoted, "]", ""));
        s.push('\n');
        s.push_str("# Per sending rank, its messages to this one in the order it sends them.\nRECEIVES = {");
        let recv = self.receives(r)?;
        if recv.is_empty() {
            s.push_str("}\n");
        } else {
            s.push('\n');
            for (src, msgs) in &recv {
                let _ = writeln!(s, "    {src}: [");
                for (tag, ty) in msgs {
                    let _ = writeln!(
                        s,
                        "        ({tag:?}, {:?}, {:?}),",
                        ty.shape,
                        elem_name(ty.elem)
                    );
                }
                s.push_str("    ],\n");
            }
            s.push_str("}\n");
        }
        // The callees first (fragments of a pipeline, user ops with bodies), then the step.
        let mut callees = Vec::new();
        ops::callees_of(g, &mut callees)?;
        let ctx = ops::RankCtx {
            plan: self,
            rank: r,
            fragment: true,
        };
        for c in &callees {
            s.push('\n');
            s.push_str(&ops::function(&ctx, c, &ops::py_ident(&c.name), None)?);
        }
        let ctx = ops::RankCtx {
            fragment: false,
            ..ctx
        };
        s.push('\n');
        let names: Vec<String> = rank.args.iter().map(|a| a.name.clone()).collect();
        s.push_str(&ops::function(&ctx, g, "step", Some(&names))?);
        Ok(s)
    }

    /// `train.py`: the plan every rank shares, and the driver.
    fn train_file(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "# One step of @{} of {} on {} ranks, written by `nnscaler emit-torch`:",
            self.name,
            self.source,
            self.ranks.len()
        );
        let _ = writeln!(
            s,
            "#   torchrun --nproc-per-node {} train.py --inputs BATCH.safetensors --params PARAMS.safetensors -o RESULTS.safetensors",
            self.ranks.len()
        );
        s.push_str("# Each process runs rankR.py for its RANK; rank 0 writes the whole results.\n");
        s.push_str("import nns_runtime\n\nPLAN = {\n");
        let _ = writeln!(s, "    \"world\": {},", self.ranks.len());
        let mesh: Vec<String> = self
            .dmesh
            .axes
            .iter()
            .map(|a| format!("({:?}, {})", a.name, a.size))
            .collect();
        let _ = writeln!(s, "    # The device mesh (ranks are row-major over it).");
        let _ = writeln!(s, "    \"mesh\": [{}],", mesh.join(", "));
        let _ = writeln!(
            s,
            "    # The mesh axes each collective runs over (a process group per set)."
        );
        let _ = writeln!(s, "    \"groups\": [{}],", py_strs(&self.groups));
        s.push_str("    # Each result: name, whole shape, dtype, and (rank, its piece) per distinct piece.\n");
        s.push_str("    \"results\": [\n");
        for res in &self.results {
            let pieces: Vec<String> = res
                .pieces
                .iter()
                .map(|(r, ranges)| {
                    let rs: Vec<String> = ranges
                        .iter()
                        .map(|x| format!("({}, {})", x.start, x.end))
                        .collect();
                    format!("({r}, [{}])", rs.join(", "))
                })
                .collect();
            let _ = writeln!(
                s,
                "        ({:?}, {:?}, {:?}, [{}]),",
                res.name,
                res.whole,
                elem_name(res.elem),
                pieces.join(", ")
            );
        }
        s.push_str("    ],\n}\n\nif __name__ == \"__main__\":\n    nns_runtime.main(PLAN)\n");
        s
    }
}

/// A result's name as `nnscaler run` writes it.
fn result_name(o: &nnscaler_dialects::graph::Output, j: usize) -> String {
    o.name()
        .map(str::to_string)
        .unwrap_or_else(|| format!("out{j}"))
}

/// The runtime's dtype name of `e`.
fn elem_name(e: Elem) -> &'static str {
    match e {
        Elem::F32 => "f32",
        Elem::F16 => "f16",
        Elem::BF16 => "bf16",
        Elem::F64 => "f64",
        Elem::I64 => "i64",
        Elem::I32 => "i32",
        Elem::I1 => "i1",
    }
}

fn py_strs(v: &[String]) -> String {
    v.iter()
        .map(|x| format!("{x:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}
