//! The host backend: an artifact's `host.so` section (its kernels compiled for this CPU)
//! loaded with `dlopen`, its programs' steps run over one arena per device.
//!
//! Programs run under [`schedule`], which the CUDA backend shares: each program runs its
//! steps in order until it reaches a receive whose send has not happened yet, then the
//! next program runs; a program's devices run each step together (collectives among
//! them). Sends do not wait. When no program can move and some have steps left, the run
//! is a deadlock, reported with what each program waits for.

use crate::artifact::{Artifact, Buffer, Step};
use crate::collective::{moves, scratch_bytes, At, Move, Places};
use crate::ranks::{lanes, on_threads, rank_scratch, run_rank, Flat, Groups, HostComm, P2p, Rank};
use crate::tensor::Tensor;
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CString};

pub(crate) type HostFn = unsafe extern "C" fn(*const *mut u8, u64);

mod blas;

/// A kernel as the host runs it: its entry in `host.so`, or for an f32 matrix product the
/// `gemm` crate ([`blas`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct HostKernel {
    f: HostFn,
    gemm: Option<crate::artifact::Gemm>,
}

impl HostKernel {
    /// Runs the kernel on its buffers at `args` over `n` indices.
    ///
    /// # Safety
    /// `args` must hold the kernel's buffers, each of the bytes it was compiled for
    /// ([`crate::artifact::Kernel::sizes`], checked on reading), and nothing else may use
    /// them meanwhile (except as the kernel's contract allows: a reducer's `acc`, read and
    /// written element by element).
    pub(crate) unsafe fn call(&self, args: &[*mut u8], n: u64) {
        match &self.gemm {
            // SAFETY: the caller's contract ([`blas::takes`] chose only f32 products).
            Some(g) => unsafe { blas::product(g, args) },
            // SAFETY: the caller's contract.
            None => unsafe { (self.f)(args.as_ptr(), n) },
        }
    }
}

/// Per program, one arena per device of it (8-byte words; offsets are multiples of 256).
pub(crate) type Arenas = Vec<Vec<Vec<u64>>>;

/// What [`schedule`] needs of a backend: run a program's kernel launches and collectives
/// on its devices, and read and write a buffer of each of its devices (sends and
/// receives).
pub(crate) trait Engine {
    /// A sent buffer of every device of a program, until it is received.
    type Parcel;
    /// Runs launch or collective step `s` of program `p` on every device of it.
    fn step(&mut self, p: usize, s: &Step) -> Result<(), String>;
    /// A copy of program `p`'s buffer `b` on each of its devices.
    fn read(&mut self, p: usize, b: usize) -> Result<Self::Parcel, String>;
    /// Writes each of program `p`'s devices' piece of `parcel` into its buffer `b`.
    fn write(&mut self, p: usize, b: usize, parcel: Self::Parcel) -> Result<(), String>;
    /// The bytes of program `p`'s buffer `b` on each of its devices (on the host).
    fn bytes(&mut self, p: usize, b: usize) -> Result<Vec<Vec<u8>>, String>;
    /// Writes each device's bytes (from the host) into program `p`'s buffer `b` (for
    /// `crate::compare`, which only the CUDA backend uses).
    #[cfg_attr(not(any(test, feature = "cuda")), allow(dead_code))]
    fn put_bytes(&mut self, p: usize, b: usize, bytes: Vec<Vec<u8>>) -> Result<(), String>;
}

/// Sent and not yet received: (from, to, tag) -> the parcels, in the order sent.
type Mailbox<'a, P> = HashMap<(usize, usize, &'a str), VecDeque<P>>;

