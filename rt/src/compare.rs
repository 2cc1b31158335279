//! Two backends in lockstep (`nnscaler-rt compare`): every step of the launch plan runs
//! on both, and what it wrote (a kernel's outputs, a collective's output, a received
//! buffer) is compared device by device before the next step. So a GPU that disagrees
//! with the host kernels is caught at the first kernel that does, named, instead of in
//! the step's results after every later kernel has spread the error.
//!
//! The error of a buffer is its largest absolute difference over its largest finite
//! magnitude on the reference side (the difference itself where that is below 1e-6:
//! `bench/gpu/compare.py`'s measure); a NaN on one side only is an infinite error; i64
//! buffers must be equal.

use crate::artifact::{Artifact, Elt, Step};
use crate::host::{schedule, Engine};

/// How one step's results agree.
#[derive(Clone, Debug, PartialEq)]
pub struct StepDiff {
    /// The program (`train`, `train.pp1`).
    pub program: String,
    /// The step's index in it.
    pub step: usize,
    /// What ran: the kernel's name, or the step's kind.
    pub what: String,
    /// The written buffer that agrees least.
    pub buffer: usize,
    /// Its device (the position in the program's devices).
    pub device: usize,
    /// Its error (see the module's docs).
    pub error: f64,
}

/// Every compared step's worst buffer, in the order the steps ran.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Comparison {
    /// One per step that wrote something.
    pub steps: Vec<StepDiff>,
}

impl Comparison {
    /// The first step whose error is above `tol`.
    pub fn first_over(&self, tol: f64) -> Option<&StepDiff> {
        self.steps
            .iter()
            .find(|d| d.error.is_nan() || d.error > tol)
    }

    /// A report: the steps compared, the worst error per kernel (or step kind), the
    /// `top` worst first, and the first step over `tol`.
    pub fn report(&self, tol: f64, top: usize) -> String {
        let mut by: Vec<(String, f64, usize)> = Vec::new();
        for d in &self.steps {
            match by.iter_mut().find(|(w, _, _)| *w == d.what) {
                Some(e) => {
                    e.1 = e.1.max(d.error);
                    e.2 += 1;
                }
                None => by.push((d.what.clone(), d.error, 1)),
            }
        }
        by.sort_by(|a, b| b.1.total_cmp(&a.1));
        let mut s = format!(
            "compared {} steps ({} kernels and step kinds); worst first:\n",
            self.steps.len(),
            by.len()
        );
        for (what, err, n) in by.iter().take(top) {
            s += &format!("  {what:<40} {n:>5} runs  error {err:.3e}\n");
        }
        match self.first_over(tol) {
            Some(d) => {
                s += &format!(
                    "first over {tol:e}: program '{}' step {} ({}): buffer {} on device {}, error {:.3e}\n",
                    d.program, d.step, d.what, d.buffer, d.device, d.error
                )
            }
            None => s += &format!("every step agrees within {tol:e}\n"),
        }
        s
    }
}

/// What step `s` of program `p` is called and which buffers it writes (none for a send).
fn written(art: &Artifact, p: usize, s: &Step) -> (String, Vec<usize>) {
    let prog = &art.header.programs[p];
    match s {
        Step::Launch { kernel, buffers } => {
            let k = &art.header.kernels[*kernel];
            (
                k.name.clone(),
                buffers[buffers.len() - k.outputs.min(buffers.len())..].to_vec(),
            )
        }
        Step::Collective { op, output, .. } => (op.name().into(), vec![*output]),
        Step::Recv { buffer, .. } => ("recv".into(), vec![*buffer]),
        Step::Send { .. } => (format!("send from '{}'", prog.name), Vec::new()),
    }
}

