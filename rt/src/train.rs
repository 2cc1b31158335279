//! Training: the loop `nnscaler train` and `nnscaler-rt train` share, and the training
//! bundles `nnscaler train --bundle DIR` writes for `nnscaler-rt train DIR` to run where
//! the GPUs are.
//!
//! The loop ([`train`]): each step a batch of random blocks of the training data (a
//! counter-based draw from the seed and the step, so a resumed run, or another process,
//! sees the same batches), the learning rate of the schedule ([`LrSchedule`]: linear
//! warm-up, then cosine to `min_lr`, nanoGPT's), one run of the compiled step by an
//! [`Engine`], whose `next.*` results replace the parameters and moments. Every
//! `eval_every` steps the mean loss over `eval_batches` batches of train and val data (the
//! forward alone, on one device). Outputs (on the lead process): a progress bar on a
//! terminal, a line per evaluation on stdout (step, train and val loss, lr, tokens/s), one
//! JSON line per step and per evaluation in `log`, a loss-curve SVG in `curve`, and
//! checkpoints (every parameter and moment as a whole tensor, and the step) written
//! atomically every `checkpoint.every` steps and at the end; a resumed run continues from
//! the last one exactly. A non-finite loss stops the run, keeping the last checkpoint.
//!
//! A bundle ([`Bundle`]) is a directory: `bundle.json` (the [`Manifest`]: format version,
//! the loop's settings, the state's names, shapes and initialization, every file's size
//! and FNV-1a checksum), `step.nnsx` and `eval.nnsx` (the artifacts of the training step
//! and the evaluation forward), `data/` (the corpus), `config.toml` (the resolved config,
//! for people) and, when the initial parameters came from a checkpoint, `init.safetensors`.

use crate::data::{Dataset, Split};
use crate::session::{Resident, Session};
pub use crate::tensor::Tensor as RtTensor;
use crate::tensor::{Data, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

mod bundle;
pub use bundle::{Bundle, BundleFiles, FileSum, Manifest};

/// The manifest's `format`.
pub const FORMAT: &str = "nnscaler-bundle";
/// The bundle format version this runtime reads and writes.
pub const VERSION: u32 = 1;
/// The manifest's file name in a bundle.
pub const MANIFEST: &str = "bundle.json";
/// A checkpoint's file name in `checkpoint.dir`.
pub const CHECKPOINT: &str = "checkpoint.safetensors";
/// The checkpoint's tensor holding the step (an integer).
pub const STEP_TENSOR: &str = "train.step";
/// The seed stream evaluation batches are drawn from (the same batches every time).
const EVAL_SEED: u64 = 0x5eed_e7a1;

/// The learning-rate schedule: linear warm-up, then cosine to `min_lr` (nanoGPT's).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrSchedule {
    /// Peak learning rate.
    pub lr: f64,
    /// The floor the cosine decays to.
    pub min_lr: f64,
    /// Warm-up steps (linear from lr / (warmup + 1)).
    pub warmup: u64,
    /// Decay until this step (absent: the run's steps).
    #[serde(default)]
    pub decay_steps: Option<u64>,
}

impl LrSchedule {
    /// The learning rate at 0-based step `it` of a run of `steps`.
    pub fn at(&self, steps: u64, it: u64) -> f64 {
        let decay = self.decay_steps.unwrap_or(steps);
        if it < self.warmup {
            return self.lr * (it + 1) as f64 / (self.warmup + 1) as f64;
        }
        if it > decay {
            return self.min_lr;
        }
        let ratio = (it - self.warmup) as f64 / (decay - self.warmup).max(1) as f64;
        let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
        self.min_lr + coeff * (self.lr - self.min_lr)
    }
}

/// Checkpoints: where, and how often.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Checkpointing {
    /// The directory (`checkpoint.safetensors` in it).
    pub dir: String,
    /// Write every this many steps (and at the end).
    pub every: u64,
}

/// The loop's settings (a config's `[train]`, `[optimizer]` schedule and `[checkpoint]`,
/// and the model's batch and block).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Loop {
    /// Steps to train.
    pub steps: u64,
    /// Evaluate every this many steps (0: only at the end).
    pub eval_every: u64,
    /// Batches per evaluation.
    pub eval_batches: u64,
    /// Seed of the initial parameters and the batches.
    pub seed: u64,
    /// Sequences per batch.
    pub batch: u64,
    /// Tokens per sequence.
    pub block: u64,
    /// JSON-lines metrics log.
    #[serde(default)]
    pub log: Option<String>,
    /// Loss-curve SVG written at the end.
    #[serde(default)]
    pub curve: Option<String>,
    /// The learning-rate schedule.
    pub schedule: LrSchedule,
    /// Checkpoints.
    #[serde(default)]
    pub checkpoint: Option<Checkpointing>,
}

