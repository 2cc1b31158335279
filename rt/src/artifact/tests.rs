//! Unit tests of `artifact`.

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
    b.header.programs[0].steps.push(Step::Collective {
        op: Collective::AllGather { dim: 3 },
        input: 0,
        output: 1,
        groups: vec![vec![0]],
    });
    let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
    assert!(e.contains("dim 3 is beyond its buffers' rank"), "{e}");
    let mut b = sample();
    b.header.programs[0].steps.push(Step::Collective {
        op: Collective::AllGather { dim: 0 },
        input: 0,
        output: 1,
        groups: vec![vec![]],
    });
    let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
    assert!(e.contains("do not partition the program's devices"), "{e}");
    let mut b = sample();
    b.header.programs[0].steps.push(Step::Collective {
        op: Collective::AllToAll {
            split_dim: 0,
            concat_dim: 0,
        },
        input: 0,
        output: 1,
        groups: vec![vec![0]],
    });
    let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
    assert!(
        e.contains("splits dim 0 and concatenates dim 0 of a rank-1 buffer"),
        "{e}"
    );
    let mut b = sample();
    b.header.programs[0].steps.push(Step::Collective {
        op: Collective::Broadcast { root: 1 },
        input: 0,
        output: 1,
        groups: vec![vec![0]],
    });
    let e = Artifact::from_bytes(&b.to_bytes().unwrap(), "a.nnsx").unwrap_err();
    assert!(e.contains("root 1 is not a member of a group of 1"), "{e}");
    // A reduction needs the reducer kernels, each on (acc, x, acc).
    let mut b = sample();
    b.header.programs[0].steps.push(Step::Collective {
        op: Collective::AllReduce { max: false },
        input: 0,
        output: 1,
        groups: vec![vec![0]],
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
        e.contains("step 0 gives kernel k0 buffer 2 of 8 bytes as its argument 1, which takes 16"),
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
        bias: None,
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
