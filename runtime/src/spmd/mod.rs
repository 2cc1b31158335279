//! Simulated devices: runs a localized (SPMD) function on every device of its mesh, one
//! thread each, with in-process collectives.
//!
//! Whole input tensors are cut into each device's piece by the arguments' `nns.layout`;
//! results are assembled from the devices' pieces by the results' `nns.layout` (replicated
//! copies must agree exactly, which catches plans that compute different values on
//! devices meant to be replicas). A collective exchanges whole local tensors among its
//! group (the devices that share every coordinate off the collective's axes): each member
//! deposits a copy of its piece, which the others read where it is; each member then
//! computes the result itself in member order (a reduce_scatter only its own piece), so
//! reductions are deterministic and identical on every member.
//!
//! **Serial timing** ([`Options::serial_devices`]): the devices take turns, one computing
//! at a time (a baton passed at collectives, receives and the end of a device's
//! program), and each is timed by its own thread's CPU time on a virtual clock. A device
//! leaves a collective at the latest of its members' arrival times and a receive no
//! earlier than the send; [`device_seconds`] is then the latest device's clock: the step
//! time of the devices with a core each and nothing else running, whatever the machine
//! is doing meanwhile. Communication costs what the devices' threads do for it (copies
//! and reductions); waiting costs nothing but the wait for a partner. Results are the
//! same bits either way.

use crate::interp::{run_on, Options, Profile, RunError};
use crate::tensor::{numel, Data, Tensor};
use nnscaler_dialects::diag::SrcLoc;
use nnscaler_dialects::graph::{Graph, Node};
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::sharding::{self, coords, Sharding};
use nnscaler_dialects::types::AttrValue;
use nnscaler_rt::{Collective, Param, ParamKind};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::sync::Arc;

mod exchange;
pub use exchange::Exchange;
use exchange::SlotKey;

/// Where a device sits in a pipeline: the devices' mesh (without the micro-batch axis),
/// its coordinates there and the pipeline axis.
#[derive(Debug, Clone)]
pub struct PipelinePlace {
    /// Sizes of the device mesh's axes.
    pub sizes: Vec<i64>,
    /// This device's coordinates in it.
    pub coords: Vec<usize>,
    /// The pipeline axis (an index into `sizes`).
    pub axis: usize,
}

/// One simulated device: its mesh coordinates and the run's exchange.
#[derive(Debug)]
pub struct Device<'a> {
    /// The mesh.
    pub mesh: &'a Mesh,
    /// This device's coordinates (row-major numbering).
    pub coords: Vec<usize>,
    /// Shared with the other devices.
    pub exchange: &'a Exchange,
    /// Its number (row-major over the devices).
    pub id: usize,
    /// In a pipelined run, where it sits.
    pub pipeline: Option<PipelinePlace>,
    /// How many collectives it has run per (axes, group): the n-th meets the group's n-th.
    pub seq: std::cell::RefCell<HashMap<(Vec<usize>, usize), usize>>,
    /// While a pipeline fragment of micro-batch `i` runs: `i`, this device's coordinate on
    /// the micro-batch axis (what dropout's mask offsets by).
    pub microbatch: std::cell::Cell<Option<usize>>,
    /// Under serial timing: its time on the virtual clock when it last took its turn...
    pub clock: std::cell::Cell<f64>,
    /// ... and its thread's CPU time then.
    pub since: std::cell::Cell<f64>,
}

/// This thread's CPU time in seconds (what serial timing counts).
pub fn thread_cpu_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to write; the clock id is a constant
    // Linux supports for every thread.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

impl Device<'_> {
    /// Its time on the serial clock now (0 without serial timing).
    pub fn serial_now(&self) -> f64 {
        if self.exchange.serial {
            self.clock.get() + (thread_cpu_seconds() - self.since.get())
        } else {
            0.0
        }
    }

    /// Under serial timing: its turn starts (again) at `at` on the virtual clock, or at
    /// its own time if that is later.
    fn resume(&self, at: f64) {
        if self.exchange.serial {
            self.clock.set(self.clock.get().max(at));
            self.since.set(thread_cpu_seconds());
        }
    }

    /// Under serial timing: stops its clock (before it waits or ends).
    fn pause(&self) {
        if self.exchange.serial {
            self.clock.set(self.serial_now());
            self.since.set(thread_cpu_seconds());
        }
    }

    /// Its coordinates, the micro-batch axis at the running fragment's micro-batch.
    pub fn current_coords(&self) -> Vec<usize> {
        let mut c = self.coords.clone();
        if let (Some(i), Some(a)) = (
            self.microbatch.get(),
            self.mesh.axes.iter().position(|a| a.microbatches),
        ) {
            c[a] = i;
        }
        c
    }
}

