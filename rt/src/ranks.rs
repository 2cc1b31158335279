//! Ranks: every device of an artifact on a thread of its own, as on a cluster, instead of
//! the lockstep of [`crate::host::schedule`] (which runs one program's devices step by
//! step together on one thread).
//!
//! A rank runs its program's steps in order on its own arena. A collective step becomes
//! the rank's share of it ([`rank_plan`]): local strided copies into or out of the rank's
//! scratch space around one *flat* collective ([`Flat`]), the calls NCCL has: an
//! all-reduce, an all-gather or a reduce-scatter of contiguous pieces in member order, a
//! broadcast, or a grouped exchange of pieces (an all-to-all, which NCCL spells as
//! grouped sends and receives). A gather along a dim other than the outermost lands in
//! scratch, member after member, and is copied into its place; a reduce-scatter's pieces
//! are packed member after member into scratch first.
//!
//! Sends do not wait for their receives (the lockstep's semantics, which the compiler's
//! schedules and memory plans assume: a sent buffer's space may be reused right after the
//! send); a receive waits for its message. Messages between two devices are matched in
//! order, as NCCL matches them, on *lanes* ([`lanes`]): a schedule may receive in another
//! order than it sends (an interleaved schedule does), so each lane takes messages that
//! come in the same order on both sides, and lanes are matched independently.
//!
//! Backends implement [`Rank`]. On the host ([`HostComm`]) the communicator is
//! in-process: a group's last member to arrive runs the flat collective for all of them
//! (sums in member order, as the lockstep sums, so the results are the same bits), a send
//! copies its bytes into the receiver's mail, and a receive takes the lane's next
//! message. Ranks that all wait for each other are a deadlock, reported with what each
//! waits for, never a hang. On GPUs (`crate::nccl`, feature `cuda`) the communicator is
//! NCCL, one GPU per device.

use crate::artifact::{Artifact, Buffer, Program, Step};
use crate::collective::{at, piece, At, Move, Place};
use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex};

/// The communicator groups of an artifact: every distinct group of its collective
/// steps (devices in member order), numbered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Groups {
    /// Each group's devices, in member order.
    pub list: Vec<Vec<usize>>,
    index: HashMap<Vec<usize>, usize>,
}

impl Groups {
    /// The groups of `art`'s collectives.
    pub fn of(art: &Artifact) -> Groups {
        let mut g = Groups {
            list: Vec::new(),
            index: HashMap::new(),
        };
        for p in &art.header.programs {
            for s in &p.steps {
                for grp in step_groups(s) {
                    g.add(grp.clone());
                }
            }
        }
        g
    }

    fn add(&mut self, g: Vec<usize>) {
        if !self.index.contains_key(&g) {
            self.index.insert(g.clone(), self.list.len());
            self.list.push(g);
        }
    }

    /// The group (its number) and the member position of `device` among `groups`.
    fn find(&self, groups: &[Vec<usize>], device: usize) -> Result<(usize, usize), String> {
        for g in groups {
            if let Some(m) = g.iter().position(|&d| d == device) {
                let id = self.index.get(g).ok_or("a collective's group is unknown")?;
                return Ok((*id, m));
            }
        }
        Err(format!(
            "device {device} is in none of a collective's groups"
        ))
    }
}

/// The groups a collective step names (none for launches, sends and receives).
fn step_groups(s: &Step) -> &[Vec<usize>] {
    match s {
        Step::AllReduce { groups, .. }
        | Step::AllGather { groups, .. }
        | Step::Slice { groups, .. }
        | Step::ReduceScatter { groups, .. }
        | Step::AllToAll { groups, .. }
        | Step::Broadcast { groups, .. } => groups,
        Step::Launch { .. } | Step::Send { .. } | Step::Recv { .. } => &[],
    }
}

