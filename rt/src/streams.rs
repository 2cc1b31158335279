//! Ranks as streams on one GPU (feature `cuda`): every device of an artifact a virtual
//! device on GPU 0 with its own arena, scratch space and stream, driven by a thread of
//! its own ([`crate::ranks`]), as a GPU of its own would be. So a data-, tensor- or
//! pipeline-parallel program runs on one card with its devices' kernels overlapping, and
//! its ranks' logic (shares of collectives, lanes, sends that do not wait) is checked
//! there before NCCL runs it across GPUs (`crate::nccl`).
//!
//! The communicator is the in-process one ([`Comm`]), with stream events for tokens. A
//! member arriving at a collective records an event on its stream; the group's last
//! member makes its own stream wait for all of them, queues the collective on its stream
//! as [`shared_plan`]'s device copies and reducer launches over the members' memory (all
//! in one address space: one GPU), and records an event that every member's stream then
//! waits for. Sums are in member order, as the lockstep backends sum, so a collective
//! gives the lockstep's bits from the same inputs. No thread waits for the GPU at a
//! collective: only the host-side rendezvous waits, so deadlocks are found as on the
//! host.
//!
//! A send copies its buffer into a fresh device parcel on the sender's stream and posts
//! it with an event; the receive makes its stream wait for that event and copies the
//! parcel into its arena. Parcels are kept until the receiver's stream has finished.

use crate::artifact::Artifact;
use crate::collective::{At, Move};
use crate::cuda::{CudaProgram, RankMemory};
use crate::host::{load_inputs, results};
use crate::ranks::{
    lanes, on_threads, rank_scratch, run_rank, runs, shared_plan, Comm, Flat, Gate, Groups, P2p,
    Rank, Shared,
};
use crate::tensor::Tensor;
use cudarc::driver::{CudaEvent, CudaSlice, DevicePtr};
use std::sync::Arc;

/// A message between virtual devices: a device copy of the sent bytes, and the event
/// after which it holds them.
struct Parcel {
    bytes: CudaSlice<u8>,
    ready: Arc<CudaEvent>,
}

type StreamComm = Comm<Parcel, Arc<CudaEvent>>;

fn cu<T>(
    r: Result<T, cudarc::driver::DriverError>,
    device: usize,
    what: &str,
) -> Result<T, String> {
    r.map_err(|e| format!("CUDA: device {device}: {what}: {e}"))
}

/// A virtual device of a run: its program on its own stream, its memory, the
/// communicator.
struct StreamRank<'a> {
    mem: RankMemory<'a>,
    device: usize,
    comm: &'a StreamComm,
    /// Parcels received in this run, kept until the stream has copied them.
    kept: Vec<Parcel>,
}

impl StreamRank<'_> {
    /// An event after everything queued on the rank's stream so far.
    fn mark(&self) -> Result<Arc<CudaEvent>, String> {
        cu(
            self.mem.prog.stream().record_event(None),
            self.device,
            "an event",
        )
        .map(Arc::new)
    }
}

/// Queues `steps` ([`shared_plan`]) on `prog`'s stream: copies, and reductions by the
/// artifact's reducer kernels.
///
/// # Safety
/// Every step's spans must be live device memory of the program's context, which nothing
/// else writes until the stream has run them.
unsafe fn queue(prog: &CudaProgram, steps: &[Shared]) -> Result<(), String> {
    for st in steps {
        // SAFETY (both arms): the caller's contract.
        match *st {
            Shared::Copy { src, dst, bytes } => {
                unsafe { prog.copy2d(src as u64, dst as u64, bytes, 1, bytes, bytes) }?
            }
            Shared::Reduce { acc, x, n, max } => {
                unsafe { prog.reduce(acc as u64, x as u64, n, max) }?
            }
        }
    }
    Ok(())
}