impl Device<'_> {
    fn axes(&self, n: &Node) -> Result<Vec<usize>, String> {
        let names = match n.attrs.get("axes") {
            Some(AttrValue::Strs(v)) => v.clone(),
            _ => return Err("requires 'axes'".into()),
        };
        names
            .iter()
            .map(|a| {
                self.mesh
                    .axes
                    .iter()
                    .position(|x| &x.name == a)
                    .ok_or_else(|| format!("mesh '@{}' has no axis '{a}'", self.mesh.name))
            })
            .collect()
    }

    /// Where this device meets the others of a collective over `axes`.
    fn group(&self, axes: &[usize]) -> sharding::Meeting {
        let sizes: Vec<i64> = self.mesh.axes.iter().map(|a| a.size).collect();
        sharding::meeting(&sizes, &self.coords, axes)
    }

    /// The device at pipeline rank `rank` with this device's other coordinates.
    fn peer(&self, n: &Node) -> Result<usize, String> {
        let p = self
            .pipeline
            .as_ref()
            .ok_or("needs a pipelined run (the programs of a --schedule-* pass)")?;
        let rank = match n.attrs.get("peer") {
            Some(AttrValue::Int(r)) if *r >= 0 && *r < p.sizes[p.axis] => *r as usize,
            _ => return Err("requires 'peer', a pipeline rank".into()),
        };
        let mut c = p.coords.clone();
        c[p.axis] = rank;
        Ok(sharding::device(&p.sizes, &c))
    }

    fn tag(n: &Node) -> Result<&str, String> {
        match n.attrs.get("tag") {
            Some(AttrValue::Str(t)) => Ok(t),
            _ => Err("requires 'tag'".into()),
        }
    }

    /// `nns.send`: leaves this device's piece for its peer.
    pub fn send(&self, n: &Node, x: &Tensor) -> Result<(), String> {
        let to = self.peer(n)?;
        let piece = x.clone();
        self.exchange
            .send(self.id, to, Self::tag(n)?, piece, self.serial_now())
    }

    /// `nns.recv`: waits for the peer's piece.
    pub fn recv(&self, n: &Node) -> Result<Tensor, String> {
        let from = self.peer(n)?;
        self.pause();
        let (t, sent) = self.exchange.recv(from, self.id, Self::tag(n)?)?;
        self.resume(sent);
        Ok(t)
    }

    /// Every member's piece of the collective `k`, this device member `me` of `size`
    /// (shared, in member order).
    fn all(
        &self,
        k: SlotKey,
        me: usize,
        size: usize,
        x: &Tensor,
    ) -> Result<Vec<Arc<Tensor>>, String> {
        let piece = Arc::new(x.clone());
        self.pause();
        let (parts, latest) = self
            .exchange
            .all(k, (me, size, self.id), piece, self.clock.get())?;
        self.resume(latest);
        Ok(parts)
    }

    /// Executes collective node `n` on this device's piece `x`.
    pub fn collective(&self, n: &Node, x: &Tensor) -> Result<Tensor, String> {
        let int = |key: &str| match n.attrs.get(key) {
            Some(AttrValue::Int(v)) => Ok(*v as usize),
            _ => Err(format!("requires integer attribute '{key}'")),
        };
        if n.op == "nns.microbatch" {
            // A step in time, not a group of devices: the piece is given, not looked up.
            let axes = self.axes(n)?;
            let parts: usize = axes
                .iter()
                .map(|&a| self.mesh.axes[a].size as usize)
                .product();
            let i = int("index")?;
            if i >= parts {
                return Err(format!("micro-batch {i} of {parts}"));
            }
            return x.piece(int("dim")?, parts, i);
        }
        let axes = self.axes(n)?;
        let sharding::Meeting {
            group: gid,
            member: me,
            size,
        } = self.group(&axes);
        let k = {
            let mut seq = self.seq.borrow_mut();
            let c = seq.entry((axes.clone(), gid)).or_insert(0);
            *c += 1;
            (axes.clone(), gid, *c)
        };
        if n.op == "nns.partition" {
            let k = 1.0 / size as f32;
            return Ok(Tensor::f32(
                &x.shape,
                x.f()?.iter().map(|v| v * k).collect(),
            ));
        }
        let op = collective_of(n)
            .ok_or_else(|| format!("the simulated devices cannot run '{}' yet", n.op))??;
        let parts = if op.communicates() {
            self.all(k, me, size, x)?
        } else {
            Vec::new()
        };
        // Member `me`'s result from the members' pieces (only its own where it does not
        // communicate), as the collective is defined.
        macro_rules! run {
            ($get:ident, $mk:ident) => {{
                let views = if op.communicates() {
                    parts
                        .iter()
                        .map(|p| p.$get())
                        .collect::<Result<Vec<_>, _>>()?
                } else {
                    vec![x.$get()?; size]
                };
                let (shape, v) = op.reference(&views, &x.shape, me)?;
                Ok(Tensor::$mk(&shape, v))
            }};
        }
        if x.is_float() {
            run!(f, f32)
        } else {
            run!(ints, i64)
        }
    }
}

