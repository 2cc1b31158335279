//! Ranks on GPUs (feature `cuda`): every device of an artifact on a GPU of its own, driven
//! by a thread of its own ([`crate::ranks`]), collectives, sends and receives through
//! NCCL (cudarc loads `libnccl.so` at run time, as it loads the driver). Not yet run on
//! GPUs: the ranks' logic is tested on the host ([`crate::ranks`]), this file maps it to
//! NCCL's calls.
//!
//! Device `d` runs on GPU `d`. Each distinct group of the artifact's collectives gets a
//! communicator (`ncclCommInitAll` over its devices' GPUs, ranks in member order). A
//! rank's share of a collective ([`crate::ranks::rank_plan`]) is its local copies
//! (`cuMemcpy2DAsync`) around one NCCL call on the rank's stream; an exchange (all-to-all)
//! is one `ncclGroupStart`/`ncclGroupEnd` of sends and receives. NCCL's sums are its own
//! order, not the members', so results are not the same bits as the virtual devices';
//! they agree within rounding.
//!
//! Every lane of messages from one device to another ([`crate::ranks::lanes`]) gets a
//! communicator of the two (sender rank 0, receiver rank 1). A send does not wait for its
//! receive: its bytes are copied on the kernels' stream into staging space, and sent
//! from there on a stream of the lane's own, so a send waiting for its receive holds up
//! neither the kernels nor the other lanes; the staging space is freed when the step's
//! sends are done. A receive runs on the kernels' stream (the next kernels need it).

use crate::artifact::{Artifact, Step};
use crate::collective::{At, Move};
use crate::cuda::{available, CudaProgram, RankMemory};
use crate::host::{load_inputs, results};
use crate::ranks::{lanes, on_threads, rank_scratch, run_rank, Flat, Gate, Groups, P2p, Rank};
use crate::tensor::Tensor;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use cudarc::nccl::{result as nccl, sys as nccl_sys};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// One NCCL communicator handle (a rank of one group).
struct Handle(nccl_sys::ncclComm_t);

// SAFETY: a communicator is used by one thread at a time (its rank's), which NCCL allows;
// the handle moves to that thread once.
unsafe impl Send for Handle {}
// SAFETY: as above: shared references only reach the thread that uses the handle.
unsafe impl Sync for Handle {}

/// The communicators: every group's, by group and member; and per lane of messages
/// from one device to another, a pair (the sender's, the receiver's).
struct Comms {
    groups: Vec<Vec<Handle>>,
    lanes: HashMap<(usize, usize, usize), [Handle; 2]>,
    /// Set once [`Comms::abort`] ran (the handles are then gone).
    aborted: AtomicBool,
}

/// `ncclCommInitAll` over `gpus`: a handle per GPU, ranks in their order.
fn init_all(gpus: &[usize]) -> Result<Vec<Handle>, String> {
    let mut comms = vec![std::ptr::null_mut(); gpus.len()];
    let list: Vec<i32> = gpus.iter().map(|&d| d as i32).collect();
    // SAFETY: `comms` has room for one handle per listed GPU.
    unsafe { nccl::comm_init_all(comms.as_mut_ptr(), list.len() as i32, list.as_ptr()) }
        .map_err(|e| format!("NCCL: a communicator of devices {gpus:?}: {e:?}"))?;
    Ok(comms.into_iter().map(Handle).collect())
}

impl Comms {
    /// Communicators for `art`'s groups and for every lane of its messages (`lanes`).
    fn new(art: &Artifact, groups: &Groups, lanes: &[Vec<usize>]) -> Result<Comms, String> {
        let mut c = Comms {
            groups: Vec::with_capacity(groups.list.len()),
            lanes: HashMap::new(),
            aborted: AtomicBool::new(false),
        };
        for g in &groups.list {
            c.groups.push(init_all(g)?);
        }
        let progs = &art.header.programs;
        for (p, prog) in progs.iter().enumerate() {
            for (s, &lane) in prog.steps.iter().zip(&lanes[p]) {
                let Step::Send { to, .. } = s else { continue };
                for (&from, &to) in prog.devices.iter().zip(&progs[*to].devices) {
                    if let std::collections::hash_map::Entry::Vacant(v) =
                        c.lanes.entry((from, to, lane))
                    {
                        let [a, b]: [Handle; 2] = init_all(&[from, to])?
                            .try_into()
                            .map_err(|_| "NCCL: a pair's communicator".to_string())?;
                        v.insert([a, b]);
                    }
                }
            }
        }
        Ok(c)
    }
}