/// A flat collective: NCCL's calls, on contiguous memory, addressed by `A` (a place in
/// the rank's arena or scratch while planned, a pointer or device address when run).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Flat<A> {
    /// `recv` = the members' `send`s (`n` f32s each) summed (or their maximum) in
    /// member order.
    AllReduce {
        /// Read.
        send: A,
        /// Written (may be `send`).
        recv: A,
        /// f32s.
        n: u64,
        /// Maximum instead of sum.
        max: bool,
    },
    /// `recv` = the members' `send`s (`bytes` each) one after another in member order.
    AllGather {
        /// Read.
        send: A,
        /// Written.
        recv: A,
        /// Bytes per member.
        bytes: u64,
    },
    /// Member `k`'s `recv` = piece `k` (`n` f32s) of the members' `send`s reduced.
    ReduceScatter {
        /// Read: one piece per member, in member order.
        send: A,
        /// Written.
        recv: A,
        /// f32s per member.
        n: u64,
        /// Maximum instead of sum.
        max: bool,
    },
    /// `recv` = the `send` of member `root`.
    Broadcast {
        /// Read (on the root).
        send: A,
        /// Written.
        recv: A,
        /// Bytes.
        bytes: u64,
        /// The member whose `send` every member gets.
        root: usize,
    },
    /// Grouped point-to-point within the group: `sends[k]` goes to member `k`, whose
    /// `recvs[me]` receives it (each `bytes` long; a member's own piece included).
    Exchange {
        /// Per member, what this member sends it.
        sends: Vec<A>,
        /// Per member, where what it sends lands.
        recvs: Vec<A>,
        /// Bytes of every piece.
        bytes: u64,
    },
}

impl<A: Copy> Flat<A> {
    /// The same collective at other addresses: `f(address, bytes there)` for a group of
    /// `members`.
    pub fn map<B>(
        &self,
        members: u64,
        f: &mut impl FnMut(A, u64) -> Result<B, String>,
    ) -> Result<Flat<B>, String> {
        Ok(match self {
            Flat::AllReduce { send, recv, n, max } => Flat::AllReduce {
                send: f(*send, n * 4)?,
                recv: f(*recv, n * 4)?,
                n: *n,
                max: *max,
            },
            Flat::AllGather { send, recv, bytes } => Flat::AllGather {
                send: f(*send, *bytes)?,
                recv: f(*recv, bytes * members)?,
                bytes: *bytes,
            },
            Flat::ReduceScatter { send, recv, n, max } => Flat::ReduceScatter {
                send: f(*send, n * 4 * members)?,
                recv: f(*recv, n * 4)?,
                n: *n,
                max: *max,
            },
            Flat::Broadcast {
                send,
                recv,
                bytes,
                root,
            } => Flat::Broadcast {
                send: f(*send, *bytes)?,
                recv: f(*recv, *bytes)?,
                bytes: *bytes,
                root: *root,
            },
            Flat::Exchange {
                sends,
                recvs,
                bytes,
            } => Flat::Exchange {
                sends: sends
                    .iter()
                    .map(|&a| f(a, *bytes))
                    .collect::<Result<_, _>>()?,
                recvs: recvs
                    .iter()
                    .map(|&a| f(a, *bytes))
                    .collect::<Result<_, _>>()?,
                bytes: *bytes,
            },
        })
    }

    /// The collective without its addresses: what every member must agree on.
    fn shape(&self) -> Flat<()> {
        self.map(0, &mut |_, _| Ok(()))
            .expect("an address-free map does not fail")
    }

    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Flat::AllReduce { .. } => "all_reduce",
            Flat::AllGather { .. } => "all_gather",
            Flat::ReduceScatter { .. } => "reduce_scatter",
            Flat::Broadcast { .. } => "broadcast",
            Flat::Exchange { .. } => "all_to_all",
        }
    }
}

/// What a rank does for its share of a collective step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RankOp {
    /// A strided copy within the rank's arena and scratch (places `Device(0)`, its own
    /// arena, and `Scratch`).
    Copy(Move),
    /// A flat collective over group `group` ([`Groups::list`]), this rank being member
    /// `member`.
    Flat {
        /// The group's number.
        group: usize,
        /// This rank's position in it.
        member: usize,
        /// The collective, on places of this rank.
        op: Flat<At>,
    },
}

