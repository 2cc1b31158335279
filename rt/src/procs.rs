//! Training as one of several processes (torchrun, srun, mpirun: one per GPU on a
//! cluster; on a CPU, processes on loopback): the host backend's [`Engine`] where each
//! process runs its share of the mesh's devices.
//!
//! The mesh's devices are dealt out in order: with `D` devices and `W` processes, rank
//! `r` runs devices `r*D/W ..< (r+1)*D/W`, each on a thread of its own. A device keeps its
//! pieces of the training state between steps (what its program reads of each
//! parameter and moment; the step's `next.*` results replace them, the same pieces), so a
//! step moves only what the step's collectives and messages move. Those go over the
//! network ([`crate::net`]) as keyed messages: a collective's member sends every other
//! member what it needs and reduces what it receives in member order, the lockstep's
//! order and arithmetic, so the results are the same bits as one process's. The loss
//! reaches every process; the whole state (for evaluation and checkpoints) is gathered
//! on rank 0, the lead, which evaluates, logs and writes.

use crate::artifact::{Artifact, Elt};
use crate::host::{cut, place_checked, write_at, HostProgram, HostRank, HostWire};
use crate::net::{Key, Net};
use crate::ranks::{lanes, rank_scratch, run_rank, Flat, Groups, P2p};
use crate::tensor::{Data, Tensor};
use crate::train::{scalar, Engine, Forward, StateSpec};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;

/// Message kinds (a [`Key`]'s first number).
const P2P: u64 = 1;
const COLLECTIVE: u64 = 2;
const ROUND: u64 = 3;
const REFRESH: u64 = 4;

/// The network as a host rank's communicator: devices on other processes reached by
/// message.
struct NetWire<'a> {
    net: &'a Net,
    /// Per device, the rank of the process running it.
    owner: &'a [usize],
    groups: &'a [Vec<usize>],
    /// Per (device, group): the collectives it has joined (a collective's messages carry
    /// its number).
    seq: &'a Mutex<HashMap<(usize, usize), u64>>,
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect()
}

fn le(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `acc = acc + x` (or the maximum), element by element: the lockstep's reduction.
fn reduce(acc: &mut [f32], x: &[f32], max: bool) {
    for (a, b) in acc.iter_mut().zip(x) {
        *a = if max { a.max(*b) } else { *a + *b };
    }
}

/// # Safety
/// `at` must be valid for `n` bytes.
unsafe fn read(at: usize, n: u64) -> Vec<u8> {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(at as *const u8, n as usize) }.to_vec()
}

/// # Safety
/// `at` must be valid for `b.len()` bytes that nothing else uses meanwhile.
unsafe fn write(at: usize, b: &[u8]) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy(b.as_ptr(), at as *mut u8, b.len()) };
}