/// Runs every program of `art` to its end (see the module's docs).
pub(crate) fn schedule<E: Engine>(art: &Artifact, e: &mut E) -> Result<(), String> {
    let programs = &art.header.programs;
    let mut pc = vec![0usize; programs.len()];
    let mut mail: Mailbox<'_, E::Parcel> = HashMap::new();
    loop {
        let mut moved = false;
        for (p, prog) in programs.iter().enumerate() {
            while let Some(s) = prog.steps.get(pc[p]) {
                match s {
                    Step::Send { buffer, to, tag } => {
                        let data = e.read(p, *buffer)?;
                        mail.entry((p, *to, tag.as_str()))
                            .or_default()
                            .push_back(data);
                    }
                    Step::Recv { buffer, from, tag } => {
                        let got = mail
                            .get_mut(&(*from, p, tag.as_str()))
                            .and_then(VecDeque::pop_front);
                        match got {
                            Some(data) => e.write(p, *buffer, data)?,
                            None => break,
                        }
                    }
                    _ => e.step(p, s)?,
                }
                pc[p] += 1;
                moved = true;
            }
        }
        if pc.iter().zip(programs).all(|(&i, p)| i == p.steps.len()) {
            break;
        }
        if !moved {
            let waiting: Vec<String> = programs
                .iter()
                .zip(&pc)
                .filter_map(|(p, &i)| match p.steps.get(i) {
                    Some(Step::Recv { from, tag, .. }) => Some(format!(
                        "'{}' waits at step {i} for '{tag}' from '{}'",
                        p.name, programs[*from].name
                    )),
                    _ => None,
                })
                .collect();
            return Err(format!("deadlock: {}", waiting.join("; ")));
        }
    }
    if let Some(((from, to, tag), _)) = mail.iter().find(|(_, q)| !q.is_empty()) {
        return Err(format!(
            "'{}' sent '{tag}' to '{}', which never received it",
            programs[*from].name, programs[*to].name
        ));
    }
    Ok(())
}

/// A loaded program on the host.
#[derive(Debug)]
pub struct HostProgram {
    art: Artifact,
    lib: *mut c_void,
    /// The memory file the library was loaded from (kept open while it is loaded).
    _memfd: Option<std::fs::File>,
    fns: Vec<HostKernel>,
    /// What running as ranks needs of the artifact (its lanes, groups and scratch words),
    /// worked out at the first run as ranks (a training run makes one per step).
    ranks: std::sync::OnceLock<Result<RankSetup, String>>,
}

/// [`HostProgram::run_ranks_timed`]'s plan of an artifact.
#[derive(Debug)]
struct RankSetup {
    lanes: Vec<Vec<usize>>,
    groups: Groups,
    scratch: usize,
}

fn dl_error() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc.
    unsafe {
        let e = libc::dlerror();
        if e.is_null() {
            "unknown dlopen error".into()
        } else {
            std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
        }
    }
}

/// `dlopen`s a shared object held in memory without a file another user could create,
/// replace or point elsewhere: an anonymous memory file (`memfd_create`, loaded as
/// `/proc/self/fd/N`), or where that is missing a file created with `O_EXCL |
/// O_NOFOLLOW`, mode 0600, in a fresh directory of mode 0700 (removed once loaded).
/// Returns the handle (null with `dlerror` set), and the memory file, which must stay
/// open while the library is loaded: the dynamic loader knows a library by its path, so
/// a second library loaded from a reused `/proc/self/fd/N` would be taken for the first.
fn dlopen_bytes(so: &[u8]) -> Result<(*mut c_void, Option<std::fs::File>), String> {
    use std::io::Write;
    use std::os::fd::{AsRawFd, FromRawFd};
    let open = |path: &std::path::Path| -> Result<*mut c_void, String> {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: `c` is a NUL-terminated path; the library is our kernels (no
        // constructors besides the C runtime's).
        Ok(unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) })
    };
    // SAFETY: a NUL-terminated name and flags; the result is a new fd or -1.
    let fd = unsafe { libc::memfd_create(c"nnscaler-host-kernels".as_ptr(), libc::MFD_CLOEXEC) };
    if fd >= 0 {
        // SAFETY: `fd` is a fresh descriptor this function owns (closed when `f` drops).
        let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
        f.write_all(so)
            .map_err(|e| format!("host kernels in memory: {e}"))?;
        let path = std::path::PathBuf::from(format!("/proc/self/fd/{}", f.as_raw_fd()));
        if path.exists() {
            return Ok((open(&path)?, Some(f)));
        }
    }
    // No memfd (or no /proc): a private directory.
    use std::os::unix::fs::OpenOptionsExt;
    let dir = private_dir("nnscaler-rt")
        .map_err(|e| format!("no private directory for the host kernels: {e}"))?;
    let path = dir.join("host.so");
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&path)
        .and_then(|mut f| f.write_all(so));
    let lib = match written {
        Ok(()) => open(&path),
        Err(e) => Err(format!("{}: {e}", path.display())),
    };
    let _ = std::fs::remove_file(&path);
    let _ = std::fs::remove_dir(&dir);
    Ok((lib?, None))
}