/// How a state tensor starts (a parameter's rule; moments start at zero).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Init {
    /// Every element `value`.
    Const {
        /// The value.
        value: f64,
    },
    /// normal(mean, std), drawn from the tensor's own stream (a hash of its name).
    Normal {
        /// Mean.
        mean: f64,
        /// Standard deviation.
        std: f64,
    },
    /// uniform(lo, hi), drawn the same way.
    Uniform {
        /// Low end.
        lo: f64,
        /// High end.
        hi: f64,
    },
    /// Read from the bundle's `init.safetensors` (a run started from a checkpoint).
    Stored,
}

/// A tensor of the training state: a parameter or an optimizer moment.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StateSpec {
    /// Its name (the step's argument; its new value is the result `next.NAME`).
    pub name: String,
    /// Its shape.
    pub shape: Vec<u64>,
    /// How it starts.
    pub init: Init,
}

impl StateSpec {
    /// Its initial value under `seed` (not for [`Init::Stored`]).
    pub fn draw(&self, seed: u64) -> Result<Tensor, String> {
        use crate::rng;
        let n: u64 = self.shape.iter().product();
        let stream = rng::name_stream(&self.name);
        let v: Vec<f32> = match self.init {
            Init::Const { value } => vec![value as f32; n as usize],
            Init::Normal { mean, std } => (0..n)
                .map(|i| (mean + std * rng::normal(seed, stream, i)) as f32)
                .collect(),
            Init::Uniform { lo, hi } => (0..n)
                .map(|i| (lo + (hi - lo) * rng::uniform(seed, stream, i)) as f32)
                .collect(),
            Init::Stored => {
                return Err(format!(
                    "'{}' is stored, not drawn (init.safetensors)",
                    self.name
                ))
            }
        };
        Ok(Tensor {
            shape: crate::tensor::shape(&self.shape),
            data: Data::F32(v),
        })
    }
}

/// What runs the training step and the evaluation forward: on one process over whole
/// tensors ([`Whole`]), or as one of several processes each running its devices
/// (`crate::procs`).
pub trait Engine {
    /// Takes the whole state (every parameter and moment by name) to start from.
    fn set_state(&mut self, state: BTreeMap<String, Tensor>) -> Result<(), String>;
    /// Runs one step on a batch with the step number and learning rate; returns the loss.
    fn step(
        &mut self,
        tokens: &Tensor,
        targets: &Tensor,
        step: u64,
        lr: f32,
    ) -> Result<f64, String>;
    /// The whole state (on the lead process; `None` on the others, which take part).
    fn state(&mut self) -> Result<Option<BTreeMap<String, Tensor>>, String>;
    /// The evaluation forward's loss on a batch with `state` (on the lead process).
    fn forward(
        &mut self,
        state: &BTreeMap<String, Tensor>,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<f64, String>;
    /// The lead process's `stop` on every process (one process: its own).
    fn agree(&mut self, stop: bool) -> Result<bool, String> {
        Ok(stop)
    }
}

/// A function run on whole tensors (its arguments in order; its results in order).
pub type RunFn<'a> = Box<dyn FnMut(&[Tensor]) -> Result<Vec<Tensor>, String> + 'a>;

/// The engine of one process: the whole state on the host, the step and the forward run
/// by functions over whole tensors (a compiled artifact on the host or a GPU, or the
/// reference runtime).
pub struct Whole<'a> {
    step_inputs: Vec<String>,
    step_outputs: Vec<String>,
    step: RunFn<'a>,
    forward_inputs: Vec<String>,
    forward: RunFn<'a>,
    state: BTreeMap<String, Tensor>,
}

impl std::fmt::Debug for Whole<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Whole")
            .field("step_inputs", &self.step_inputs)
            .field("step_outputs", &self.step_outputs)
            .field("forward_inputs", &self.forward_inputs)
            .finish_non_exhaustive()
    }
}

impl<'a> Whole<'a> {
    /// The step (its arguments' and results' names, and how it runs) and the forward
    /// (its arguments' names; its first result is the loss).
    pub fn new(
        step_inputs: Vec<String>,
        step_outputs: Vec<String>,
        step: RunFn<'a>,
        forward_inputs: Vec<String>,
        forward: RunFn<'a>,
    ) -> Self {
        Whole {
            step_inputs,
            step_outputs,
            step,
            forward_inputs,
            forward,
            state: BTreeMap::new(),
        }
    }
}

/// A scalar f32 tensor.
pub fn scalar(x: f32) -> Tensor {
    Tensor {
        shape: Vec::new(),
        data: Data::F32(vec![x]),
    }
}

/// The first element of a result as f64.
fn first(t: &Tensor, what: &str) -> Result<f64, String> {
    match &t.data {
        Data::F32(v) => v.first().map(|&x| f64::from(x)),
        Data::I64(_) => None,
    }
    .ok_or_else(|| format!("{what} is not an f32 scalar"))
}

