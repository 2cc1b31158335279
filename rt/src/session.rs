//! Sessions: a program run many times with some of its arguments kept where it runs
//! (a training step's parameters and moments on the GPU), instead of every run taking
//! whole tensors from the host and giving whole results back.
//!
//! A session holds its devices' arenas for its lifetime. Each run starts them as a fresh
//! run would (zeros, then the constants), writes every kept argument's pieces from where
//! they are kept (a device-to-device copy on a GPU), writes the run's other arguments
//! from the host (each device's piece), runs the steps, and keeps each `next.NAME`
//! result as argument `NAME` of the next run (again device to device). Only the results
//! asked for travel to the host. Where a device reads a piece of `NAME` that it does not
//! compute (a pipeline's tied weights), the new value is assembled whole on the host and
//! kept again: correct, and slower. The arithmetic is the program's: results are the same
//! bits as [`crate::HostProgram::run`]'s (or the GPU's lockstep run's).

use crate::artifact::{Artifact, Elt};
use crate::host::{cut, place_checked};
use crate::tensor::{Data, Tensor};
use std::collections::BTreeMap;

/// What a backend provides for a session: its arenas kept between runs.
pub trait Resident {
    /// Per-device copies of a buffer, kept between runs where the program runs.
    type Kept: std::fmt::Debug;
    /// The artifact.
    fn artifact(&self) -> &Artifact;
    /// Every arena zeroed.
    fn zero(&mut self) -> Result<(), String>;
    /// Writes each device's bytes (from the host) into program `p`'s buffer `b`.
    fn put(&mut self, p: usize, b: usize, pieces: Vec<Vec<u8>>) -> Result<(), String>;
    /// The bytes of program `p`'s buffer `b` on each of its devices.
    fn get(&mut self, p: usize, b: usize) -> Result<Vec<Vec<u8>>, String>;
    /// Copies program `p`'s buffer `b` into `kept` (made on first use, reused after).
    fn save(&mut self, p: usize, b: usize, kept: &mut Option<Self::Kept>) -> Result<(), String>;
    /// Copies `kept` into program `p`'s buffer `b`.
    fn load(&mut self, p: usize, b: usize, kept: &Self::Kept) -> Result<(), String>;
    /// Runs every program's steps on the arenas (and waits for them).
    fn execute(&mut self) -> Result<(), String>;
}

/// A program run repeatedly with arguments kept where it runs (see the module's docs).
#[derive(Debug)]
pub struct Session<R: Resident> {
    r: R,
    /// Per kept argument (by input port): per program, its devices' pieces (`None` for
    /// programs that do not read it).
    kept: BTreeMap<usize, Vec<Option<R::Kept>>>,
    /// Per kept argument whose new value some program reads but does not compute: it is
    /// made whole on the host after each run.
    whole: Vec<usize>,
    /// What the artifact says, worked out once: every run's constants (program, buffer,
    /// each device's bytes), per input port the buffer of each program reading it, per
    /// input port its `next.NAME` result, and per result the buffer of each program
    /// computing it.
    plan: Plan,
}

/// Bytes for a program's buffer: (program, buffer, each device's bytes).
type Put = (usize, usize, Vec<Vec<u8>>);

/// A session's reading of its artifact ([`Session::plan`]).
#[derive(Debug)]
struct Plan {
    consts: Result<Vec<Put>, String>,
    reads: Vec<Vec<Option<usize>>>,
    next: Vec<Option<usize>>,
    writes: Vec<Vec<Option<usize>>>,
}

impl Plan {
    fn of(art: &Artifact) -> Plan {
        let h = &art.header;
        let consts = art.section("consts").unwrap_or_default();
        let constants = h
            .programs
            .iter()
            .enumerate()
            .flat_map(|(p, prog)| {
                prog.constants.iter().map(move |c| {
                    let b = &prog.buffers[c.buffer];
                    (0..prog.devices.len())
                        .map(|d| c.bytes(consts, b, d).map(<[u8]>::to_vec))
                        .collect::<Result<Vec<_>, _>>()
                        .map(|pieces| (p, c.buffer, pieces))
                })
            })
            .collect();
        let bufs = |port: usize, out: bool| -> Vec<Option<usize>> {
            h.programs
                .iter()
                .map(|prog| {
                    let binds = if out { &prog.outputs } else { &prog.inputs };
                    binds.iter().find(|b| b.port == port).map(|b| b.buffer)
                })
                .collect()
        };
        Plan {
            consts: constants,
            reads: (0..h.inputs.len()).map(|i| bufs(i, false)).collect(),
            next: h
                .inputs
                .iter()
                .map(|p| {
                    let next = format!("next.{}", p.name);
                    h.outputs.iter().position(|o| o.name == next)
                })
                .collect(),
            writes: (0..h.outputs.len()).map(|o| bufs(o, true)).collect(),
        }
    }
}