/// A fresh directory `$TMPDIR/<prefix>-<pid>-<nonce>-<k>` of mode 0700: `create`, not
/// `create_all`, fails on anything already at that name (a planted link too), so what is
/// written there no other user can swap. The caller removes it.
pub fn private_dir(prefix: &str) -> Result<std::path::PathBuf, String> {
    use std::os::unix::fs::DirBuilderExt;
    let mut last = String::new();
    for attempt in 0..16u32 {
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let dir = std::env::temp_dir().join(format!(
            "{prefix}-{}-{nonce:x}-{attempt}",
            std::process::id()
        ));
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) => last = format!("{}: {e}", dir.display()),
        }
    }
    Err(last)
}

impl HostProgram {
    /// Loads the artifact's host kernels.
    pub fn load(art: Artifact) -> Result<Self, String> {
        // The arenas against the host's memory before anything is allocated.
        crate::memory::check(&art, None, crate::memory::host_available())?;
        let so = art
            .section("host.so")
            .ok_or("the artifact has no host.so section (compiled without host kernels)")?;
        let (lib, memfd) = dlopen_bytes(so)?;
        if lib.is_null() {
            return Err(format!("cannot load the host kernels: {}", dl_error()));
        }
        let mut fns = Vec::new();
        for k in &art.header.kernels {
            let sym = CString::new(format!("{}.host", k.name)).map_err(|e| e.to_string())?;
            // SAFETY: `lib` is a live handle and `sym` NUL-terminated.
            let f = unsafe { libc::dlsym(lib, sym.as_ptr()) };
            if f.is_null() {
                // SAFETY: `lib` came from dlopen and is not used again.
                unsafe { libc::dlclose(lib) };
                return Err(format!("host.so has no kernel {}.host", k.name));
            }
            // SAFETY: the symbol is a kernel entry with this signature (the artifact
            // format's contract for host.so).
            let f = unsafe { std::mem::transmute::<*mut c_void, HostFn>(f) };
            fns.push(HostKernel {
                f,
                gemm: blas::takes(k),
            });
        }
        Ok(HostProgram {
            art,
            lib,
            _memfd: memfd,
            fns,
            ranks: std::sync::OnceLock::new(),
        })
    }

    /// The artifact.
    pub fn artifact(&self) -> &Artifact {
        &self.art
    }

    /// Its kernels' entry points, by kernel.
    pub(crate) fn fns(&self) -> &[HostKernel] {
        &self.fns
    }

    /// Runs the program once on its arguments (whole tensors, in order) on every device
    /// of its mesh in lockstep (each device its own arena: a virtual device); returns its
    /// results made whole from the devices' pieces.
    pub fn run(&self, inputs: &[Tensor]) -> Result<Vec<Tensor>, String> {
        Ok(self.run_timed(inputs, 1)?.0)
    }

    /// [`HostProgram::run`] `repeat` times (at least once): the results, and the seconds
    /// of each run's steps.
    pub fn run_timed(
        &self,
        inputs: &[Tensor],
        repeat: usize,
    ) -> Result<(Vec<Tensor>, Vec<f64>), String> {
        let mut times = Vec::new();
        let mut out = Vec::new();
        for _ in 0..repeat.max(1) {
            let mut arenas = load_inputs(&self.art, inputs)?;
            let started = std::time::Instant::now();
            self.execute(&mut arenas)?;
            times.push(started.elapsed().as_secs_f64());
            out = results(&self.art, &arenas)?;
        }
        Ok((out, times))
    }

    /// [`HostProgram::run`] with every step timed: the results and the run's profile by
    /// kernel family ([`crate::profile`]).
    pub fn run_profiled(
        &self,
        inputs: &[Tensor],
    ) -> Result<(Vec<Tensor>, crate::profile::Profile), String> {
        let mut arenas = load_inputs(&self.art, inputs)?;
        let mut clock = crate::profile::Wall;
        let profile = {
            let engine = HostEngine::new(self, &mut arenas)?;
            let mut timed = crate::profile::Profiled::new(engine, &mut clock, &self.art);
            schedule(&self.art, &mut timed)?;
            timed.profile()?
        };
        Ok((results(&self.art, &arenas)?, profile))
    }

    fn execute(&self, arenas: &mut Arenas) -> Result<(), String> {
        schedule(&self.art, &mut HostEngine::new(self, arenas)?)
    }

