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

use crate::artifact::{Artifact, Program, Step};
use crate::board::{Board, Mailbox};
use crate::collective::{at, At, Move, Place};
pub use crate::collective::{Flat, RankOp};
use std::collections::HashMap;
#[cfg(any(test, feature = "cuda"))]
use std::sync::{Condvar, Mutex};

mod shared;
pub use shared::{shared_plan, Shared};

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
        Step::Collective { groups, .. } => groups,
        Step::Launch { .. } | Step::Send { .. } | Step::Recv { .. } => &[],
    }
}

/// Device `device`'s share of collective step `s` of `prog`, and the scratch bytes it
/// needs.
pub fn rank_plan(
    prog: &Program,
    s: &Step,
    device: usize,
    groups: &Groups,
) -> Result<(Vec<RankOp>, u64), String> {
    let Step::Collective {
        op, input, output, ..
    } = s
    else {
        return Err("not a collective".into());
    };
    let (group, member) = groups.find(step_groups(s), device)?;
    let n = groups.list[group].len() as u64;
    let flat = |op: Flat<At>| RankOp::Flat { group, member, op };
    let (ib, ob) = (&prog.buffers[*input], &prog.buffers[*output]);
    Ok(op.share(ib, ob, n, member, &flat))
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

/// Messages from one device to another on one lane: (from, to, lane).
type Lane = (usize, usize, usize);

/// A message in a communicator's mail: its tag, its bytes, and what carries them.
#[derive(Debug)]
struct Letter<P> {
    tag: String,
    bytes: u64,
    payload: P,
}

/// A member at a collective: its addresses and its token.
type Arrival<E> = (Flat<usize>, E);

/// What a communicator's devices wait on ([`Board`] holds it with their statuses).
#[derive(Debug)]
struct State<P, E> {
    /// Per group: collectives completed, the arrivals at the next one (by member: its
    /// addresses and its token), and the last completed one's token.
    done: Vec<u64>,
    arrived: Vec<Vec<Option<Arrival<E>>>>,
    outcome: Vec<Option<E>>,
    /// Per (from, to) device and lane: what was sent and not yet received, in the order
    /// sent.
    mail: Mailbox<Lane, Letter<P>>,
}

/// An in-process communicator: the ranks of one run, each a thread (see the module's
/// docs). It matches arrivals and messages; its [`Board`] detects deadlocks; what a
/// collective does and what a message carries are its backend's. `P` is what a message
/// carries (the bytes on the host, a device parcel and its event on a GPU); `E` a token
/// a member hands in at a collective and gets back when it completes (nothing on the
/// host, where a collective is complete when it returns; stream events on a GPU, whose
/// collectives are queued).
#[derive(Debug)]
pub struct Comm<P, E> {
    groups: Vec<Vec<usize>>,
    board: Board<State<P, E>>,
}

/// The host's communicator: the bytes of every message copied into the receiver's mail,
/// and the collective run by the group's last member to arrive.
pub type HostComm = Comm<Vec<u8>, ()>;

/// That the members of a collective agree on it (its kind and sizes; their addresses
/// are their own), and for an exchange that every member names every member.
pub(crate) fn agree(ops: &[Flat<usize>]) -> Result<(), String> {
    let first = &ops[0];
    if ops.iter().any(|o| o.shape() != first.shape()) {
        return Err(format!(
            "the members disagree on it ({})",
            ops.iter().map(Flat::kind).collect::<Vec<_>>().join(", ")
        ));
    }
    if let Flat::Exchange { sends, recvs, .. } = first {
        if sends.len() != ops.len() || recvs.len() != ops.len() {
            return Err("an exchange names another number of members".into());
        }
    }
    Ok(())
}

impl<P, E: Clone> Comm<P, E> {
    /// A communicator for `devices` devices and `groups` ([`Groups::list`]).
    pub fn new(devices: usize, groups: &Groups) -> Comm<P, E> {
        Comm {
            groups: groups.list.clone(),
            board: Board::new(
                devices,
                State {
                    done: vec![0; groups.list.len()],
                    arrived: groups.list.iter().map(|g| vec![None; g.len()]).collect(),
                    outcome: vec![None; groups.list.len()],
                    mail: Mailbox::default(),
                },
            ),
        }
    }

    /// How many devices group `group` has.
    pub fn members(&self, group: usize) -> usize {
        self.groups[group].len()
    }

    /// Why the run failed, if it did (the first error; a deadlock names every wait).
    pub fn failure(&self) -> Option<String> {
        self.board.failure()
    }

    /// Marks `device` finished (`Err`: failed, which stops every other rank).
    pub fn finish(&self, device: usize, r: &Result<(), String>) {
        if let Err(e) = r {
            self.board.fail(format!("device {device}: {e}"));
        }
        self.board.finish(device);
    }

    /// Every device running again (a new run of the steps, every device having
    /// [`Comm::finish`]ed the last one and none waiting here).
    #[cfg(any(test, feature = "cuda"))]
    pub fn restart(&self) {
        self.board.restart();
    }

    /// `device`, member `member` of group `group`, arrives at a flat collective (its
    /// addresses `op`, its token `token`). The last member to arrive calls `run` with
    /// every member's addresses and tokens, in member order (after checking that they
    /// agree, [`agree`]); every member returns its token when it has. `run` is called
    /// with the communicator locked: it must not wait for another rank.
    pub fn meet(
        &self,
        device: usize,
        group: usize,
        member: usize,
        op: Flat<usize>,
        token: E,
        run: impl FnOnce(&[Flat<usize>], Vec<E>) -> Result<E, String>,
    ) -> Result<E, String> {
        let mut g = self.board.lock();
        if let Some(e) = g.failed() {
            return Err(e.clone());
        }
        let seq = g.state.done[group];
        let kind = op.kind();
        g.state.arrived[group][member] = Some((op, token));
        if g.state.arrived[group].iter().all(Option::is_some) {
            let (ops, tokens): (Vec<Flat<usize>>, Vec<E>) = std::mem::replace(
                &mut g.state.arrived[group],
                vec![None; self.groups[group].len()],
            )
            .into_iter()
            .map(|a| a.expect("every member arrived"))
            .unzip();
            let r = agree(&ops).and_then(|_| run(&ops, tokens));
            match r {
                Ok(t) => g.state.outcome[group] = Some(t),
                Err(e) => g.fail(format!(
                    "collective {seq} of devices {:?}: {e}",
                    self.groups[group]
                )),
            }
            g.state.done[group] += 1;
            self.board.notify();
        } else {
            let what = format!(
                "{kind} {seq} of devices {:?} (arrived: {:?})",
                self.groups[group],
                self.groups[group]
                    .iter()
                    .zip(&g.state.arrived[group])
                    .filter(|(_, a)| a.is_some())
                    .map(|(d, _)| *d)
                    .collect::<Vec<_>>()
            );
            g = self
                .board
                .wait(g, device, || what, move |s| s.done[group] > seq)?;
        }
        // No member arrives at the group's next collective before this one left, so the
        // outcome is still this collective's.
        match (g.failed(), &g.state.outcome[group]) {
            (Some(e), _) => Err(e.clone()),
            (None, Some(t)) => Ok(t.clone()),
            (None, None) => Err("a collective completed without its outcome".into()),
        }
    }

    /// `device` posts a message of `bytes` bytes tagged `tag` to `peer` on `lane`,
    /// carried by `payload`; it does not wait for the receive.
    pub fn post(
        &self,
        device: usize,
        peer: usize,
        lane: usize,
        tag: &str,
        bytes: u64,
        payload: P,
    ) -> Result<(), String> {
        let mut g = self.board.lock();
        if let Some(e) = g.failed() {
            return Err(e.clone());
        }
        g.state.mail.post(
            (device, peer, lane),
            Letter {
                tag: tag.to_string(),
                bytes,
                payload,
            },
        );
        self.board.notify();
        Ok(())
    }

    /// `device` takes the next message from `peer` on `lane`, waiting for it; its tag
    /// and size must be `tag` and `bytes`.
    pub fn take(
        &self,
        device: usize,
        peer: usize,
        lane: usize,
        tag: &str,
        bytes: u64,
    ) -> Result<P, String> {
        let key = (peer, device, lane);
        let mut g = self.board.lock();
        if let Some(e) = g.failed() {
            return Err(e.clone());
        }
        g = self.board.wait(
            g,
            device,
            || format!("'{tag}' from device {peer}"),
            move |s: &State<P, E>| s.mail.has(&key),
        )?;
        let letter = g.state.mail.take(&key).ok_or("a message vanished")?;
        if letter.tag != tag || letter.bytes != bytes {
            let e = format!(
                "device {device} receives '{tag}' ({bytes} bytes) from device {peer} on lane {lane}, which sent '{}' ({} bytes) there",
                letter.tag, letter.bytes
            );
            g.fail(e.clone());
            self.board.notify();
            return Err(e);
        }
        Ok(letter.payload)
    }

    /// A message sent and never received, if one was (after every rank finished).
    pub fn unreceived(&self) -> Option<String> {
        let g = self.board.lock();
        g.state.mail.left().map(|((from, to, _), l)| {
            format!(
                "device {from} sent '{}' to device {to}, which never received it",
                l.tag
            )
        })
    }
}

impl HostComm {
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
        // SAFETY: every member waits in `meet` until the last one ran the collective, so
        // their memory is that thread's to read and write then (the caller's contract;
        // `shared_plan` checks that no step writes what a later one reads).
        self.meet(device, group, member, op, (), |ops, _| {
            let steps = shared_plan(ops)?;
            unsafe { Self::execute(&steps) };
            Ok(())
        })
    }

    /// Runs the steps of [`shared_plan`] on host addresses.
    ///
    /// # Safety
    /// Every step's spans must be valid host memory that nothing else uses meanwhile.
    unsafe fn execute(steps: &[Shared]) {
        for st in steps {
            match *st {
                // SAFETY (both arms): the caller's contract.
                Shared::Copy { src, dst, bytes } => unsafe {
                    std::ptr::copy(src as *const u8, dst as *mut u8, bytes as usize)
                },
                Shared::Reduce { acc, x, n, max } => {
                    let (acc, x) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(acc as *mut f32, n as usize),
                            std::slice::from_raw_parts(x as *const f32, n as usize),
                        )
                    };
                    for (a, b) in acc.iter_mut().zip(x) {
                        *a = if max { a.max(*b) } else { *a + *b };
                    }
                }
            }
        }
    }

    /// `device` sends `op.bytes` at host address `op.at` to `op.peer` on `op.lane`: the
    /// bytes are copied into the peer's mail at once (a send does not wait).
    ///
    /// # Safety
    /// `op.at` must be valid for `op.bytes` bytes.
    pub unsafe fn send(&self, device: usize, op: &P2p<usize>) -> Result<(), String> {
        // SAFETY: the caller's contract.
        let data =
            unsafe { std::slice::from_raw_parts(op.at as *const u8, op.bytes as usize) }.to_vec();
        self.post(device, op.peer, op.lane, &op.tag, op.bytes, data)
    }

    /// `device` receives the next message from `op.peer` on `op.lane` into host address
    /// `op.at` (`op.bytes` long); waits for it. Its tag and size must be the awaited
    /// ones.
    ///
    /// # Safety
    /// `op.at` must be valid for `op.bytes` bytes that nothing else uses meanwhile.
    pub unsafe fn recv(&self, device: usize, op: &P2p<usize>) -> Result<(), String> {
        let data = self.take(device, op.peer, op.lane, &op.tag, op.bytes)?;
        // SAFETY: the caller's contract.
        unsafe { std::ptr::copy(data.as_ptr(), op.at as *mut u8, data.len()) };
        Ok(())
    }
}