impl HostWire for NetWire<'_> {
    fn members(&self, group: usize) -> usize {
        self.groups[group].len()
    }

    unsafe fn collective(
        &self,
        device: usize,
        group: usize,
        member: usize,
        op: Flat<usize>,
    ) -> Result<(), String> {
        let seq = {
            let mut s = self.seq.lock().unwrap_or_else(|e| e.into_inner());
            let c = s.entry((device, group)).or_default();
            *c += 1;
            *c - 1
        };
        let g = &self.groups[group];
        let kind = op.kind();
        let key = |from: usize, to: usize| -> Key {
            [
                COLLECTIVE,
                group as u64,
                seq,
                ((from as u64) << 32) | to as u64,
            ]
        };
        let send_to = |k: usize, b: &[u8]| self.net.send(self.owner[g[k]], key(member, k), b);
        let take_from = |k: usize| {
            self.net.take(self.owner[g[k]], key(k, member), &|| {
                format!("{kind} {seq} of devices {g:?}: device {}'s part", g[k])
            })
        };
        let others = (0..g.len()).filter(|&k| k != member);
        // SAFETY (every read and write below): the addresses are valid for the
        // collective's sizes and this member's alone until it returns (the caller's
        // contract).
        match op {
            Flat::AllReduce { send, recv, n, max } => {
                let mine = unsafe { read(send, n * 4) };
                for k in others {
                    send_to(k, &mine)?;
                }
                let mut acc = if member == 0 {
                    f32s(&mine)
                } else {
                    f32s(&take_from(0)?)
                };
                for k in 1..g.len() {
                    let x = if k == member {
                        f32s(&mine)
                    } else {
                        f32s(&take_from(k)?)
                    };
                    reduce(&mut acc, &x, max);
                }
                unsafe { write(recv, &le(&acc)) };
            }
            Flat::ReduceScatter { send, recv, n, max } => {
                let w = (n * 4) as usize;
                let mine = unsafe { read(send, n * 4 * g.len() as u64) };
                for k in others {
                    send_to(k, &mine[k * w..(k + 1) * w])?;
                }
                let own = f32s(&mine[member * w..(member + 1) * w]);
                let mut acc = if member == 0 {
                    own.clone()
                } else {
                    f32s(&take_from(0)?)
                };
                for k in 1..g.len() {
                    let x = if k == member {
                        own.clone()
                    } else {
                        f32s(&take_from(k)?)
                    };
                    reduce(&mut acc, &x, max);
                }
                unsafe { write(recv, &le(&acc)) };
            }
            Flat::AllGather { send, recv, bytes } => {
                let mine = unsafe { read(send, bytes) };
                for k in others {
                    send_to(k, &mine)?;
                }
                let mut all = Vec::with_capacity(bytes as usize * g.len());
                for k in 0..g.len() {
                    if k == member {
                        all.extend_from_slice(&mine);
                    } else {
                        all.extend_from_slice(&take_from(k)?);
                    }
                }
                unsafe { write(recv, &all) };
            }
            Flat::Broadcast {
                send,
                recv,
                bytes,
                root,
            } => {
                if member == root {
                    let mine = unsafe { read(send, bytes) };
                    for k in others {
                        send_to(k, &mine)?;
                    }
                    if recv != send {
                        unsafe { write(recv, &mine) };
                    }
                } else {
                    let b = take_from(root)?;
                    unsafe { write(recv, &b) };
                }
            }
            Flat::Exchange {
                sends,
                recvs,
                bytes,
            } => {
                let mine: Vec<Vec<u8>> = sends.iter().map(|&a| unsafe { read(a, bytes) }).collect();
                for k in others {
                    send_to(k, &mine[k])?;
                }
                for (j, &at) in recvs.iter().enumerate() {
                    let b = if j == member {
                        mine[j].clone()
                    } else {
                        take_from(j)?
                    };
                    unsafe { write(at, &b) };
                }
            }
        }
        Ok(())
    }

    unsafe fn send(&self, device: usize, op: &P2p<usize>) -> Result<(), String> {
        let mut b = (op.tag.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(op.tag.as_bytes());
        // SAFETY: the caller's contract.
        b.extend_from_slice(&unsafe { read(op.at, op.bytes) });
        self.net.send(
            self.owner[op.peer],
            [P2P, device as u64, op.peer as u64, op.lane as u64],
            &b,
        )
    }

    unsafe fn recv(&self, device: usize, op: &P2p<usize>) -> Result<(), String> {
        let b = self.net.take(
            self.owner[op.peer],
            [P2P, op.peer as u64, device as u64, op.lane as u64],
            &|| format!("'{}' from device {}", op.tag, op.peer),
        )?;
        let n = b
            .get(..8)
            .map(|h| u64::from_le_bytes(h.try_into().expect("8 bytes")) as usize)
            .ok_or("a message without its header")?;
        let tag = String::from_utf8_lossy(b.get(8..8 + n).ok_or("a short message")?);
        let data = &b[8 + n..];
        if tag != op.tag || data.len() as u64 != op.bytes {
            return Err(format!(
                "device {device} receives '{}' ({} bytes) from device {} on lane {}, which sent '{tag}' ({} bytes) there",
                op.tag,
                op.bytes,
                op.peer,
                op.lane,
                data.len()
            ));
        }
        // SAFETY: the caller's contract.
        unsafe { write(op.at, data) };
        Ok(())
    }
}

/// A device this process runs: its program, its position among the program's devices,
/// and its pieces of the training state.
#[derive(Debug)]
struct Local {
    device: usize,
    p: usize,
    k: usize,
    pieces: BTreeMap<String, Vec<u8>>,
}

/// Where a process's devices run: on the host (each on a thread of its own, their
/// collectives and messages through the network), or each on a GPU of its own through
/// NCCL (feature `cuda`).
enum Exec {
    Host(Box<HostProgram>),
    #[cfg(feature = "cuda")]
    Cuda(Vec<Mutex<crate::nccl::ProcGpu>>),
}

impl std::fmt::Debug for Procs<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Procs")
            .field("world", &self.net.world)
            .field("locals", &self.locals.len())
            .finish_non_exhaustive()
    }
}