impl Comms {
    /// The handles this process holds (a process's communicators have null handles
    /// for the members other processes hold).
    fn handles(&self) -> impl Iterator<Item = &Handle> {
        self.groups
            .iter()
            .flatten()
            .chain(self.lanes.values().flatten())
            .filter(|h| !h.0.is_null())
    }

    /// Aborts every communicator (once): NCCL calls waiting on a device that failed
    /// return with an error instead of waiting for ever.
    fn abort(&self) {
        if !self.aborted.swap(true, Ordering::SeqCst) {
            for h in self.handles() {
                // SAFETY: every handle came from ncclCommInitAll; ncclCommAbort may be
                // called while other threads wait in calls on it (that is its purpose).
                let _ = unsafe { nccl::comm_abort(h.0) };
            }
        }
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        if self.aborted.load(Ordering::SeqCst) {
            return;
        }
        for h in self.handles() {
            // SAFETY: every handle came from ncclCommInitAll and no rank uses it any more.
            let _ = unsafe { nccl::comm_destroy(h.0) };
        }
    }
}

fn check(r: Result<nccl::NcclStatus, nccl::NcclError>, what: &str) -> Result<(), String> {
    r.map(|_| ()).map_err(|e| format!("NCCL: {what}: {e:?}"))
}

/// A device of a run: its program, arena and scratch on its GPU, and the communicators.
struct GpuRank<'a> {
    mem: RankMemory<'a>,
    device: usize,
    /// Per (receiving device, lane), the stream this rank sends on (so a send waiting for
    /// its receive holds up neither the kernels nor the other lanes).
    lane_streams: HashMap<(usize, usize), Arc<CudaStream>>,
    /// Sent bytes, kept until the sends are done ([`GpuRank::drain`]).
    staging: Vec<CudaSlice<u8>>,
    comms: &'a Comms,
}

impl GpuRank<'_> {
    fn stream(&self) -> nccl_sys::cudaStream_t {
        self.mem.prog.stream().cu_stream() as nccl_sys::cudaStream_t
    }

    /// Waits for every send to finish, then frees what they sent.
    fn drain(&mut self) -> Result<(), String> {
        for s in self.lane_streams.values() {
            s.synchronize()
                .map_err(|e| format!("CUDA: device {}: sends: {e}", self.device))?;
        }
        self.staging.clear();
        Ok(())
    }
}