    /// [`HostProgram::run_timed`] with every device on a thread of its own
    /// ([`crate::ranks`]): collectives through the in-process communicator, messages
    /// matched in order on lanes, as NCCL matches them. The results are the same bits as
    /// the lockstep's; the devices compute at once.
    pub fn run_ranks_timed(
        &self,
        inputs: &[Tensor],
        repeat: usize,
    ) -> Result<(Vec<Tensor>, Vec<f64>), String> {
        let setup = self.ranks.get_or_init(|| {
            let lanes = lanes(&self.art)?;
            let groups = Groups::of(&self.art);
            let scratch = rank_scratch(&self.art, &groups)?.div_ceil(8) as usize;
            Ok(RankSetup {
                lanes,
                groups,
                scratch,
            })
        });
        let RankSetup {
            lanes,
            groups,
            scratch,
        } = setup.as_ref().map_err(Clone::clone)?;
        let mut times = Vec::new();
        let mut out = Vec::new();
        for _ in 0..repeat.max(1) {
            let mut arenas = load_inputs(&self.art, inputs)?;
            let started = std::time::Instant::now();
            run_ranks(&self.art, lanes, &self.fns, groups, *scratch, &mut arenas)?;
            times.push(started.elapsed().as_secs_f64());
            out = results(&self.art, &arenas)?;
        }
        Ok((out, times))
    }

    /// Runs a collective's moves over a program's arenas (in its devices' order) and the
    /// scratch space: copies by `memmove`, reductions by the artifact's reducer kernels.
    fn run_moves(
        &self,
        ms: &[Move],
        arenas: &mut [Vec<u64>],
        scratch: &mut [u64],
    ) -> Result<(), String> {
        let places = Places {
            devices: arenas
                .iter_mut()
                .map(|a| (bytes_mut(a).as_mut_ptr(), a.len() as u64 * 8))
                .collect(),
            scratch: (bytes_mut(scratch).as_mut_ptr(), scratch.len() as u64 * 8),
        };
        // A move's address, checked to lie with `bytes` inside its place.
        let addr = |a: At, bytes: u64| -> Result<*mut u8, String> {
            let (base, offset) = places.locate(a, bytes)?;
            // SAFETY: in bounds, just checked.
            Ok(unsafe { base.add(offset as usize) })
        };
        for m in ms {
            let [(src, src_span), (dst, dst_span)] = m.spans();
            let (s, d) = (addr(src, src_span)?, addr(dst, dst_span)?);
            match *m {
                Move::Copy {
                    width,
                    rows,
                    src_pitch,
                    dst_pitch,
                    ..
                } => {
                    if src_span == 0 {
                        continue;
                    }
                    // SAFETY: both spans lie in their places (checked above).
                    unsafe { strided(s, d, width, rows, src_pitch, dst_pitch) };
                }
                Move::Reduce { n, max, .. } => {
                    let k = self.art.header.reducer(max)?;
                    let args = [d, s, d];
                    // SAFETY: the reducer reads and writes `n` f32s at each pointer,
                    // all inside their places (checked); `dst` is both read and written
                    // element by element, as the kernel's contract allows.
                    unsafe { self.fns[k].call(&args, n) };
                }
            }
        }
        Ok(())
    }
}

