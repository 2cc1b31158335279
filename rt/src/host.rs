//! The host backend: an artifact's `host.so` section (its kernels compiled for this CPU)
//! loaded with `dlopen`, its steps run in order over one arena.

use crate::artifact::{Artifact, Buffer, Elt, Step};
use crate::tensor::{Tensor, Values};
use std::ffi::{c_void, CString};

type HostFn = unsafe extern "C" fn(*const *mut u8, u64);

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

    fn execute(&self, arenas: &mut [Vec<u64>]) -> Result<(), String> {
        let h = &self.art.header;
        for s in &h.steps {
            if let Step::Launch { kernel, buffers } = s {
                for arena in arenas.iter_mut() {
                    let base = bytes_mut(arena).as_mut_ptr();
                    // SAFETY: every buffer lies inside the arena (checked on reading).
                    let args: Vec<*mut u8> = buffers
                        .iter()
                        .map(|&b| unsafe { base.add(h.buffers[b].offset as usize) })
                        .collect();
                    // SAFETY: the kernel reads and writes its buffers within their
                    // lengths (the compiler's contract), all inside this arena, which
                    // nothing else uses during the call.
                    unsafe { (self.fns[*kernel])(args.as_ptr(), h.kernels[*kernel].len) };
                }
            } else {
                collective(&self.art, s, arenas)?;
            }
        }
        Ok(())
    }
}

/// One arena per device (8-byte words; offsets are multiples of 256), holding each
/// device's block of every argument (whole tensors, in order).
pub(crate) fn load_inputs(art: &Artifact, inputs: &[Tensor]) -> Result<Vec<Vec<u64>>, String> {
    let h = &art.header;
    if inputs.len() != h.inputs.len() {
        return Err(format!(
            "the program takes {} arguments, given {}",
            h.inputs.len(),
            inputs.len()
        ));
    }
    let words = h.arena_bytes.div_ceil(8) as usize;
    let mut arenas: Vec<Vec<u64>> = (0..art.devices()).map(|_| vec![0u64; words]).collect();
    let consts = art.section("consts").unwrap_or_default();
    for c in &h.constants {
        let b = &h.buffers[c.buffer];
        for (d, arena) in arenas.iter_mut().enumerate() {
            let at = c.offsets[if c.offsets.len() > 1 { d } else { 0 }] as usize;
            let src = &consts[at..][..b.bytes() as usize];
            write_at(arena, b.offset, src);
        }
    }
    for (p, t) in h.inputs.iter().zip(inputs) {
        let b = &h.buffers[p.buffer];
        if t.shape != p.global_shape || t.elt() != b.elt {
            return Err(format!(
                "'{}' must be {:?} {:?}, given {:?} {:?}",
                p.name,
                b.elt,
                p.global_shape,
                t.elt(),
                t.shape
            ));
        }
        let whole = t.bytes();
        for (d, arena) in arenas.iter_mut().enumerate() {
            let piece = cut(&whole, &p.global_shape, &p.shards[d], b.elt.size() as usize);
            let at = b.offset as usize;
            write_at(arena, at as u64, &piece);
        }
    }
    Ok(arenas)
}