impl Rank for StreamRank<'_> {
    fn launch(&mut self, kernel: usize, buffers: &[usize]) -> Result<(), String> {
        self.mem.launch(kernel, buffers)
    }

    fn copy(&mut self, m: &Move) -> Result<(), String> {
        self.mem.copy(m)
    }

    fn collective(&mut self, group: usize, member: usize, op: &Flat<At>) -> Result<(), String> {
        let members = self.comm.members(group) as u64;
        let op = op.map(members, &mut |a, bytes| {
            self.mem.address(a, bytes).map(|x| x as usize)
        })?;
        let ready = self.mark()?;
        let device = self.device;
        let done = self
            .comm
            .meet(device, group, member, op, ready, |ops, readies| {
                // The last member to arrive: its stream waits for every member's work so
                // far, runs the collective over their memory, and marks its end.
                let prog = self.mem.prog;
                let stream = prog.stream();
                for e in &readies {
                    cu(stream.wait(e), device, "waiting for a member")?;
                }
                let steps = shared_plan(ops)?;
                // SAFETY: every address lies in a member's arena or scratch on this GPU
                // (located by its member), and each member's stream waits for `done` before
                // it touches them again.
                unsafe { queue(prog, &steps) }?;
                cu(stream.record_event(None), device, "an event").map(Arc::new)
            })?;
        cu(self.mem.prog.stream().wait(&done), device, "a collective")
    }

    fn send(&mut self, op: &P2p<At>) -> Result<(), String> {
        let at = self.mem.address(op.at, op.bytes)?;
        let stream = self.mem.prog.stream();
        // SAFETY: written whole by the copy below before anything reads it.
        let bytes = cu(
            unsafe { stream.alloc::<u8>(op.bytes.max(1) as usize) },
            self.device,
            &format!("a parcel for '{}'", op.tag),
        )?;
        let dst = bytes.device_ptr(stream).0;
        // SAFETY: the buffer lies in this rank's arena (located); the parcel is fresh
        // and `op.bytes` long.
        unsafe {
            self.mem
                .prog
                .copy2d(at, dst, op.bytes, 1, op.bytes, op.bytes)
        }?;
        let ready = self.mark()?;
        self.comm.post(
            self.device,
            op.peer,
            op.lane,
            &op.tag,
            op.bytes,
            Parcel { bytes, ready },
        )
    }

    fn recv(&mut self, op: &P2p<At>) -> Result<(), String> {
        let at = self.mem.address(op.at, op.bytes)?;
        let parcel = self
            .comm
            .take(self.device, op.peer, op.lane, &op.tag, op.bytes)?;
        let stream = self.mem.prog.stream();
        cu(stream.wait(&parcel.ready), self.device, &op.tag)?;
        let src = parcel.bytes.device_ptr(stream).0;
        // SAFETY: the parcel holds `op.bytes` once `ready` (waited for above); the buffer
        // lies in this rank's arena (located).
        unsafe {
            self.mem
                .prog
                .copy2d(src, at, op.bytes, 1, op.bytes, op.bytes)
        }?;
        self.kept.push(parcel);
        Ok(())
    }
}