/// Runs every device of `art` on a thread of its own over `arenas` (from
/// [`load_inputs`]), with `scratch` words of scratch space each and the in-process
/// communicator; the first error (a deadlock names every wait) if one failed.
fn run_ranks(
    art: &Artifact,
    lanes: &[Vec<usize>],
    fns: &[HostKernel],
    groups: &Groups,
    scratch: usize,
    arenas: &mut Arenas,
) -> Result<(), String> {
    // The programs partition the mesh's devices, numbered 0.. (checked on reading).
    let comm = HostComm::new(art.devices().max(1), groups);
    let comm = &comm;
    let failed: Vec<String> = on_threads(
        art,
        arenas,
        |p, device, arena| {
            let mut rank = HostRank {
                art,
                fns,
                comm,
                p,
                device,
                arena: (
                    bytes_mut(arena).as_mut_ptr() as usize,
                    arena.len() as u64 * 8,
                ),
                scratch: vec![0u64; scratch.max(1)],
            };
            run_rank(art, &lanes[p], p, device, groups, &mut rank)
        },
        // A failure (a panic too) stops the others instead of leaving them waiting.
        |device, r| comm.finish(device, r),
    )
    .into_iter()
    .filter_map(Result::err)
    .collect();
    match comm
        .failure()
        .or(failed.into_iter().next())
        .or_else(|| comm.unreceived())
    {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// What a host rank's collectives, sends and receives go through: the in-process
/// communicator ([`HostComm`]), or the network between processes (`crate::procs`).
pub(crate) trait HostWire: Sync {
    /// How many devices group `group` has.
    fn members(&self, group: usize) -> usize;
    /// `device`, member `member` of group `group`, takes part in a flat collective at
    /// host addresses; returns when its part is complete.
    ///
    /// # Safety
    /// The addresses must be valid for the collective's sizes, and the member must not
    /// touch that memory until this returns.
    unsafe fn collective(
        &self,
        device: usize,
        group: usize,
        member: usize,
        op: Flat<usize>,
    ) -> Result<(), String>;
    /// `device` sends `op.bytes` at `op.at` to `op.peer`; does not wait for the receive.
    ///
    /// # Safety
    /// `op.at` must be valid for `op.bytes` bytes.
    unsafe fn send(&self, device: usize, op: &P2p<usize>) -> Result<(), String>;
    /// `device` receives the next message from `op.peer` on its lane into `op.at`.
    ///
    /// # Safety
    /// `op.at` must be valid for `op.bytes` bytes that nothing else uses meanwhile.
    unsafe fn recv(&self, device: usize, op: &P2p<usize>) -> Result<(), String>;
}

impl HostWire for HostComm {
    fn members(&self, group: usize) -> usize {
        HostComm::members(self, group)
    }
    unsafe fn collective(
        &self,
        device: usize,
        group: usize,
        member: usize,
        op: Flat<usize>,
    ) -> Result<(), String> {
        // SAFETY: the caller's contract, passed on.
        unsafe { HostComm::collective(self, device, group, member, op) }
    }
    unsafe fn send(&self, device: usize, op: &P2p<usize>) -> Result<(), String> {
        // SAFETY: the caller's contract, passed on.
        unsafe { HostComm::send(self, device, op) }
    }
    unsafe fn recv(&self, device: usize, op: &P2p<usize>) -> Result<(), String> {
        // SAFETY: the caller's contract, passed on.
        unsafe { HostComm::recv(self, device, op) }
    }
}

/// A device of a host run on its own thread ([`HostProgram::run_ranks_timed`]): its
/// arena (a host address and its bytes; used only through this address while the run
/// lasts) and its scratch space.
pub(crate) struct HostRank<'a, W: HostWire> {
    pub(crate) art: &'a Artifact,
    pub(crate) fns: &'a [HostKernel],
    pub(crate) comm: &'a W,
    pub(crate) p: usize,
    pub(crate) device: usize,
    pub(crate) arena: (usize, u64),
    pub(crate) scratch: Vec<u64>,
}

impl<W: HostWire> HostRank<'_, W> {
    /// A send or receive at its host address.
    fn locate(&mut self, op: &P2p<At>) -> Result<P2p<usize>, String> {
        let (base, off) = self.places().locate(op.at, op.bytes)?;
        Ok(P2p {
            peer: op.peer,
            at: base + off as usize,
            bytes: op.bytes,
            tag: op.tag.clone(),
            lane: op.lane,
        })
    }

    fn places(&mut self) -> Places<usize> {
        Places {
            devices: vec![self.arena],
            scratch: (
                bytes_mut(&mut self.scratch).as_mut_ptr() as usize,
                self.scratch.len() as u64 * 8,
            ),
        }
    }
}

impl<W: HostWire> Rank for HostRank<'_, W> {
    fn launch(&mut self, kernel: usize, buffers: &[usize]) -> Result<(), String> {
        let prog = &self.art.header.programs[self.p];
        let base = self.arena.0 as *mut u8;
        // SAFETY: every buffer lies inside the arena (checked on reading).
        let args: Vec<*mut u8> = buffers
            .iter()
            .map(|&b| unsafe { base.add(prog.buffers[b].offset as usize) })
            .collect();
        // SAFETY: the kernel reads and writes its buffers within their lengths, all in
        // this device's arena, which only this thread uses outside its collectives.
        unsafe { self.fns[kernel].call(&args, self.art.header.kernels[kernel].len) };
        Ok(())
    }

    fn copy(&mut self, m: &Move) -> Result<(), String> {
        let Some(c) = self.places().local_copy(m)? else {
            return Ok(());
        };
        // SAFETY: both spans lie in this rank's arena or scratch (checked by local_copy).
        unsafe {
            strided(
                (c.src.0 + c.src.1 as usize) as *const u8,
                (c.dst.0 + c.dst.1 as usize) as *mut u8,
                c.width,
                c.rows,
                c.src_pitch,
                c.dst_pitch,
            )
        };
        Ok(())
    }

    fn collective(&mut self, group: usize, member: usize, op: &Flat<At>) -> Result<(), String> {
        let members = self.comm.members(group) as u64;
        let places = self.places();
        let op = op.map(members, &mut |a, bytes| {
            let (base, off) = places.locate(a, bytes)?;
            Ok(base + off as usize)
        })?;
        // SAFETY: the addresses lie in this rank's arena and scratch (located above),
        // which this thread leaves alone until the collective returns.
        unsafe { self.comm.collective(self.device, group, member, op) }
    }

    fn send(&mut self, op: &P2p<At>) -> Result<(), String> {
        let op = self.locate(op)?;
        // SAFETY: the bytes lie in this rank's arena (located).
        unsafe { self.comm.send(self.device, &op) }
    }

    fn recv(&mut self, op: &P2p<At>) -> Result<(), String> {
        let op = self.locate(op)?;
        // SAFETY: as for sends; only this thread writes its arena.
        unsafe { self.comm.recv(self.device, &op) }
    }
}