/// The runtime's collective of `nns` op `n` (`None` for an op that is not one): its
/// dims and members read from the op's integer attributes, its maximum from
/// `reduce = "max"`. The one reading of a collective op, for the simulated devices,
/// codegen's steps and emit-torch's calls; the verifier has checked the attributes.
pub fn collective_of(n: &Node) -> Option<Result<Collective, String>> {
    let name = n.op.strip_prefix("nns.")?;
    Collective::parse(name, |key, kind| {
        Ok(match kind {
            ParamKind::Max => {
                Param::Flag(matches!(n.attrs.get("reduce"), Some(AttrValue::Str(r)) if r == "max"))
            }
            ParamKind::Dim | ParamKind::Member => Param::Index(match n.attrs.get(key) {
                Some(AttrValue::Int(d)) if *d >= 0 => *d as usize,
                _ => return Err(format!("requires '{key}', an integer >= 0")),
            }),
        })
    })
}

/// The piece of `t` given by per-dim ranges.
fn cut(t: &Tensor, ranges: &[Range<usize>]) -> Tensor {
    let mut cur = t.clone();
    for (d, r) in ranges.iter().enumerate() {
        if r.len() != cur.shape[d] {
            cur = cur.narrow(d, r.clone());
        }
    }
    cur
}

/// The layout an argument or result carries (`nns.layout`; replicated when it has none),
/// for a tensor of rank `rank` on `mesh`.
pub fn layout_of(
    attrs: &nnscaler_dialects::types::Attrs,
    mesh: &Mesh,
    rank: usize,
) -> Result<Sharding, String> {
    match attrs.get("nns.layout") {
        None => Ok(Sharding::replicated(rank, mesh.axes.len())),
        Some(v) => Sharding::from_attr(v, mesh, rank),
    }
}

/// `g` with its arguments' and results' types made whole again (local shape times the
/// split factors of each one's layout): the view that tensor files and parameter init bind
/// against, and that the memory estimate counts. Lengths saturate instead of overflowing
/// (the estimate then refuses the run).
pub fn global_view(g: &Graph, mesh: &Mesh) -> Result<Graph, String> {
    let sizes: Vec<i64> = mesh.axes.iter().map(|a| a.size).collect();
    let mut v = g.clone();
    let mut done = vec![false; g.values.len()];
    let ends = g
        .args
        .iter()
        .enumerate()
        .map(|(i, a)| (format!("argument {i}"), a.value, &a.attrs))
        .chain(
            g.outputs
                .iter()
                .enumerate()
                .map(|(i, o)| (format!("result {i}"), o.value, &o.attrs)),
        );
    for (what, value, attrs) in ends {
        if std::mem::replace(&mut done[value], true) {
            continue;
        }
        let ty = &g.values[value];
        let l = layout_of(attrs, mesh, ty.rank()).map_err(|e| format!("{what}: {e}"))?;
        let t = &mut v.values[value];
        for (d, axes) in l.split.iter().enumerate() {
            let parts = axes.iter().fold(1i64, |n, &x| n.saturating_mul(sizes[x]));
            t.shape[d] = t.shape[d].saturating_mul(parts);
        }
    }
    Ok(v)
}