/// The product of `b`'s dims before `dim`: where it is 1, a piece along `dim` is
/// contiguous (the members' pieces lie one after another, as NCCL's calls want them).
fn outer(b: &Buffer, dim: usize) -> u64 {
    b.shape[..dim].iter().product()
}

/// Device `device`'s share of collective step `s` of `prog`, and the scratch bytes it
/// needs.
pub fn rank_plan(
    prog: &Program,
    s: &Step,
    device: usize,
    groups: &Groups,
) -> Result<(Vec<RankOp>, u64), String> {
    let own = |o: u64| at(Place::Device(0), o);
    let scratch = |o: u64| at(Place::Scratch, o);
    let (group, member) = groups.find(step_groups(s), device)?;
    let n = groups.list[group].len() as u64;
    let flat = |op: Flat<At>| RankOp::Flat { group, member, op };
    let bufs = &prog.buffers;
    let mut ops = Vec::new();
    let mut need = 0;
    match s {
        Step::Launch { .. } | Step::Send { .. } | Step::Recv { .. } => {
            return Err("not a collective".into())
        }
        Step::AllReduce {
            input, output, max, ..
        } => {
            let (ib, ob) = (&bufs[*input], &bufs[*output]);
            ops.push(flat(Flat::AllReduce {
                send: own(ib.offset),
                recv: own(ob.offset),
                n: ib.len(),
                max: *max,
            }));
        }
        Step::AllGather {
            input, output, dim, ..
        } => {
            let (ib, ob) = (&bufs[*input], &bufs[*output]);
            if outer(ob, *dim) == 1 {
                ops.push(flat(Flat::AllGather {
                    send: own(ib.offset),
                    recv: own(ob.offset),
                    bytes: ib.bytes(),
                }));
            } else {
                need = n * ib.bytes();
                ops.push(flat(Flat::AllGather {
                    send: own(ib.offset),
                    recv: scratch(0),
                    bytes: ib.bytes(),
                }));
                for k in 0..n {
                    let p = piece(ob, *dim, k, n);
                    ops.push(RankOp::Copy(
                        p.scatter(scratch(k * ib.bytes()), own(ob.offset)),
                    ));
                }
            }
        }
        Step::ReduceScatter {
            input,
            output,
            dim,
            max,
            ..
        } => {
            let (ib, ob) = (&bufs[*input], &bufs[*output]);
            let send = if outer(ib, *dim) == 1 {
                own(ib.offset)
            } else {
                need = ib.bytes();
                for k in 0..n {
                    let p = piece(ib, *dim, k, n);
                    ops.push(RankOp::Copy(
                        p.gather(own(ib.offset), scratch(k * ob.bytes())),
                    ));
                }
                scratch(0)
            };
            ops.push(flat(Flat::ReduceScatter {
                send,
                recv: own(ob.offset),
                n: ob.len(),
                max: *max,
            }));
        }
        Step::Slice {
            input, output, dim, ..
        } => {
            let (ib, ob) = (&bufs[*input], &bufs[*output]);
            let p = piece(ib, *dim, member as u64, n);
            ops.push(RankOp::Copy(p.gather(own(ib.offset), own(ob.offset))));
        }
        Step::Broadcast {
            input,
            output,
            root,
            ..
        } => {
            let (ib, ob) = (&bufs[*input], &bufs[*output]);
            ops.push(flat(Flat::Broadcast {
                send: own(ib.offset),
                recv: own(ob.offset),
                bytes: ib.bytes(),
                root: *root,
            }));
        }
        Step::AllToAll {
            input,
            output,
            split_dim,
            concat_dim,
            ..
        } => {
            // Pack piece k along the split dim into slot k, exchange slot k with member
            // k (whose piece lands in slot `me` of the second half), unpack slot k into
            // place k along the concatenated dim.
            let (ib, ob) = (&bufs[*input], &bufs[*output]);
            let w = ib.bytes() / n;
            need = 2 * ib.bytes();
            for k in 0..n {
                let p = piece(ib, *split_dim, k, n);
                ops.push(RankOp::Copy(p.gather(own(ib.offset), scratch(k * w))));
            }
            ops.push(flat(Flat::Exchange {
                sends: (0..n).map(|k| scratch(k * w)).collect(),
                recvs: (0..n).map(|k| scratch(ib.bytes() + k * w)).collect(),
                bytes: w,
            }));
            for k in 0..n {
                let p = piece(ob, *concat_dim, k, n);
                ops.push(RankOp::Copy(
                    p.scatter(scratch(ib.bytes() + k * w), own(ob.offset)),
                ));
            }
        }
    }
    Ok((ops, need))
}