/// The engine of one process among several (see the module's docs).
pub struct Procs<'a> {
    net: Net,
    art: Artifact,
    /// Where this process's devices run.
    exec: Exec,
    /// The evaluation forward (on the lead).
    eval: Option<Box<dyn Forward + 'a>>,
    owner: Vec<usize>,
    lanes: Vec<Vec<usize>>,
    groups: Groups,
    scratch: usize,
    locals: Vec<Local>,
    specs: Vec<StateSpec>,
    /// The state pieces devices read but do not compute (a pipeline's tied weights),
    /// and who computes them.
    refresh: Vec<Refresh>,
    seq: Mutex<HashMap<(usize, usize), u64>>,
    /// Exchanges between the processes so far (their messages carry the number).
    round: u64,
}

/// A device that reads a piece of state `name` without computing its new value, and the
/// device whose `next.NAME` piece (`from_ranges`) holds it.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Refresh {
    /// The state's input port.
    port: usize,
    /// The reader and the ranges it reads.
    to: usize,
    to_ranges: Vec<[u64; 2]>,
    /// The computing device and the ranges of its `next.NAME` piece.
    from: usize,
    from_ranges: Vec<[u64; 2]>,
}

/// Every [`Refresh`] of `art`: for each device reading a state tensor it does not
/// compute, the first device computing a piece of its new value that covers it.
fn refresh_plan(art: &Artifact) -> Result<Vec<Refresh>, String> {
    let h = &art.header;
    let mut out = Vec::new();
    for prog in &h.programs {
        for (k, &d) in prog.devices.iter().enumerate() {
            for i in &prog.inputs {
                let name = &h.inputs[i.port].name;
                let next = format!("next.{name}");
                let computes = prog.outputs.iter().any(|o| h.outputs[o.port].name == next);
                let Some(out_port) = h.outputs.iter().position(|o| o.name == next) else {
                    continue;
                };
                if computes {
                    continue;
                }
                let want = &i.shards[k];
                let source = h.programs.iter().find_map(|q| {
                    let o = q.outputs.iter().find(|o| o.port == out_port)?;
                    q.devices.iter().zip(&o.shards).find_map(|(&s, r)| {
                        let covers = r
                            .iter()
                            .zip(want)
                            .all(|(a, b)| a[0] <= b[0] && b[1] <= a[1]);
                        covers.then(|| (s, r.clone()))
                    })
                });
                let (from, from_ranges) = source.ok_or_else(|| {
                    format!("device {d} reads '{name}', and no device computes the piece of next.{name} it needs")
                })?;
                out.push(Refresh {
                    port: i.port,
                    to: d,
                    to_ranges: want.clone(),
                    from,
                    from_ranges,
                });
            }
        }
    }
    Ok(out)
}

/// The devices process `rank` of `world` runs among `devices`.
pub fn share(devices: usize, rank: usize, world: usize) -> Result<std::ops::Range<usize>, String> {
    if world > devices || !devices.is_multiple_of(world) {
        return Err(format!(
            "{world} processes cannot share the mesh's {devices} devices evenly (give a number of processes that divides {devices})"
        ));
    }
    let per = devices / world;
    Ok(rank * per..(rank + 1) * per)
}