/// Runs localized `g` on every device of `mesh`: `inputs` are whole tensors, one per
/// argument; the results come back whole.
pub fn run_spmd(
    g: &Graph,
    mesh: &Mesh,
    inputs: Vec<Tensor>,
    opts: &Options,
) -> Result<Vec<Tensor>, RunError> {
    let fail = |m: String| RunError {
        loc: g.loc.clone(),
        message: m,
    };
    let sizes: Vec<i64> = mesh.axes.iter().map(|a| a.size).collect();
    let devices = mesh.devices() as usize;
    if inputs.len() != g.args.len() {
        return Err(fail(format!(
            "@{} takes {} arguments, got {}",
            g.name,
            g.args.len(),
            inputs.len()
        )));
    }
    let mut arg_layouts = Vec::new();
    for (i, (a, t)) in g.args.iter().zip(&inputs).enumerate() {
        let l = layout_of(&a.attrs, mesh, t.shape.len())
            .map_err(|e| fail(format!("argument {i}: {e}")))?;
        if l.partial.iter().any(Option::is_some) {
            return Err(fail(format!(
                "argument {i} has a partial layout; inputs must be whole"
            )));
        }
        let shape: Vec<i64> = t.shape.iter().map(|&d| d as i64).collect();
        l.check(&shape, &sizes)
            .map_err(|e| fail(format!("argument {i}: {e}")))?;
        arg_layouts.push(l);
    }
    let per_device = run_devices(
        devices,
        |d| {
            let local: Vec<Tensor> = inputs
                .iter()
                .zip(&arg_layouts)
                .map(|(t, l)| {
                    let shape: Vec<i64> = t.shape.iter().map(|&x| x as i64).collect();
                    cut(t, &l.shard(&shape, &sizes, d).ranges)
                })
                .collect();
            (g, local, coords(&sizes, d), None)
        },
        mesh,
        opts,
    )?;
    // Assemble each result from the pieces.
    (0..g.outputs.len())
        .map(|j| {
            assemble(
                g,
                j,
                mesh,
                per_device.iter().enumerate().map(|(d, o)| (d, &o[j])),
            )
        })
        .collect::<Result<Vec<_>, _>>()
        .map_err(fail)
}

/// Result `j` of `g` made whole from `pieces` (a device's number and its piece), each
/// placed by the result's layout on `mesh`; where pieces overlap (replicas) they must agree
/// bit for bit.
fn assemble<'t>(
    g: &Graph,
    j: usize,
    mesh: &Mesh,
    pieces: impl Iterator<Item = (usize, &'t Tensor)>,
) -> Result<Tensor, String> {
    let o = &g.outputs[j];
    let name = o.name().map(|n| format!(" '{n}'")).unwrap_or_default();
    let sizes: Vec<i64> = mesh.axes.iter().map(|a| a.size).collect();
    let local_ty = &g.values[o.value];
    let l = layout_of(&o.attrs, mesh, local_ty.rank()).map_err(|e| format!("result {j}: {e}"))?;
    if l.partial.iter().any(Option::is_some) {
        return Err(format!(
            "result {j} is partial; its layout must not contain V"
        ));
    }
    let global: Vec<i64> = local_ty
        .shape
        .iter()
        .zip(&l.split)
        .map(|(&n, axes)| n * axes.iter().map(|&a| sizes[a]).product::<i64>())
        .collect();
    let gshape: Vec<usize> = global.iter().map(|&d| d as usize).collect();
    let mut whole: Option<Tensor> = None;
    let mut written = vec![false; numel(&gshape)];
    for (d, piece) in pieces {
        let ranges = l.shard(&global, &sizes, d).ranges;
        let w = whole.get_or_insert_with(|| {
            if piece.is_float() {
                Tensor::zeros(&gshape)
            } else {
                Tensor::i64(&gshape, vec![0; numel(&gshape)])
            }
        });
        place(w, piece, &ranges, &mut written)
            .map_err(|e| format!("result {j}{name}: device {d}: {e}"))?;
    }
    Ok(whole.unwrap_or_else(|| Tensor::zeros(&gshape)))
}

/// What one device runs: its function, its pieces of the arguments, its coordinates in the
/// mesh and, in a pipelined run, its place in the pipeline.
type DeviceJob<'g> = (&'g Graph, Vec<Tensor>, Vec<usize>, Option<PipelinePlace>);