impl Engine for Whole<'_> {
    fn set_state(&mut self, state: BTreeMap<String, Tensor>) -> Result<(), String> {
        self.state = state;
        Ok(())
    }

    fn step(
        &mut self,
        tokens: &Tensor,
        targets: &Tensor,
        step: u64,
        lr: f32,
    ) -> Result<f64, String> {
        let mut inputs = Vec::with_capacity(self.step_inputs.len());
        for name in &self.step_inputs {
            inputs.push(match name.as_str() {
                "tokens" => tokens.clone(),
                "targets" => targets.clone(),
                "step" => scalar(step as f32),
                "lr" => scalar(lr),
                n => self
                    .state
                    .get(n)
                    .cloned()
                    .ok_or(format!("no value for the step's argument '{n}'"))?,
            });
        }
        let outs = (self.step)(&inputs)?;
        let mut loss = f64::NAN;
        for (name, v) in self.step_outputs.iter().zip(outs) {
            if name == "loss" {
                loss = first(&v, "the loss")?;
            } else if let Some(key) = name.strip_prefix("next.") {
                self.state.insert(key.to_string(), v);
            }
        }
        Ok(loss)
    }

    fn state(&mut self) -> Result<Option<BTreeMap<String, Tensor>>, String> {
        Ok(Some(self.state.clone()))
    }

    fn forward(
        &mut self,
        state: &BTreeMap<String, Tensor>,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<f64, String> {
        let inputs = self
            .forward_inputs
            .iter()
            .map(|n| match n.as_str() {
                "tokens" => Ok(tokens.clone()),
                "targets" => Ok(targets.clone()),
                n => state
                    .get(n)
                    .cloned()
                    .ok_or(format!("no parameter '{n}' to evaluate with")),
            })
            .collect::<Result<Vec<_>, String>>()?;
        let outs = (self.forward)(&inputs).map_err(|e| format!("evaluation: {e}"))?;
        first(
            outs.first()
                .ok_or("evaluation: the forward has no result")?,
            "evaluation's loss",
        )
    }
}

/// The evaluation forward as an engine runs it: the loss of a batch with the state's
/// parameters.
pub trait Forward {
    /// The state changed since the last call (the parameters must be taken again).
    fn invalidate(&mut self);
    /// The forward's loss on a batch with `state`.
    fn forward(
        &mut self,
        state: &BTreeMap<String, Tensor>,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<f64, String>;
}

/// The evaluation forward as a [`Session`]: the parameters taken once per evaluation,
/// each batch moving its tokens in and its loss out.
#[derive(Debug)]
pub struct Evaluator<Q: Resident> {
    eval: Session<Q>,
    /// The forward's parameters are older than the state.
    stale: bool,
}

impl<Q: Resident> Evaluator<Q> {
    /// The forward's session.
    pub fn new(eval: Session<Q>) -> Self {
        Evaluator { eval, stale: true }
    }
}

impl<Q: Resident> Forward for Evaluator<Q> {
    fn invalidate(&mut self) {
        self.stale = true;
    }

    fn forward(
        &mut self,
        state: &BTreeMap<String, Tensor>,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<f64, String> {
        let h = &self.eval.resident().artifact().header;
        let loss = h
            .outputs
            .first()
            .map(|p| p.name.clone())
            .ok_or("evaluation: the forward has no result")?;
        if self.stale {
            let params: BTreeMap<String, Tensor> = h
                .inputs
                .iter()
                .filter(|p| p.name != "tokens" && p.name != "targets")
                .map(|p| {
                    state
                        .get(&p.name)
                        .cloned()
                        .map(|t| (p.name.clone(), t))
                        .ok_or(format!("no parameter '{}' to evaluate with", p.name))
                })
                .collect::<Result<_, _>>()?;
            self.eval.keep(&params)?;
            self.stale = false;
        }
        let out = self
            .eval
            .run(&[("tokens", tokens), ("targets", targets)], &[&loss])
            .map_err(|e| format!("evaluation: {e}"))?;
        first(&out[0], "evaluation's loss")
    }
}

/// The engine of one process whose state stays where the step runs (a [`Session`] of
/// the step, and an [`Evaluator`]): a step moves its batch in and its loss out; the state
/// comes to the host for checkpoints and evaluations only, and the forward takes the
/// parameters once per evaluation.
#[derive(Debug)]
pub struct Kept<R: Resident, Q: Resident> {
    step: Session<R>,
    eval: Evaluator<Q>,
    names: Vec<String>,
}

impl<R: Resident, Q: Resident> Kept<R, Q> {
    /// The step's session and the forward's; `names`: the state's tensors.
    pub fn new(step: Session<R>, eval: Session<Q>, names: Vec<String>) -> Self {
        Kept {
            step,
            eval: Evaluator::new(eval),
            names,
        }
    }
}

impl<R: Resident, Q: Resident> Engine for Kept<R, Q> {
    fn set_state(&mut self, state: BTreeMap<String, Tensor>) -> Result<(), String> {
        self.eval.invalidate();
        self.step.keep(&state)
    }

