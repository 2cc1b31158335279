//! The `.nnsx` artifact: a compiled program, self-contained (see `docs/gpu.md`).
//!
//! ```text
//! "NNSX" | version: u32 LE | header length: u64 LE | header (JSON, UTF-8) | sections
//! ```
//!
//! The header ([`Header`]) holds the step's signature, the kernels with their launch
//! geometry, and one or more programs ([`Program`]): the devices that run it, where it
//! keeps the signature's tensors, its memory plan (every buffer's offset in one arena per
//! device) and its steps in order. A partitioned (SPMD) program is one program that every
//! device runs; a pipeline has one program per pipeline rank, which exchange tensors by
//! [`Step::Send`] and [`Step::Recv`];
//! sections follow it back to back, each with its byte range and FNV-1a 64 checksum in
//! the header: `ptx` (the kernels for the GPU) and `host.so` (the same kernels compiled
//! for the host CPU as a shared object, entry points `<kernel>.host(ptr args, i64 n)`).
//! A reader refuses another version, a bad magic, a header that does not parse, a
//! section out of range or whose checksum differs, and a plan that addresses outside
//! its arena.

pub use crate::collective::Collective;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;

mod check;
mod step_serde;

/// The file's first four bytes.
pub const MAGIC: &[u8; 4] = b"NNSX";
/// The format version this build reads and writes.
pub const VERSION: u32 = 8;
/// Threads per block of a kernel with one thread per index (and of the reducers).
pub const BLOCK: u32 = 256;

/// A buffer's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Elt {
    /// 4-byte float.
    F32,
    /// 8-byte signed integer.
    I64,
    /// 2-byte bfloat16 (an f32's high half), only inside a program: kernels widen it on
    /// load and round to it on store; never an argument, a result, a collective's or a
    /// message's buffer.
    Bf16,
}

impl Elt {
    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Elt::F32 => 4,
            Elt::I64 => 8,
            Elt::Bf16 => 2,
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
    /// Elements (saturating: a read artifact's are checked, [`Buffer::checked_bytes`]).
    pub fn len(&self) -> u64 {
        self.shape.iter().fold(1u64, |n, &d| n.saturating_mul(d))
    }
    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Bytes (saturating).
    pub fn bytes(&self) -> u64 {
        self.len().saturating_mul(self.elt.size())
    }
    /// Bytes, or `None` when they overflow a u64.
    pub fn checked_bytes(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(self.elt.size(), |n, &d| n.checked_mul(d))
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

/// A tensor of the step's signature: an argument or a result.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Port {
    /// Its `nns.name` (`in<k>` / `out<k>` when it has none).
    pub name: String,
    /// The whole tensor's shape (each device's buffer holds its piece of it).
    pub global_shape: Vec<u64>,
    /// Element type.
    pub elt: Elt,
    /// Its `nns.layout` on the mesh, when the program is one device's share.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layout: Option<String>,
    /// A parameter (`nns.param`).
    #[serde(default)]
    pub param: bool,
    /// The values an argument may hold, as the compiler read them from its uses (ids
    /// below a table's rows or a logit's classes, AdamW's step from 1); the runtime
    /// refuses inputs outside it, as the reference runtime's kernels do. Absent: any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain: Option<Domain>,
}

impl Port {
    /// That `t` can be this port's value: its shape and element type, and its values
    /// inside the port's domain.
    pub fn check(&self, t: &crate::tensor::Tensor) -> Result<(), String> {
        if !t.has_shape(&self.global_shape) || t.elt() != self.elt {
            return Err(format!(
                "'{}' must be {:?} {:?}, given {:?} {:?}",
                self.name,
                self.elt,
                self.global_shape,
                t.elt(),
                t.shape
            ));
        }
        match self.domain {
            Some(d) => d.check(&self.name, t),
            None => Ok(()),
        }
    }
}

/// What values a port may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Domain {
    /// Integer ids in `[0, n)`.
    Below(u64),
    /// Numbers at least this (AdamW's step counts from 1).
    AtLeast(i64),
}

