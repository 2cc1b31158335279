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

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// The file's first four bytes.
pub const MAGIC: &[u8; 4] = b"NNSX";
/// The format version this build reads and writes.
pub const VERSION: u32 = 7;
/// Threads per block of a kernel with one thread per index (and of the reducers).
pub const BLOCK: u32 = 256;

/// A buffer's element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
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
        if t.shape != self.global_shape || t.elt() != self.elt {
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
        use crate::tensor::Values;
        match (self, &t.data) {
            (Domain::Below(n), Values::I64(v)) => match v.iter().position(|&x| x < 0 || x as u64 >= n) {
                Some(i) => Err(format!(
                    "'{name}' holds {} at element {i}; its ids must be in [0, {n}) (the rows or classes it indexes)",
                    v[i]
                )),
                None => Ok(()),
            },
            (Domain::AtLeast(m), Values::F32(v)) => {
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
    /// Member `k`'s `output` becomes piece `k` along `split_dim` of every member's
    /// `input`, concatenated along `concat_dim` in member order (a dim's shards turned
    /// into another dim's).
    AllToAll {
        /// Buffer read.
        input: usize,
        /// Buffer written.
        output: usize,
        /// The groups.
        groups: Vec<Vec<usize>>,
        /// The dim cut into the members' pieces.
        split_dim: usize,
        /// The dim the received pieces are concatenated along.
        concat_dim: usize,
    },
    /// Every member's `output` becomes member `root`'s `input`.
    Broadcast {
        /// Buffer read.
        input: usize,
        /// Buffer written.
        output: usize,
        /// The groups.
        groups: Vec<Vec<usize>>,
        /// The member whose input is copied (a position in each group).
        root: usize,
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

    /// The plans address only inside their arenas, every index is in range, every device
    /// runs one program, and every send has its receive.
    fn check(&self) -> Result<(), String> {
        let h = &self.header;
        let devices = self.devices();
        if h.programs.is_empty() {
            return Err("the artifact has no program".into());
        }
        // Every device of the mesh runs one program: as many devices as the programs list.
        let listed: usize = h.programs.iter().map(|p| p.devices.len()).sum();
        let mesh = h.mesh.iter().try_fold(1u64, |n, a| n.checked_mul(a.size));
        if mesh != Some(listed as u64) {
            return Err(format!(
                "the mesh {:?} has {} devices, and its programs run on {listed}",
                h.mesh.iter().map(|a| a.size).collect::<Vec<_>>(),
                mesh.map_or("more than 2^64".to_string(), |m| m.to_string())
            ));
        }
        let mut owner: Vec<Option<usize>> = vec![None; devices];
        for (pi, p) in h.programs.iter().enumerate() {
            for &d in &p.devices {
                if d >= devices || owner[d].replace(pi).is_some() {
                    return Err(format!(
                        "program '{}' names device {d}, which is not a device of the mesh or runs another program",
                        p.name
                    ));
                }
            }
            if !p.devices.windows(2).all(|w| w[0] < w[1]) {
                return Err(format!(
                    "program '{}' lists its devices out of order",
                    p.name
                ));
            }
        }
        if let Some(d) = owner.iter().position(Option::is_none) {
            return Err(format!("device {d} runs no program"));
        }
        // Every kernel but the reducers: its header entry as its code was compiled (the
        // code exports its index count and buffer sizes), its geometry exact.
        let facts = code_facts(&String::from_utf8_lossy(self.section("ptx").unwrap_or(&[])));
        let reducer = |i: usize| h.reducers.is_some_and(|r| r.sum == i || r.max == i);
        for (i, k) in h.kernels.iter().enumerate() {
            if k.block == 0 || !k.block.is_power_of_two() || k.block > 1024 {
                return Err(format!(
                    "kernel {} has blocks of {} threads (a power of two up to 1024)",
                    k.name, k.block
                ));
            }
            if reducer(i) {
                continue;
            }
            let grid = if k.team {
                k.len
            } else {
                k.len.div_ceil(u64::from(k.block))
            };
            if k.grid != grid {
                return Err(format!(
                    "kernel {}'s grid of {} blocks is not the {grid} its {} indices take",
                    k.name, k.grid, k.len
                ));
            }
            match facts.get(&k.name) {
                Some((len, sizes)) if *len == k.len && *sizes == k.sizes => {}
                Some((len, sizes)) => {
                    return Err(format!(
                        "kernel {}: the header says {} indices over buffers of {:?} bytes, its code was compiled for {len} over {sizes:?}",
                        k.name, k.len, k.sizes
                    ))
                }
                None => {
                    return Err(format!(
                        "kernel {} is not in the PTX (or says nothing of its sizes)",
                        k.name
                    ))
                }
            }
            if k.sizes.len() != k.buffers || k.outputs > k.buffers {
                return Err(format!(
                    "kernel {} takes {} buffers ({} written) and gives sizes for {}",
                    k.name,
                    k.buffers,
                    k.outputs,
                    k.sizes.len()
                ));
            }
        }
        let reduces = h
            .programs
            .iter()
            .flat_map(|p| &p.steps)
            .any(|s| matches!(s, Step::AllReduce { .. } | Step::ReduceScatter { .. }));
        match h.reducers {
            Some(r) => {
                for k in [r.sum, r.max] {
                    if h.kernels.get(k).is_none_or(|k| k.buffers != 3) {
                        return Err(format!(
                            "reducer kernel {k} does not exist or does not take 3 buffers"
                        ));
                    }
                }
            }
            None if reduces => {
                return Err("a collective reduces, and the artifact has no reducer kernels".into())
            }
            None => {}
        }
        // Whole tensors of the signature: their sizes fit a u64.
        for (what, ports) in [("argument", &h.inputs), ("result", &h.outputs)] {
            for port in ports.iter() {
                let b = Buffer {
                    shape: port.global_shape.clone(),
                    elt: port.elt,
                    offset: 0,
                };
                if b.checked_bytes().is_none() {
                    return Err(format!(
                        "{what} '{}' of shape {:?} overflows a 64-bit size",
                        port.name, port.global_shape
                    ));
                }
            }
        }
        // Every program on its own first: the checks between them index its buffers.
        for p in &h.programs {
            self.check_program(p)
                .map_err(|e| format!("program '{}': {e}", p.name))?;
        }
        let mut computed = vec![0usize; h.outputs.len()];
        for (pi, p) in h.programs.iter().enumerate() {
            for b in &p.outputs {
                if let Some(c) = computed.get_mut(b.port) {
                    *c += 1;
                }
            }
            // Every send has a receive of the same tag there, on a buffer like its own.
            for (i, s) in p.steps.iter().enumerate() {
                let Step::Send { buffer, to, tag } = s else {
                    continue;
                };
                let q = h
                    .programs
                    .get(*to)
                    .filter(|q| *to != pi && q.devices.len() == p.devices.len())
                    .ok_or_else(|| {
                        format!(
                            "program '{}' step {i} sends to program {to}, which does not exist or has other devices",
                            p.name
                        )
                    })?;
                let recv = q.steps.iter().find_map(|r| match r {
                    Step::Recv {
                        buffer: rb,
                        from,
                        tag: rt,
                    } if *from == pi && rt == tag => Some(*rb),
                    _ => None,
                });
                let Some(rb) = recv else {
                    return Err(format!(
                        "program '{}' sends '{tag}' to '{}', which never receives it",
                        p.name, q.name
                    ));
                };
                let (sb, rb) = (&p.buffers[*buffer], &q.buffers[rb]);
                if sb.shape != rb.shape || sb.elt != rb.elt {
                    return Err(format!(
                        "'{tag}' is sent by '{}' as {:?} {:?} and received by '{}' as {:?} {:?}",
                        p.name, sb.elt, sb.shape, q.name, rb.elt, rb.shape
                    ));
                }
            }
        }
        // Every receive names another program of as many devices, which sends its tag.
        for (pi, p) in h.programs.iter().enumerate() {
            for (i, s) in p.steps.iter().enumerate() {
                let Step::Recv { from, tag, .. } = s else {
                    continue;
                };
                let q = h
                    .programs
                    .get(*from)
                    .filter(|q| *from != pi && q.devices.len() == p.devices.len())
                    .ok_or_else(|| {
                        format!(
                            "program '{}' step {i} receives from program {from}, which does not exist or has other devices",
                            p.name
                        )
                    })?;
                let sent = q
                    .steps
                    .iter()
                    .any(|r| matches!(r, Step::Send { to, tag: t, .. } if *to == pi && t == tag));
                if !sent {
                    return Err(format!(
                        "program '{}' receives '{tag}' from '{}', which never sends it",
                        p.name, q.name
                    ));
                }
            }
        }
        if let Some(k) = computed.iter().position(|&c| c != 1) {
            return Err(format!(
                "result '{}' is computed by {} programs, not one",
                h.outputs[k].name, computed[k]
            ));
        }
        Ok(())
    }

    /// One program's plan against the header.
    fn check_program(&self, p: &Program) -> Result<(), String> {
        let h = &self.header;
        for (i, b) in p.buffers.iter().enumerate() {
            let Some(bytes) = b.checked_bytes() else {
                return Err(format!(
                    "buffer {i}'s shape {:?} overflows a 64-bit size",
                    b.shape
                ));
            };
            if b.offset % 256 != 0
                || b.offset
                    .checked_add(bytes)
                    .is_none_or(|e| e > p.arena_bytes)
            {
                return Err(format!(
                    "buffer {i} ({} bytes at {}) lies outside the {}-byte arena",
                    b.bytes(),
                    b.offset,
                    p.arena_bytes
                ));
            }
        }
        let consts = self.section("consts").map_or(0, |c| c.len() as u64);
        for c in &p.constants {
            let b = p.buffers.get(c.buffer).ok_or_else(|| {
                format!("a constant names buffer {}, which does not exist", c.buffer)
            })?;
            let per_device = c.offsets.len() == p.devices.len();
            if c.offsets.is_empty() || (c.offsets.len() > 1 && !per_device) {
                return Err(format!(
                    "constant buffer {} has {} values for {} devices",
                    c.buffer,
                    c.offsets.len(),
                    p.devices.len()
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
        for (ports, bindings) in [(&h.inputs, &p.inputs), (&h.outputs, &p.outputs)] {
            for bd in bindings {
                let port = ports
                    .get(bd.port)
                    .ok_or_else(|| format!("binds port {}, which does not exist", bd.port))?;
                let b = p.buffers.get(bd.buffer).ok_or_else(|| {
                    format!(
                        "'{}' names buffer {}, which does not exist",
                        port.name, bd.buffer
                    )
                })?;
                let fits = b.elt == port.elt
                    && bd.shards.len() == p.devices.len()
                    && port.global_shape.len() == b.shape.len()
                    && bd.shards.iter().all(|r| {
                        r.len() == b.shape.len()
                            && r.iter()
                                .zip(&b.shape)
                                .zip(&port.global_shape)
                                .all(|((&[lo, hi], &n), &g)| hi >= lo && hi - lo == n && hi <= g)
                    });
                if !fits {
                    return Err(format!(
                        "'{}' has shards that do not fit its buffer",
                        port.name
                    ));
                }
            }
        }
        // A result's pieces tile its whole tensor: the distinct ones do not overlap, and
        // their volumes add up to its own (nothing of it left unwritten).
        for bd in &p.outputs {
            let port = &h.outputs[bd.port];
            let mut boxes: Vec<&Vec<[u64; 2]>> = bd.shards.iter().collect();
            boxes.sort();
            boxes.dedup();
            let volume = |r: &[[u64; 2]]| {
                r.iter()
                    .try_fold(1u64, |n, &[lo, hi]| n.checked_mul(hi - lo))
            };
            let whole = port
                .global_shape
                .iter()
                .try_fold(1u64, |n, &d| n.checked_mul(d));
            let covered = boxes
                .iter()
                .try_fold(0u64, |n, b| volume(b).and_then(|v| n.checked_add(v)));
            let overlap = |a: &[[u64; 2]], b: &[[u64; 2]]| {
                a.iter()
                    .zip(b)
                    .all(|(&[a0, a1], &[b0, b1])| a0 < b1 && b0 < a1)
            };
            let overlapping = boxes
                .iter()
                .enumerate()
                .any(|(i, a)| boxes[i + 1..].iter().any(|b| overlap(a, b)));
            if covered.is_none() || covered != whole || overlapping {
                return Err(format!(
                    "result '{}''s pieces do not tile its {:?} tensor",
                    port.name, port.global_shape
                ));
            }
        }
        let missing = |b: usize| b >= p.buffers.len();
        for (i, s) in p.steps.iter().enumerate() {
            match s {
                Step::Launch { kernel, buffers } => {
                    let k = h.kernels.get(*kernel).ok_or_else(|| {
                        format!("step {i} launches kernel {kernel}, which does not exist")
                    })?;
                    if buffers.len() != k.buffers || buffers.iter().any(|&b| missing(b)) {
                        return Err(format!(
                            "step {i} gives kernel {} the wrong buffers",
                            k.name
                        ));
                    }
                    if k.sizes.len() != k.buffers {
                        return Err(format!(
                            "step {i} launches kernel {}, which is launched over any count (a reducer)",
                            k.name
                        ));
                    }
                    for (j, (&b, &need)) in buffers.iter().zip(&k.sizes).enumerate() {
                        let have = p.buffers[b].bytes();
                        if have < need {
                            return Err(format!(
                                "step {i} gives kernel {} buffer {b} of {have} bytes as its argument {j}, which takes {need}",
                                k.name
                            ));
                        }
                    }
                    if let Some(g) = &k.gemm {
                        let bufs: Vec<&Buffer> = buffers.iter().map(|&b| &p.buffers[b]).collect();
                        gemm_fits(g, &bufs)
                            .map_err(|e| format!("step {i}, kernel {}: {e}", k.name))?;
                    }
                }
                Step::Send { buffer, .. } | Step::Recv { buffer, .. } => {
                    if missing(*buffer) {
                        return Err(format!("step {i} names a missing buffer"));
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
                }
                | Step::AllToAll {
                    input,
                    output,
                    groups,
                    ..
                }
                | Step::Broadcast {
                    input,
                    output,
                    groups,
                    ..
                } => {
                    if missing(*input) || missing(*output) {
                        return Err(format!("step {i}'s collective names a missing buffer"));
                    }
                    let mut members: Vec<usize> = groups.iter().flatten().copied().collect();
                    members.sort_unstable();
                    if members != p.devices || groups.iter().any(Vec::is_empty) {
                        return Err(format!(
                            "step {i}'s groups do not partition the program's devices"
                        ));
                    }
                    collective_shapes(s, &p.buffers[*input], &p.buffers[*output], groups)
                        .map_err(|e| format!("step {i}: {e}"))?;
                }
            }
        }
        Ok(())
    }
}

/// Whether a matrix product's operands, as its shape says (what cuBLAS reads and writes),
/// lie inside the buffers it is given: `A` (`batch * m * k`), `B` (`k * n`, per product
/// when `b_batched`), `C` (`batch * m * n`), each at its buffer's element size, by
/// checked arithmetic.
fn gemm_fits(g: &Gemm, bufs: &[&Buffer]) -> Result<(), String> {
    if bufs.len() < 3 {
        return Err("a matrix product with fewer than 3 buffers".into());
    }
    let b_count = if g.b_batched { g.batch } else { 1 };
    let dims = [
        [g.batch, g.m, g.k],
        [b_count, g.k, g.n],
        [g.batch, g.m, g.n],
    ];
    for (what, (d, b)) in ["A", "B", "C"].iter().zip(dims.iter().zip(bufs)) {
        let need = d.iter().try_fold(b.elt.size(), |n, &x| n.checked_mul(x));
        let have = b.bytes();
        match need {
            Some(n) if n <= have => {}
            _ => {
                return Err(format!(
                "its product {}x{}x{} (batch {}) needs more of {what} than its {have}-byte buffer",
                g.m, g.n, g.k, g.batch
            ))
            }
        }
    }
    Ok(())
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
    if let Step::AllToAll {
        split_dim,
        concat_dim,
        ..
    } = s
    {
        return all_to_all_shapes(i, o, n, *split_dim, *concat_dim);
    }
    if let Step::Broadcast { root, .. } = s {
        if *root as u64 >= n {
            return Err(format!("its root {root} is not a member of a group of {n}"));
        }
    }
    let (dim, reduces) = match s {
        Step::AllReduce { .. } => (None, true),
        Step::Broadcast { .. } => (None, false),
        Step::AllGather { dim, .. } => (Some((*dim, true)), false),
        Step::Slice { dim, .. } => (Some((*dim, false)), false),
        Step::ReduceScatter { dim, .. } => (Some((*dim, false)), true),
        Step::Launch { .. } | Step::Send { .. } | Step::Recv { .. } | Step::AllToAll { .. } => {
            return Ok(())
        }
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

/// Whether an all-to-all's buffers fit it: two different dims within the rank, the split
/// dim divisible by the group, the output the input with the split dim over the group and
/// the concatenated dim times it.
fn all_to_all_shapes(
    i: &Buffer,
    o: &Buffer,
    n: u64,
    split: usize,
    concat: usize,
) -> Result<(), String> {
    let rank = i.shape.len();
    if split == concat || split >= rank || concat >= rank {
        return Err(format!(
            "an all_to_all splits dim {split} and concatenates dim {concat} of a rank-{rank} buffer"
        ));
    }
    if i.elt != o.elt {
        return Err("its buffers' element types do not fit it".into());
    }
    if !i.shape[split].is_multiple_of(n) {
        return Err(format!(
            "dim {split} ({}) does not divide into {n} pieces",
            i.shape[split]
        ));
    }
    let mut want = i.shape.clone();
    want[split] /= n;
    want[concat] *= n;
    if want != o.shape {
        return Err(format!(
            "an input of shape {:?} gives {want:?}, not {:?}",
            i.shape, o.shape
        ));
    }
    Ok(())
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
mod tests {
    use super::*;

    fn buf(offset: u64) -> Buffer {
        Buffer {
            shape: vec![4],
            elt: Elt::F32,
            offset,
        }
    }

    fn port(name: &str) -> Port {
        Port {
            name: name.into(),
            global_shape: vec![4],
            elt: Elt::F32,
            layout: None,
            param: false,
            domain: None,
        }
    }

    fn bind(port: usize, buffer: usize, devices: usize) -> Binding {
        Binding {
            port,
            buffer,
            shards: vec![vec![[0, 4]]; devices],
        }
    }

    fn program(name: &str, devices: Vec<usize>, steps: Vec<Step>) -> Program {
        let n = devices.len();
        Program {
            name: name.into(),
            devices,
            inputs: vec![bind(0, 0, n)],
            outputs: Vec::new(),
            buffers: vec![buf(0), buf(256)],
            arena_bytes: 512,
            constants: Vec::new(),
            steps,
        }
    }

    /// What the sample's PTX says of its kernel (as generated code exports it).
    const SAMPLE_PTX: &str = "// ptx\n.visible .global .align 8 .u64 nns_len_k0 = 4;\n.visible .global .align 8 .b8 nns_sizes_k0[16] = {16, 0, 0, 0, 0, 0, 0, 0, 16};\n";

    pub(super) fn sample() -> Artifact {
        let mut p = program(
            "f",
            vec![0],
            vec![Step::Launch {
                kernel: 0,
                buffers: vec![0, 1],
            }],
        );
        p.outputs = vec![bind(0, 1, 1)];
        Artifact {
            header: Header {
                target: Target { sm: 90, ptx: 80 },
                source: "m.mlir @f".into(),
                mesh: Vec::new(),
                pipeline_axis: None,
                inputs: vec![port("x")],
                outputs: vec![port("y")],
                kernels: vec![Kernel {
                    name: "k0".into(),
                    len: 4,
                    grid: 1,
                    block: BLOCK,
                    team: false,
                    buffers: 2,
                    outputs: 1,
                    gemm: None,
                    sizes: vec![16, 16],
                }],
                reducers: None,
                programs: vec![p],
                sections: Vec::new(),
            },
            sections: vec![("ptx".into(), SAMPLE_PTX.as_bytes().to_vec())],
        }
    }

    /// Two programs on a mesh of 2: rank 0 sends `x` to rank 1, which computes `y`.
    pub(super) fn pipeline() -> Artifact {
        let mut a = sample();
        a.header.mesh = vec![MeshAxis {
            name: "pp".into(),
            size: 2,
        }];
        a.header.pipeline_axis = Some("pp".into());
        let first = program(
            "f.pp0",
            vec![0],
            vec![Step::Send {
                buffer: 0,
                to: 1,
                tag: "x".into(),
            }],
        );
        let mut second = program(
            "f.pp1",
            vec![1],
            vec![
                Step::Recv {
                    buffer: 0,
                    from: 0,
                    tag: "x".into(),
                },
                Step::Launch {
                    kernel: 0,
                    buffers: vec![0, 1],
                },
            ],
        );
        second.inputs.clear();
        second.outputs = vec![bind(0, 1, 1)];
        a.header.programs = vec![first, second];
        a
    }

    #[test]
    fn pipelines_pair_their_sends_and_cover_the_devices() {
        let ok = pipeline();
        let back = Artifact::from_bytes(&ok.to_bytes().unwrap(), "a.nnsx").unwrap();
        assert_eq!(back.header, {
            let mut h = ok.header.clone();
            h.sections = back.header.sections.clone();
            h
        });
        let err = |a: Artifact| Artifact::from_bytes(&a.to_bytes().unwrap(), "a.nnsx").unwrap_err();

        let mut a = pipeline();
        a.header.programs[1].steps[0] = Step::Recv {
            buffer: 0,
            from: 0,
            tag: "z".into(),
        };
        let e = err(a);
        assert!(
            e.contains("sends 'x' to 'f.pp1', which never receives it"),
            "{e}"
        );

        let mut a = pipeline();
        a.header.programs[1].buffers[0].shape = vec![2, 2];
        let e = err(a);
        assert!(
            e.contains("'x' is sent by 'f.pp0' as F32 [4] and received by 'f.pp1' as F32 [2, 2]"),
            "{e}"
        );

        let mut a = pipeline();
        a.header.programs[1].devices = vec![0];
        let e = err(a);
        assert!(
            e.contains("names device 0, which is not a device of the mesh or runs another program"),
            "{e}"
        );

        let mut a = pipeline();
        a.header.programs.pop();
        a.header.programs[0].steps.clear();
        let e = err(a);
        assert!(
            e.contains("the mesh [2] has 2 devices, and its programs run on 1"),
            "{e}"
        );

        let mut a = pipeline();
        a.header.programs[0].outputs = vec![bind(0, 1, 1)];
        let e = err(a);
        assert!(
            e.contains("result 'y' is computed by 2 programs, not one"),
            "{e}"
        );
    }

    #[test]
    fn round_trip_and_every_corruption_is_named() {
        let a = sample();
        let bytes = a.to_bytes().unwrap();
        let back = Artifact::from_bytes(&bytes, "a.nnsx").unwrap();
        assert_eq!(back.sections, a.sections);
        assert_eq!(back.header.programs, a.header.programs);

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

        // The header is inside a checksum of its own; past it, JSON that does not parse.
        let mut v = bytes.clone();
        v[30] = b'#';
        let e = Artifact::from_bytes(&v, "a.nnsx").unwrap_err();
        assert!(e.contains("the header is corrupt (checksum"), "{e}");
        let n = u64::from_le_bytes(v[8..16].try_into().unwrap()) as usize;
        let sum = fnv1a64(&v[24..24 + n]);
        v[16..24].copy_from_slice(&sum.to_le_bytes());
        let e = Artifact::from_bytes(&v, "a.nnsx").unwrap_err();
        assert!(e.contains("corrupt header"), "{e}");

        let mut b = sample();
        b.header.programs[0].steps.push(Step::AllGather {
            input: 0,
            output: 1,
            groups: vec![vec![0]],
            dim: 3,
        });
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(e.contains("dim 3 is beyond its buffers' rank"), "{e}");
        let mut b = sample();
        b.header.programs[0].steps.push(Step::AllGather {
            input: 0,
            output: 1,
            groups: vec![vec![]],
            dim: 0,
        });
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(e.contains("do not partition the program's devices"), "{e}");
        let mut b = sample();
        b.header.programs[0].steps.push(Step::AllToAll {
            input: 0,
            output: 1,
            groups: vec![vec![0]],
            split_dim: 0,
            concat_dim: 0,
        });
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(
            e.contains("splits dim 0 and concatenates dim 0 of a rank-1 buffer"),
            "{e}"
        );
        let mut b = sample();
        b.header.programs[0].steps.push(Step::Broadcast {
            input: 0,
            output: 1,
            groups: vec![vec![0]],
            root: 1,
        });
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(e.contains("root 1 is not a member of a group of 1"), "{e}");
        // A reduction needs the reducer kernels, each on (acc, x, acc).
        let mut b = sample();
        b.header.programs[0].steps.push(Step::AllReduce {
            input: 0,
            output: 1,
            groups: vec![vec![0]],
            max: false,
        });
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(e.contains("no reducer kernels"), "{e}");
        b.header.reducers = Some(Reducers { sum: 0, max: 0 });
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(
            e.contains("reducer kernel 0 does not exist or does not take 3 buffers"),
            "{e}"
        );

        // Launch geometry: blocks of a power of two, a grid covering the indices.
        let mut b = sample();
        b.header.kernels[0].block = 96;
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(e.contains("kernel k0 has blocks of 96 threads"), "{e}");
        let mut b = sample();
        b.header.kernels[0].team = true;
        b.header.kernels[0].block = 64;
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(
            e.contains("kernel k0's grid of 1 blocks is not the 4 its 4 indices take"),
            "{e}"
        );
        // A header whose counts or sizes differ from what the code was compiled for (the
        // issue's crafted artifact: every kernel's len and grid times 64, the header's
        // checksum made right) is refused, naming both.
        let mut b = sample();
        b.header.kernels[0].len *= 64;
        b.header.kernels[0].grid = 1;
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(
            e.contains("kernel k0: the header says 256 indices over buffers of [16, 16] bytes, its code was compiled for 4 over [16, 16]"),
            "{e}"
        );
        let mut b = sample();
        b.header.kernels[0].sizes = vec![16, 8];
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(
            e.contains("its code was compiled for 4 over [16, 16]"),
            "{e}"
        );
        // A launch's buffers hold what the kernel touches.
        let mut b = sample();
        b.header.programs[0].buffers.push(Buffer {
            shape: vec![2],
            elt: Elt::F32,
            offset: 256,
        });
        b.header.programs[0].steps = vec![Step::Launch {
            kernel: 0,
            buffers: vec![0, 2],
        }];
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(
            e.contains(
                "step 0 gives kernel k0 buffer 2 of 8 bytes as its argument 1, which takes 16"
            ),
            "{e}"
        );
        // Sizes by checked arithmetic: a shape whose bytes overflow.
        let mut b = sample();
        b.header.programs[0].buffers[1].shape = vec![1 << 40, 1 << 40];
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(e.contains("overflows a 64-bit size"), "{e}");
        // A matrix product's shape inside its buffers.
        let mut b = sample();
        b.header.kernels[0].buffers = 3;
        b.header.kernels[0].sizes = vec![16, 16, 16];
        b.header.kernels[0].gemm = Some(Gemm {
            batch: 1,
            m: 2,
            n: 2,
            k: 4,
            ta: false,
            tb: false,
            b_batched: false,
        });
        b.header.programs[0].steps = vec![Step::Launch {
            kernel: 0,
            buffers: vec![0, 0, 1],
        }];
        b.sections[0].1 = b"// ptx\n.visible .global .align 8 .u64 nns_len_k0 = 4;\n.visible .global .align 8 .b8 nns_sizes_k0[24] = {16, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0, 16};\n".to_vec();
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(
            e.contains("step 0, kernel k0: its product 2x2x4 (batch 1) needs more of A than its 16-byte buffer"),
            "{e}"
        );

        let mut b = sample();
        b.header.programs[0].buffers[1].offset = 512;
        let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
        assert!(e.contains("outside the 512-byte arena"), "{e}");
    }

    /// A receive names an existing peer that sends its tag (a `from` naming no program
    /// panicked the scheduler before).
    #[test]
    fn receives_name_their_senders() {
        let mut a = pipeline();
        if let Some(Step::Recv { from, .. }) = a.header.programs[1]
            .steps
            .iter_mut()
            .find(|s| matches!(s, Step::Recv { .. }))
        {
            *from = 7;
        }
        let e = Artifact::from_bytes(&a.to_bytes().unwrap(), "p.nnsx").unwrap_err();
        assert!(
            e.contains("receives from program 7, which does not exist")
                || e.contains("which never receives it"),
            "{e}"
        );
        let mut a = pipeline();
        a.header.programs[1].steps.insert(
            0,
            Step::Recv {
                buffer: 0,
                from: 0,
                tag: "nobody".into(),
            },
        );
        let e = Artifact::from_bytes(&a.to_bytes().unwrap(), "p.nnsx").unwrap_err();
        assert!(
            e.contains("receives 'nobody' from 'f.pp0', which never sends it"),
            "{e}"
        );
    }
}
