//! `nnscaler-rt run --profile`: every step of a run timed (CUDA events on the GPU, the
//! clock on the host), summed by kernel family (a kernel's name less its numbering: every
//! `nN_layer_norm` is `layer_norm`), with each family's launches, share of the step, and the
//! rate it reached where it knows its work: bytes (the buffers it touches, each once: a
//! lower bound of its traffic) and, for matrix products, FLOPs.

use crate::artifact::{Artifact, Step};
use crate::host::Engine;
use std::collections::BTreeMap;

/// Marks in time on a device's timeline, and the seconds between two.
pub(crate) trait Clock {
    type Mark;
    fn mark(&mut self) -> Result<Self::Mark, String>;
    /// Seconds from `a` to `b` (after the run: the marks are complete).
    fn between(&self, a: &Self::Mark, b: &Self::Mark) -> Result<f64, String>;
}

/// The host's clock.
pub(crate) struct Wall;

impl Clock for Wall {
    type Mark = std::time::Instant;
    fn mark(&mut self) -> Result<Self::Mark, String> {
        Ok(std::time::Instant::now())
    }
    fn between(&self, a: &Self::Mark, b: &Self::Mark) -> Result<f64, String> {
        Ok(b.duration_since(*a).as_secs_f64())
    }
}

/// What a step is, for the table: its family, the bytes it touches and its FLOPs.
type Label = (String, u64, u64);

/// A step's [`Label`].
pub(crate) fn label(art: &Artifact, p: usize, s: &Step) -> Label {
    let h = &art.header;
    let prog = &h.programs[p];
    let devices = prog.devices.len() as u64;
    match s {
        Step::Launch { kernel, .. } => {
            let k = &h.kernels[*kernel];
            let bytes = k.sizes.iter().fold(0u64, |n, &b| n.saturating_add(b));
            let flops = k.gemm.map_or(0, |g| {
                2u64.saturating_mul(g.batch)
                    .saturating_mul(g.m)
                    .saturating_mul(g.n)
                    .saturating_mul(g.k)
            });
            (
                family(&k.name),
                bytes.saturating_mul(devices),
                flops.saturating_mul(devices),
            )
        }
        Step::Collective { op, input, .. } => {
            let b = prog.buffers.get(*input).map_or(0, |b| b.bytes());
            (format!("({})", op.name()), b.saturating_mul(devices), 0)
        }
        Step::Send { .. } | Step::Recv { .. } => ("(send/recv)".into(), 0, 0),
    }
}

/// A kernel's family: its name less the numbering the compiler gives (`n12_`, `k3_`,
/// `pp0_`, repeated).
pub fn family(name: &str) -> String {
    let mut s = name;
    loop {
        let Some((head, rest)) = s.split_once('_') else {
            return s.to_string();
        };
        let letters = head.trim_end_matches(|c: char| c.is_ascii_digit());
        let numbered = letters.len() < head.len()
            && !letters.is_empty()
            && letters.chars().all(|c| c.is_ascii_lowercase());
        if !numbered || rest.is_empty() {
            return s.to_string();
        }
        s = rest;
    }
}

/// An engine whose every step is timed.
pub(crate) struct Profiled<'c, E, C: Clock> {
    pub(crate) inner: E,
    clock: &'c mut C,
    art: &'c Artifact,
    marks: Vec<(Label, C::Mark, C::Mark)>,
}

impl<'c, E: Engine, C: Clock> Profiled<'c, E, C> {
    pub(crate) fn new(inner: E, clock: &'c mut C, art: &'c Artifact) -> Self {
        Profiled {
            inner,
            clock,
            art,
            marks: Vec::new(),
        }
    }

    /// The table of the timed steps (after the run finished on the device).
    pub(crate) fn profile(&self) -> Result<Profile, String> {
        let mut p = Profile::default();
        for ((fam, bytes, flops), a, b) in &self.marks {
            let secs = self.clock.between(a, b)?;
            let r = p.rows.entry(fam.clone()).or_default();
            r.launches += 1;
            r.seconds += secs;
            r.bytes = r.bytes.saturating_add(*bytes);
            r.flops = r.flops.saturating_add(*flops);
        }
        Ok(p)
    }
}