/// Runs `run(p, device, arena)` for every device of `art` on a thread of its own, with
/// `arenas` its arenas (by program, then device, as [`crate::host::load_inputs`] gives
/// them); a panic is its device's error. `done(device, &result)` is called on each
/// device's thread as it ends (so a failure can stop the others). The results by
/// program, then device.
pub(crate) fn on_threads<T: Send>(
    art: &Artifact,
    arenas: &mut [Vec<Vec<u64>>],
    run: impl Fn(usize, usize, &mut Vec<u64>) -> Result<T, String> + Sync,
    done: impl Fn(usize, &Result<T, String>) + Sync,
) -> Vec<Result<T, String>> {
    let (run, done) = (&run, &done);
    std::thread::scope(|sc| {
        let mut handles = Vec::new();
        for (p, prog) in arenas.iter_mut().enumerate() {
            for (k, arena) in prog.iter_mut().enumerate() {
                let device = art.header.programs[p].devices[k];
                handles.push(sc.spawn(move || {
                    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                        run(p, device, arena)
                    }))
                    .unwrap_or_else(|_| Err(format!("device {device}'s thread panicked")));
                    done(device, &r);
                    r
                }));
            }
        }
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err("a rank's thread panicked".into()))
            })
            .collect()
    })
}

/// Device `device`'s `repeat` runs of its steps beside the other devices' threads (ranks
/// on GPUs): `ready()` before each (its arguments in place), then the gate, whose last
/// arrival sets every device running again ([`Comm::restart`]), then `steps(ready's
/// value)`, timed; after each, the device is marked done in the communicator, so a device
/// still waiting for it (at a collective it never joins, for a message it never sends)
/// is a deadlock, reported, not a hang while this one waits at the next gate. `finish`
/// (after the steps, still timed) waits for the device to complete them. The seconds of
/// each run, and the last run's value of `ready`.
#[cfg(any(test, feature = "cuda"))]
pub(crate) fn runs<P, E: Clone, T>(
    comm: &Comm<P, E>,
    gate: &Gate,
    device: usize,
    repeat: usize,
    mut ready: impl FnMut() -> Result<T, String>,
    mut steps: impl FnMut(&T) -> Result<(), String>,
    mut finish: impl FnMut(&T) -> Result<(), String>,
) -> Result<(Vec<f64>, Option<T>), String> {
    let mut times = Vec::with_capacity(repeat);
    let mut last = None;
    for _ in 0..repeat {
        let t = ready()?;
        gate.wait_and(|| comm.restart())?;
        let started = std::time::Instant::now();
        steps(&t)?;
        comm.finish(device, &Ok(()));
        finish(&t)?;
        times.push(started.elapsed().as_secs_f64());
        last = Some(t);
    }
    Ok((times, last))
}