/// `rows` runs of `width` bytes from `s + r * src_pitch` to `d + r * dst_pitch`.
///
/// # Safety
/// Both spans (`(rows - 1) * pitch + width` bytes) must be valid, and nothing else may
/// use them meanwhile; they may overlap (each run is a `memmove`).
unsafe fn strided(s: *const u8, d: *mut u8, width: u64, rows: u64, src_pitch: u64, dst_pitch: u64) {
    for r in 0..rows as usize {
        // SAFETY: the caller's contract.
        unsafe {
            std::ptr::copy(
                s.add(r * src_pitch as usize),
                d.add(r * dst_pitch as usize),
                width as usize,
            )
        };
    }
}

/// The host backend as an [`Engine`]: a loaded program over a run's arenas.
pub(crate) struct HostEngine<'a> {
    prog: &'a HostProgram,
    arenas: &'a mut Arenas,
    scratch: Vec<u64>,
}

impl<'a> HostEngine<'a> {
    /// `arenas` from [`load_inputs`] for `prog`'s artifact.
    pub(crate) fn new(prog: &'a HostProgram, arenas: &'a mut Arenas) -> Result<Self, String> {
        let scratch = scratch_bytes(&prog.art.header.programs)?.div_ceil(8) as usize;
        Ok(HostEngine {
            prog,
            arenas,
            scratch: vec![0; scratch],
        })
    }
}

impl Engine for HostEngine<'_> {
    type Parcel = Vec<Vec<u8>>;
    fn step(&mut self, p: usize, s: &Step) -> Result<(), String> {
        let h = &self.prog.art.header;
        let prog = &h.programs[p];
        let Step::Launch { kernel, buffers } = s else {
            let (ms, _) = moves(prog, s)?;
            return self
                .prog
                .run_moves(&ms, &mut self.arenas[p], &mut self.scratch);
        };
        for arena in self.arenas[p].iter_mut() {
            let base = bytes_mut(arena).as_mut_ptr();
            // SAFETY: every buffer lies inside the arena (checked on reading).
            let args: Vec<*mut u8> = buffers
                .iter()
                .map(|&b| unsafe { base.add(prog.buffers[b].offset as usize) })
                .collect();
            // SAFETY: the kernel reads and writes its buffers within their lengths (the
            // compiler's contract), all inside this arena, which nothing else uses
            // during the call.
            unsafe { self.prog.fns[*kernel].call(&args, h.kernels[*kernel].len) };
        }
        Ok(())
    }
    fn read(&mut self, p: usize, b: usize) -> Result<Self::Parcel, String> {
        self.bytes(p, b)
    }
    fn write(&mut self, p: usize, b: usize, pieces: Self::Parcel) -> Result<(), String> {
        let buf = &self.prog.art.header.programs[p].buffers[b];
        for (a, piece) in self.arenas[p].iter_mut().zip(pieces) {
            write_at(a, buf.offset, &piece);
        }
        Ok(())
    }
    fn bytes(&mut self, p: usize, b: usize) -> Result<Vec<Vec<u8>>, String> {
        let buf = &self.prog.art.header.programs[p].buffers[b];
        Ok(self.arenas[p].iter().map(|a| get(a, buf)).collect())
    }
    fn put_bytes(&mut self, p: usize, b: usize, bytes: Vec<Vec<u8>>) -> Result<(), String> {
        self.write(p, b, bytes)
    }
}