impl<'a> Procs<'a> {
    /// This process's share of `step` (the training step's artifact) over `net` for the
    /// state `specs`, on `backend` (`host`, or `cuda`: the process's device on GPU
    /// `LOCAL_RANK`, one device a process); `eval` evaluates (on the lead).
    pub fn new(
        net: Net,
        step: Artifact,
        backend: &str,
        eval: Option<Box<dyn Forward + 'a>>,
        specs: Vec<StateSpec>,
    ) -> Result<Procs<'a>, String> {
        let devices = step.devices().max(1);
        let (rank, world) = (net.world.rank, net.world.size);
        let mine = share(devices, rank, world)?;
        let per = devices / world;
        let owner: Vec<usize> = (0..devices).map(|d| d / per).collect();
        let h = &step.header;
        let mut locals = Vec::new();
        for d in mine {
            let (p, k) = h
                .programs
                .iter()
                .enumerate()
                .find_map(|(p, prog)| prog.devices.iter().position(|&x| x == d).map(|k| (p, k)))
                .ok_or_else(|| format!("no program runs device {d}"))?;
            // A device's new pieces of the state must be the pieces it reads.
            let prog = &h.programs[p];
            for o in &prog.outputs {
                let Some(x) = h.outputs[o.port].name.strip_prefix("next.") else {
                    continue;
                };
                let read = prog
                    .inputs
                    .iter()
                    .find(|i| h.inputs[i.port].name == x)
                    .map(|i| &i.shards[k]);
                if read != Some(&o.shards[k]) {
                    return Err(format!(
                        "device {d} computes a piece of next.{x} other than the piece of '{x}' it reads; this plan needs one process"
                    ));
                }
            }
            locals.push(Local {
                device: d,
                p,
                k,
                pieces: BTreeMap::new(),
            });
        }
        let refresh = refresh_plan(&step)?;
        let lanes = lanes(&step)?;
        let groups = Groups::of(&step);
        let scratch = rank_scratch(&step, &groups)?.div_ceil(8) as usize;
        let exec = match backend {
            "host" => Exec::Host(Box::new(HostProgram::load(step.clone())?)),
            #[cfg(feature = "cuda")]
            "cuda" => {
                if per != 1 {
                    return Err(format!(
                        "on GPUs every process runs one device: start {devices} processes for the mesh's {devices} devices (given {world})"
                    ));
                }
                let gpu = net.world.local_rank;
                let l = &locals[0];
                Exec::Cuda(vec![Mutex::new(crate::nccl::ProcGpu::new(
                    &step,
                    (l.p, l.device, gpu),
                    (&groups, &lanes),
                    &net,
                    &owner,
                )?)])
            }
            other => {
                return Err(format!(
                "processes on the '{other}' backend: host or cuda (a build with --features cuda)"
            ))
            }
        };
        Ok(Procs {
            art: step,
            exec,
            eval,
            net,
            owner,
            lanes,
            groups,
            scratch,
            locals,
            specs,
            refresh,
            seq: Mutex::new(HashMap::new()),
            round: 0,
        })
    }

    /// Every process sends `mine` to every process in `to` and takes theirs: by rank
    /// (`None` for those it does not take from).
    fn exchange(&mut self, mine: &[u8], to: &[usize]) -> Result<Vec<Option<Vec<u8>>>, String> {
        let round = self.round;
        self.round += 1;
        let (rank, world) = (self.net.world.rank, self.net.world.size);
        for &r in to {
            self.net.send(r, [ROUND, round, rank as u64, 0], mine)?;
        }
        let mut out = vec![None; world];
        if to.contains(&rank) {
            for (r, slot) in out.iter_mut().enumerate() {
                *slot = Some(self.net.take(r, [ROUND, round, r as u64, 0], &|| {
                    format!("exchange {round} (the loss or the state)")
                })?);
            }
        }
        Ok(out)
    }

    /// Waits until every process arrived here, then lets connections close.
    pub fn finish(mut self) -> Result<(), String> {
        let all: Vec<usize> = (0..self.net.world.size).collect();
        self.exchange(&[], &all)?;
        self.net.close();
        Ok(())
    }

    /// This process stops with error `e`: its peers learn why ([`Net::abort`]).
    pub fn abort(&self, e: &str) {
        self.net.abort(e);
    }

    fn lead(&self) -> bool {
        self.net.world.rank == 0
    }
}

/// A piece of a state tensor being sent: its name, its ranges and its bytes.
type PieceRef<'a> = (&'a str, &'a [[u64; 2]], &'a [u8]);

/// What a device's step leaves: its new state pieces by name, and the loss if it has it.
type Stepped = (BTreeMap<String, Vec<u8>>, Option<f32>);

/// Pieces as bytes: per piece its name, its ranges and its bytes.
fn pack(pieces: &[PieceRef<'_>]) -> Vec<u8> {
    let mut b = Vec::new();
    let u = |b: &mut Vec<u8>, x: u64| b.extend_from_slice(&x.to_le_bytes());
    u(&mut b, pieces.len() as u64);
    for (name, ranges, data) in pieces {
        u(&mut b, name.len() as u64);
        b.extend_from_slice(name.as_bytes());
        u(&mut b, ranges.len() as u64);
        for [lo, hi] in ranges.iter() {
            u(&mut b, *lo);
            u(&mut b, *hi);
        }
        u(&mut b, data.len() as u64);
        b.extend_from_slice(data);
    }
    b
}

type Piece = (String, Vec<[u64; 2]>, Vec<u8>);

/// Reads what [`pack`] wrote.
fn unpack(b: &[u8]) -> Result<Vec<Piece>, String> {
    struct Cursor<'a>(&'a [u8], usize);
    impl<'a> Cursor<'a> {
        fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
            let s = self
                .0
                .get(self.1..self.1 + n)
                .ok_or("a short message of state pieces")?;
            self.1 += n;
            Ok(s)
        }
        fn u(&mut self) -> Result<u64, String> {
            Ok(u64::from_le_bytes(
                self.take(8)?.try_into().expect("8 bytes"),
            ))
        }
    }
    let mut c = Cursor(b, 0);
    let n = c.u()?;
    let mut out = Vec::new();
    for _ in 0..n {
        let len = c.u()? as usize;
        let name = String::from_utf8_lossy(c.take(len)?).into_owned();
        let dims = c.u()? as usize;
        let mut ranges = Vec::with_capacity(dims.min(64));
        for _ in 0..dims {
            ranges.push([c.u()?, c.u()?]);
        }
        let len = c.u()? as usize;
        out.push((name, ranges, c.take(len)?.to_vec()));
    }
    Ok(out)
}