/// A barrier that fails: every device waits at it before each run (so the runs start
/// together), and a device that failed opens it for the others with an error instead of
/// leaving them waiting.
#[cfg(any(test, feature = "cuda"))]
#[derive(Debug)]
pub(crate) struct Gate {
    /// Arrived, generation, failed.
    state: Mutex<(usize, u64, bool)>,
    cv: Condvar,
    n: usize,
}

#[cfg(any(test, feature = "cuda"))]
impl Gate {
    pub(crate) fn new(n: usize) -> Gate {
        Gate {
            state: Mutex::new((0, 0, false)),
            cv: Condvar::new(),
            n,
        }
    }

    /// Waits until every device arrived (`Err` once one failed).
    pub(crate) fn wait(&self) -> Result<(), String> {
        self.wait_and(|| ())
    }

    /// [`Gate::wait`], the last device to arrive calling `on_open` before any passes.
    pub(crate) fn wait_and(&self, on_open: impl FnOnce()) -> Result<(), String> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let generation = st.1;
        st.0 += 1;
        if st.0 == self.n {
            on_open();
            st.0 = 0;
            st.1 += 1;
            self.cv.notify_all();
        }
        while st.1 == generation && !st.2 {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
        if st.2 {
            return Err("stopped: another device failed".into());
        }
        Ok(())
    }

    /// Opens the gate for good, with an error for those waiting and those to come.
    pub(crate) fn fail(&self) {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).2 = true;
        self.cv.notify_all();
    }
}

#[cfg(test)]
mod tests;