impl<E: Engine, C: Clock> Engine for Profiled<'_, E, C> {
    type Parcel = E::Parcel;
    fn step(&mut self, p: usize, s: &Step) -> Result<(), String> {
        let a = self.clock.mark()?;
        self.inner.step(p, s)?;
        let b = self.clock.mark()?;
        self.marks.push((label(self.art, p, s), a, b));
        Ok(())
    }
    fn read(&mut self, p: usize, b: usize) -> Result<Self::Parcel, String> {
        self.inner.read(p, b)
    }
    fn write(&mut self, p: usize, b: usize, parcel: Self::Parcel) -> Result<(), String> {
        self.inner.write(p, b, parcel)
    }
    fn bytes(&mut self, p: usize, b: usize) -> Result<Vec<Vec<u8>>, String> {
        self.inner.bytes(p, b)
    }
    fn put_bytes(&mut self, p: usize, b: usize, bytes: Vec<Vec<u8>>) -> Result<(), String> {
        self.inner.put_bytes(p, b, bytes)
    }
}

/// One family's totals.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Row {
    pub launches: u64,
    pub seconds: f64,
    pub bytes: u64,
    pub flops: u64,
}

/// A run's steps by family.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Profile {
    pub rows: BTreeMap<String, Row>,
}

impl Profile {
    /// The families, most time first: time, share, launches, GB/s and TFLOP/s where known.
    pub fn table(&self) -> String {
        let total: f64 = self.rows.values().map(|r| r.seconds).sum();
        let launches: u64 = self.rows.values().map(|r| r.launches).sum();
        let mut rows: Vec<(&String, &Row)> = self.rows.iter().collect();
        rows.sort_by(|a, b| b.1.seconds.total_cmp(&a.1.seconds));
        let mut s = format!(
            "profile: {launches} steps, {:.3} ms in them\n{:<40} {:>10} {:>7} {:>8} {:>9} {:>9}\n",
            total * 1e3,
            "family",
            "ms",
            "share",
            "steps",
            "GB/s",
            "TFLOP/s"
        );
        for (name, r) in rows {
            let rate = |x: u64, unit: f64| {
                if x == 0 || r.seconds <= 0.0 {
                    "-".to_string()
                } else {
                    let v = x as f64 / r.seconds / unit;
                    if v < 10.0 {
                        format!("{v:.3}")
                    } else {
                        format!("{v:.1}")
                    }
                }
            };
            s.push_str(&format!(
                "{:<40} {:>10.3} {:>6.1}% {:>8} {:>9} {:>9}\n",
                name,
                r.seconds * 1e3,
                100.0 * r.seconds / total.max(f64::MIN_POSITIVE),
                r.launches,
                rate(r.bytes, 1e9),
                rate(r.flops, 1e12),
            ));
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn families_drop_the_numbering() {
        assert_eq!(family("n12_layer_norm_grad_rows"), "layer_norm_grad_rows");
        assert_eq!(family("k0_add"), "add");
        assert_eq!(family("pp0_n3_linear_gemm"), "linear_gemm");
        assert_eq!(family("nns_reduce_sum"), "nns_reduce_sum");
        assert_eq!(family("add_add"), "add_add");
        assert_eq!(family("n4_"), "n4_");
    }

    #[test]
    fn a_profiled_run_times_every_step_by_family() {
        let art = crate::artifact::tests_support::sample();
        let prog = crate::host::tests_support::doubling(&art).expect("the doubling kernels load");
        let x = crate::tensor::Tensor {
            shape: vec![4],
            data: crate::tensor::Data::F32(vec![1.0, 2.0, 3.0, 4.0]),
        };
        let (y, profile) = prog.run_profiled(&[x]).unwrap();
        assert_eq!(
            y[0].data,
            crate::tensor::Data::F32(vec![2.0, 4.0, 6.0, 8.0])
        );
        let r = &profile.rows["k0"];
        assert_eq!((r.launches, r.bytes, r.flops), (1, 32, 0));
        let t = profile.table();
        assert!(t.starts_with("profile: 1 steps, "), "{t}");
        assert!(t.contains("\nk0 "), "{t}");
    }
}