    fn step(
        &mut self,
        tokens: &Tensor,
        targets: &Tensor,
        step: u64,
        lr: f32,
    ) -> Result<f64, String> {
        self.eval.invalidate();
        let (s, l) = (scalar(step as f32), scalar(lr));
        let inputs = [
            ("tokens", tokens),
            ("targets", targets),
            ("step", &s),
            ("lr", &l),
        ];
        let out = self.step.run(&inputs, &["loss"])?;
        first(&out[0], "the loss")
    }

    fn state(&mut self) -> Result<Option<BTreeMap<String, Tensor>>, String> {
        let mut out = BTreeMap::new();
        for n in &self.names {
            out.insert(n.clone(), self.step.kept(n)?);
        }
        Ok(Some(out))
    }

    fn forward(
        &mut self,
        state: &BTreeMap<String, Tensor>,
        tokens: &Tensor,
        targets: &Tensor,
    ) -> Result<f64, String> {
        self.eval.forward(state, tokens, targets)
    }
}

/// How a run goes: resumed or not, where it stops, and whether this process is the
/// lead (which prints, logs, plots and checkpoints).
#[derive(Clone, Debug)]
pub struct RunOpts {
    /// Continue from the checkpoint in `checkpoint.dir`.
    pub resume: bool,
    /// Stop after this step (checkpointing there).
    pub until: Option<u64>,
    /// The lead process.
    pub lead: bool,
    /// Stop after the step during which this many seconds of training have passed
    /// (evaluating and checkpointing there), as `until` stops.
    pub max_time: Option<f64>,
    /// Print a progress line on stderr at most this often (seconds; the lead only),
    /// where no progress bar shows (a job's log file).
    pub progress_every: Option<f64>,
}

/// One JSON line of the metrics log.
#[derive(Serialize)]
struct Line<'a> {
    kind: &'a str,
    step: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    val_loss: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    lr: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tokens_per_s: Option<f64>,
}

fn line(l: &Line<'_>) -> Result<String, String> {
    serde_json::to_string(l)
        .map(|s| s + "\n")
        .map_err(|e| e.to_string())
}

/// Appends `text` to `path` (truncating it first when `fresh`).
fn append(path: &str, text: &str, fresh: bool) -> Result<(), String> {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(!fresh)
        .write(true)
        .truncate(fresh)
        .open(path)
        .map_err(|e| format!("{path}: {e}"))?;
    f.write_all(text.as_bytes())
        .map_err(|e| format!("{path}: {e}"))
}

/// Writes `bytes` to `path` atomically: a temporary file beside it, synced, then a
/// rename, and the directory synced (so the new name survives a crash too).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), String> {
    use std::io::Write;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
    if let Some(d) = dir {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    let tmp = path.with_file_name(format!(
        ".{}.tmp{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("out"),
        std::process::id()
    ));
    let r = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = r {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!("{}: {e}", path.display()));
    }
    let d = dir.unwrap_or(Path::new("."));
    std::fs::File::open(d)
        .and_then(|f| f.sync_all())
        .map_err(|e| format!("{}: syncing the directory: {e}", d.display()))
}

/// Writes `files` (paths inside the directory, bytes) as directory `dir`, whole or not at
/// all: into a fresh directory beside it, renamed into place; a bundle already at `dir`
/// is replaced, anything else there is refused.
pub fn write_dir(dir: &Path, files: &[(String, Vec<u8>)]) -> Result<(), String> {
    if dir.exists() {
        let empty = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .next()
            .is_none();
        if !empty && !dir.join(MANIFEST).exists() {
            return Err(format!(
                "{}: exists and is not a bundle (no {MANIFEST}); give a new directory",
                dir.display()
            ));
        }
    }
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| format!("{}: not a directory name", dir.display()))?;
    let parent = dir.parent().filter(|d| !d.as_os_str().is_empty());
    let beside = |tag: &str| {
        let n = format!(".{name}.{tag}{}", std::process::id());
        parent.map_or_else(|| PathBuf::from(&n), |p| p.join(&n))
    };
    let (tmp, old) = (beside("new"), beside("old"));
    if let Some(p) = parent {
        std::fs::create_dir_all(p).map_err(|e| format!("{}: {e}", p.display()))?;
    }
    let _ = std::fs::remove_dir_all(&tmp);
    let written = (|| -> Result<(), String> {
        for (path, bytes) in files {
            let p = tmp.join(path);
            if let Some(d) = p.parent() {
                std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
            }
            std::fs::write(&p, bytes).map_err(|e| format!("{}: {e}", p.display()))?;
        }
        if dir.exists() {
            std::fs::rename(dir, &old).map_err(|e| format!("{}: {e}", dir.display()))?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| format!("{}: {e}", dir.display()))
    })();
    if written.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
        if old.exists() && !dir.exists() {
            let _ = std::fs::rename(&old, dir);
        }
    }
    let _ = std::fs::remove_dir_all(&old);
    written
}

/// The first non-finite value of the training state: the tensor and the element.
fn first_non_finite(state: &BTreeMap<String, Tensor>) -> Option<String> {
    state.iter().find_map(|(name, t)| {
        let Data::F32(v) = &t.data else {
            return None;
        };
        let i = v.iter().position(|x| !x.is_finite())?;
        Some(format!("'{name}' has {} at element {i}", v[i]))
    })
}