impl Rank for GpuRank<'_> {
    fn launch(&mut self, kernel: usize, buffers: &[usize]) -> Result<(), String> {
        self.mem.launch(kernel, buffers)
    }

    fn copy(&mut self, m: &Move) -> Result<(), String> {
        self.mem.copy(m)
    }

    fn collective(&mut self, group: usize, member: usize, op: &Flat<At>) -> Result<(), String> {
        let comm = self.comms.groups[group][member].0;
        let members = self.comms.groups[group].len() as u64;
        let op = op.map(members, &mut |a, bytes| self.mem.address(a, bytes))?;
        let stream = self.stream();
        let red = |max: bool| {
            if max {
                nccl_sys::ncclRedOp_t::ncclMax
            } else {
                nccl_sys::ncclRedOp_t::ncclSum
            }
        };
        let f32t = nccl_sys::ncclDataType_t::ncclFloat32;
        let u8t = nccl_sys::ncclDataType_t::ncclUint8;
        let ptr = |a: u64| a as *mut c_void;
        // SAFETY (every call): the addresses lie in this rank's arena and scratch on its
        // GPU (located above) for the sizes given; the communicator is this rank's of
        // the group, used by this thread only; the call is queued on the rank's stream.
        let kind = op.kind();
        match op {
            // The same arguments: n f32s per member reduced; all of them to every member,
            // or member k's piece to member k.
            Flat::AllReduce { send, recv, n, max } | Flat::ReduceScatter { send, recv, n, max } => {
                let call = if kind == "all_reduce" {
                    nccl::all_reduce
                } else {
                    nccl::reduce_scatter
                };
                check(
                    unsafe {
                        call(
                            ptr(send),
                            ptr(recv),
                            n as usize,
                            f32t,
                            red(max),
                            comm,
                            stream,
                        )
                    },
                    kind,
                )
            }
            Flat::AllGather { send, recv, bytes } => check(
                unsafe {
                    nccl::all_gather(ptr(send), ptr(recv), bytes as usize, u8t, comm, stream)
                },
                "all_gather",
            ),
            Flat::Broadcast {
                send,
                recv,
                bytes,
                root,
            } => check(
                unsafe {
                    nccl::broadcast(
                        ptr(send),
                        ptr(recv),
                        bytes as usize,
                        u8t,
                        root as i32,
                        comm,
                        stream,
                    )
                },
                "broadcast",
            ),
            Flat::Exchange {
                sends,
                recvs,
                bytes,
            } => {
                check(nccl::group_start(), "all_to_all")?;
                let mut r = Ok(());
                for (k, (s, d)) in sends.iter().zip(&recvs).enumerate() {
                    let k = k as i32;
                    r = r
                        .and_then(|_| {
                            check(
                                unsafe {
                                    nccl::send(ptr(*s), bytes as usize, u8t, k, comm, stream)
                                },
                                "all_to_all send",
                            )
                        })
                        .and_then(|_| {
                            check(
                                unsafe {
                                    nccl::recv(ptr(*d), bytes as usize, u8t, k, comm, stream)
                                },
                                "all_to_all receive",
                            )
                        });
                }
                // The group is closed whatever happened inside it.
                let end = check(nccl::group_end(), "all_to_all");
                r.and(end)
            }
        }
    }

    fn send(&mut self, op: &P2p<At>) -> Result<(), String> {
        let device = self.device;
        let cu =
            |e: cudarc::driver::DriverError| format!("CUDA: device {device}: '{}': {e}", op.tag);
        let at = self.mem.address(op.at, op.bytes)?;
        let compute = self.mem.prog.stream().clone();
        // The bytes as they are now, copied on the kernels' stream (later kernels may
        // write over the buffer), then sent from there on the lane's stream.
        // SAFETY: the staging space is written whole by the copy before it is read.
        let staging = unsafe { compute.alloc::<u8>(op.bytes.max(1) as usize) }.map_err(cu)?;
        let dst = staging.device_ptr(&compute).0;
        // SAFETY: the buffer lies in this rank's arena (located); the staging space is
        // fresh, `bytes` long.
        unsafe {
            self.mem
                .prog
                .copy2d(at, dst, op.bytes, 1, op.bytes, op.bytes)
        }?;
        let ready = compute.record_event(None).map_err(cu)?;
        let lane = match self.lane_streams.get(&(op.peer, op.lane)) {
            Some(s) => s.clone(),
            None => {
                let s = compute.context().new_stream().map_err(cu)?;
                self.lane_streams.insert((op.peer, op.lane), s.clone());
                s
            }
        };
        lane.wait(&ready).map_err(cu)?;
        let comm = self
            .comms
            .lanes
            .get(&(device, op.peer, op.lane))
            .ok_or_else(|| format!("'{}': no communicator to device {}", op.tag, op.peer))?[0]
            .0;
        let u8t = nccl_sys::ncclDataType_t::ncclUint8;
        let stream = lane.cu_stream() as nccl_sys::cudaStream_t;
        // SAFETY: the staging space is `bytes` long and kept until the sends are done
        // (`drain`); the lane's communicator is this rank's, used by this thread on this
        // stream only; the receiver is rank 1 of it.
        let sent = unsafe {
            nccl::send(
                dst as *const c_void,
                op.bytes as usize,
                u8t,
                1,
                comm,
                stream,
            )
        };
        self.staging.push(staging);
        check(sent, &op.tag)
    }

    fn recv(&mut self, op: &P2p<At>) -> Result<(), String> {
        let at = self.mem.address(op.at, op.bytes)?;
        let comm = self
            .comms
            .lanes
            .get(&(op.peer, self.device, op.lane))
            .ok_or_else(|| format!("'{}': no communicator from device {}", op.tag, op.peer))?[1]
            .0;
        let u8t = nccl_sys::ncclDataType_t::ncclUint8;
        // SAFETY: the buffer lies in this rank's arena for `bytes` (located); the lane's
        // communicator is this rank's, used by this thread on the kernels' stream only;
        // the sender is rank 0 of it.
        check(
            unsafe {
                nccl::recv(
                    at as *mut c_void,
                    op.bytes as usize,
                    u8t,
                    0,
                    comm,
                    self.stream(),
                )
            },
            &op.tag,
        )
    }
}

/// One device's runs (a thread's work in [`run_ranks_timed`]).
struct RankRun<'a> {
    art: &'a Artifact,
    p: usize,
    device: usize,
    words: usize,
    repeat: usize,
    gate: &'a Gate,
    comms: &'a Comms,
    groups: &'a Groups,
    lanes: &'a [usize],
}