/// The input port named `name`.
fn port(art: &Artifact, name: &str) -> Result<usize, String> {
    art.header
        .inputs
        .iter()
        .position(|p| p.name == name)
        .ok_or_else(|| format!("the program has no argument '{name}'"))
}

impl<R: Resident> Session<R> {
    /// A session on `r`'s arenas.
    pub fn new(r: R) -> Self {
        let art = r.artifact();
        let h = &art.header;
        // The arguments whose new values cannot stay where they are: some program reads
        // a piece of `NAME` that the same program and device do not compute.
        let plan = Plan::of(art);
        let mut whole = Vec::new();
        for i in 0..h.inputs.len() {
            let Some(o) = plan.next[i] else {
                continue;
            };
            let stays = h.programs.iter().all(|prog| {
                let Some(read) = prog.inputs.iter().find(|b| b.port == i) else {
                    return true;
                };
                prog.outputs
                    .iter()
                    .find(|b| b.port == o)
                    .is_some_and(|w| w.shards == read.shards)
            });
            if !stays {
                whole.push(i);
            }
        }
        Session {
            r,
            kept: BTreeMap::new(),
            whole,
            plan,
        }
    }

    /// The backend.
    pub fn resident(&self) -> &R {
        &self.r
    }

    /// Starts the arenas as a fresh run does: zeros, then the constants.
    fn reset(&mut self) -> Result<(), String> {
        self.r.zero()?;
        let consts = self.plan.consts.as_ref().map_err(Clone::clone)?;
        for (p, b, pieces) in consts {
            self.r.put(*p, *b, pieces.clone())?;
        }
        Ok(())
    }

    /// Writes whole tensor `t` as argument `i` into the arenas of the programs reading
    /// it (each device its piece).
    fn put_whole(&mut self, i: usize, t: &Tensor) -> Result<(), String> {
        let art = self.r.artifact();
        let p = &art.header.inputs[i];
        p.check(t)?;
        let bytes = t.bytes();
        let mut puts = Vec::new();
        for (q, prog) in art.header.programs.iter().enumerate() {
            for bd in prog.inputs.iter().filter(|b| b.port == i) {
                let es = prog.buffers[bd.buffer].elt.size() as usize;
                let pieces = bd
                    .shards
                    .iter()
                    .map(|r| cut(&bytes, &p.global_shape, r, es))
                    .collect();
                puts.push((q, bd.buffer, pieces));
            }
        }
        for (q, b, pieces) in puts {
            self.r.put(q, b, pieces)?;
        }
        Ok(())
    }

    /// Keeps whole tensors as arguments (by name) for the following runs.
    pub fn keep(&mut self, values: &BTreeMap<String, Tensor>) -> Result<(), String> {
        self.reset()?;
        for (name, t) in values {
            let i = port(self.r.artifact(), name)?;
            self.put_whole(i, t)?;
            self.save_input(i)?;
        }
        Ok(())
    }

    /// Copies argument `i`'s buffers, as the arenas hold them now, into its kept pieces.
    fn save_input(&mut self, i: usize) -> Result<(), String> {
        let binds = &self.plan.reads[i];
        let mut kept = self
            .kept
            .remove(&i)
            .unwrap_or_else(|| binds.iter().map(|_| None).collect());
        for (p, b) in binds.iter().enumerate() {
            if let Some(b) = b {
                self.r.save(p, *b, &mut kept[p])?;
            }
        }
        self.kept.insert(i, kept);
        Ok(())
    }

    /// Output `o` made whole from the devices computing it (replicas must agree).
    fn whole_output(&mut self, o: usize) -> Result<Tensor, String> {
        let h = &self.r.artifact().header;
        let port = h.outputs[o].clone();
        let binds: Vec<Bind> = h
            .programs
            .iter()
            .enumerate()
            .flat_map(|(p, prog)| {
                prog.outputs
                    .iter()
                    .filter(|b| b.port == o)
                    .map(move |b| (p, b.buffer, b.shards.clone()))
            })
            .collect();
        let mut pieces = Vec::new();
        for (p, b, shards) in binds {
            pieces.push((p, self.r.get(p, b)?, shards));
        }
        assemble(self.r.artifact(), &port, pieces)
    }