impl Domain {
    /// Why `t` (port `name`'s tensor) is outside the domain, if it is.
    pub fn check(self, name: &str, t: &crate::tensor::Tensor) -> Result<(), String> {
        use crate::tensor::Data;
        match (self, &t.data) {
            (Domain::Below(n), Data::I64(v)) => match v.iter().position(|&x| x < 0 || x as u64 >= n) {
                Some(i) => Err(format!(
                    "'{name}' holds {} at element {i}; its ids must be in [0, {n}) (the rows or classes it indexes)",
                    v[i]
                )),
                None => Ok(()),
            },
            (Domain::AtLeast(m), Data::F32(v)) => {
                match v.iter().position(|&x| x.is_nan() || f64::from(x) < m as f64) {
                    Some(i) => Err(format!(
                        "'{name}' holds {} at element {i}; it must be at least {m} (AdamW's step counts from 1)",
                        v[i]
                    )),
                    None => Ok(()),
                }
            }
            _ => Ok(()),
        }
    }
}

/// Where a program keeps a port: its buffer, and each device's piece.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Binding {
    /// Index into [`Header::inputs`] (in a program's `inputs`) or [`Header::outputs`].
    pub port: usize,
    /// Index into the program's buffers.
    pub buffer: usize,
    /// Per device of the program (in [`Program::devices`]' order), the piece's index
    /// range `[start, end)` along each dim of the whole tensor (devices with equal ranges
    /// hold replicas).
    pub shards: Vec<Vec<[u64; 2]>>,
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
    /// A bias of `n` elements, the kernel's third buffer (C is then the fourth), added to
    /// every row of the result after the sum (`dnn.linear`): the index of the
    /// element-wise kernel that adds it in place, launched on `(C, bias, C)`, for a
    /// runtime whose BLAS call does not add it itself (a cuBLASLt epilogue does).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bias: Option<u64>,
}

/// A kernel: its symbol in `ptx` (and `<name>.host` in `host.so`) and launch geometry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Kernel {
    /// Symbol.
    pub name: String,
    /// Indices it covers: one GPU thread each, or, for a team kernel, one block each.
    pub len: u64,
    /// Blocks.
    pub grid: u64,
    /// Threads per block: [`BLOCK`], or a team kernel's team (a power of two, at most
    /// 1024).
    pub block: u32,
    /// A team kernel: each block computes one index (a row), its threads combining
    /// through shared memory (`grid` >= `len`); else each thread one index (`grid *
    /// block` >= `len`).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub team: bool,
    /// Buffers it takes (inputs, then outputs).
    pub buffers: usize,
    /// How many of them, the last ones, it writes.
    pub outputs: usize,
    /// Set when the kernel is a matrix product.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gemm: Option<Gemm>,
    /// The bytes it reads or writes of each buffer it takes (their sizes when compiled):
    /// a launch's buffers must hold at least these. Empty for the reducers, which are
    /// launched over any count (the runtime's collective plans size them).
    #[serde(default)]
    pub sizes: Vec<u64>,
}

/// The element-wise kernels collectives reduce with, each launched on buffers
/// `(acc, x, acc)` over any number of f32s (the index count is the launch's, not the
/// kernel's `len`): `acc = acc + x`, and `acc = max(acc, x)` (`f32::max`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reducers {
    /// Index into [`Header::kernels`] of the sum.
    pub sum: usize,
    /// Index into [`Header::kernels`] of the maximum.
    pub max: usize,
}

impl Header {
    /// The kernel (index into [`Header::kernels`]) of the sum reducer, or with `max` of
    /// the maximum one.
    pub fn reducer(&self, max: bool) -> Result<usize, String> {
        let r = self.reducers.ok_or("the artifact has no reducers")?;
        Ok(if max { r.max } else { r.sum })
    }
}