impl RankRun<'_> {
    /// Loads the program on the device's GPU, runs it `repeat` times from the arguments
    /// in `h_arena`, and leaves the last run's arena there; the seconds of each run.
    fn run(&self, h_arena: &mut Vec<u64>) -> Result<Vec<f64>, String> {
        let device = self.device;
        let cu = |r: Result<(), cudarc::driver::DriverError>, what: &str| {
            r.map_err(|e| format!("CUDA: device {device}: {what}: {e}"))
        };
        let prog = CudaProgram::load(self.art.clone(), device)?;
        let stream = prog.stream().clone();
        let scratch = stream
            .alloc_zeros::<u64>(self.words)
            .map_err(|e| format!("CUDA: device {device}: scratch: {e}"))?;
        let mut times = Vec::with_capacity(self.repeat);
        let mut arena = None;
        for _ in 0..self.repeat {
            // Every run starts from the arguments.
            let a = stream
                .clone_htod(h_arena.as_slice())
                .map_err(|e| format!("CUDA: device {device}: arguments: {e}"))?;
            cu(stream.synchronize(), "arguments")?;
            self.gate.wait()?;
            let t = std::time::Instant::now();
            let mut rank = GpuRank {
                mem: RankMemory {
                    prog: &prog,
                    p: self.p,
                    arena: &a,
                    scratch: &scratch,
                },
                device,
                lane_streams: HashMap::new(),
                staging: Vec::new(),
                comms: self.comms,
            };
            run_rank(self.art, self.lanes, self.p, device, self.groups, &mut rank)?;
            cu(stream.synchronize(), "the step")?;
            rank.drain()?;
            times.push(t.elapsed().as_secs_f64());
            arena = Some(a);
        }
        if let Some(a) = arena {
            cu(stream.memcpy_dtoh(&a, h_arena.as_mut_slice()), "results")?;
            cu(stream.synchronize(), "results")?;
        }
        Ok(times)
    }
}

/// Runs `art` `repeat` times (at least once) with every device on GPU `d` of its own,
/// driven by a thread of its own, collectives and sends through NCCL; returns the results
/// made whole and the seconds of each run (from a barrier before every device's first
/// step until the slowest device's stream finished).
pub fn run_ranks_timed(
    art: &Artifact,
    inputs: &[Tensor],
    repeat: usize,
) -> Result<(Vec<Tensor>, Vec<f64>), String> {
    let lanes = lanes(art)?;
    let devices = art.devices().max(1);
    let gpus = available()?;
    if gpus < devices {
        return Err(format!(
            "{devices} devices need {devices} GPUs to run as ranks, and the driver sees {gpus} (without ranks they run as virtual devices on GPU 0)"
        ));
    }
    // SAFETY: probing for the library has no preconditions.
    if !unsafe { nccl_sys::is_culib_present() } {
        return Err("NCCL (libnccl.so) cannot be loaded: ranks on GPUs need it".into());
    }
    let groups = Groups::of(art);
    let words = rank_scratch(art, &groups)?.div_ceil(8).max(1) as usize;
    let mut host = load_inputs(art, inputs)?;
    let comms = Comms::new(art, &groups, &lanes)?;
    let repeat = repeat.max(1);
    let gate = Gate::new(devices);
    let (comms, gate, groups, lanes) = (&comms, &gate, &groups, &lanes);
    let per_device = on_threads(
        art,
        &mut host,
        |p, device, h_arena| {
            RankRun {
                art,
                p,
                device,
                words,
                repeat,
                gate,
                comms,
                groups,
                lanes: &lanes[p],
            }
            .run(h_arena)
        },
        |_, r| {
            if r.is_err() {
                // The others stop at the next gate, and those waiting in NCCL for this
                // device return instead of hanging.
                gate.fail();
                comms.abort();
            }
        },
    );
    let mut times = vec![0.0f64; repeat];
    for r in per_device {
        for (t, d) in times.iter_mut().zip(r?) {
            *t = t.max(d);
        }
    }
    Ok((results(art, &host)?, times))
}

/// Kind of the rendezvous messages carrying NCCL's unique ids between processes.
const NCCL_ID: u64 = 0x6e63_636c;

/// The bytes of a unique id.
fn id_bytes(id: &nccl_sys::ncclUniqueId) -> Vec<u8> {
    id.internal.iter().map(|&c| c as u8).collect()
}