thread_local! {
    static DEVICE_SECONDS: std::cell::Cell<f64> = const { std::cell::Cell::new(0.0) };
    static DEVICE_PROFILES: std::cell::RefCell<Vec<Profile>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// Each simulated device's op times in this thread's last [`run_spmd`] or
/// [`run_pipeline`] with [`Options::profile_devices`] (empty without).
pub fn device_profiles() -> Vec<Profile> {
    DEVICE_PROFILES.with(|p| p.borrow().clone())
}

/// Seconds the simulated devices of this thread's last [`run_spmd`] or [`run_pipeline`]
/// ran, from the first device's start to the last one's end: the step without the
/// harness's cutting of global inputs into pieces and assembling of results. Under serial
/// timing ([`Options::serial_devices`]), the latest device's virtual clock.
pub fn device_seconds() -> f64 {
    DEVICE_SECONDS.with(|c| c.get())
}

/// Runs `devices` simulated devices, one thread each, device `d` running `job(d)`, and
/// returns each device's results (or the first real error: a device that stopped because
/// another failed is not the cause).
fn run_devices<'g>(
    devices: usize,
    job: impl Fn(usize) -> DeviceJob<'g>,
    mesh: &Mesh,
    opts: &Options,
) -> Result<Vec<Vec<Tensor>>, RunError> {
    let exchange = Exchange::with_devices(devices, opts.serial_devices);
    // Each device's pieces are cut before the clock starts.
    let jobs: Vec<DeviceJob<'g>> = (0..devices).map(job).collect();
    let started = std::time::Instant::now();
    let results: Vec<(Result<Vec<Tensor>, RunError>, Profile, f64)> = std::thread::scope(|s| {
        let handles: Vec<_> = jobs
            .into_iter()
            .enumerate()
            .map(|(d, (g, local, c, pipeline))| {
                let exchange = &exchange;
                s.spawn(move || {
                    let dev = Device {
                        mesh,
                        coords: c,
                        exchange,
                        id: d,
                        pipeline,
                        seq: Default::default(),
                        microbatch: Default::default(),
                        clock: Default::default(),
                        since: Default::default(),
                    };
                    let mut profile = Profile::default();
                    let timed = opts.profile_devices.then_some(&mut profile);
                    // A panicking kernel must not leave the other devices waiting forever
                    // at a collective: catch it and wake them.
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        exchange.start_turn(d).map_err(|message| RunError {
                            loc: g.loc.clone(),
                            message,
                        })?;
                        dev.resume(0.0);
                        let r = run_on(g, local, opts, timed, Some(&dev));
                        dev.pause();
                        r
                    }))
                    .unwrap_or_else(|_| {
                        Err(RunError {
                            loc: SrcLoc::default(),
                            message: "the device's thread panicked (a kernel bug)".into(),
                        })
                    });
                    if r.is_err() {
                        exchange.fail();
                    }
                    exchange.finished(d);
                    (r, profile, dev.clock.get())
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    (
                        Err(RunError {
                            loc: SrcLoc::default(),
                            message: "a device thread panicked".into(),
                        }),
                        Profile::default(),
                        0.0,
                    )
                })
            })
            .collect()
    });
    let wall = started.elapsed().as_secs_f64();
    let latest = results.iter().map(|r| r.2).fold(0.0, f64::max);
    DEVICE_SECONDS.with(|c| c.set(if opts.serial_devices { latest } else { wall }));
    let (results, profiles): (Vec<_>, Vec<_>) = results.into_iter().map(|(r, p, _)| (r, p)).unzip();
    DEVICE_PROFILES.with(|p| {
        *p.borrow_mut() = if opts.profile_devices {
            profiles
        } else {
            Vec::new()
        }
    });
    // The error reported: the first device's (in device order) that failed on its own,
    // else the first device's (told to stop because another failed).
    let mut per_device = Vec::with_capacity(devices);
    let mut first_err: Option<(bool, RunError)> = None;
    for (d, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => per_device.push(v),
            Err(e) => {
                let own = !exchange.stopped(d);
                if first_err
                    .as_ref()
                    .is_none_or(|(had_own, _)| own && !had_own)
                {
                    let message = format!("device {d}: {}", e.message);
                    first_err = Some((
                        own,
                        RunError {
                            loc: e.loc,
                            message,
                        },
                    ));
                }
            }
        }
    }
    match first_err {
        Some((_, e)) => Err(e),
        None => match exchange.unreceived() {
            Some(message) => Err(RunError {
                loc: SrcLoc::default(),
                message,
            }),
            None => Ok(per_device),
        },
    }
}

/// The programs of pipeline `name` among `all` (a module's functions, as graphs), by
/// rank, each linked to `all` (the fragments it calls): the localized functions with
/// `nns.pipeline = "name"` and `nns.pipeline_rank`. An unlocalized program or one without
/// its rank is an error naming it.
pub fn pipeline_programs(all: &[Graph], name: &str) -> Result<Vec<Graph>, String> {
    let mut programs: Vec<(i64, Graph)> = Vec::new();
    for g in all {
        if g.func_attrs.get("nns.pipeline") != Some(&AttrValue::Str(name.into())) {
            continue;
        }
        if !g.is_localized() {
            return Err(format!(
                "@{} is not localized; run --lower-relayouts --localize after the --schedule-* pass",
                g.name
            ));
        }
        let r = match g.func_attrs.get("nns.pipeline_rank") {
            Some(AttrValue::Int(r)) => *r,
            _ => return Err(format!("@{} has no 'nns.pipeline_rank'", g.name)),
        };
        let mut p = g.clone();
        p.link(all);
        programs.push((r, p));
    }
    programs.sort_by_key(|(r, _)| *r);
    Ok(programs.into_iter().map(|(_, g)| g).collect())
}