/// One device's work in a step: the bytes written into its arena before it runs (at
/// their offsets), and the spans of the results read back after.
type Work<'a> = (Vec<(u64, Cow<'a, [u8]>)>, Vec<(u64, u64)>);

impl<'a> Procs<'a> {
    /// Each device's writes (the constants and its pieces of the arguments, at their
    /// offsets in its arena) and the results it reads back; `whole` holds the step's
    /// whole inputs by name.
    fn device_work<'w>(
        &'w self,
        whole: &'w HashMap<&str, Vec<u8>>,
    ) -> Result<Vec<Work<'w>>, String> {
        let (art, h) = (&self.art, &self.art.header);
        let consts = art.section("consts").unwrap_or_default();
        let mut work = Vec::with_capacity(self.locals.len());
        for l in &self.locals {
            let prog = &h.programs[l.p];
            // (Borrowed where the bytes are already at hand: the constants and the kept
            // pieces; only the batch's pieces are cut.)
            let mut writes: Vec<(u64, Cow<'_, [u8]>)> = Vec::new();
            for c in &prog.constants {
                let b = &prog.buffers[c.buffer];
                writes.push((b.offset, Cow::Borrowed(c.bytes(consts, b, l.k)?)));
            }
            for bd in &prog.inputs {
                let port = &h.inputs[bd.port];
                let b = &prog.buffers[bd.buffer];
                let piece = match (l.pieces.get(&port.name), whole.get(port.name.as_str())) {
                    (Some(p), _) => Cow::Borrowed(p.as_slice()),
                    (None, Some(w)) => Cow::Owned(cut(
                        w,
                        &port.global_shape,
                        &bd.shards[l.k],
                        b.elt.size() as usize,
                    )),
                    (None, None) => {
                        return Err(format!("no value for the step's argument '{}'", port.name))
                    }
                };
                writes.push((b.offset, piece));
            }
            let reads: Vec<(u64, u64)> = prog
                .outputs
                .iter()
                .map(|bd| {
                    let b = &prog.buffers[bd.buffer];
                    (b.offset, b.bytes())
                })
                .collect();
            work.push((writes, reads));
        }
        Ok(work)
    }
}