/// The error of `got` against `want` (see the module's docs).
fn error(elt: Elt, got: &[u8], want: &[u8]) -> f64 {
    match elt {
        Elt::I64 => {
            if got == want {
                0.0
            } else {
                f64::INFINITY
            }
        }
        Elt::F32 | Elt::Bf16 => {
            let f = |b: &[u8]| -> Vec<f32> {
                if elt == Elt::Bf16 {
                    return b
                        .chunks_exact(2)
                        .map(|c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16))
                        .collect();
                }
                b.chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
                    .collect()
            };
            let (x, y) = (f(got), f(want));
            let scale = y
                .iter()
                .filter(|v| v.is_finite())
                .fold(0.0f64, |m, v| m.max(f64::from(v.abs())));
            let mut worst = 0.0f64;
            for (a, b) in x.iter().zip(&y) {
                let d = if a.is_nan() || b.is_nan() {
                    if a.is_nan() && b.is_nan() {
                        0.0
                    } else {
                        f64::INFINITY
                    }
                } else if a == b {
                    0.0
                } else {
                    (f64::from(*a) - f64::from(*b)).abs()
                };
                worst = worst.max(d);
            }
            if scale >= 1e-6 {
                worst / scale
            } else {
                worst
            }
        }
    }
}

/// Runs `a` (checked) and `b` (the reference) in lockstep.
pub(crate) struct Lockstep<'x, A, B> {
    art: &'x Artifact,
    a: A,
    b: B,
    /// After each step, `a` takes `b`'s values of what it wrote, so every step starts
    /// from the reference's inputs and its error is its own.
    resync: bool,
    /// Per program, the index of its next step.
    next: Vec<usize>,
    found: Comparison,
}

impl<'x, A: Engine, B: Engine> Lockstep<'x, A, B> {
    pub(crate) fn new(art: &'x Artifact, a: A, b: B, resync: bool) -> Self {
        Lockstep {
            art,
            a,
            b,
            resync,
            next: vec![0; art.header.programs.len()],
            found: Comparison::default(),
        }
    }

    /// Runs every program to its end under [`schedule`] and returns how the steps agree.
    pub(crate) fn run(mut self) -> Result<Comparison, String> {
        let art = self.art;
        schedule(art, &mut self)?;
        Ok(self.found)
    }

    fn compare(
        &mut self,
        p: usize,
        step: usize,
        what: String,
        bufs: &[usize],
    ) -> Result<(), String> {
        let prog = &self.art.header.programs[p];
        let mut worst: Option<StepDiff> = None;
        for &b in bufs {
            let (x, y) = (self.a.bytes(p, b)?, self.b.bytes(p, b)?);
            for (device, (got, want)) in x.iter().zip(&y).enumerate() {
                let e = error(prog.buffers[b].elt, got, want);
                if worst.as_ref().is_none_or(|w| e > w.error) {
                    worst = Some(StepDiff {
                        program: prog.name.clone(),
                        step,
                        what: what.clone(),
                        buffer: b,
                        device,
                        error: e,
                    });
                }
            }
        }
        self.found.steps.extend(worst);
        if self.resync {
            for &b in bufs {
                let want = self.b.bytes(p, b)?;
                self.a.put_bytes(p, b, want)?;
            }
        }
        Ok(())
    }

    fn take_step(&mut self, p: usize) -> usize {
        let i = self.next[p];
        self.next[p] += 1;
        i
    }
}