/// The scratch bytes a rank of `art` needs: the most any of its collectives' shares needs.
pub fn rank_scratch(art: &Artifact, groups: &Groups) -> Result<u64, String> {
    let mut most = 0;
    for p in &art.header.programs {
        for s in &p.steps {
            if step_groups(s).is_empty() {
                continue;
            }
            for &d in &p.devices {
                most = most.max(rank_plan(p, s, d, groups)?.1);
            }
        }
    }
    Ok(most)
}

/// A send or a receive of a rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct P2p<A> {
    /// The other device.
    pub peer: usize,
    /// What is sent, or where it lands.
    pub at: A,
    /// Bytes.
    pub bytes: u64,
    /// The artifact's tag (for messages and checks; matching is by order within a lane).
    pub tag: String,
    /// Its lane ([`lanes`]): messages from one device to another are matched in order
    /// within each lane.
    pub lane: usize,
}

/// What a backend does for a rank: its launches, its local copies, its collectives, its
/// sends and its receives.
pub trait Rank {
    /// Launches kernel `kernel` on `buffers` of the rank's program.
    fn launch(&mut self, kernel: usize, buffers: &[usize]) -> Result<(), String>;
    /// A strided copy within the rank's arena and scratch.
    fn copy(&mut self, m: &Move) -> Result<(), String>;
    /// A flat collective over group `group` (this rank being member `member`).
    fn collective(&mut self, group: usize, member: usize, op: &Flat<At>) -> Result<(), String>;
    /// Sends a buffer; does not wait for the receive (the bytes are taken at once).
    fn send(&mut self, op: &P2p<At>) -> Result<(), String>;
    /// Receives into a buffer: waits for the lane's next message from the peer.
    fn recv(&mut self, op: &P2p<At>) -> Result<(), String>;
}

/// The lane of every send and receive of every program (0 for other steps).
///
/// Between two programs the k-th send of a tag matches the k-th receive of it (as in the
/// lockstep). NCCL matches by order instead, and a schedule may receive in another order
/// than it sends (an interleaved schedule's activations and gradients cross so), so the
/// messages from one program to another are spread over lanes, each taking messages that
/// are received in the order they are sent, as few lanes as that allows (each message,
/// in the sender's order, joins the lane whose last message is received latest before
/// it). Every lane is matched in order on its own: under NCCL a communicator of its own.
/// A send or receive without its partner is an error naming it.
pub fn lanes(art: &Artifact) -> Result<Vec<Vec<usize>>, String> {
    let progs = &art.header.programs;
    // (from, to) -> (tag, occurrence) -> (sender's step, receiver's step).
    type Messages<'a> = HashMap<(&'a str, usize), (Option<usize>, Option<usize>)>;
    let mut pairs: HashMap<(usize, usize), Messages<'_>> = HashMap::new();
    for (p, prog) in progs.iter().enumerate() {
        let mut seen: HashMap<(bool, usize, &str), usize> = HashMap::new();
        for (i, s) in prog.steps.iter().enumerate() {
            let (send, other, tag) = match s {
                Step::Send { to, tag, .. } => (true, *to, tag.as_str()),
                Step::Recv { from, tag, .. } => (false, *from, tag.as_str()),
                _ => continue,
            };
            let k = seen.entry((send, other, tag)).or_default();
            let pair = if send { (p, other) } else { (other, p) };
            let m = pairs.entry(pair).or_default().entry((tag, *k)).or_default();
            *k += 1;
            if send {
                m.0 = Some(i);
            } else {
                m.1 = Some(i);
            }
        }
    }
    let mut out: Vec<Vec<usize>> = progs.iter().map(|p| vec![0; p.steps.len()]).collect();
    let mut keys: Vec<&(usize, usize)> = pairs.keys().collect();
    keys.sort_unstable();
    for &(from, to) in keys {
        let (fname, tname) = (&progs[from].name, &progs[to].name);
        let mut msgs = Vec::new();
        // In step order, so the first message without its partner is the one named.
        let mut all: Vec<_> = pairs[&(from, to)].iter().collect();
        all.sort_by_key(|(_, &(si, ri))| (si.unwrap_or(usize::MAX), ri.unwrap_or(usize::MAX)));
        for (&(tag, _), &(si, ri)) in all {
            match (si, ri) {
                (Some(si), Some(ri)) => msgs.push((si, ri)),
                (Some(_), None) => {
                    return Err(format!(
                        "'{fname}' sends '{tag}' to '{tname}', which does not receive it"
                    ))
                }
                _ => {
                    return Err(format!(
                        "'{tname}' receives '{tag}' from '{fname}', which does not send it"
                    ))
                }
            }
        }
        msgs.sort_unstable();
        // Each lane's receiver step of its last message.
        let mut last: Vec<usize> = Vec::new();
        for (si, ri) in msgs {
            let lane = match (0..last.len())
                .filter(|&l| last[l] < ri)
                .max_by_key(|&l| last[l])
            {
                Some(l) => l,
                None => {
                    last.push(0);
                    last.len() - 1
                }
            };
            last[lane] = ri;
            out[from][si] = lane;
            out[to][ri] = lane;
        }
    }
    Ok(out)
}