    /// Runs once: the kept arguments and `inputs` (whole tensors by name; every
    /// argument must be one or the other); returns the results named in `want`, whole,
    /// and keeps every `next.NAME` result as the kept argument `NAME`.
    pub fn run(
        &mut self,
        inputs: &[(&str, &Tensor)],
        want: &[&str],
    ) -> Result<Vec<Tensor>, String> {
        self.reset()?;
        let n = self.r.artifact().header.inputs.len();
        for i in 0..n {
            if let Some(kept) = self.kept.get(&i) {
                for (p, (k, b)) in kept.iter().zip(&self.plan.reads[i]).enumerate() {
                    if let (Some(k), Some(b)) = (k, b) {
                        self.r.load(p, *b, k)?;
                    }
                }
                continue;
            }
            let name = self.r.artifact().header.inputs[i].name.clone();
            let t = inputs
                .iter()
                .find(|(n, _)| *n == name)
                .map(|x| x.1)
                .ok_or_else(|| format!("no value for the argument '{name}'"))?;
            self.put_whole(i, t)?;
        }
        self.r.execute()?;
        let h = &self.r.artifact().header;
        let wanted: Vec<usize> = want
            .iter()
            .map(|w| {
                h.outputs
                    .iter()
                    .position(|p| p.name == *w)
                    .ok_or_else(|| format!("the program has no result '{w}'"))
            })
            .collect::<Result<_, _>>()?;
        let out = wanted
            .into_iter()
            .map(|o| self.whole_output(o))
            .collect::<Result<Vec<_>, _>>()?;
        // The new values of the kept arguments, kept.
        let carried: Vec<(usize, usize)> = self
            .kept
            .keys()
            .filter_map(|&i| self.plan.next[i].map(|o| (i, o)))
            .collect();
        let mut wholes = BTreeMap::new();
        for (i, o) in carried {
            if self.whole.contains(&i) {
                wholes.insert(i, self.whole_output(o)?);
                continue;
            }
            let kept = self.kept.get_mut(&i).expect("a kept argument");
            for (p, b) in self.plan.writes[o].iter().enumerate() {
                if let (Some(b), true) = (b, kept[p].is_some()) {
                    self.r.save(p, *b, &mut kept[p])?;
                }
            }
        }
        if !wholes.is_empty() {
            // Written through the arenas (the run's values are no longer needed there).
            for (i, t) in wholes {
                self.put_whole(i, &t)?;
                self.save_input(i)?;
            }
        }
        Ok(out)
    }

    /// The kept argument `name`, whole (its pieces brought to the host).
    pub fn kept(&mut self, name: &str) -> Result<Tensor, String> {
        let i = port(self.r.artifact(), name)?;
        let kept = self
            .kept
            .remove(&i)
            .ok_or_else(|| format!("'{name}' is not kept"))?;
        let art = self.r.artifact();
        let p = art.header.inputs[i].clone();
        let binds: Vec<Bind> = art
            .header
            .programs
            .iter()
            .enumerate()
            .filter_map(|(q, prog)| {
                prog.inputs
                    .iter()
                    .find(|b| b.port == i)
                    .map(|b| (q, b.buffer, b.shards.clone()))
            })
            .collect();
        let r = (|| {
            let mut pieces = Vec::new();
            for (q, b, shards) in binds {
                let k = kept[q].as_ref().ok_or("a kept piece is missing")?;
                self.r.load(q, b, k)?;
                pieces.push((q, self.r.get(q, b)?, shards));
            }
            Ok::<_, String>(pieces)
        })();
        self.kept.insert(i, kept);
        assemble(self.r.artifact(), &p, r?)
    }
}

/// A port's buffer in a program: (program, buffer, each device's ranges).
type Bind = (usize, usize, Vec<Vec<[u64; 2]>>);

/// A port's pieces in a program: (program, each device's bytes, each device's ranges).
pub(crate) type Pieces = (usize, Vec<Vec<u8>>, Vec<Vec<[u64; 2]>>);

/// Port `port` made whole from pieces: per program, its devices' bytes and ranges
/// (replicas must agree bit for bit; every element must be covered).
pub(crate) fn assemble(
    art: &Artifact,
    port: &crate::artifact::Port,
    pieces: Vec<Pieces>,
) -> Result<Tensor, String> {
    let es = port.elt.size() as usize;
    let n: u64 = port.global_shape.iter().product();
    let mut whole = vec![0u8; n as usize * es];
    let mut owner = vec![u32::MAX; n as usize];
    for (p, bytes, shards) in pieces {
        let devices = &art.header.programs[p].devices;
        for ((piece, ranges), &device) in bytes.iter().zip(&shards).zip(devices) {
            if let Some((i, first)) = place_checked(
                &mut whole,
                &port.global_shape,
                ranges,
                piece,
                es,
                &mut owner,
                device,
            ) {
                return Err(format!(
                    "replicas of '{}' disagree: element {i} on devices {first} and {device}",
                    port.name
                ));
            }
        }
    }
    if owner.contains(&u32::MAX) {
        return Err(format!("no device holds all of '{}'", port.name));
    }
    let data = match port.elt {
        Elt::F32 => Data::F32(
            whole
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect(),
        ),
        Elt::I64 => Data::I64(
            whole
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect(),
        ),
        Elt::Bf16 => return Err(format!("'{}' is stored as bf16", port.name)),
    };
    Ok(Tensor {
        shape: crate::tensor::shape(&port.global_shape),
        data,
    })
}