/// One arena per device of each program, holding the constants and each device's block
/// of every argument the program reads (`inputs`: whole tensors, in the step's order).
pub(crate) fn load_inputs(art: &Artifact, inputs: &[Tensor]) -> Result<Arenas, String> {
    let h = &art.header;
    if inputs.len() != h.inputs.len() {
        return Err(format!(
            "the program takes {} arguments, given {}",
            h.inputs.len(),
            inputs.len()
        ));
    }
    for (p, t) in h.inputs.iter().zip(inputs) {
        p.check(t)?;
    }
    let whole: Vec<Vec<u8>> = inputs.iter().map(Tensor::bytes).collect();
    let consts = art.section("consts").unwrap_or_default();
    let mut all = Vec::with_capacity(h.programs.len());
    for prog in &h.programs {
        let words = prog.arena_bytes.div_ceil(8) as usize;
        let mut arenas: Vec<Vec<u64>> = prog.devices.iter().map(|_| vec![0u64; words]).collect();
        for c in &prog.constants {
            let b = &prog.buffers[c.buffer];
            for (d, arena) in arenas.iter_mut().enumerate() {
                write_at(arena, b.offset, c.bytes(consts, b, d)?);
            }
        }
        for bd in &prog.inputs {
            let port = &h.inputs[bd.port];
            let b = &prog.buffers[bd.buffer];
            for (d, arena) in arenas.iter_mut().enumerate() {
                let piece = cut(
                    &whole[bd.port],
                    &port.global_shape,
                    &bd.shards[d],
                    b.elt.size() as usize,
                );
                write_at(arena, b.offset, &piece);
            }
        }
        all.push(arenas);
    }
    Ok(all)
}

/// The results made whole from the arenas of the devices of the programs computing them
/// (replicas must agree bit for bit).
pub(crate) fn results(art: &Artifact, arenas: &Arenas) -> Result<Vec<Tensor>, String> {
    let h = &art.header;
    (0..h.outputs.len())
        .map(|o| {
            let pieces: Vec<crate::session::Pieces> = h
                .programs
                .iter()
                .zip(arenas)
                .enumerate()
                .flat_map(|(p, (prog, arenas))| {
                    prog.outputs.iter().filter(|b| b.port == o).map(move |b| {
                        let buf = &prog.buffers[b.buffer];
                        (
                            p,
                            arenas.iter().map(|a| get(a, buf)).collect(),
                            b.shards.clone(),
                        )
                    })
                })
                .collect();
            if pieces.is_empty() {
                return Err(format!("no program computes '{}'", h.outputs[o].name));
            }
            crate::session::assemble(art, &h.outputs[o], pieces)
        })
        .collect()
}

pub(crate) fn bytes(a: &[u64]) -> &[u8] {
    // SAFETY: any u64 memory is valid as bytes; the length covers exactly the words.
    unsafe { std::slice::from_raw_parts(a.as_ptr().cast::<u8>(), a.len() * 8) }
}

pub(crate) fn bytes_mut(a: &mut [u64]) -> &mut [u8] {
    // SAFETY: as `bytes`; the borrow is exclusive.
    unsafe { std::slice::from_raw_parts_mut(a.as_mut_ptr().cast::<u8>(), a.len() * 8) }
}

/// Copies `bytes` into an arena at byte `offset`.
pub(crate) fn write_at(arena: &mut [u64], offset: u64, bytes: &[u8]) {
    bytes_mut(arena)[offset as usize..][..bytes.len()].copy_from_slice(bytes);
}

/// A buffer's bytes in an arena.
pub(crate) fn get(arena: &[u64], b: &Buffer) -> Vec<u8> {
    bytes(arena)[b.offset as usize..][..b.bytes() as usize].to_vec()
}

/// Calls `f(whole_offset, piece_offset, run)` for each contiguous run of the block
/// `ranges` of a row-major `shape` (offsets and run in elements).
fn runs(shape: &[u64], ranges: &[[u64; 2]], mut f: impl FnMut(usize, usize, usize)) {
    let r = shape.len();
    if r == 0 {
        f(0, 0, 1);
        return;
    }
    let mut strides = vec![1u64; r];
    for d in (0..r - 1).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    let inner = (ranges[r - 1][1] - ranges[r - 1][0]) as usize;
    let outer: Vec<u64> = ranges[..r - 1].iter().map(|[lo, hi]| hi - lo).collect();
    let count: u64 = outer.iter().product();
    let mut idx = vec![0u64; r - 1];
    for k in 0..count as usize {
        let mut off = ranges[r - 1][0];
        for d in 0..r - 1 {
            off += (ranges[d][0] + idx[d]) * strides[d];
        }
        f(off as usize, k * inner, inner);
        for d in (0..r - 1).rev() {
            idx[d] += 1;
            if idx[d] < outer[d] {
                break;
            }
            idx[d] = 0;
        }
    }
}