/// Runs collective step `s` across the devices' arenas (a launch is an error here).
pub(crate) fn collective(art: &Artifact, s: &Step, arenas: &mut [Vec<u64>]) -> Result<(), String> {
    let h = &art.header;
    match s {
        Step::Launch { .. } => return Err("a kernel launch is not a collective".into()),
        Step::AllReduce {
            input,
            output,
            groups,
            max,
        } => {
            for g in groups {
                let r = reduced(arenas, g, &h.buffers[*input], *max);
                for &d in g {
                    put(&mut arenas[d], &h.buffers[*output], &r)?;
                }
            }
        }
        Step::AllGather {
            input,
            output,
            groups,
            dim,
        } => {
            let (ib, ob) = (&h.buffers[*input], &h.buffers[*output]);
            let es = ib.elt.size() as usize;
            for g in groups {
                let mut whole = vec![0u8; ob.bytes() as usize];
                let len = ib.shape.get(*dim).copied().unwrap_or(1);
                for (k, &d) in g.iter().enumerate() {
                    let piece = get(&arenas[d], ib);
                    let ranges = along(&ob.shape, *dim, k as u64 * len, len);
                    place(&mut whole, &ob.shape, &ranges, &piece, es);
                }
                for &d in g {
                    write_at(&mut arenas[d], ob.offset, &whole);
                }
            }
        }
        Step::Slice {
            input,
            output,
            groups,
            dim,
        } => {
            let (ib, ob) = (&h.buffers[*input], &h.buffers[*output]);
            let es = ib.elt.size() as usize;
            let len = ob.shape.get(*dim).copied().unwrap_or(1);
            for g in groups {
                for (k, &d) in g.iter().enumerate() {
                    let ranges = along(&ib.shape, *dim, k as u64 * len, len);
                    let piece = cut(&get(&arenas[d], ib), &ib.shape, &ranges, es);
                    write_at(&mut arenas[d], ob.offset, &piece);
                }
            }
        }
        Step::ReduceScatter {
            input,
            output,
            groups,
            dim,
            max,
        } => {
            let (ib, ob) = (&h.buffers[*input], &h.buffers[*output]);
            for g in groups {
                let r = reduced(arenas, g, ib, *max);
                let bytes: Vec<u8> = r.iter().flat_map(|x| x.to_le_bytes()).collect();
                let len = ob.shape.get(*dim).copied().unwrap_or(1);
                for (k, &d) in g.iter().enumerate() {
                    let ranges = along(&ib.shape, *dim, k as u64 * len, len);
                    let piece = cut(&bytes, &ib.shape, &ranges, 4);
                    write_at(&mut arenas[d], ob.offset, &piece);
                }
            }
        }
    }
    Ok(())
}

/// The results made whole from the devices' arenas (replicas must agree bit for bit).
pub(crate) fn results(art: &Artifact, arenas: &[Vec<u64>]) -> Result<Vec<Tensor>, String> {
    let h = &art.header;
    h.outputs
        .iter()
        .map(|p| {
            let b = &h.buffers[p.buffer];
            let es = b.elt.size() as usize;
            let n: u64 = p.global_shape.iter().product();
            let mut whole = vec![0u8; n as usize * es];
            let mut owner: Vec<Option<usize>> = vec![None; n as usize];
            for (d, arena) in arenas.iter().enumerate() {
                let piece = &bytes(arena)[b.offset as usize..][..b.bytes() as usize];
                let clash = place_checked(
                    &mut whole,
                    &p.global_shape,
                    &p.shards[d],
                    piece,
                    es,
                    &mut owner,
                    d,
                );
                if let Some((i, first)) = clash {
                    return Err(format!(
                        "replicas of '{}' disagree: element {i} on devices {first} and {d}",
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
            Ok(Tensor {
                shape: p.global_shape.clone(),
                data,
            })
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
fn write_at(arena: &mut [u64], offset: u64, bytes: &[u8]) {
    bytes_mut(arena)[offset as usize..][..bytes.len()].copy_from_slice(bytes);
}

/// A buffer's bytes in an arena.
fn get(arena: &[u64], b: &Buffer) -> Vec<u8> {
    bytes(arena)[b.offset as usize..][..b.bytes() as usize].to_vec()
}

fn put(arena: &mut [u64], b: &Buffer, v: &[f32]) -> Result<(), String> {
    if v.len() as u64 != b.len() || b.elt != Elt::F32 {
        return Err("a collective's output does not match its input".into());
    }
    let out = &mut bytes_mut(arena)[b.offset as usize..][..b.bytes() as usize];
    for (o, x) in out.chunks_exact_mut(4).zip(v) {
        o.copy_from_slice(&x.to_le_bytes());
    }
    Ok(())
}

/// The members' pieces of `b` summed (or maxed) in member order.
fn reduced(arenas: &[Vec<u64>], g: &[usize], b: &Buffer, max: bool) -> Vec<f32> {
    let f = |d: usize| -> Vec<f32> {
        get(&arenas[d], b)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect()
    };
    let mut acc = f(g[0]);
    for &d in &g[1..] {
        for (a, x) in acc.iter_mut().zip(f(d)) {
            *a = if max { a.max(x) } else { *a + x };
        }
    }
    acc
}

/// Ranges covering `shape` whole except `[start, start + len)` along `dim`.
fn along(shape: &[u64], dim: usize, start: u64, len: u64) -> Vec<[u64; 2]> {
    shape
        .iter()
        .enumerate()
        .map(|(d, &n)| {
            if d == dim {
                [start, start + len]
            } else {
                [0, n]
            }
        })
        .collect()
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
    use super::{along, cut, place, place_checked};

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
        assert_eq!(along(&shape, 1, 2, 2), vec![[0, 3], [2, 4]]);
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