impl<A: Engine, B: Engine> Engine for Lockstep<'_, A, B> {
    type Parcel = (A::Parcel, B::Parcel);

    fn step(&mut self, p: usize, s: &Step) -> Result<(), String> {
        let i = self.take_step(p);
        self.a.step(p, s)?;
        self.b.step(p, s)?;
        let (what, bufs) = written(self.art, p, s);
        self.compare(p, i, what, &bufs)
    }

    fn read(&mut self, p: usize, b: usize) -> Result<Self::Parcel, String> {
        self.take_step(p);
        Ok((self.a.read(p, b)?, self.b.read(p, b)?))
    }

    fn write(&mut self, p: usize, b: usize, (x, y): Self::Parcel) -> Result<(), String> {
        let i = self.take_step(p);
        self.a.write(p, b, x)?;
        self.b.write(p, b, y)?;
        self.compare(p, i, "recv".into(), &[b])
    }

    fn bytes(&mut self, p: usize, b: usize) -> Result<Vec<Vec<u8>>, String> {
        self.a.bytes(p, b)
    }

    fn put_bytes(&mut self, p: usize, b: usize, bytes: Vec<Vec<u8>>) -> Result<(), String> {
        self.a.put_bytes(p, b, bytes.clone())?;
        self.b.put_bytes(p, b, bytes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifact::tests_support::sample;

    /// One f32 per buffer per device; kernel launches add 1 to their last buffer, and
    /// `skew` adds more at one step.
    struct Toy {
        vals: Vec<f32>,
        steps: usize,
        skew: Option<(usize, f32)>,
    }

    impl Engine for Toy {
        type Parcel = f32;
        fn step(&mut self, _: usize, s: &Step) -> Result<(), String> {
            if let Step::Launch { buffers, .. } = s {
                let b = *buffers.last().unwrap();
                self.vals[b] += 1.0;
                if let Some((at, by)) = self.skew {
                    if at == self.steps {
                        self.vals[b] += by;
                    }
                }
            }
            self.steps += 1;
            Ok(())
        }
        fn read(&mut self, _: usize, b: usize) -> Result<f32, String> {
            Ok(self.vals[b])
        }
        fn write(&mut self, _: usize, b: usize, v: f32) -> Result<(), String> {
            self.vals[b] = v;
            Ok(())
        }
        fn bytes(&mut self, _: usize, b: usize) -> Result<Vec<Vec<u8>>, String> {
            let mut v = self.vals[b].to_le_bytes().to_vec();
            v.resize(16, 0);
            Ok(vec![v])
        }
        fn put_bytes(&mut self, _: usize, b: usize, v: Vec<Vec<u8>>) -> Result<(), String> {
            self.vals[b] = f32::from_le_bytes(v[0][..4].try_into().unwrap());
            Ok(())
        }
    }

    fn toy(skew: Option<(usize, f32)>) -> Toy {
        Toy {
            vals: vec![0.0, 100.0],
            steps: 0,
            skew,
        }
    }

    /// The first step that disagrees is the one named, with its kernel.
    #[test]
    fn the_first_disagreeing_step_is_named() {
        let mut art = sample();
        let launch = art.header.programs[0].steps[0].clone();
        art.header.programs[0].steps = vec![launch.clone(), launch.clone(), launch];
        let same = Lockstep::new(&art, toy(None), toy(None), true)
            .run()
            .unwrap();
        assert_eq!(same.steps.len(), 3);
        assert_eq!(same.first_over(0.0), None);
        for resync in [true, false] {
            let c = Lockstep::new(&art, toy(Some((1, 0.5))), toy(None), resync)
                .run()
                .unwrap();
            let d = c.first_over(1e-4).unwrap();
            assert_eq!((d.step, d.what.as_str(), d.buffer), (1, "k0", 1));
            // 0.5 off a largest magnitude of 102.
            assert!((d.error - 0.5 / 102.0).abs() < 1e-9, "{}", d.error);
            let report = c.report(1e-4, 5);
            assert!(
                report.contains("first over 1e-4: program 'f' step 1 (k0)"),
                "{report}"
            );
            // Resynchronized, the next step starts from the reference's value; else the
            // skew carries on.
            let e = c.steps[2].error;
            if resync {
                assert_eq!(e, 0.0);
            } else {
                assert!((e - 0.5 / 103.0).abs() < 1e-9, "{e}");
            }
        }
    }

    #[test]
    fn errors_follow_nans_and_integers() {
        let f = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
        assert_eq!(
            error(Elt::F32, &f(&[1.0, f32::NAN]), &f(&[1.0, f32::NAN])),
            0.0
        );
        assert!(error(Elt::F32, &f(&[1.0, 2.0]), &f(&[1.0, f32::NAN])).is_infinite());
        assert!((error(Elt::F32, &f(&[1.0, 2.5]), &f(&[1.0, 2.0])) - 0.25).abs() < 1e-12);
        assert!(error(
            Elt::I64,
            &[1, 0, 0, 0, 0, 0, 0, 0],
            &[2, 0, 0, 0, 0, 0, 0, 0]
        )
        .is_infinite());
    }
}