/// Runs `art` (loaded as `prog`, on its GPU) `repeat` times (at least once) with every
/// device a virtual device on that GPU with a stream of its own, driven by a thread of
/// its own; returns the results made whole and the seconds of each run (from a barrier
/// before every device's first step until the slowest device's stream finished).
pub fn run_ranks_timed(
    prog: &CudaProgram,
    inputs: &[Tensor],
    repeat: usize,
) -> Result<(Vec<Tensor>, Vec<f64>), String> {
    let art: &Artifact = prog.artifact();
    let lanes = lanes(art)?;
    let devices = art.devices().max(1);
    let groups = Groups::of(art);
    let words = rank_scratch(art, &groups)?.div_ceil(8).max(1) as usize;
    let mut host = load_inputs(art, inputs)?;
    let comm: StreamComm = Comm::new(devices, &groups);
    let repeat = repeat.max(1);
    let gate = Gate::new(devices);
    let (comm, gate, groups, lanes) = (&comm, &gate, &groups, &lanes);
    let per_device = on_threads(
        art,
        &mut host,
        |p, device, h_arena| -> Result<Vec<f64>, String> {
            let mine = prog.fork()?;
            let stream = mine.stream().clone();
            let scratch = cu(stream.alloc_zeros::<u64>(words), device, "scratch")?;
            // Parcels received in a run, kept until the stream has copied them.
            let kept = std::cell::RefCell::new(Vec::new());
            let (times, arena) = runs(
                comm,
                gate,
                device,
                repeat,
                // Every run starts from the arguments.
                || {
                    let a = cu(stream.clone_htod(h_arena.as_slice()), device, "arguments")?;
                    cu(stream.synchronize(), device, "arguments")?;
                    Ok(a)
                },
                |a| {
                    let mut rank = StreamRank {
                        mem: RankMemory {
                            prog: &mine,
                            p,
                            arena: a,
                            scratch: &scratch,
                        },
                        device,
                        comm,
                        kept: Vec::new(),
                    };
                    let r = run_rank(art, &lanes[p], p, device, groups, &mut rank);
                    kept.borrow_mut().append(&mut rank.kept);
                    if r.is_err() {
                        // Nothing queued may still read a parcel when they are freed.
                        let _ = stream.synchronize();
                    }
                    r
                },
                |_| {
                    cu(stream.synchronize(), device, "the step")?;
                    kept.borrow_mut().clear();
                    Ok(())
                },
            )?;
            if let Some(a) = arena {
                cu(
                    stream.memcpy_dtoh(&a, h_arena.as_mut_slice()),
                    device,
                    "results",
                )?;
                cu(stream.synchronize(), device, "results")?;
            }
            Ok(times)
        },
        |device, r| {
            // A failure stops the others: at the next run's gate, or in the
            // communicator where they wait for this device.
            let unit = r.as_ref().map(|_| ()).map_err(Clone::clone);
            comm.finish(device, &unit);
            if r.is_err() {
                gate.fail();
            }
        },
    );
    // The first failure (a deadlock names every wait) before those it caused.
    if let Some(e) = comm.failure() {
        return Err(e);
    }
    let mut times = vec![0.0f64; repeat];
    for r in per_device {
        for (t, d) in times.iter_mut().zip(r?) {
            *t = t.max(d);
        }
    }
    if let Some(e) = comm.unreceived() {
        return Err(e);
    }
    Ok((results(art, &host)?, times))
}

/// Where the ranks of a program run on GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// A GPU per device where there are enough GPUs and NCCL loads, else streams on one.
    Auto,
    /// Device `d` on GPU `d`, collectives and messages through NCCL ([`crate::nccl`]).
    Gpus,
    /// Every device a stream on the program's GPU ([`run_ranks_timed`]).
    Streams,
}

impl std::str::FromStr for Placement {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(Placement::Auto),
            "gpus" => Ok(Placement::Gpus),
            "streams" => Ok(Placement::Streams),
            _ => Err(format!("'{s}': ranks run on auto, gpus or streams")),
        }
    }
}

/// Runs `prog`'s artifact as ranks placed by `on` ([`Placement`]): the results made
/// whole, each run's seconds, and a line saying where the ranks ran.
pub fn run_ranks(
    prog: &CudaProgram,
    inputs: &[Tensor],
    repeat: usize,
    on: Placement,
) -> Result<(Vec<Tensor>, Vec<f64>, String), String> {
    let devices = prog.artifact().devices().max(1);
    let gpus = crate::cuda::available()?;
    // SAFETY: probing for the library has no preconditions.
    let nccl = unsafe { cudarc::nccl::sys::is_culib_present() };
    let gpus_each = match on {
        Placement::Gpus => true,
        Placement::Streams => false,
        Placement::Auto => gpus >= devices && nccl,
    };
    if gpus_each {
        let (outs, times) = crate::nccl::run_ranks_timed(prog.artifact(), inputs, repeat)?;
        let line = format!("ranks: {devices} GPUs, a device each, through NCCL");
        Ok((outs, times, line))
    } else {
        let (outs, times) = run_ranks_timed(prog, inputs, repeat)?;
        let why = match on {
            Placement::Auto if gpus < devices => format!(" ({gpus} GPU(s) for {devices} devices)"),
            Placement::Auto => " (NCCL cannot be loaded)".to_string(),
            _ => String::new(),
        };
        let line = format!("ranks: {devices} streams on one GPU{why}");
        Ok((outs, times, line))
    }
}