/// Runs device `device` of program `p` of `art` to the end of its steps on `rank`
/// (`lanes`: the program's of [`lanes`]).
pub fn run_rank<R: Rank>(
    art: &Artifact,
    lanes: &[usize],
    p: usize,
    device: usize,
    groups: &Groups,
    rank: &mut R,
) -> Result<(), String> {
    let progs = &art.header.programs;
    let prog = &progs[p];
    let k = prog
        .devices
        .iter()
        .position(|&d| d == device)
        .ok_or_else(|| format!("device {device} does not run '{}'", prog.name))?;
    for (s, &lane) in prog.steps.iter().zip(lanes) {
        let message = |buffer: usize, other: usize, tag: &String| {
            let b = &prog.buffers[buffer];
            P2p {
                peer: progs[other].devices[k],
                at: at(Place::Device(0), b.offset),
                bytes: b.bytes(),
                tag: tag.clone(),
                lane,
            }
        };
        match s {
            Step::Launch { kernel, buffers } => rank.launch(*kernel, buffers)?,
            Step::Send { buffer, to, tag } => rank.send(&message(*buffer, *to, tag))?,
            Step::Recv { buffer, from, tag } => rank.recv(&message(*buffer, *from, tag))?,
            _ => {
                for op in rank_plan(prog, s, device, groups)?.0 {
                    match op {
                        RankOp::Copy(m) => rank.copy(&m)?,
                        RankOp::Flat { group, member, op } => {
                            rank.collective(group, member, &op)?
                        }
                    }
                }
            }
        }
    }
    Ok(())
}

/// What a rank of the host communicator is doing.
#[derive(Clone, Debug)]
enum Status {
    Running,
    /// Blocked: what it waits for.
    Waiting(String),
    Done,
}

/// Messages from one device to another on one lane: (from, to, lane).
type Lane = (usize, usize, usize);

#[derive(Debug, Default)]
struct State {
    status: Vec<Status>,
    /// Per group: collectives completed, and the arrivals at the next one (by member).
    done: Vec<u64>,
    arrived: Vec<Vec<Option<Flat<usize>>>>,
    /// Per (from, to) device and lane: what was sent and not yet received (tag, bytes),
    /// in the order sent.
    mail: HashMap<Lane, VecDeque<(String, Vec<u8>)>>,
    /// Per device: the lane it waits to receive on.
    awaits: Vec<Option<Lane>>,
    failed: Option<String>,
}