/// What the PTX says of each kernel it was compiled with: `nns_len_<name>` (its index
/// count) and `nns_sizes_<name>` (the bytes of each buffer it takes, as little-endian u64
/// bytes), which the generated code exports beside its entry.
pub fn code_facts(ptx: &str) -> HashMap<String, (u64, Vec<u64>)> {
    let mut lens: HashMap<String, u64> = HashMap::new();
    let mut sizes: HashMap<String, Vec<u64>> = HashMap::new();
    for line in ptx.lines().filter(|l| l.starts_with(".visible .global")) {
        let Some((decl, init)) = line.trim_end_matches(';').split_once(" = ") else {
            continue;
        };
        let name = decl.rsplit(' ').next().unwrap_or("");
        if let Some(k) = name.strip_prefix("nns_len_") {
            if let Ok(v) = init.trim().parse() {
                lens.insert(k.to_string(), v);
            }
        } else if let Some(rest) = name.strip_prefix("nns_sizes_") {
            let Some((k, n)) = rest.split_once('[') else {
                continue;
            };
            let Ok(n) = n.trim_end_matches(']').parse::<usize>() else {
                continue;
            };
            let mut bytes: Vec<u8> = init
                .trim()
                .trim_start_matches('{')
                .trim_end_matches('}')
                .split(',')
                .filter_map(|b| b.trim().parse().ok())
                .collect();
            if bytes.len() > n || n % 8 != 0 {
                continue;
            }
            bytes.resize(n, 0);
            let words = bytes
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
            sizes.insert(k.to_string(), words);
        }
    }
    lens.into_iter()
        .map(|(k, l)| {
            let s = sizes.remove(&k).unwrap_or_default();
            (k, (l, s))
        })
        .collect()
}

/// One step of the program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Launch `kernel` on `buffers` (its inputs, then its outputs).
    Launch {
        /// Index into [`Header::kernels`].
        kernel: usize,
        /// Indices into [`Header::buffers`].
        buffers: Vec<usize>,
    },
    /// A collective among the program's devices: `op` ([`Collective`]: what each member's
    /// `output` becomes) from `input` within each of `groups` (devices in member order).
    /// Written as `{"<op's name>": {"input", "output", "groups", <op's parameters>}}`.
    Collective {
        /// What it does.
        op: Collective,
        /// Buffer read.
        input: usize,
        /// Buffer written.
        output: usize,
        /// The groups.
        groups: Vec<Vec<usize>>,
    },
    /// Each device's `buffer` goes to the device in the same place of program `to` (the
    /// k-th device of one program exchanges with the k-th of the other); it does not wait.
    Send {
        /// Buffer read.
        buffer: usize,
        /// The receiving program (an index into [`Header::programs`]).
        to: usize,
        /// Matches the receive.
        tag: String,
    },
    /// Waits for the [`Step::Send`] of program `from` with `tag` and writes what it sent
    /// into `buffer`.
    Recv {
        /// Buffer written.
        buffer: usize,
        /// The sending program.
        from: usize,
        /// Matches the send.
        tag: String,
    },
}

/// A buffer whose values are fixed at compile time (rotary's tables, a shard's offset):
/// written into the arena of every device of its program before the first step, from the
/// `consts` section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Constant {
    /// The buffer.
    pub buffer: usize,
    /// Byte offsets in the `consts` section: one (every device reads it), or one per
    /// device of the program.
    pub offsets: Vec<u64>,
}

impl Constant {
    /// Its bytes for device `k` of its program (`buf`: its buffer) in the `consts`
    /// section.
    pub fn bytes<'a>(&self, consts: &'a [u8], buf: &Buffer, k: usize) -> Result<&'a [u8], String> {
        let at = self.offsets[if self.offsets.len() > 1 { k } else { 0 }] as usize;
        consts
            .get(at..at.saturating_add(buf.bytes() as usize))
            .ok_or_else(|| {
                format!(
                    "constant buffer {} lies outside the consts section",
                    self.buffer
                )
            })
    }
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

