//! The `.nnsx` artifact: a compiled program, self-contained (see `docs/gpu.md`).
//!
//! ```text
//! "NNSX" | version: u32 LE | header length: u64 LE | header (JSON, UTF-8) | sections
//! ```
//!
//! The header ([`Header`]) holds the signature, the memory plan (every buffer's offset in
//! one arena per device), the kernels with their launch geometry, and the steps in order;
//! sections follow it back to back, each with its byte range and FNV-1a 64 checksum in
//! the header: `ptx` (the kernels for the GPU) and `host.so` (the same kernels compiled
//! for the host CPU as a shared object, entry points `<kernel>.host(ptr args, i64 n)`).
//! A reader refuses another version, a bad magic, a header that does not parse, a
//! section out of range or whose checksum differs, and a plan that addresses outside
//! its arena.

use serde::{Deserialize, Serialize};

/// The file's first four bytes.
pub const MAGIC: &[u8; 4] = b"NNSX";
/// The format version this build reads and writes.
pub const VERSION: u32 = 1;
/// Threads per block of every kernel launch.
pub const BLOCK: u32 = 256;

/// A buffer's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Elt {
    /// 4-byte float.
    F32,
    /// 8-byte signed integer.
    I64,
}

impl Elt {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Elt::F32 => 4,
            Elt::I64 => 8,
        }
    }
}

/// The GPU the PTX was generated for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Target {
    /// Compute capability times ten (90: `sm_90`).
    pub sm: u32,
    /// PTX ISA version times ten.
    pub ptx: u32,
}

/// A buffer of the memory plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buffer {
    /// Dimension lengths.
    pub shape: Vec<u64>,
    /// Element type.
    pub elt: Elt,
    /// Byte offset in the arena (a multiple of 256).
    pub offset: u64,
}

impl Buffer {
    /// Elements.
    pub fn len(&self) -> u64 {
        self.shape.iter().product()
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes.
    pub fn bytes(&self) -> u64 {
        self.len() * self.elt.size()
    }
}

/// A mesh axis.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshAxis {
    /// Its name.
    pub name: String,
    /// Devices along it.
    pub size: u64,
}

/// An argument or result of the program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Port {
    /// Its `nns.name` (`in<k>` / `out<k>` when it has none).
    pub name: String,
    /// Its buffer.
    pub buffer: usize,
    /// The whole tensor's shape (the buffer holds one device's piece of it).
    pub global_shape: Vec<u64>,
    /// Per device, the piece's index range `[start, end)` along each dim of the whole
    /// tensor (devices with equal ranges hold replicas).
    pub shards: Vec<Vec<[u64; 2]>>,
    /// Its `nns.layout` on the mesh, when the program is one device's share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
    /// A parameter (`nns.param`).
    #[serde(default)]
    pub param: bool,
}

/// A matrix product a kernel computes, for a runtime that calls a BLAS instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gemm {
    /// Independent products.
    pub batch: u64,
    /// Result rows.
    pub m: u64,
    /// Result columns.
    pub n: u64,
    /// Summed dimension.
    pub k: u64,
    /// A stored transposed.
    pub ta: bool,
    /// B stored transposed.
    pub tb: bool,
    /// Each product has its own B.
    pub b_batched: bool,
}

/// A kernel: its symbol in `ptx` (and `<name>.host` in `host.so`) and launch geometry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kernel {
    /// Symbol.
    pub name: String,
    /// Indices it covers (one GPU thread each).
    pub len: u64,
    /// Blocks of [`BLOCK`] threads.
    pub grid: u64,
    /// Buffers it takes (inputs, then outputs).
    pub buffers: usize,
    /// Set when the kernel is a matrix product.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm: Option<Gemm>,
}

/// One step of the program.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Step {
    /// Launch `kernel` on `buffers` (its inputs, then its outputs).
    Launch {
        /// Index into [`Header::kernels`].
        kernel: usize,
        /// Indices into [`Header::buffers`].
        buffers: Vec<usize>,
    },
    /// Within each group (devices in member order), every member's `output` becomes the
    /// sum (or maximum) of the members' `input`s, summed in member order.
    AllReduce {
        /// Buffer read.
        input: usize,
        /// Buffer written.
        output: usize,
        /// The groups.
        groups: Vec<Vec<usize>>,
        /// Maximum instead of sum.
        max: bool,
    },
    /// Every member's `output` becomes the members' `input`s concatenated along `dim`.
    AllGather {
        /// Buffer read.
        input: usize,
        /// Buffer written.
        output: usize,
        /// The groups.
        groups: Vec<Vec<usize>>,
        /// The concatenated dim.
        dim: usize,
    },
    /// Member `k`'s `output` becomes piece `k` along `dim` of its own `input` (a device's
    /// shard of a replicated value; no communication).
    Slice {
        /// Buffer read.
        input: usize,
        /// Buffer written.
        output: usize,
        /// The groups.
        groups: Vec<Vec<usize>>,
        /// The cut dim.
        dim: usize,
    },
    /// Member `k`'s `output` becomes piece `k` along `dim` of the members' reduced inputs.
    ReduceScatter {
        /// Buffer read.
        input: usize,
        /// Buffer written.
        output: usize,
        /// The groups.
        groups: Vec<Vec<usize>>,
        /// The cut dim.
        dim: usize,
        /// Maximum instead of sum.
        max: bool,
    },
}