/// The host's in-process communicator: the ranks of one run, each a thread (see the
/// module's docs). Addresses are host pointers into the ranks' arenas and scratch.
#[derive(Debug)]
pub struct HostComm {
    groups: Vec<Vec<usize>>,
    state: Mutex<State>,
    cv: Condvar,
}

/// Reads `n` f32s at host address `a`.
///
/// # Safety
/// `a` must point to `n` readable f32s that nothing writes meanwhile.
unsafe fn f32s(a: usize, n: u64) -> Vec<f32> {
    // SAFETY: the caller's contract; arenas are 8-byte words, offsets multiples of 4.
    unsafe { std::slice::from_raw_parts(a as *const f32, n as usize) }.to_vec()
}

/// Writes `v`'s bytes at host address `a`.
///
/// # Safety
/// `a` must point to `v.len()` writable bytes that nothing else uses meanwhile.
unsafe fn put(a: usize, v: &[u8]) {
    // SAFETY: the caller's contract.
    unsafe { std::ptr::copy(v.as_ptr(), a as *mut u8, v.len()) }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Reads `bytes` bytes at host address `a`.
///
/// # Safety
/// As [`f32s`].
unsafe fn read(a: usize, bytes: u64) -> Vec<u8> {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts(a as *const u8, bytes as usize) }.to_vec()
}

/// The members' f32s reduced in member order (the lockstep's order and arithmetic).
fn reduce(parts: Vec<Vec<f32>>, max: bool) -> Vec<f32> {
    let mut it = parts.into_iter();
    let mut acc = it.next().unwrap_or_default();
    for x in it {
        for (a, b) in acc.iter_mut().zip(x) {
            *a = if max { a.max(b) } else { *a + b };
        }
    }
    acc
}

impl HostComm {
    /// A communicator for `devices` devices and `groups` ([`Groups::list`]).
    pub fn new(devices: usize, groups: &Groups) -> HostComm {
        HostComm {
            groups: groups.list.clone(),
            state: Mutex::new(State {
                status: vec![Status::Running; devices],
                done: vec![0; groups.list.len()],
                arrived: groups.list.iter().map(|g| vec![None; g.len()]).collect(),
                awaits: vec![None; devices],
                ..State::default()
            }),
            cv: Condvar::new(),
        }
    }

    /// How many devices group `group` has.
    pub fn members(&self, group: usize) -> usize {
        self.groups[group].len()
    }

    /// Why the run failed, if it did (the first error; a deadlock names every wait).
    pub fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Marks `device` finished (`Err`: failed, which stops every other rank).
    pub fn finish(&self, device: usize, r: &Result<(), String>) {
        let mut st = self.lock();
        st.status[device] = Status::Done;
        if let Err(e) = r {
            st.failed
                .get_or_insert_with(|| format!("device {device}: {e}"));
        }
        Self::check_deadlock(&mut st);
        self.cv.notify_all();
    }

    /// When every rank left waits, none can move: the run fails, naming what each waits
    /// for.
    fn check_deadlock(st: &mut State) {
        let waiting: Vec<String> = st
            .status
            .iter()
            .enumerate()
            .filter_map(|(d, s)| match s {
                Status::Waiting(w) => Some(format!("device {d} waits for {w}")),
                _ => None,
            })
            .collect();
        let running = st.status.iter().any(|s| matches!(s, Status::Running));
        if !running && !waiting.is_empty() && st.failed.is_none() {
            st.failed = Some(format!("deadlock: {}", waiting.join("; ")));
        }
    }