/// A unique id from its bytes.
fn id_from(b: &[u8]) -> Result<nccl_sys::ncclUniqueId, String> {
    let mut id = nccl_sys::ncclUniqueId { internal: [0; 128] };
    if b.len() != id.internal.len() {
        return Err(format!("an NCCL id of {} bytes", b.len()));
    }
    for (d, &s) in id.internal.iter_mut().zip(b) {
        *d = s as std::ffi::c_char;
    }
    Ok(id)
}

/// `ncclCommInitRank` as member `member` of `n`, the id from the process of member 0
/// (made there and sent over `net` under `key` to the others, `others`: their ranks).
fn init_rank(
    net: &crate::net::Net,
    key: crate::net::Key,
    member: usize,
    n: usize,
    first: usize,
    others: &[usize],
    what: &str,
) -> Result<Handle, String> {
    let id = if member == 0 {
        let id = nccl::get_uniqueid().map_err(|e| format!("NCCL: an id for {what}: {e:?}"))?;
        for &r in others {
            net.send(r, key, &id_bytes(&id))?;
        }
        id
    } else {
        id_from(&net.take(first, key, &|| format!("NCCL's id for {what}"))?)?
    };
    let mut comm = std::ptr::null_mut();
    // SAFETY: `comm` receives the handle; the id is the group's, every member calls this
    // with the same `n` and its own `member`.
    unsafe { nccl::comm_init_rank(&mut comm, n as i32, id, member as i32) }
        .map_err(|e| format!("NCCL: {what}: {e:?}"))?;
    Ok(Handle(comm))
}

impl Comms {
    /// Device `device`'s communicators when every device is a process of its own
    /// (`owner`: each device's rank): for every group it is in, and every lane it sends
    /// or receives on, in one order all processes share (so their initializations, each
    /// waiting for its members, cannot wait on each other in a cycle); the other
    /// members' handles are null.
    fn for_device(
        art: &Artifact,
        groups: &Groups,
        lanes: &[Vec<usize>],
        device: usize,
        net: &crate::net::Net,
        owner: &[usize],
    ) -> Result<Comms, String> {
        let mut c = Comms {
            groups: Vec::with_capacity(groups.list.len()),
            lanes: HashMap::new(),
            aborted: AtomicBool::new(false),
        };
        for (g, members) in groups.list.iter().enumerate() {
            let mut hs: Vec<Handle> = members
                .iter()
                .map(|_| Handle(std::ptr::null_mut()))
                .collect();
            if let Some(m) = members.iter().position(|&d| d == device) {
                let others: Vec<usize> = members[1..].iter().map(|&d| owner[d]).collect();
                hs[m] = init_rank(
                    net,
                    [NCCL_ID, 0, g as u64, 0],
                    m,
                    members.len(),
                    owner[members[0]],
                    &others,
                    &format!("the group of devices {members:?}"),
                )?;
            }
            c.groups.push(hs);
        }
        let progs = &art.header.programs;
        let mut pairs = std::collections::BTreeSet::new();
        for (p, prog) in progs.iter().enumerate() {
            for (s, &lane) in prog.steps.iter().zip(&lanes[p]) {
                let Step::Send { to, .. } = s else { continue };
                for (&from, &to) in prog.devices.iter().zip(&progs[*to].devices) {
                    pairs.insert((from, to, lane));
                }
            }
        }
        for (from, to, lane) in pairs {
            if from != device && to != device {
                continue;
            }
            let me = usize::from(to == device);
            let key = [NCCL_ID, 1, ((from as u64) << 32) | to as u64, lane as u64];
            let h = init_rank(
                net,
                key,
                me,
                2,
                owner[from],
                &[owner[to]],
                &format!("lane {lane} from device {from} to device {to}"),
            )?;
            let null = || Handle(std::ptr::null_mut());
            c.lanes.insert(
                (from, to, lane),
                if me == 0 { [h, null()] } else { [null(), h] },
            );
        }
        Ok(c)
    }
}

/// A device of one process among several (`crate::procs`), on a GPU of its own: its
/// program, arena, scratch space and NCCL communicators, made with the other processes
/// through the rendezvous's connections. Built, not yet run on GPUs.
pub(crate) struct ProcGpu {
    prog: CudaProgram,
    p: usize,
    device: usize,
    arena: CudaSlice<u64>,
    scratch: CudaSlice<u64>,
    comms: Arc<Comms>,
}