/// A buffer whose values are fixed at compile time (rotary's tables, a shard's offset):
/// written into every device's arena before the first step, from the `consts` section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Constant {
    /// The buffer.
    pub buffer: usize,
    /// Byte offsets in the `consts` section: one (every device reads it), or one per
    /// device.
    pub offsets: Vec<u64>,
}

/// A section's place in the file (after the header) and its checksum.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Section {
    /// `ptx` or `host.so`.
    pub name: String,
    /// Byte offset from the end of the header.
    pub offset: u64,
    /// Length in bytes.
    pub bytes: u64,
    /// FNV-1a 64 of its bytes, hex.
    pub fnv1a64: String,
}

/// The header.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    /// The GPU the PTX is for.
    pub target: Target,
    /// The compiled function, as `file @name`.
    pub source: String,
    /// The mesh of a per-device program (empty: one device); devices are numbered
    /// row-major over its axes.
    #[serde(default)]
    pub mesh: Vec<MeshAxis>,
    /// Arguments, in order.
    pub inputs: Vec<Port>,
    /// Results, in order.
    pub outputs: Vec<Port>,
    /// The memory plan.
    pub buffers: Vec<Buffer>,
    /// Bytes of the arena every buffer lies in.
    pub arena_bytes: u64,
    /// Buffers with compile-time values.
    #[serde(default)]
    pub constants: Vec<Constant>,
    /// The kernels.
    pub kernels: Vec<Kernel>,
    /// What runs, in order.
    pub steps: Vec<Step>,
    /// The sections.
    pub sections: Vec<Section>,
}

/// An artifact in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct Artifact {
    /// The header.
    pub header: Header,
    /// Section bytes, by name, in the header's order.
    pub sections: Vec<(String, Vec<u8>)>,
}