    /// Blocks `device` until `ready` holds (or the run failed).
    fn wait_guard<'g>(
        &'g self,
        mut st: std::sync::MutexGuard<'g, State>,
        device: usize,
        what: String,
        ready: impl Fn(&State) -> bool,
    ) -> Result<std::sync::MutexGuard<'g, State>, String> {
        if !ready(&st) {
            st.status[device] = Status::Waiting(what);
            Self::check_deadlock(&mut st);
            self.cv.notify_all();
            while !ready(&st) && st.failed.is_none() {
                st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
        }
        st.status[device] = Status::Running;
        match &st.failed {
            Some(e) if !ready(&st) => Err(e.clone()),
            _ => Ok(st),
        }
    }

    /// `device`, member `member` of group `group`, takes part in a flat collective
    /// (host addresses); returns when it is complete.
    ///
    /// # Safety
    /// The addresses must be valid for the collective's sizes (on the member's arena or
    /// scratch), and the member must not touch that memory until this returns.
    pub unsafe fn collective(
        &self,
        device: usize,
        group: usize,
        member: usize,
        op: Flat<usize>,
    ) -> Result<(), String> {
        let mut st = self.lock();
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        let seq = st.done[group];
        let kind = op.kind();
        st.arrived[group][member] = Some(op);
        if st.arrived[group].iter().all(Option::is_some) {
            let ops: Vec<Flat<usize>> =
                std::mem::replace(&mut st.arrived[group], vec![None; self.groups[group].len()])
                    .into_iter()
                    .map(|a| a.expect("every member arrived"))
                    .collect();
            // SAFETY: every member waits in this call until `done` moves on, so their
            // memory is this thread's to read and write now (the caller's contract).
            if let Err(e) = unsafe { Self::execute(&ops) } {
                let e = format!("collective {seq} of devices {:?}: {e}", self.groups[group]);
                st.failed.get_or_insert(e);
            }
            st.done[group] += 1;
            for &d in &self.groups[group] {
                if matches!(st.status[d], Status::Waiting(_)) {
                    st.status[d] = Status::Running;
                }
            }
            self.cv.notify_all();
            return match &st.failed {
                Some(e) => Err(e.clone()),
                None => Ok(()),
            };
        }
        let what = format!(
            "{kind} {seq} of devices {:?} (arrived: {:?})",
            self.groups[group],
            self.groups[group]
                .iter()
                .zip(&st.arrived[group])
                .filter(|(_, a)| a.is_some())
                .map(|(d, _)| *d)
                .collect::<Vec<_>>()
        );
        self.wait_guard(st, device, what, |s| s.done[group] > seq)
            .map(|_| ())
    }

    /// Runs a flat collective given every member's addresses, in member order.
    ///
    /// # Safety
    /// As [`HostComm::collective`], for every member.
    unsafe fn execute(ops: &[Flat<usize>]) -> Result<(), String> {
        let first = &ops[0];
        if ops.iter().any(|o| o.shape() != first.shape()) {
            return Err(format!(
                "the members disagree on it ({})",
                ops.iter().map(Flat::kind).collect::<Vec<_>>().join(", ")
            ));
        }
        // Every read happens before any write, so a member's recv may be its send.
        // SAFETY (all blocks): the caller's contract.
        match first {
            Flat::AllReduce { n, max, .. } => {
                let parts = ops
                    .iter()
                    .map(|o| match o {
                        Flat::AllReduce { send, .. } => unsafe { f32s(*send, *n) },
                        _ => unreachable!("checked above"),
                    })
                    .collect();
                let sum = f32_bytes(&reduce(parts, *max));
                for o in ops {
                    if let Flat::AllReduce { recv, .. } = o {
                        unsafe { put(*recv, &sum) };
                    }
                }
            }
            Flat::ReduceScatter { n, max, .. } => {
                let m = ops.len() as u64;
                let parts = ops
                    .iter()
                    .map(|o| match o {
                        Flat::ReduceScatter { send, .. } => unsafe { f32s(*send, n * m) },
                        _ => unreachable!("checked above"),
                    })
                    .collect();
                let sum = f32_bytes(&reduce(parts, *max));
                let w = (*n * 4) as usize;
                for (k, o) in ops.iter().enumerate() {
                    if let Flat::ReduceScatter { recv, .. } = o {
                        unsafe { put(*recv, &sum[k * w..(k + 1) * w]) };
                    }
                }
            }
            Flat::AllGather { bytes, .. } => {
                let all: Vec<u8> = ops
                    .iter()
                    .flat_map(|o| match o {
                        Flat::AllGather { send, .. } => unsafe { read(*send, *bytes) },
                        _ => unreachable!("checked above"),
                    })
                    .collect();
                for o in ops {
                    if let Flat::AllGather { recv, .. } = o {
                        unsafe { put(*recv, &all) };
                    }
                }
            }
            Flat::Broadcast { bytes, root, .. } => {
                let Some(Flat::Broadcast { send, .. }) = ops.get(*root) else {
                    return Err(format!("root {root} is not a member"));
                };
                let v = unsafe { read(*send, *bytes) };
                for o in ops {
                    if let Flat::Broadcast { recv, .. } = o {
                        unsafe { put(*recv, &v) };
                    }
                }
            }
            Flat::Exchange { bytes, .. } => {
                let m = ops.len();
                let mut pieces = vec![Vec::new(); m * m];
                for (p, o) in ops.iter().enumerate() {
                    if let Flat::Exchange { sends, .. } = o {
                        if sends.len() != m {
                            return Err("an exchange names another number of members".into());
                        }
                        for (k, &a) in sends.iter().enumerate() {
                            pieces[p * m + k] = unsafe { read(a, *bytes) };
                        }
                    }
                }
                for (k, o) in ops.iter().enumerate() {
                    if let Flat::Exchange { recvs, .. } = o {
                        if recvs.len() != m {
                            return Err("an exchange names another number of members".into());
                        }
                        for (p, &a) in recvs.iter().enumerate() {
                            unsafe { put(a, &pieces[p * m + k]) };
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// `device` sends `op.bytes` at host address `op.at` to `op.peer` on `op.lane`: the
    /// bytes are copied into the peer's mail at once (a send does not wait).
    ///
    /// # Safety
    /// `op.at` must be valid for `op.bytes` bytes.
    pub unsafe fn send(&self, device: usize, op: &P2p<usize>) -> Result<(), String> {
        // SAFETY: the caller's contract.
        let data = unsafe { read(op.at, op.bytes) };
        let mut st = self.lock();
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        let key = (device, op.peer, op.lane);
        st.mail
            .entry(key)
            .or_default()
            .push_back((op.tag.clone(), data));
        if st.awaits[op.peer] == Some(key) {
            st.status[op.peer] = Status::Running;
        }
        self.cv.notify_all();
        Ok(())
    }

    /// `device` receives the next message from `op.peer` on `op.lane` into host address
    /// `op.at` (`op.bytes` long); waits for it. Its tag and size must be the awaited
    /// ones.
    ///
    /// # Safety
    /// `op.at` must be valid for `op.bytes` bytes that nothing else uses meanwhile.
    pub unsafe fn recv(&self, device: usize, op: &P2p<usize>) -> Result<(), String> {
        let key = (op.peer, device, op.lane);
        let mut st = self.lock();
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        let has = |s: &State| s.mail.get(&key).is_some_and(|q| !q.is_empty());
        if !has(&st) {
            st.awaits[device] = Some(key);
            let what = format!("'{}' from device {}", op.tag, op.peer);
            st = self.wait_guard(st, device, what, has)?;
            st.awaits[device] = None;
        }
        let (tag, data) = st
            .mail
            .get_mut(&key)
            .and_then(VecDeque::pop_front)
            .ok_or("a message vanished")?;
        if tag != op.tag || data.len() as u64 != op.bytes {
            let e = format!(
                "device {device} receives '{}' ({} bytes) from device {} on lane {}, which sent '{tag}' ({} bytes) there",
                op.tag,
                op.bytes,
                op.peer,
                op.lane,
                data.len()
            );
            st.failed.get_or_insert(e.clone());
            self.cv.notify_all();
            return Err(e);
        }
        drop(st);
        // SAFETY: the caller's contract.
        unsafe { put(op.at, &data) };
        Ok(())
    }

    /// A message sent and never received, if one was (after every rank finished).
    pub fn unreceived(&self) -> Option<String> {
        let st = self.lock();
        let mut left: Vec<_> = st
            .mail
            .iter()
            .filter_map(|(k, q)| q.front().map(|(tag, _)| (*k, tag.clone())))
            .collect();
        left.sort();
        left.first().map(|((from, to, _), tag)| {
            format!("device {from} sent '{tag}' to device {to}, which never received it")
        })
    }
}