/// The block `ranges` of a whole tensor's bytes.
pub(crate) fn cut(whole: &[u8], shape: &[u64], ranges: &[[u64; 2]], es: usize) -> Vec<u8> {
    let n: u64 = ranges.iter().map(|[lo, hi]| hi - lo).product();
    let mut out = vec![0u8; n as usize * es];
    runs(shape, ranges, |w, p, len| {
        out[p * es..(p + len) * es].copy_from_slice(&whole[w * es..(w + len) * es]);
    });
    out
}

/// Writes a piece into the block `ranges` of a whole tensor's bytes.
#[cfg(test)]
fn place(whole: &mut [u8], shape: &[u64], ranges: &[[u64; 2]], piece: &[u8], es: usize) {
    runs(shape, ranges, |w, p, len| {
        whole[w * es..(w + len) * es].copy_from_slice(&piece[p * es..(p + len) * es]);
    });
}

/// [`place`], where an element already written by another device must be equal bit for
/// bit; returns the first element that is not, and the device that wrote it first.
pub(crate) fn place_checked(
    whole: &mut [u8],
    shape: &[u64],
    ranges: &[[u64; 2]],
    piece: &[u8],
    es: usize,
    owner: &mut [u32],
    device: usize,
) -> Option<(usize, usize)> {
    // `owner[i]`: the device that wrote element `i` first, `u32::MAX` before any did (4
    // bytes an element: a whole result is held at most twice beside it).
    let mut clash = None;
    runs(shape, ranges, |w, p, len| {
        for k in 0..len {
            let (wi, pi) = (w + k, p + k);
            let src = &piece[pi * es..(pi + 1) * es];
            match owner[wi] {
                u32::MAX => {
                    whole[wi * es..(wi + 1) * es].copy_from_slice(src);
                    owner[wi] = device as u32;
                }
                first if &whole[wi * es..(wi + 1) * es] != src => {
                    clash.get_or_insert((wi, first as usize));
                }
                _ => {}
            }
        }
    });
    clash
}

impl Drop for HostProgram {
    fn drop(&mut self) {
        // SAFETY: `lib` came from dlopen; no kernel pointer outlives `self`.
        unsafe { libc::dlclose(self.lib) };
    }
}

/// Host programs for the crate's tests.
#[cfg(test)]
pub(crate) mod tests_support {
    /// A host.so with the sample artifact's kernel `k0.host`: `y = 2 x`.
    pub(crate) fn doubling_so(dir: &std::path::Path) -> Vec<u8> {
        scaling_so(dir, 2)
    }

    /// A host.so whose kernel `k0.host` is `y = factor x` (built in `dir`).
    pub(crate) fn scaling_so(dir: &std::path::Path, factor: u32) -> Vec<u8> {
        let c = dir.join(format!("k{factor}.c"));
        std::fs::write(
            &c,
            format!(
                "void k0(float **a, unsigned long n) __asm__(\"k0.host\");\n\
                 void k0(float **a, unsigned long n) {{ for (unsigned long i = 0; i < n; i++) a[1][i] = {factor} * a[0][i]; }}\n"
            ),
        )
        .unwrap();
        let so = dir.join(format!("k{factor}.so"));
        let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
        let st = std::process::Command::new(cc)
            .args(["-shared", "-fPIC", "-o"])
            .arg(&so)
            .arg(&c)
            .status()
            .expect("a C compiler");
        assert!(st.success());
        std::fs::read(&so).unwrap()
    }

    /// The sample artifact (`crate::artifact::tests_support::sample`) with the doubling
    /// host.so, loaded.
    pub(crate) fn doubling(art: &crate::artifact::Artifact) -> Option<super::HostProgram> {
        let dir = std::env::temp_dir().join(format!(
            "nnscaler-doubling-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).ok()?;
        let so = doubling_so(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        let mut art = art.clone();
        art.sections.push(("host.so".into(), so));
        super::HostProgram::load(art).ok()
    }
}

#[cfg(test)]
mod load_tests;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod schedule_tests;

#[cfg(test)]
mod rank_tests;