impl Engine for Procs<'_> {
    fn set_state(&mut self, state: BTreeMap<String, Tensor>) -> Result<(), String> {
        let h = &self.art.header;
        for l in &mut self.locals {
            l.pieces.clear();
            for b in &h.programs[l.p].inputs {
                let port = &h.inputs[b.port];
                if let Some(t) = state.get(&port.name) {
                    let es = port.elt.size() as usize;
                    l.pieces.insert(
                        port.name.clone(),
                        cut(&t.bytes(), &port.global_shape, &b.shards[l.k], es),
                    );
                }
            }
        }
        Ok(())
    }

    fn step(
        &mut self,
        tokens: &Tensor,
        targets: &Tensor,
        step: u64,
        lr: f32,
    ) -> Result<f64, String> {
        if let Some(e) = self.eval.as_mut() {
            e.invalidate();
        }
        let art = &self.art;
        let h = &art.header;
        let whole: HashMap<&str, Vec<u8>> = [
            ("tokens", tokens.bytes()),
            ("targets", targets.bytes()),
            ("step", scalar(step as f32).bytes()),
            ("lr", scalar(lr).bytes()),
        ]
        .into_iter()
        .collect();
        for p in &h.inputs {
            match p.name.as_str() {
                "tokens" => p.check(tokens)?,
                "targets" => p.check(targets)?,
                _ => {}
            }
        }
        let work = self.device_work(&whole)?;
        let wire = NetWire {
            net: &self.net,
            owner: &self.owner,
            groups: &self.groups.list,
            seq: &self.seq,
        };
        let (lanes, groups, scratch) = (&self.lanes, &self.groups, self.scratch);
        // What the devices' threads take of where they run (a loaded host library is
        // not shared between threads, its kernels' entry points are).
        let host = match &self.exec {
            Exec::Host(prog) => Some(prog.fns()),
            #[cfg(feature = "cuda")]
            Exec::Cuda(_) => None,
        };
        #[cfg(feature = "cuda")]
        let gpus = match &self.exec {
            Exec::Cuda(g) => Some(g),
            Exec::Host(_) => None,
        };
        let read: Vec<Result<Vec<Vec<u8>>, String>> = std::thread::scope(|sc| {
            let handles: Vec<_> = self
                .locals
                .iter()
                .zip(&work)
                .enumerate()
                .map(|(i, (l, (writes, reads)))| {
                    let wire = &wire;
                    sc.spawn(move || -> Result<Vec<Vec<u8>>, String> {
                        let r = match host {
                            Some(fns) => host_device(
                                (art, fns),
                                wire,
                                l,
                                (lanes, groups, scratch),
                                writes,
                                reads,
                            ),
                            #[cfg(feature = "cuda")]
                            None => gpus
                                .and_then(|g| g.get(i))
                                .ok_or("no GPU for a device")?
                                .lock()
                                .unwrap_or_else(|e| e.into_inner())
                                .run(art, &lanes[l.p], groups, writes, reads),
                            #[cfg(not(feature = "cuda"))]
                            None => Err(format!("no backend for device {i}")),
                        };
                        if let Err(e) = &r {
                            wire.net.fail(&format!("device {}: {e}", l.device));
                        }
                        r
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("a device's thread panicked".into()))
                })
                .collect()
        });
        let mut results: Vec<Result<Stepped, String>> = Vec::with_capacity(read.len());
        for (l, r) in self.locals.iter().zip(read) {
            results.push(r.map(|bytes| {
                let prog = &h.programs[l.p];
                let mut next = BTreeMap::new();
                let mut loss = None;
                for (bd, b) in prog.outputs.iter().zip(bytes) {
                    let name = &h.outputs[bd.port].name;
                    if name == "loss" && prog.buffers[bd.buffer].elt == Elt::F32 {
                        loss = f32s(&b).first().copied();
                    } else if let Some(x) = name.strip_prefix("next.") {
                        next.insert(x.to_string(), b);
                    }
                }
                (next, loss)
            }));
        }
        let mut loss = None;
        for (l, r) in self.locals.iter_mut().zip(results) {
            let (next, lo) = r?;
            for (x, b) in next {
                l.pieces.insert(x, b);
            }
            loss = loss.or(lo);
        }
        // State read where it is not computed: from the device that computes it.
        let rank = self.net.world.rank;
        for (n, f) in self.refresh.iter().enumerate() {
            let key = [REFRESH, n as u64, f.from as u64, f.to as u64];
            if self.owner[f.from] == rank {
                let name = &h.inputs[f.port].name;
                let piece = self
                    .locals
                    .iter()
                    .find(|l| l.device == f.from)
                    .and_then(|l| l.pieces.get(name))
                    .ok_or_else(|| format!("device {} has no new '{name}'", f.from))?;
                self.net.send(self.owner[f.to], key, piece)?;
            }
        }
        for (n, f) in self.refresh.iter().enumerate() {
            if self.owner[f.to] != rank {
                continue;
            }
            let port = &h.inputs[f.port];
            let key = [REFRESH, n as u64, f.from as u64, f.to as u64];
            let got = self.net.take(self.owner[f.from], key, &|| {
                format!("the new '{}' from device {}", port.name, f.from)
            })?;
            // The reader's ranges within the source's piece.
            let shape: Vec<u64> = f.from_ranges.iter().map(|[a, b]| b - a).collect();
            let within: Vec<[u64; 2]> = f
                .to_ranges
                .iter()
                .zip(&f.from_ranges)
                .map(|(t, s)| [t[0] - s[0], t[1] - s[0]])
                .collect();
            let piece = cut(&got, &shape, &within, port.elt.size() as usize);
            if let Some(l) = self.locals.iter_mut().find(|l| l.device == f.to) {
                l.pieces.insert(port.name.clone(), piece);
            }
        }
        // The loss to every process (from the lowest rank that computes it).
        let mine = match loss {
            Some(x) => [vec![1u8], x.to_le_bytes().to_vec()].concat(),
            None => vec![0u8],
        };
        let all: Vec<usize> = (0..self.net.world.size).collect();
        let got = self.exchange(&mine, &all)?;
        got.iter()
            .flatten()
            .find(|b| b.first() == Some(&1) && b.len() == 5)
            .map(|b| f64::from(f32::from_le_bytes(b[1..5].try_into().expect("4 bytes"))))
            .ok_or_else(|| "no process computes the loss".to_string())
    }

    fn agree(&mut self, stop: bool) -> Result<bool, String> {
        let all: Vec<usize> = (0..self.net.world.size).collect();
        let got = self.exchange(&[u8::from(stop)], &all)?;
        Ok(got[0].as_deref() == Some(&[1u8][..]))
    }

    fn state(&mut self) -> Result<Option<BTreeMap<String, Tensor>>, String> {
        let h = &self.art.header;
        let mut mine: Vec<PieceRef<'_>> = Vec::new();
        for l in &self.locals {
            for b in &h.programs[l.p].inputs {
                let name = h.inputs[b.port].name.as_str();
                if let Some(p) = l.pieces.get(name) {
                    mine.push((name, &b.shards[l.k], p));
                }
            }
        }
        let packed = pack(&mine);
        let got = self.exchange(&packed, &[0])?;
        if !self.lead() {
            return Ok(None);
        }
        let mut whole: BTreeMap<String, (Vec<u8>, Vec<u32>)> = self
            .specs
            .iter()
            .map(|s| {
                let n: u64 = s.shape.iter().product();
                (
                    s.name.clone(),
                    (vec![0u8; n as usize * 4], vec![u32::MAX; n as usize]),
                )
            })
            .collect();
        for (r, b) in got.iter().enumerate() {
            let b = b.as_ref().ok_or("a process's state is missing")?;
            for (name, ranges, data) in unpack(b)? {
                let spec = self.specs.iter().find(|s| s.name == name).ok_or_else(|| {
                    format!("rank {r} sent a piece of '{name}', which is not state")
                })?;
                let (w, owner) = whole.get_mut(&name).expect("every spec has its tensor");
                if let Some((i, first)) = place_checked(w, &spec.shape, &ranges, &data, 4, owner, r)
                {
                    return Err(format!(
                        "replicas of '{name}' disagree: element {i} on ranks {first} and {r}"
                    ));
                }
            }
        }
        let mut out = BTreeMap::new();
        for s in &self.specs {
            let (w, owner) = whole.remove(&s.name).expect("every spec has its tensor");
            if let Some(i) = owner.iter().position(|&o| o == u32::MAX) {
                return Err(format!("no device holds element {i} of '{}'", s.name));
            }
            out.insert(
                s.name.clone(),
                Tensor {
                    shape: crate::tensor::shape(&s.shape),
                    data: Data::F32(f32s(&w)),
                },
            );
        }
        Ok(Some(out))
    }

    fn forward(
        &mut self,
        state: &BTreeMap<String, Tensor>,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<f64, String> {
        self.eval
            .as_mut()
            .ok_or("only the lead process evaluates")?
            .forward(state, tokens, targets)
    }
}

/// A device's step on the host: its arena made from `writes`, its steps run on this
/// thread (collectives and messages through `wire`), and the bytes at `reads` returned.
fn host_device(
    (art, fns): (&Artifact, &[crate::host::HostKernel]),
    wire: &NetWire<'_>,
    l: &Local,
    (lanes, groups, scratch): (&[Vec<usize>], &Groups, usize),
    writes: &[(u64, Cow<'_, [u8]>)],
    reads: &[(u64, u64)],
) -> Result<Vec<Vec<u8>>, String> {
    let words = art.header.programs[l.p].arena_bytes.div_ceil(8) as usize;
    let mut arena = vec![0u64; words];
    for (off, b) in writes {
        write_at(&mut arena, *off, b);
    }
    let mut rank = HostRank {
        art,
        fns,
        comm: wire,
        p: l.p,
        device: l.device,
        arena: (
            crate::host::bytes_mut(&mut arena).as_mut_ptr() as usize,
            arena.len() as u64 * 8,
        ),
        scratch: vec![0u64; scratch.max(1)],
    };
    run_rank(art, &lanes[l.p], l.p, l.device, groups, &mut rank)?;
    let bytes = crate::host::bytes(&arena);
    Ok(reads
        .iter()
        .map(|&(off, n)| bytes[off as usize..(off + n) as usize].to_vec())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_pack_and_unpack() {
        let r = [[0u64, 2], [1, 3]];
        let b = pack(&[("w", &r, &[1, 2, 3]), ("b", &[], &[])]);
        let u = unpack(&b).unwrap();
        assert_eq!(u[0], ("w".into(), r.to_vec(), vec![1, 2, 3]));
        assert_eq!(u[1], ("b".into(), vec![], vec![]));
        assert!(unpack(&b[..b.len() - 2]).is_err());
    }

    /// Three processes (threads with their own connections on loopback), one device
    /// each, run every kind of collective through the network: the results are the
    /// lockstep's (sums and maxima in member order, pieces in member order), bit for bit.
    #[test]
    fn collectives_over_the_network_are_the_lockstep_ones() {
        use crate::net::{Rendezvous, World};
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let n = 6usize;
        // Member k's input: distinct, non-associative-friendly values.
        let input = |k: usize| -> Vec<f32> {
            (0..3 * n)
                .map(|i| 0.1 + (k * 31 + i) as f32 * 0.37)
                .collect()
        };
        let groups = vec![vec![0usize, 1, 2]];
        let owner = vec![0usize, 1, 2];
        let results: Vec<Vec<Vec<f32>>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    let (groups, owner) = (&groups, &owner);
                    sc.spawn(move || {
                        let w = World {
                            rank,
                            size: 3,
                            local_rank: 0,
                            master: format!("127.0.0.1:{port}"),
                            launcher: "test",
                        };
                        let net = Net::connect(
                            w,
                            &Rendezvous::Tcp,
                            1,
                            std::time::Duration::from_secs(20),
                        )
                        .unwrap();
                        let seq = Mutex::new(HashMap::new());
                        let wire = NetWire {
                            net: &net,
                            owner,
                            groups,
                            seq: &seq,
                        };
                        let mine = input(rank);
                        let addr = |v: &Vec<f32>| v.as_ptr() as usize;
                        let mut outs = Vec::new();
                        let run = |op: Flat<usize>| {
                            // SAFETY: the addresses are this thread's vectors, sized
                            // for the collective, untouched until it returns.
                            unsafe { wire.collective(rank, 0, rank, op) }.unwrap();
                        };
                        for max in [false, true] {
                            let out = vec![0f32; n];
                            run(Flat::AllReduce {
                                send: addr(&mine),
                                recv: addr(&out),
                                n: n as u64,
                                max,
                            });
                            outs.push(out);
                        }
                        let out = vec![0f32; n];
                        run(Flat::ReduceScatter {
                            send: addr(&mine),
                            recv: addr(&out),
                            n: n as u64,
                            max: false,
                        });
                        outs.push(out);
                        let out = vec![0f32; 3 * n];
                        run(Flat::AllGather {
                            send: addr(&mine),
                            recv: addr(&out),
                            bytes: 4 * n as u64,
                        });
                        outs.push(out);
                        let out = vec![0f32; n];
                        run(Flat::Broadcast {
                            send: addr(&mine),
                            recv: addr(&out),
                            bytes: 4 * n as u64,
                            root: 1,
                        });
                        outs.push(out);
                        let out = vec![0f32; 3 * n];
                        run(Flat::Exchange {
                            sends: (0..3).map(|k| addr(&mine) + 4 * k * n).collect(),
                            recvs: (0..3).map(|k| addr(&out) + 4 * k * n).collect(),
                            bytes: 4 * n as u64,
                        });
                        outs.push(out);
                        // Every process has what it needs before any closes.
                        net.close();
                        outs
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let x: Vec<Vec<f32>> = (0..3).map(input).collect();
        for (r, outs) in results.iter().enumerate() {
            let sum: Vec<f32> = (0..n).map(|i| (x[0][i] + x[1][i]) + x[2][i]).collect();
            let max: Vec<f32> = (0..n).map(|i| x[0][i].max(x[1][i]).max(x[2][i])).collect();
            assert_eq!(outs[0], sum, "all_reduce on {r}");
            assert_eq!(outs[1], max, "all_reduce max on {r}");
            let piece: Vec<f32> = (0..n)
                .map(|i| (x[0][r * n + i] + x[1][r * n + i]) + x[2][r * n + i])
                .collect();
            assert_eq!(outs[2], piece, "reduce_scatter on {r}");
            let gathered: Vec<f32> = (0..3).flat_map(|k| x[k][..n].to_vec()).collect();
            assert_eq!(outs[3], gathered, "all_gather on {r}");
            assert_eq!(outs[4], x[1][..n].to_vec(), "broadcast on {r}");
            let exchanged: Vec<f32> = (0..3)
                .flat_map(|k| x[k][r * n..(r + 1) * n].to_vec())
                .collect();
            assert_eq!(outs[5], exchanged, "all_to_all on {r}");
        }
    }

    #[test]
    fn devices_are_dealt_out_evenly() {
        assert_eq!(share(4, 1, 2).unwrap(), 2..4);
        assert_eq!(share(4, 3, 4).unwrap(), 3..4);
        let e = share(4, 0, 3).unwrap_err();
        assert!(
            e.contains("3 processes cannot share the mesh's 4 devices"),
            "{e}"
        );
    }
}
