//! Tests of `host`: `schedule_tests`.

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