/// The host's arenas kept between runs.
#[derive(Debug)]
pub struct HostResident<'a> {
    prog: &'a crate::HostProgram,
    arenas: crate::host::Arenas,
}

impl<'a> HostResident<'a> {
    /// Arenas for `prog`.
    pub fn new(prog: &'a crate::HostProgram) -> Self {
        let arenas = prog
            .artifact()
            .header
            .programs
            .iter()
            .map(|p| {
                let words = p.arena_bytes.div_ceil(8) as usize;
                p.devices.iter().map(|_| vec![0u64; words]).collect()
            })
            .collect();
        HostResident { prog, arenas }
    }
}

impl Resident for HostResident<'_> {
    type Kept = Vec<Vec<u8>>;
    fn artifact(&self) -> &Artifact {
        self.prog.artifact()
    }
    fn zero(&mut self) -> Result<(), String> {
        for a in self.arenas.iter_mut().flatten() {
            a.fill(0);
        }
        Ok(())
    }
    fn put(&mut self, p: usize, b: usize, pieces: Vec<Vec<u8>>) -> Result<(), String> {
        let buf = &self.prog.artifact().header.programs[p].buffers[b];
        for (a, piece) in self.arenas[p].iter_mut().zip(pieces) {
            crate::host::write_at(a, buf.offset, &piece);
        }
        Ok(())
    }
    fn get(&mut self, p: usize, b: usize) -> Result<Vec<Vec<u8>>, String> {
        let buf = &self.prog.artifact().header.programs[p].buffers[b];
        Ok(self.arenas[p]
            .iter()
            .map(|a| crate::host::get(a, buf))
            .collect())
    }
    fn save(&mut self, p: usize, b: usize, kept: &mut Option<Self::Kept>) -> Result<(), String> {
        *kept = Some(self.get(p, b)?);
        Ok(())
    }
    fn load(&mut self, p: usize, b: usize, kept: &Self::Kept) -> Result<(), String> {
        self.put(p, b, kept.clone())
    }
    fn execute(&mut self) -> Result<(), String> {
        crate::host::schedule(
            self.prog.artifact(),
            &mut crate::host::HostEngine::new(self.prog, &mut self.arenas)?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::{HostResident, Session};
    use crate::tensor::{Data, Tensor};
    use std::collections::BTreeMap;

    /// The sample artifacts (`y = 2 x`) as a step: `x` is the kept `w`, `y` its new
    /// value `next.w`.
    fn as_step(mut art: crate::Artifact) -> Option<crate::HostProgram> {
        art.header.inputs[0].name = "w".into();
        art.header.outputs[0].name = "next.w".into();
        crate::host::tests_support::doubling(&art)
    }

    fn w(v: Vec<f32>) -> Tensor {
        Tensor {
            shape: vec![4],
            data: Data::F32(v),
        }
    }

    /// Kept arguments stay between runs and take their new values: three doublings.
    /// In the pipeline, program 0 reads `w` and program 1 computes `next.w`, so the new
    /// value goes through the host; the same values.
    #[test]
    fn kept_arguments_take_their_new_values_between_runs() {
        for art in [
            crate::artifact::tests_support::sample(),
            crate::artifact::tests_support::pipeline(),
        ] {
            let Some(prog) = as_step(art) else {
                eprintln!("skipped: no C compiler for the test kernels");
                return;
            };
            let mut s = Session::new(HostResident::new(&prog));
            s.keep(&BTreeMap::from([(
                "w".to_string(),
                w(vec![1.0, 2.0, 3.0, 4.0]),
            )]))
            .unwrap();
            assert!(s.run(&[], &[]).unwrap().is_empty());
            let out = s.run(&[], &["next.w"]).unwrap();
            assert_eq!(out[0], w(vec![4.0, 8.0, 12.0, 16.0]));
            s.run(&[], &[]).unwrap();
            assert_eq!(s.kept("w").unwrap(), w(vec![8.0, 16.0, 24.0, 32.0]));
            let e = s.run(&[], &["loss"]).unwrap_err();
            assert!(e.contains("no result 'loss'"), "{e}");
        }
    }

    /// An argument neither kept nor given is an error naming it.
    #[test]
    fn a_missing_argument_is_named() {
        let Some(prog) = as_step(crate::artifact::tests_support::sample()) else {
            return;
        };
        let mut s = Session::new(HostResident::new(&prog));
        let e = s.run(&[], &[]).unwrap_err();
        assert!(e.contains("no value for the argument 'w'"), "{e}");
        let x = w(vec![1.0; 4]);
        assert_eq!(
            s.run(&[("w", &x)], &["next.w"]).unwrap()[0],
            w(vec![2.0; 4])
        );
    }
}