impl std::fmt::Debug for ProcGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcGpu")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl ProcGpu {
    /// Device `device` (of program `p`) of `art` on GPU `gpu`, its communicators (for
    /// `groups` and `lanes`) made with the processes of `net` (`owner`: each device's
    /// rank).
    pub(crate) fn new(
        art: &Artifact,
        (p, device, gpu): (usize, usize, usize),
        (groups, lanes): (&Groups, &[Vec<usize>]),
        net: &crate::net::Net,
        owner: &[usize],
    ) -> Result<ProcGpu, String> {
        // SAFETY: probing for the library has no preconditions.
        if !unsafe { nccl_sys::is_culib_present() } {
            return Err("NCCL (libnccl.so) cannot be loaded: processes on GPUs need it".into());
        }
        let prog = CudaProgram::load(art.clone(), gpu)?;
        let stream = prog.stream().clone();
        let cu = |e: cudarc::driver::DriverError| format!("CUDA: device {device}: {e}");
        let arena = stream
            .alloc_zeros::<u64>(art.header.programs[p].arena_bytes.div_ceil(8).max(1) as usize)
            .map_err(cu)?;
        let words = rank_scratch(art, groups)?.div_ceil(8).max(1) as usize;
        let scratch = stream.alloc_zeros::<u64>(words).map_err(cu)?;
        stream.context().bind_to_thread().map_err(cu)?;
        let comms = Arc::new(Comms::for_device(art, groups, lanes, device, net, owner)?);
        // A peer gone makes this process fail: NCCL calls waiting on it return then.
        let (watch, c) = (net.watcher(), Arc::clone(&comms));
        std::thread::spawn(move || {
            if watch.wait().is_some() {
                c.abort();
            }
        });
        Ok(ProcGpu {
            prog,
            p,
            device,
            arena,
            scratch,
            comms,
        })
    }

    /// One run of the device's steps: the arena zeroed, `writes` (byte offset, bytes)
    /// copied in, the steps run with NCCL, and the bytes at `reads` (offset, length)
    /// brought back.
    pub(crate) fn run(
        &mut self,
        art: &Artifact,
        lanes: &[usize],
        groups: &Groups,
        writes: &[(u64, std::borrow::Cow<'_, [u8]>)],
        reads: &[(u64, u64)],
    ) -> Result<Vec<Vec<u8>>, String> {
        let device = self.device;
        let cu = |e: cudarc::driver::DriverError| format!("CUDA: device {device}: {e}");
        let stream = self.prog.stream().clone();
        stream.context().bind_to_thread().map_err(cu)?;
        stream.memset_zeros(&mut self.arena).map_err(cu)?;
        for (off, bytes) in writes {
            // Buffers start at multiples of 256 and their space is rounded up to 256
            // bytes, so padding to whole words writes over nothing else.
            let mut words = vec![0u64; bytes.len().div_ceil(8)];
            for (k, c) in bytes.chunks(8).enumerate() {
                let mut w = [0u8; 8];
                w[..c.len()].copy_from_slice(c);
                words[k] = u64::from_le_bytes(w);
            }
            let lo = (*off / 8) as usize;
            stream
                .memcpy_htod(
                    words.as_slice(),
                    &mut self.arena.slice_mut(lo..lo + words.len()),
                )
                .map_err(cu)?;
        }
        let mut rank = GpuRank {
            mem: RankMemory {
                prog: &self.prog,
                p: self.p,
                arena: &self.arena,
                scratch: &self.scratch,
            },
            device,
            lane_streams: HashMap::new(),
            staging: Vec::new(),
            comms: &self.comms,
        };
        let r = run_rank(art, lanes, self.p, device, groups, &mut rank)
            .and_then(|_| stream.synchronize().map_err(cu))
            .and_then(|_| rank.drain());
        if r.is_err() {
            self.comms.abort();
        }
        r?;
        let mut out = Vec::with_capacity(reads.len());
        for &(off, len) in reads {
            let lo = (off / 8) as usize;
            let mut words = vec![0u64; len.div_ceil(8) as usize];
            stream
                .memcpy_dtoh(
                    &self.arena.slice(lo..lo + words.len()),
                    words.as_mut_slice(),
                )
                .map_err(cu)?;
            stream.synchronize().map_err(cu)?;
            let mut b: Vec<u8> = words.iter().flat_map(|x| x.to_le_bytes()).collect();
            b.truncate(len as usize);
            out.push(b);
        }
        Ok(out)
    }
}