/// Runs a pipelined step: `programs[r]` (localized, made by a `--schedule-*` pass) on the
/// devices at pipeline rank `r` of `mesh`'s pipeline axis `axis`. `inputs` are whole
/// tensors by the original function's argument index (each program's `nns.arg`); the
/// results come back whole by the original result index (`nns.result`).
pub fn run_pipeline(
    programs: &[Graph],
    mesh: &Mesh,
    axis: &str,
    inputs: &BTreeMap<usize, Tensor>,
    opts: &Options,
) -> Result<BTreeMap<usize, Tensor>, RunError> {
    let loc = programs.first().map(|g| g.loc.clone()).unwrap_or_default();
    let fail = |m: String| RunError {
        loc: loc.clone(),
        message: m,
    };
    let dmesh = mesh.device_mesh();
    let dsizes: Vec<i64> = dmesh.axes.iter().map(|a| a.size).collect();
    let devices = dmesh.devices() as usize;
    let ppi = dmesh
        .axes
        .iter()
        .position(|a| a.name == axis)
        .ok_or_else(|| {
            fail(format!(
                "mesh '@{}' has no pipeline axis '{axis}'",
                mesh.name
            ))
        })?;
    if programs.len() != dsizes[ppi] as usize {
        return Err(fail(format!(
            "{} programs for the {} ranks of '{axis}'",
            programs.len(),
            dsizes[ppi]
        )));
    }
    let mbi = mesh.axes.iter().position(|a| a.microbatches);
    let index = |attrs: &nnscaler_dialects::types::Attrs, key: &str| match attrs.get(key) {
        Some(AttrValue::Int(i)) => Ok(*i as usize),
        _ => Err(format!(
            "a pipelined program's arguments and results carry '{key}'"
        )),
    };
    // Every device's pieces of its program's arguments.
    let mut locals: Vec<Vec<Tensor>> = Vec::with_capacity(devices);
    for d in 0..devices {
        let c = coords(&dsizes, d);
        let g = &programs[c[ppi]];
        let mut local = Vec::with_capacity(g.args.len());
        for (i, a) in g.args.iter().enumerate() {
            let k = index(&a.attrs, "nns.arg").map_err(&fail)?;
            let t = inputs
                .get(&k)
                .ok_or_else(|| fail(format!("@{}: no input for argument {k}", g.name)))?;
            let l = layout_of(&a.attrs, &dmesh, t.shape.len())
                .map_err(|e| fail(format!("@{} argument {i}: {e}", g.name)))?;
            let shape: Vec<i64> = t.shape.iter().map(|&x| x as i64).collect();
            l.check(&shape, &dsizes)
                .map_err(|e| fail(format!("@{} argument {i}: {e}", g.name)))?;
            local.push(cut(t, &l.shard(&shape, &dsizes, d).ranges));
        }
        locals.push(local);
    }
    let locals = std::sync::Mutex::new(locals.into_iter().map(Some).collect::<Vec<_>>());
    let per_device = run_devices(
        devices,
        |d| {
            let c = coords(&dsizes, d);
            let mut full = c.clone();
            if let Some(m) = mbi {
                full.insert(m, 0);
            }
            let local = locals
                .lock()
                .ok()
                .and_then(|mut l| l[d].take())
                .unwrap_or_default();
            let place = PipelinePlace {
                sizes: dsizes.clone(),
                coords: c.clone(),
                axis: ppi,
            };
            (&programs[c[ppi]], local, full, Some(place))
        },
        mesh,
        opts,
    )?;
    // Each result from the pieces of the devices of the rank computing it.
    let mut out = BTreeMap::new();
    for (r, g) in programs.iter().enumerate() {
        for (j, o) in g.outputs.iter().enumerate() {
            let k = index(&o.attrs, "nns.result").map_err(&fail)?;
            let pieces = per_device
                .iter()
                .enumerate()
                .filter(|(d, _)| coords(&dsizes, *d)[ppi] == r)
                .map(|(d, outs)| (d, &outs[j]));
            let whole =
                assemble(g, j, &dmesh, pieces).map_err(|e| fail(format!("@{}: {e}", g.name)))?;
            out.insert(k, whole);
        }
    }
    Ok(out)
}