/// FNV-1a, 64 bits.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl Artifact {
    /// Devices the program runs on.
    pub fn devices(&self) -> usize {
        self.header.mesh.iter().map(|a| a.size as usize).product()
    }

    /// A section's bytes.
    pub fn section(&self, name: &str) -> Option<&[u8]> {
        self.sections
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, b)| b.as_slice())
    }

    /// The file's bytes (the header's section table is rewritten from `sections`).
    pub fn to_bytes(&self) -> Result<Vec<u8>, String> {
        let mut header = self.header.clone();
        header.sections.clear();
        let mut offset = 0u64;
        for (name, bytes) in &self.sections {
            header.sections.push(Section {
                name: name.clone(),
                offset,
                bytes: bytes.len() as u64,
                fnv1a64: format!("{:016x}", fnv1a64(bytes)),
            });
            offset += bytes.len() as u64;
        }
        let json = serde_json::to_vec_pretty(&header).map_err(|e| e.to_string())?;
        let mut out = Vec::with_capacity(16 + json.len() + offset as usize);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&json);
        for (_, bytes) in &self.sections {
            out.extend_from_slice(bytes);
        }
        Ok(out)
    }

    /// Reads an artifact; `what` (the file name) starts every error.
    pub fn from_bytes(bytes: &[u8], what: &str) -> Result<Self, String> {
        let bad = |m: String| format!("{what}: {m}");
        if bytes.len() < 16 || &bytes[..4] != MAGIC {
            return Err(bad("not an nnscaler artifact (no NNSX magic)".into()));
        }
        let version = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(bad(format!(
                "artifact format version {version}; this nnscaler-rt reads version {VERSION} (recompile with the nnscaler that matches it)"
            )));
        }
        let hlen = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let body = &bytes[16..];
        if hlen > body.len() as u64 {
            return Err(bad(format!(
                "truncated: the header needs {hlen} bytes, {} remain",
                body.len()
            )));
        }
        let (json, rest) = body.split_at(hlen as usize);
        let header: Header =
            serde_json::from_slice(json).map_err(|e| bad(format!("corrupt header ({e})")))?;
        let mut sections = Vec::new();
        for s in &header.sections {
            let end = s
                .offset
                .checked_add(s.bytes)
                .filter(|&e| e <= rest.len() as u64);
            let Some(end) = end else {
                return Err(bad(format!(
                    "truncated: section '{}' needs bytes {}..{}, the file has {}",
                    s.name,
                    s.offset,
                    s.offset.saturating_add(s.bytes),
                    rest.len()
                )));
            };
            let data = &rest[s.offset as usize..end as usize];
            let sum = format!("{:016x}", fnv1a64(data));
            if sum != s.fnv1a64 {
                return Err(bad(format!(
                    "section '{}' is corrupt (checksum {sum}, the header says {})",
                    s.name, s.fnv1a64
                )));
            }
            sections.push((s.name.clone(), data.to_vec()));
        }
        let a = Artifact { header, sections };
        a.check().map_err(bad)?;
        Ok(a)
    }

    /// The plan addresses only inside its arena, and every index is in range.
    fn check(&self) -> Result<(), String> {
        let h = &self.header;
        for (i, b) in h.buffers.iter().enumerate() {
            if b.offset % 256 != 0 || b.offset.saturating_add(b.bytes()) > h.arena_bytes {
                return Err(format!(
                    "buffer {i} ({} bytes at {}) lies outside the {}-byte arena",
                    b.bytes(),
                    b.offset,
                    h.arena_bytes
                ));
            }
        }
        for p in h.inputs.iter().chain(&h.outputs) {
            if p.buffer >= h.buffers.len() {
                return Err(format!(
                    "'{}' names buffer {}, which does not exist",
                    p.name, p.buffer
                ));
            }
        }
        let consts = self.section("consts").map_or(0, |c| c.len() as u64);
        for c in &h.constants {
            let b = h.buffers.get(c.buffer).ok_or_else(|| {
                format!("a constant names buffer {}, which does not exist", c.buffer)
            })?;
            let per_device = c.offsets.len() == self.devices();
            if c.offsets.is_empty() || (c.offsets.len() > 1 && !per_device) {
                return Err(format!(
                    "constant buffer {} has {} values for {} devices",
                    c.buffer,
                    c.offsets.len(),
                    self.devices()
                ));
            }
            if c.offsets
                .iter()
                .any(|o| o.saturating_add(b.bytes()) > consts)
            {
                return Err(format!(
                    "constant buffer {} lies outside the consts section ({consts} bytes)",
                    c.buffer
                ));
            }
        }
        let devices = self.devices();
        for p in h.inputs.iter().chain(&h.outputs) {
            let b = &h.buffers[p.buffer];
            let fits = p.shards.len() == devices
                && p.global_shape.len() == b.shape.len()
                && p.shards.iter().all(|r| {
                    r.len() == b.shape.len()
                        && r.iter()
                            .zip(&b.shape)
                            .zip(&p.global_shape)
                            .all(|((&[lo, hi], &n), &g)| hi >= lo && hi - lo == n && hi <= g)
                });
            if !fits {
                return Err(format!(
                    "'{}' has shards that do not fit its buffer",
                    p.name
                ));
            }
        }
        for (i, s) in h.steps.iter().enumerate() {
            match s {
                Step::Launch { kernel, buffers } => {
                    let k = h.kernels.get(*kernel).ok_or_else(|| {
                        format!("step {i} launches kernel {kernel}, which does not exist")
                    })?;
                    if buffers.len() != k.buffers || buffers.iter().any(|&b| b >= h.buffers.len()) {
                        return Err(format!(
                            "step {i} gives kernel {} the wrong buffers",
                            k.name
                        ));
                    }
                }
                Step::AllReduce {
                    input,
                    output,
                    groups,
                    ..
                }
                | Step::AllGather {
                    input,
                    output,
                    groups,
                    ..
                }
                | Step::Slice {
                    input,
                    output,
                    groups,
                    ..
                }
                | Step::ReduceScatter {
                    input,
                    output,
                    groups,
                    ..
                } => {
                    if *input >= h.buffers.len() || *output >= h.buffers.len() {
                        return Err(format!("step {i}'s collective names a missing buffer"));
                    }
                    let mut seen = vec![false; devices];
                    for &d in groups.iter().flatten() {
                        if d >= devices || std::mem::replace(&mut seen[d], true) {
                            return Err(format!("step {i}'s groups do not partition the devices"));
                        }
                    }
                    if seen.contains(&false) || groups.iter().any(Vec::is_empty) {
                        return Err(format!("step {i}'s groups do not partition the devices"));
                    }
                    collective_shapes(s, &h.buffers[*input], &h.buffers[*output], groups)
                        .map_err(|e| format!("step {i}: {e}"))?;
                }
            }
        }
        Ok(())
    }
}