/// The step a checkpoint holds (an integer; an f32 in checkpoints before 2026-12-04).
fn checkpoint_step(t: &Tensor) -> u64 {
    match &t.data {
        Data::I64(v) => v.first().copied().filter(|&x| x > 0).unwrap_or(0) as u64,
        Data::F32(v) => {
            let x = v.first().copied().unwrap_or(0.0);
            if x.fract() == 0.0 && x > 0.0 {
                x as u64
            } else {
                0
            }
        }
    }
}

/// The state a run starts from, and its step: the checkpoint's (`resume`), else
/// `stored` tensors (at step `stored_at`) and the others drawn under the seed; each
/// checked against its spec's shape.
pub fn initial_state(
    l: &Loop,
    specs: &[StateSpec],
    stored: Option<(&BTreeMap<String, Tensor>, u64)>,
    resume: bool,
) -> Result<(BTreeMap<String, Tensor>, u64), String> {
    let mut state = BTreeMap::new();
    let mut start = stored.map_or(0, |s| s.1);
    if resume {
        let k = l
            .checkpoint
            .as_ref()
            .ok_or("--resume needs [checkpoint] dir in the config")?;
        let path = Path::new(&k.dir).join(CHECKPOINT).display().to_string();
        for (name, t) in crate::tensor::read(&path)? {
            if name == STEP_TENSOR {
                start = checkpoint_step(&t);
            } else {
                state.insert(name, t);
            }
        }
        if start == 0 {
            return Err(format!(
                "{path}: not a training checkpoint (no '{STEP_TENSOR}')"
            ));
        }
    }
    for s in specs {
        match state.get(&s.name) {
            Some(t) if t.has_shape(&s.shape) => {}
            Some(t) => {
                return Err(format!(
                    "checkpoint: '{}' is {:?} but the model's is {:?}",
                    s.name, t.shape, s.shape
                ))
            }
            None if resume => {
                return Err(format!("checkpoint: no tensor '{}' for this model", s.name))
            }
            None => {
                let t = match (s.init, stored) {
                    (Init::Stored, Some((m, _))) => m
                        .get(&s.name)
                        .cloned()
                        .ok_or(format!("init.safetensors: no tensor '{}'", s.name))?,
                    _ => s.draw(l.seed)?,
                };
                if !t.has_shape(&s.shape) {
                    return Err(format!(
                        "init.safetensors: '{}' is {:?} but the model's is {:?}",
                        s.name, t.shape, s.shape
                    ));
                }
                state.insert(s.name.clone(), t);
            }
        }
    }
    if start >= l.steps {
        return Err(format!(
            "the checkpoint is at step {start}, at or past train.steps = {}",
            l.steps
        ));
    }
    Ok((state, start))
}

/// Writes every parameter and moment (whole) and the step, atomically.
fn save_checkpoint(
    k: &Checkpointing,
    state: &BTreeMap<String, Tensor>,
    t: u64,
) -> Result<(), String> {
    let mut named: Vec<(String, Tensor)> =
        state.iter().map(|(n, t)| (n.clone(), t.clone())).collect();
    named.push((
        STEP_TENSOR.into(),
        Tensor {
            shape: Vec::new(),
            data: Data::I64(vec![t as i64]),
        },
    ));
    let bytes = crate::tensor::to_bytes(&named)?;
    write_atomic(&Path::new(&k.dir).join(CHECKPOINT), &bytes)
}

/// The mean loss over `eval_batches` batches of `split`, the forward on one device.
fn evaluate(
    e: &mut dyn Engine,
    l: &Loop,
    data: &Dataset,
    state: &BTreeMap<String, Tensor>,
    split: Split,
) -> Result<f64, String> {
    let n = l.eval_batches.max(1);
    let mut sum = 0.0;
    for k in 0..n {
        // Evaluation batches come from their own seed stream, the same every time.
        let (x, y) = data.batch(
            split,
            l.batch as usize,
            l.block as usize,
            l.seed ^ EVAL_SEED,
            k,
        )?;
        sum += e.forward(state, &x, &y)?;
    }
    Ok(sum / n as f64)
}