/// Writes `piece` into the region `ranges` of `whole`; where the region was written
/// before (a replica), the values must be identical.
fn place(
    whole: &mut Tensor,
    piece: &Tensor,
    ranges: &[Range<usize>],
    written: &mut [bool],
) -> Result<(), String> {
    let gs = crate::tensor::strides(&whole.shape);
    let ls = crate::tensor::strides(&piece.shape);
    let n = piece.numel();
    // Row by row along the last dim, which is contiguous in both.
    let row = piece.shape.last().copied().unwrap_or(1);
    if n == 0 || row == 0 {
        return Ok(());
    }
    for start in (0..n).step_by(row) {
        let mut rem = start;
        let mut off = 0;
        for (d, r) in ranges.iter().enumerate() {
            let c = rem / ls[d];
            rem %= ls[d];
            off += (r.start + c) * gs[d];
        }
        let seen = &mut written[off..off + row];
        macro_rules! put {
            ($w:expr, $p:expr, $same:expr) => {{
                let (w, p) = (&mut $w[off..off + row], &$p[start..start + row]);
                if let Some(k) = (0..row).find(|&k| seen[k] && !$same(w[k], p[k])) {
                    return Err(format!("replicas disagree at element {}", off + k));
                }
                w.copy_from_slice(p);
            }};
        }
        match (&mut whole.data, &piece.data) {
            (Data::F32(w), Data::F32(p)) => {
                put!(w, p, |a: f32, b: f32| a.to_bits() == b.to_bits())
            }
            (Data::I64(w), Data::I64(p)) => put!(w, p, |a: i64, b: i64| a == b),
            _ => return Err("element kinds differ between devices".into()),
        }
        seen.fill(true);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Serial timing: at most one device computes at any moment (each holds the turn
    /// between the start, a collective, a receive and its end); a collective's members
    /// leave at the latest arrival on the virtual clock, a receive learns when the message
    /// was sent, and the values exchanged are the same.
    #[test]
    fn serial_devices_take_turns_and_meet_at_the_latest_clock() {
        let x = Exchange::with_devices(3, true);
        let (inside, most) = (AtomicUsize::new(0), AtomicUsize::new(0));
        let compute = || {
            let n = inside.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(n, Ordering::SeqCst);
            std::thread::sleep(std::time::Duration::from_millis(2));
            inside.fetch_sub(1, Ordering::SeqCst);
        };
        std::thread::scope(|s| {
            for d in 0..3 {
                let (x, compute) = (&x, &compute);
                s.spawn(move || {
                    x.start_turn(d).unwrap();
                    compute();
                    let piece = Arc::new(Tensor::f32(&[1], vec![d as f32]));
                    let (parts, latest) = x
                        .all((vec![0], 0, 1), (d, 3, d), piece, 10.0 * d as f64)
                        .unwrap();
                    assert_eq!(latest, 20.0);
                    let got: Vec<f32> = parts.iter().map(|p| p.f().unwrap()[0]).collect();
                    assert_eq!(got, [0.0, 1.0, 2.0]);
                    compute();
                    if d == 0 {
                        x.send(0, 2, "m", Tensor::f32(&[1], vec![7.0]), 25.0)
                            .unwrap();
                    }
                    if d == 2 {
                        let (t, sent) = x.recv(0, 2, "m").unwrap();
                        assert_eq!((t.f().unwrap()[0], sent), (7.0, 25.0));
                        compute();
                    }
                    x.finished(d);
                });
            }
        });
        assert_eq!(most.load(Ordering::SeqCst), 1);
    }

    /// A message nobody receives is an error once every device has ended: a plan that
    /// gives the right results while a send goes unmatched is still wrong.
    #[test]
    fn a_send_without_its_receive_is_reported() {
        let x = Exchange::with_devices(2, false);
        x.send(0, 1, "act", Tensor::scalar(1.0), 0.0).unwrap();
        x.finished(0);
        x.finished(1);
        assert_eq!(
            x.unreceived().as_deref(),
            Some("device 0 sent 'act' to device 1, which never received it")
        );
    }

    /// Serial timing still finds a deadlock: two devices each waiting to receive from
    /// the other, neither holding the turn.
    #[test]
    fn serial_devices_report_a_deadlock() {
        let x = Exchange::with_devices(2, true);
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|d| {
                    let x = &x;
                    s.spawn(move || {
                        x.start_turn(d).unwrap();
                        let e = x.recv(1 - d, d, "never").map(|_| ()).unwrap_err();
                        x.finished(d);
                        e
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want = "deadlock: device 0 waits for 'never' from device 1; \
                    device 1 waits for 'never' from device 0";
        assert_eq!(errs, vec![want.to_string(), want.to_string()]);
    }

    /// A device that fails on its own (a NaN on device 2 only, with finiteness checked)
    /// is the one reported, whatever its index, not the devices stopped at the collective
    /// it never reached.
    #[test]
    fn the_device_that_failed_is_reported() {
        let src = r#""nns.mesh"() {sym_name = "world", axes = #nns.axes<tp = 3>} : () -> ()
func.func @f(%x: tensor<2xf32> {nns.layout = #nns.layout<@world, tp = D(0)>, nns.name = "x"}) -> (tensor<2xf32> {nns.layout = #nns.layout<@world>, nns.name = "y"}) attributes {nns.localized = #nns.axes<tp = 3>} {
  %0 = "dnn.log"(%x) : (tensor<2xf32>) -> tensor<2xf32>
  %1 = "nns.all_reduce"(%0) {axes = ["tp"], reduce = "sum"} : (tensor<2xf32>) -> tensor<2xf32>
  return %1 : tensor<2xf32>
}"#;
        let ir = nnscaler_dialects::context::IrContext::new();
        let m = ir.parse(src, "f.mlir").unwrap();
        let mut d = nnscaler_dialects::diag::Diagnostics::default();
        let mesh = nnscaler_dialects::verify::Meshes::collect(&m.as_operation(), &mut d)
            .0
            .remove(0);
        let g = Graph::all_in(&m).remove(0).unwrap();
        let x = Tensor::f32(&[6], vec![1.0, 2.0, 3.0, 4.0, -1.0, 6.0]);
        let opts = Options {
            check_finite: true,
            ..Options::default()
        };
        let e = run_spmd(&g, &mesh, vec![x], &opts).unwrap_err();
        assert!(e.message.starts_with("device 2: "), "{}", e.message);
        assert!(
            !e.message.contains("another device failed"),
            "{}",
            e.message
        );
    }

    /// Pieces land at their ranges row by row; a replica that agrees bit for bit is
    /// accepted, one that differs names the whole tensor's element; ints too.
    #[test]
    fn pieces_are_placed_and_replicas_checked() {
        let mut whole = Tensor::zeros(&[2, 6]);
        let mut written = vec![false; 12];
        let left = Tensor::f32(&[2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        let right = Tensor::f32(&[2, 3], vec![7.0, 8.0, 9.0, 10.0, 11.0, 12.0]);
        place(&mut whole, &left, &[0..2, 0..3], &mut written).unwrap();
        place(&mut whole, &right, &[0..2, 3..6], &mut written).unwrap();
        assert_eq!(
            whole.f().unwrap(),
            &[1.0, 2.0, 3.0, 7.0, 8.0, 9.0, 4.0, 5.0, 6.0, 10.0, 11.0, 12.0]
        );
        assert!(written.iter().all(|&w| w));
        // The same piece again (a replica) agrees.
        place(&mut whole, &left, &[0..2, 0..3], &mut written).unwrap();
        // A replica differing at its element (1, 1), the whole's (1, 4), flat 10.
        let mut other = right.clone();
        if let Data::F32(v) = &mut other.data {
            v[4] = 11.5;
        }
        let e = place(&mut whole, &other, &[0..2, 3..6], &mut written).unwrap_err();
        assert_eq!(e, "replicas disagree at element 10");
        // A scalar, and integers.
        let mut s = Tensor::zeros(&[]);
        let mut w1 = vec![false; 1];
        place(&mut s, &Tensor::f32(&[], vec![2.5]), &[], &mut w1).unwrap();
        assert_eq!(s.f().unwrap(), &[2.5]);
        let mut ints = Tensor::i64(&[4], vec![0; 4]);
        let mut w4 = vec![false; 4];
        let upper = std::slice::from_ref(&(2..4));
        place(&mut ints, &Tensor::i64(&[2], vec![5, 6]), upper, &mut w4).unwrap();
        let e = place(&mut ints, &Tensor::i64(&[2], vec![5, 7]), upper, &mut w4).unwrap_err();
        assert_eq!(e, "replicas disagree at element 3");
    }
}