/// One program: the devices that run it, where it keeps the step's tensors, its memory
/// plan and its steps.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Program {
    /// The compiled function (`train.pp1`).
    pub name: String,
    /// The devices that run it (increasing; row-major numbers on the mesh).
    pub devices: Vec<usize>,
    /// The arguments it reads.
    pub inputs: Vec<Binding>,
    /// The results it computes.
    pub outputs: Vec<Binding>,
    /// The memory plan.
    pub buffers: Vec<Buffer>,
    /// Bytes of the arena every buffer lies in (one arena per device).
    pub arena_bytes: u64,
    /// Buffers with compile-time values.
    #[serde(default)]
    pub constants: Vec<Constant>,
    /// What runs, in order.
    pub steps: Vec<Step>,
}

/// The header.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Header {
    /// The GPU the PTX is for.
    pub target: Target,
    /// The compiled function, as `file @name`.
    pub source: String,
    /// The devices' mesh (empty: one device); devices are numbered row-major over its
    /// axes.
    #[serde(default)]
    pub mesh: Vec<MeshAxis>,
    /// For a pipeline: the mesh axis whose rank `r` runs `programs[r]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pipeline_axis: Option<String>,
    /// The step's arguments, in order.
    pub inputs: Vec<Port>,
    /// The step's results, in order.
    pub outputs: Vec<Port>,
    /// The kernels (every program's).
    pub kernels: Vec<Kernel>,
    /// The kernels the collectives reduce with (present when a program has a reduction).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reducers: Option<Reducers>,
    /// The programs; every device runs exactly one.
    pub programs: Vec<Program>,
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
    /// Devices the programs run on.
    pub fn devices(&self) -> usize {
        self.header
            .mesh
            .iter()
            .fold(1usize, |n, a| n.saturating_mul(a.size as usize))
    }

    /// Steps of every program.
    pub fn steps(&self) -> usize {
        self.header.programs.iter().map(|p| p.steps.len()).sum()
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
        let mut out = Vec::with_capacity(24 + json.len() + offset as usize);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(json.len() as u64).to_le_bytes());
        out.extend_from_slice(&fnv1a64(&json).to_le_bytes());
        out.extend_from_slice(&json);
        for (_, bytes) in &self.sections {
            out.extend_from_slice(bytes);
        }
        Ok(out)
    }

    /// Reads an artifact; `what` (the file name) starts every error.
    pub fn from_bytes(bytes: &[u8], what: &str) -> Result<Self, String> {
        let bad = |m: String| format!("{what}: {m}");
        if bytes.len() < 8 || &bytes[..4] != MAGIC {
            return Err(bad("not an nnscaler artifact (no NNSX magic)".into()));
        }
        let version = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
        if version != VERSION {
            return Err(bad(format!(
                "artifact format version {version}; this nnscaler-rt reads version {VERSION} (recompile with the nnscaler that matches it)"
            )));
        }
        if bytes.len() < 24 {
            return Err(bad(format!(
                "truncated: {} bytes, fewer than the 24 before the header",
                bytes.len()
            )));
        }
        let hlen = u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes"));
        let hsum = u64::from_le_bytes(bytes[16..24].try_into().expect("8 bytes"));
        let body = &bytes[24..];
        if hlen > body.len() as u64 {
            return Err(bad(format!(
                "truncated: the header needs {hlen} bytes, {} remain",
                body.len()
            )));
        }
        let (json, rest) = body.split_at(hlen as usize);
        let sum = fnv1a64(json);
        if sum != hsum {
            return Err(bad(format!(
                "the header is corrupt (checksum {sum:016x}, the file says {hsum:016x})"
            )));
        }
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
}

/// Test artifacts for the crate's other modules.
#[cfg(test)]
pub(crate) mod tests_support {
    /// A one-program artifact: `y = k0(x)` on 4 floats.
    pub(crate) fn sample() -> super::Artifact {
        super::tests::sample()
    }

    /// Two programs on a mesh of 2: rank 0 sends `x` to rank 1, which computes `y`.
    pub(crate) fn pipeline() -> super::Artifact {
        super::tests::pipeline()
    }
}

#[cfg(test)]
mod tests;