/// Whether a collective's buffers fit it: the reductions on f32 and the output's shape
/// what the input's becomes (equal; `dim` times the group; `dim` over the group).
fn collective_shapes(
    s: &Step,
    i: &Buffer,
    o: &Buffer,
    groups: &[Vec<usize>],
) -> Result<(), String> {
    let n = groups.first().map_or(1, Vec::len) as u64;
    if groups.iter().any(|g| g.len() as u64 != n) {
        return Err("its groups differ in size".into());
    }
    let (dim, reduces) = match s {
        Step::AllReduce { .. } => (None, true),
        Step::AllGather { dim, .. } => (Some((*dim, true)), false),
        Step::Slice { dim, .. } => (Some((*dim, false)), false),
        Step::ReduceScatter { dim, .. } => (Some((*dim, false)), true),
        Step::Launch { .. } => return Ok(()),
    };
    if i.elt != o.elt || (reduces && i.elt != Elt::F32) {
        return Err("its buffers' element types do not fit it".into());
    }
    let mut want = i.shape.clone();
    if let Some((d, grows)) = dim {
        let Some(len) = want.get_mut(d) else {
            return Err(format!("dim {d} is beyond its buffers' rank"));
        };
        if grows {
            *len *= n;
        } else if *len % n == 0 {
            *len /= n;
        } else {
            return Err(format!("dim {d} ({len}) does not divide into {n} pieces"));
        }
    }
    if want != o.shape {
        return Err(format!(
            "an input of shape {:?} gives {want:?}, not {:?}",
            i.shape, o.shape
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Artifact {
        Artifact {
            header: Header {
                target: Target { sm: 90, ptx: 80 },
                source: "m.mlir @f".into(),
                mesh: Vec::new(),
                inputs: vec![Port {
                    name: "x".into(),
                    buffer: 0,
                    global_shape: vec![4],
                    shards: vec![vec![[0, 4]]],
                    layout: None,
                    param: false,
                }],
                outputs: vec![Port {
                    name: "y".into(),
                    buffer: 1,
                    global_shape: vec![4],
                    shards: vec![vec![[0, 4]]],
                    layout: None,
                    param: false,
                }],
                buffers: vec![
                    Buffer {
                        shape: vec![4],
                        elt: Elt::F32,
                        offset: 0,
                    },
                    Buffer {
                        shape: vec![4],
                        elt: Elt::F32,
                        offset: 256,
                    },
                ],
                arena_bytes: 512,
                constants: Vec::new(),
                kernels: vec![Kernel {
                    name: "k0".into(),
                    len: 4,
                    grid: 1,
                    buffers: 2,
                    gemm: None,
                }],
                steps: vec![Step::Launch {
                    kernel: 0,
                    buffers: vec![0, 1],
                }],
                sections: Vec::new(),
            },
            sections: vec![("ptx".into(), b"// ptx".to_vec())],
        }
    }

    #[test]
    fn round_trip_and_every_corruption_is_named() {
        let a = sample();
        let bytes = a.to_bytes().unwrap();
        let back = Artifact::from_bytes(&bytes, "a.nnsx").unwrap();
        assert_eq!(back.sections, a.sections);
        assert_eq!(back.header.steps, a.header.steps);

        let mut v = bytes.clone();
        v[4] = 9;
        let e = Artifact::from_bytes(&v, "a.nnsx").unwrap_err();
        assert!(e.contains("format version 9"), "{e}");

        let e = Artifact::from_bytes(b"PK\x03\x04 not ours at all", "a.nnsx").unwrap_err();
        assert!(e.contains("no NNSX magic"), "{e}");

        let e = Artifact::from_bytes(&bytes[..bytes.len() - 3], "a.nnsx").unwrap_err();
        assert!(e.contains("truncated: section 'ptx'"), "{e}");

        let mut v = bytes.clone();
        let last = v.len() - 1;
        v[last] ^= 1;
        let e = Artifact::from_bytes(&v, "a.nnsx").unwrap_err();
        assert!(e.contains("section 'ptx' is corrupt"), "{e}");

        let mut v = bytes.clone();
        v[20] = b'#';
        let e = Artifact::from_bytes(&v, "a.nnsx").unwrap_err();
        assert!(e.contains("corrupt header"), "{e}");

        let mut b = sample();
        b.header.steps.push(Step::AllGather {
            input: 0,
            output: 1,
            groups: vec![vec![0]],
            dim: 3,
        });
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(e.contains("dim 3 is beyond its buffers' rank"), "{e}");
        let mut b = sample();
        b.header.steps.push(Step::AllReduce {
            input: 0,
            output: 1,
            groups: vec![vec![]],
            max: false,
        });
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(e.contains("do not partition the devices"), "{e}");

        let mut b = sample();
        b.header.buffers[1].offset = 512;
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(e.contains("outside the 512-byte arena"), "{e}");
    }
}