/// Trains with `e` from `state` at step `start` (from [`initial_state`]); returns the
/// summary line to print (on the lead).
pub fn train(
    e: &mut dyn Engine,
    l: &Loop,
    data: &Dataset,
    state: BTreeMap<String, Tensor>,
    start: u64,
    o: &RunOpts,
) -> Result<String, String> {
    data.check_block("the corpus", l.block as usize)?;
    if o.lead {
        // The outputs' directories are made now, so a bad path fails before any training.
        for path in [&l.log, &l.curve].into_iter().flatten() {
            if let Some(dir) = Path::new(path)
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
            {
                std::fs::create_dir_all(dir)
                    .map_err(|e| format!("{path}: cannot make its directory: {e}"))?;
            }
        }
    }
    let end = o.until.unwrap_or(l.steps).min(l.steps);
    if end <= start {
        return Err(format!("--until {end}: the run is already at step {start}"));
    }
    e.set_state(state)?;
    let bar = if o.lead {
        indicatif::ProgressBar::new(l.steps)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
        )
        .map_err(|e| e.to_string())?,
    );
    bar.set_position(start);
    let tokens = (l.batch * l.block) as f64;
    let started = Instant::now();
    let mut log = String::new();
    let mut curve: Vec<(u64, f64)> = Vec::new();
    let mut evals: Vec<(u64, f64, f64)> = Vec::new();
    // The last checkpoint on disk (a resumed run's is its start).
    let mut last_ckpt = o.resume.then_some(start);
    // Training time and steps since the last evaluation line (its tokens/s).
    let (mut since_eval, mut steps_since_eval) = (0.0f64, 0u64);
    // Where a time limit stopped the run early; when the last progress line was printed.
    let mut stopped = None;
    let mut last_line = Instant::now();
    for t in start + 1..=end {
        let lr = l.schedule.at(l.steps, t - 1);
        let (x, y) = data.batch(Split::Train, l.batch as usize, l.block as usize, l.seed, t)?;
        let t0 = Instant::now();
        let loss = e
            .step(&x, &y, t, lr as f32)
            .map_err(|e| format!("step {t}: {e}"))?;
        let secs = t0.elapsed().as_secs_f64();
        let tps = tokens / secs;
        since_eval += secs;
        steps_since_eval += 1;
        // Out of time: every process stops at the step the lead says.
        let out_of_time = match o.max_time {
            Some(limit) => e.agree(t < end && started.elapsed().as_secs_f64() >= limit)?,
            None => false,
        };
        let last = t == end || out_of_time;
        let ckpt_now = l
            .checkpoint
            .as_ref()
            .is_some_and(|k| t % k.every == 0 || last);
        let eval_now = t == l.steps || out_of_time || (l.eval_every > 0 && t % l.eval_every == 0);
        // The whole state, where a checkpoint or an evaluation needs it (every process
        // takes part in gathering it; the lead gets it).
        let whole = if (ckpt_now || eval_now) && loss.is_finite() {
            e.state()?
        } else {
            None
        };
        // A diverged run stops here: its log keeps this step's line, and no checkpoint
        // is written over the last good one. The state is scanned only before it is
        // saved (a non-finite value in it makes the next step's loss non-finite anyway).
        let diverged = if !loss.is_finite() {
            Some(format!("the loss is {loss}"))
        } else if ckpt_now {
            whole.as_ref().and_then(first_non_finite)
        } else {
            None
        };
        log.push_str(&line(&Line {
            kind: "step",
            step: t,
            loss: loss.is_finite().then_some(loss),
            val_loss: None,
            lr: Some(lr),
            tokens_per_s: Some(tps),
        })?);
        if let Some(what) = diverged {
            if let (Some(path), true) = (&l.log, o.lead) {
                append(path, &log, t == start + 1 && start == 0)?;
            }
            bar.finish_and_clear();
            let kept = match (&l.checkpoint, last_ckpt) {
                (Some(k), Some(s)) => format!("the checkpoint of step {s} in {} is kept", k.dir),
                (Some(k), None) => format!("no checkpoint was written to {}", k.dir),
                (None, _) => "no checkpoints are configured".to_string(),
            };
            return Err(format!(
                "step {t}: training diverged: {what} (lr {lr:e}); stopped, {kept}"
            ));
        }
        curve.push((t, loss));
        bar.set_position(t);
        bar.set_message(format!("loss {loss:.4} | {tps:.0} tok/s"));
        if let (Some(every), true) = (o.progress_every, o.lead) {
            if t == end || out_of_time || last_line.elapsed().as_secs_f64() >= every {
                let done = (t - start) as f64;
                let left = started.elapsed().as_secs_f64() / done * (end - t) as f64;
                eprintln!(
                    "nnscaler-rt: step {t}/{}: loss {loss:.4}, {tps:.0} tokens/s, {:.0} s elapsed, about {left:.0} s to step {end}",
                    l.steps,
                    started.elapsed().as_secs_f64()
                );
                last_line = Instant::now();
            }
        }
        if let (true, Some(state)) = (eval_now, &whole) {
            let train_loss = evaluate(e, l, data, state, Split::Train)?;
            let val_loss = evaluate(e, l, data, state, Split::Val)?;
            evals.push((t, train_loss, val_loss));
            // A line per evaluation stays in the terminal (stdout, above the bar; the
            // same lines when stdout is a file or pipe).
            let rate = tokens * steps_since_eval as f64 / since_eval.max(1e-9);
            let said = format!(
                "step {t}: train loss {train_loss:.4}, val loss {val_loss:.4} (lr {lr:.3e}, {rate:.0} tokens/s)"
            );
            bar.suspend(|| println!("{said}"));
            log.push_str(&line(&Line {
                kind: "eval",
                step: t,
                loss: Some(train_loss),
                val_loss: Some(val_loss),
                lr: None,
                tokens_per_s: None,
            })?);
        }
        if eval_now {
            (since_eval, steps_since_eval) = (0.0, 0);
        }
        if let (true, Some(k), Some(state)) = (ckpt_now, &l.checkpoint, &whole) {
            save_checkpoint(k, state, t)?;
        }
        if ckpt_now {
            last_ckpt = Some(t);
        }
        // The log is appended as it goes (a killed run keeps its lines).
        if let (Some(path), true) = (&l.log, o.lead) {
            append(path, &log, t == start + 1 && start == 0)?;
        }
        log.clear();
        if out_of_time {
            stopped = Some(t);
            break;
        }
    }
    bar.finish_and_clear();
    let end = stopped.unwrap_or(end);
    if let (Some(path), true) = (&l.curve, o.lead) {
        write_atomic(
            Path::new(path),
            crate::plot::loss_curve(&curve, &evals).as_bytes(),
        )?;
    }
    let secs = started.elapsed().as_secs_f64();
    let steps = end - start;
    // The last evaluation, if the run reached one.
    let evaluated = evals
        .last()
        .map(|(t, tr, va)| format!("; step {t}: train loss {tr:.4}, val loss {va:.4}"))
        .unwrap_or_default();
    let limited = match (stopped, o.max_time) {
        (Some(t), Some(limit)) => format!(
            "stopped at step {t} of {} by --max-time {limit} (resume with --resume); ",
            l.steps
        ),
        _ => String::new(),
    };
    Ok(format!(
        "{limited}trained steps {}..{end} in {secs:.1} s ({:.0} tokens/s){evaluated}{}\n",
        start + 1,
        tokens * steps as f64 / secs,
        l.curve
            .as_ref()
            .map(|p| format!("; loss curve in {p}"))
            .unwrap_or_default()
    ))
}

