//! The host backend: an artifact's `host.so` section (its kernels compiled for this CPU)
//! loaded with `dlopen`, its programs' steps run over one arena per device.
//!
//! Programs run under [`schedule`], which the CUDA backend shares: each program runs its
//! steps in order until it reaches a receive whose send has not happened yet, then the
//! next program runs; a program's devices run each step together (collectives among
//! them). Sends do not wait. When no program can move and some have steps left, the run
//! is a deadlock, reported with what each program waits for.

use crate::artifact::{Artifact, Buffer, Elt, Step};
use crate::collective::{moves, scratch_bytes, At, Move, Places};
use crate::tensor::{Tensor, Values};
use std::collections::{HashMap, VecDeque};
use std::ffi::{c_void, CString};

type HostFn = unsafe extern "C" fn(*const *mut u8, u64);

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
    fns: Vec<HostFn>,
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

impl HostProgram {
    /// Loads the artifact's host kernels.
    pub fn load(art: Artifact) -> Result<Self, String> {
        let so = art
            .section("host.so")
            .ok_or("the artifact has no host.so section (compiled without host kernels)")?;
        // dlopen needs a file: a private temporary, removed once loaded.
        let path = std::env::temp_dir().join(format!(
            "nnscaler-rt-{}-{:016x}.so",
            std::process::id(),
            crate::artifact::fnv1a64(so)
        ));
        std::fs::write(&path, so).map_err(|e| format!("{}: {e}", path.display()))?;
        let c = CString::new(path.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: `c` is a NUL-terminated path; the library is our kernels (no
        // constructors besides the C runtime's).
        let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        let _ = std::fs::remove_file(&path);
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
            fns.push(unsafe { std::mem::transmute::<*mut c_void, HostFn>(f) });
        }
        Ok(HostProgram { art, lib, fns })
    }

    /// The artifact.
    pub fn artifact(&self) -> &Artifact {
        &self.art
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

    fn execute(&self, arenas: &mut Arenas) -> Result<(), String> {
        schedule(&self.art, &mut HostEngine::new(self, arenas)?)
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
                    for r in 0..rows as usize {
                        // SAFETY: both runs lie in their places (checked above); distinct
                        // buffers, so `copy` (memmove) is only ever careful.
                        unsafe {
                            std::ptr::copy(
                                s.add(r * src_pitch as usize),
                                d.add(r * dst_pitch as usize),
                                width as usize,
                            )
                        };
                    }
                }
                Move::Reduce { n, max, .. } => {
                    let r = self
                        .art
                        .header
                        .reducers
                        .ok_or("the artifact has no reducers")?;
                    let k = if max { r.max } else { r.sum };
                    let args = [d, s, d];
                    // SAFETY: the reducer reads and writes `n` f32s at each pointer,
                    // all inside their places (checked); `dst` is both read and written
                    // element by element, as the kernel's contract allows.
                    unsafe { (self.fns[k])(args.as_ptr(), n) };
                }
            }
        }
        Ok(())
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
            unsafe { (self.prog.fns[*kernel])(args.as_ptr(), h.kernels[*kernel].len) };
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
        if t.shape != p.global_shape || t.elt() != p.elt {
            return Err(format!(
                "'{}' must be {:?} {:?}, given {:?} {:?}",
                p.name,
                p.elt,
                p.global_shape,
                t.elt(),
                t.shape
            ));
        }
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
                let at = c.offsets[if c.offsets.len() > 1 { d } else { 0 }] as usize;
                let src = &consts[at..][..b.bytes() as usize];
                write_at(arena, b.offset, src);
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
    let mut out: Vec<Option<Tensor>> = vec![None; h.outputs.len()];
    for (prog, arenas) in h.programs.iter().zip(arenas) {
        for bd in &prog.outputs {
            let p = &h.outputs[bd.port];
            let b = &prog.buffers[bd.buffer];
            let es = b.elt.size() as usize;
            let n: u64 = p.global_shape.iter().product();
            let mut whole = vec![0u8; n as usize * es];
            let mut owner: Vec<Option<usize>> = vec![None; n as usize];
            for (d, arena) in arenas.iter().enumerate() {
                let piece = &bytes(arena)[b.offset as usize..][..b.bytes() as usize];
                let device = prog.devices[d];
                let clash = place_checked(
                    &mut whole,
                    &p.global_shape,
                    &bd.shards[d],
                    piece,
                    es,
                    &mut owner,
                    device,
                );
                if let Some((i, first)) = clash {
                    return Err(format!(
                        "replicas of '{}' disagree: element {i} on devices {first} and {device}",
                        p.name
                    ));
                }
            }
            let data = match b.elt {
                Elt::F32 => Values::F32(
                    whole
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                        .collect(),
                ),
                Elt::I64 => Values::I64(
                    whole
                        .chunks_exact(8)
                        .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                        .collect(),
                ),
            };
            out[bd.port] = Some(Tensor {
                shape: p.global_shape.clone(),
                data,
            });
        }
    }
    out.into_iter()
        .zip(&h.outputs)
        .map(|(t, p)| t.ok_or_else(|| format!("no program computes '{}'", p.name)))
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
fn write_at(arena: &mut [u64], offset: u64, bytes: &[u8]) {
    bytes_mut(arena)[offset as usize..][..bytes.len()].copy_from_slice(bytes);
}

/// A buffer's bytes in an arena.
fn get(arena: &[u64], b: &Buffer) -> Vec<u8> {
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
fn cut(whole: &[u8], shape: &[u64], ranges: &[[u64; 2]], es: usize) -> Vec<u8> {
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
fn place_checked(
    whole: &mut [u8],
    shape: &[u64],
    ranges: &[[u64; 2]],
    piece: &[u8],
    es: usize,
    owner: &mut [Option<usize>],
    device: usize,
) -> Option<(usize, usize)> {
    let mut clash = None;
    runs(shape, ranges, |w, p, len| {
        for k in 0..len {
            let (wi, pi) = (w + k, p + k);
            let src = &piece[pi * es..(pi + 1) * es];
            match owner[wi] {
                Some(first) if &whole[wi * es..(wi + 1) * es] != src => {
                    clash.get_or_insert((wi, first));
                }
                Some(_) => {}
                None => {
                    whole[wi * es..(wi + 1) * es].copy_from_slice(src);
                    owner[wi] = Some(device);
                }
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

#[cfg(test)]
mod tests {
    use super::{cut, place, place_checked};

    #[test]
    fn blocks_cut_and_place_back() {
        // A 3 x 4 tensor of u32 indices; the block rows 1..3, columns 1..3.
        let shape = [3u64, 4];
        let whole: Vec<u8> = (0u32..12).flat_map(|v| v.to_le_bytes()).collect();
        let ranges = [[1, 3], [1, 3]];
        let piece = cut(&whole, &shape, &ranges, 4);
        let vals: Vec<u32> = piece
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        assert_eq!(vals, vec![5, 6, 9, 10]);
        let mut back = vec![0u8; whole.len()];
        place(&mut back, &shape, &ranges, &piece, 4);
        assert_eq!(&back[20..28], &whole[20..28]);
        // Replicas must agree bit for bit.
        let mut owner = vec![None; 12];
        let mut out = vec![0u8; whole.len()];
        assert_eq!(
            place_checked(&mut out, &shape, &ranges, &piece, 4, &mut owner, 0),
            None
        );
        let mut other = piece.clone();
        other[0] ^= 1;
        assert_eq!(
            place_checked(&mut out, &shape, &ranges, &other, 4, &mut owner, 1),
            Some((5, 0))
        );
    }
}

#[cfg(test)]
mod schedule_tests {
    use super::{schedule, Engine};
    use crate::artifact::{Artifact, Buffer, Elt, Header, MeshAxis, Program, Step, Target};

    /// Records what ran; a buffer's bytes are its program's number.
    struct Log(Vec<String>);

    impl Engine for Log {
        type Parcel = Vec<Vec<u8>>;
        fn bytes(&mut self, p: usize, b: usize) -> Result<Vec<Vec<u8>>, String> {
            self.read(p, b)
        }
        fn put_bytes(&mut self, p: usize, b: usize, v: Vec<Vec<u8>>) -> Result<(), String> {
            self.write(p, b, v)
        }
        fn step(&mut self, p: usize, s: &Step) -> Result<(), String> {
            if let Step::Launch { kernel, .. } = s {
                self.0.push(format!("p{p} k{kernel}"));
            }
            Ok(())
        }
        fn read(&mut self, p: usize, _: usize) -> Result<Vec<Vec<u8>>, String> {
            self.0.push(format!("p{p} send"));
            Ok(vec![vec![p as u8]])
        }
        fn write(&mut self, p: usize, _: usize, data: Vec<Vec<u8>>) -> Result<(), String> {
            self.0.push(format!("p{p} got {}", data[0][0]));
            Ok(())
        }
    }

    fn art(steps: [Vec<Step>; 2]) -> Artifact {
        let [a, b] = steps;
        let prog = |name: &str, d: usize, steps: Vec<Step>| Program {
            name: name.into(),
            devices: vec![d],
            inputs: Vec::new(),
            outputs: Vec::new(),
            buffers: vec![Buffer {
                shape: vec![1],
                elt: Elt::F32,
                offset: 0,
            }],
            arena_bytes: 256,
            constants: Vec::new(),
            steps,
        };
        Artifact {
            header: Header {
                target: Target { sm: 90, ptx: 80 },
                source: String::new(),
                mesh: vec![MeshAxis {
                    name: "pp".into(),
                    size: 2,
                }],
                pipeline_axis: Some("pp".into()),
                inputs: Vec::new(),
                outputs: Vec::new(),
                kernels: Vec::new(),
                reducers: None,
                programs: vec![prog("f.pp0", 0, a), prog("f.pp1", 1, b)],
                sections: Vec::new(),
            },
            sections: Vec::new(),
        }
    }

    fn launch(k: usize) -> Step {
        Step::Launch {
            kernel: k,
            buffers: Vec::new(),
        }
    }
    fn send(to: usize, tag: &str) -> Step {
        Step::Send {
            buffer: 0,
            to,
            tag: tag.into(),
        }
    }
    fn recv(from: usize, tag: &str) -> Step {
        Step::Recv {
            buffer: 0,
            from,
            tag: tag.into(),
        }
    }

    /// A receive waits for its send; the other program runs meanwhile; FIFO per tag.
    #[test]
    fn receives_wait_for_their_sends() {
        let a = art([
            vec![launch(0), send(1, "x"), recv(1, "dx"), launch(1)],
            vec![recv(0, "x"), launch(2), send(0, "dx")],
        ]);
        let mut log = Log(Vec::new());
        schedule(&a, &mut log).unwrap();
        assert_eq!(
            log.0,
            ["p0 k0", "p0 send", "p1 got 0", "p1 k2", "p1 send", "p0 got 1", "p0 k1"]
        );
    }

    /// Both programs receive first: a deadlock naming what each waits for.
    #[test]
    fn a_cycle_of_receives_is_a_deadlock() {
        let a = art([
            vec![recv(1, "dx"), send(1, "x")],
            vec![recv(0, "x"), send(0, "dx")],
        ]);
        let e = schedule(&a, &mut Log(Vec::new())).unwrap_err();
        assert_eq!(
            e,
            "deadlock: 'f.pp0' waits at step 0 for 'dx' from 'f.pp1'; 'f.pp1' waits at step 0 for 'x' from 'f.pp0'"
        );
        let a = art([vec![send(1, "x"), send(1, "x")], vec![recv(0, "x")]]);
        let e = schedule(&a, &mut Log(Vec::new())).unwrap_err();
        assert_eq!(e, "'f.pp0' sent 'x' to 'f.pp1', which never received it");
    }
}