/// How `nnscaler-rt train` runs a bundle.
#[derive(Clone, Debug)]
pub struct BundleRun {
    /// The bundle's directory.
    pub dir: String,
    /// Continue from the checkpoint.
    pub resume: bool,
    /// Stop after this step.
    pub until: Option<u64>,
    /// `host` or `cuda`.
    pub backend: String,
    /// One process: every device on a thread of its own (`auto`, `gpus`, `streams` on
    /// cuda; any on the host) instead of lockstep.
    pub ranks: Option<String>,
    /// Where this process stands among the run's.
    pub world: crate::net::World,
    /// How the processes meet.
    pub rendezvous: crate::net::Rendezvous,
    /// How long a process waits for the others (at the rendezvous, and for any message).
    pub timeout: std::time::Duration,
    /// Stop after the step during which this many seconds passed.
    pub max_time: Option<f64>,
    /// Refuse to start when the step's and the forward's arenas and tensors need more.
    pub memory_limit: Option<u64>,
    /// Progress lines on stderr at most this often ([`RunOpts::progress_every`]).
    pub progress_every: Option<f64>,
}

/// Trains bundle `o.dir` (see [`BundleRun`]); the summary to print (empty on processes
/// other than the lead).
pub fn run_bundle(o: &BundleRun) -> Result<String, String> {
    let b = Bundle::open(&o.dir)?;
    let m = &b.manifest;
    // The state is checked against the step before anything is drawn by its shapes.
    let step = b.artifact(&m.step)?;
    let eval = b.artifact(&m.eval)?;
    b.check_state(&step)?;
    let data = b.dataset()?;
    let stored = b.stored()?;
    let (state, start) = initial_state(
        &m.run,
        &m.state,
        stored.as_ref().map(|s| (s, m.start)),
        o.resume,
    )?;
    let w = &o.world;
    let opts = RunOpts {
        resume: o.resume,
        until: o.until,
        lead: w.rank == 0,
        max_time: o.max_time,
        progress_every: o.progress_every,
    };
    // The step's and the forward's arenas and whole tensors side by side, before any is
    // allocated (each artifact alone is checked again as it loads).
    if o.backend == "host" {
        crate::memory::check_all(
            &[&step, &eval],
            o.memory_limit,
            crate::memory::host_available(),
        )
        .map_err(|e| format!("{}: {e}", o.dir))?;
    } else if let Some(l) = o.memory_limit {
        crate::memory::check_all(&[&step, &eval], Some(l), None)
            .map_err(|e| format!("{}: {e}", o.dir))?;
    }
    if w.size > 1 {
        if o.ranks.is_some() {
            return Err("--ranks runs one process's devices on threads; with several processes each runs its own devices already".into());
        }
        let devices = step.devices().max(1);
        let mine = crate::procs::share(devices, w.rank, w.size)?;
        let token = crate::artifact::fnv1a64(
            &std::fs::read(b.path(MANIFEST)).map_err(|e| format!("{}: {e}", o.dir))?,
        );
        let net = crate::net::Net::connect(w.clone(), &o.rendezvous, token, o.timeout)?;
        if opts.lead {
            eprintln!(
                "nnscaler-rt: {} processes ({}), devices {}..{} of {devices} here; met at {}",
                w.size,
                w.launcher,
                mine.start,
                mine.end,
                match &o.rendezvous {
                    crate::net::Rendezvous::Tcp => w.master.clone(),
                    crate::net::Rendezvous::File(f) => f.clone(),
                }
            );
        }
        // The lead evaluates: the forward as a session on its host or GPU.
        let host_eval = match (opts.lead, o.backend.as_str()) {
            (true, "host") => Some(crate::HostProgram::load(eval.clone())?),
            _ => None,
        };
        #[cfg(feature = "cuda")]
        let cuda_eval = match (opts.lead, o.backend.as_str()) {
            (true, "cuda") => Some(crate::cuda::CudaProgram::load(eval.clone(), w.local_rank)?),
            _ => None,
        };
        #[cfg_attr(not(feature = "cuda"), allow(unused_mut))]
        let mut forward: Option<Box<dyn Forward + '_>> = host_eval.as_ref().map(|p| {
            Box::new(Evaluator::new(Session::new(
                crate::session::HostResident::new(p),
            ))) as Box<dyn Forward>
        });
        #[cfg(feature = "cuda")]
        if let Some(p) = &cuda_eval {
            forward = Some(Box::new(Evaluator::new(Session::new(
                crate::cuda::CudaResident::new(p)?,
            ))));
        }
        if opts.lead && forward.is_none() {
            return Err(format!("unknown backend '{}' (host, cuda)", o.backend));
        }
        let mut e = crate::procs::Procs::new(net, step, &o.backend, forward, m.state.clone())?;
        let said = match train(&mut e, &m.run, &data, state, start, &opts) {
            Ok(s) => s,
            Err(err) => {
                e.abort(&err);
                return Err(err);
            }
        };
        e.finish()?;
        return Ok(if opts.lead { said } else { String::new() });
    }
    let names = |a: &crate::Artifact| -> (Vec<String>, Vec<String>) {
        (
            a.header.inputs.iter().map(|p| p.name.clone()).collect(),
            a.header.outputs.iter().map(|p| p.name.clone()).collect(),
        )
    };
    let ((step_in, step_out), (fwd_in, _)) = (names(&step), names(&eval));
    match o.backend.as_str() {
        "host" => {
            let (sp, ep) = (
                crate::HostProgram::load(step)?,
                crate::HostProgram::load(eval)?,
            );
            if o.ranks.is_some() {
                // Every device on a thread of its own: whole tensors in and out.
                let run_step: RunFn<'_> = Box::new(|x: &[Tensor]| Ok(sp.run_ranks_timed(x, 1)?.0));
                let run_eval: RunFn<'_> = Box::new(|x: &[Tensor]| ep.run(x));
                let mut e = Whole::new(step_in, step_out, run_step, fwd_in, run_eval);
                return train(&mut e, &m.run, &data, state, start, &opts);
            }
            use crate::session::HostResident;
            let mut e = Kept::new(
                Session::new(HostResident::new(&sp)),
                Session::new(HostResident::new(&ep)),
                m.state.iter().map(|s| s.name.clone()).collect(),
            );
            train(&mut e, &m.run, &data, state, start, &opts)
        }
        #[cfg(feature = "cuda")]
        "cuda" => {
            let gpu = w.local_rank;
            let (sp, ep) = (
                crate::cuda::CudaProgram::load(step, gpu)?,
                crate::cuda::CudaProgram::load(eval, gpu)?,
            );
            if let Some(p) = o.ranks.as_deref() {
                let placement: crate::streams::Placement = p.parse()?;
                let run_step: RunFn<'_> = Box::new(|x: &[Tensor]| {
                    Ok(crate::streams::run_ranks(&sp, x, 1, placement)?.0)
                });
                let run_eval: RunFn<'_> = Box::new(|x: &[Tensor]| Ok(ep.run_timed(x, 1)?.0));
                let mut e = Whole::new(step_in, step_out, run_step, fwd_in, run_eval);
                return train(&mut e, &m.run, &data, state, start, &opts);
            }
            use crate::cuda::CudaResident;
            eprintln!("nnscaler-rt: GPU {gpu}: {}", sp.gemms());
            let mut e = Kept::new(
                Session::new(CudaResident::new(&sp)?),
                Session::new(CudaResident::new(&ep)?),
                m.state.iter().map(|s| s.name.clone()).collect(),
            );
            train(&mut e, &m.run, &data, state, start, &opts)
        }
        #[cfg(not(feature = "cuda"))]
        "cuda" => Err("this nnscaler-rt was built without the CUDA backend (cargo build --release -p nnscaler-rt --features cuda)".into()),
        other => Err(format!("unknown backend '{other}' (host, cuda)")),
    }
}

#[cfg(test)]
mod tests;
