//! `nnscaler train --config FILE.toml [--set key=value ...]`: trains a zoo model on a
//! character corpus (`nnscaler data prepare-char`, or `[data] text` to prepare it on the
//! first run), single-device or partitioned over
//! simulated devices, with the optimizer step compiled into the IR (`--optimizer`).
//!
//! This file reads the config and compiles the step (and the forward evaluation runs);
//! the loop itself is `nnscaler-rt`'s ([`nnscaler_rt::train`]: batches, schedule,
//! evaluations, log, checkpoints, resume), the one `nnscaler-rt train` runs too. The
//! step runs on the reference runtime (through [`Whole`]) or compiled on the host or a
//! GPU (a [`rt::Kept`] session: the state stays where the step runs). `--bundle DIR`
//! writes the compiled step, the evaluation forward, the corpus and the state's
//! initialization instead, for `nnscaler-rt train DIR` to run on a machine without MLIR.

use crate::data::Dataset;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::domain::{self, Domain};
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::verify::Meshes;
use nnscaler_passes::pipeline::{self, Step};
use nnscaler_passes::planner::plan_search::PlanChoice;
use nnscaler_passes::planner::schedule::ScheduleKind;
use nnscaler_rt::train::{
    self as rt, Checkpointing, Loop, LrSchedule, RunFn, RunOpts, StateSpec, Whole,
};
use nnscaler_runtime::spmd::{global_view, pipeline_programs, run_pipeline, run_spmd};
use nnscaler_runtime::{kernels, run, Options};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Instant;

/// `nnscaler train`'s command line.
#[derive(clap::Args, Debug)]
#[command(
    about = "Train a zoo model on a character corpus, single-device or on simulated devices",
    long_about = "Train a zoo model on a character corpus (nnscaler data prepare-char), \
        single-device or partitioned over simulated devices, the AdamW step compiled into \
        the IR. The config is TOML (see examples/nanogpt/); --set section.key=value \
        overrides one entry. Unknown keys and bad values are errors naming the key."
)]
pub struct TrainArgs {
    /// The config (TOML).
    #[arg(long, value_name = "FILE.toml")]
    pub config: String,
    /// Override a config entry, e.g. --set train.steps=100 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Continue from the checkpoint in checkpoint.dir (its step, parameters and moments).
    #[arg(long)]
    pub resume: bool,
    /// Stop after this step (checkpointing there), as if the run were stopped; --resume
    /// continues it exactly.
    #[arg(long, value_name = "STEP")]
    pub until: Option<u64>,
    /// Refuse to start when training is estimated to need more memory than this (e.g. 8G;
    /// default: the memory this process may still use, as `nnscaler run`).
    #[arg(long, value_name = "BYTES", value_parser = crate::cli::parse_bytes)]
    pub memory_limit: Option<u64>,
    /// Compile everything a run needs into the directory DIR and stop: the training step
    /// and the evaluation forward as artifacts (PTX and host kernels), the corpus, the
    /// state's initialization (with --resume: the checkpoint's tensors and step) and the
    /// resolved config, versioned and checksummed. `nnscaler-rt train DIR` trains it on a
    /// machine without MLIR or LLVM (docs/gpu.md, "Training on a cluster"). DIR is
    /// written whole or not at all; a bundle already there is replaced.
    #[arg(long, value_name = "DIR")]
    pub bundle: Option<String>,
}

/// The config file.
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The model.
    pub model: ModelSection,
    /// The data.
    pub data: DataSection,
    /// The plan (absent: one device).
    #[serde(default)]
    pub plan: Option<PlanSection>,
    /// The optimizer and its schedule.
    pub optimizer: OptimizerSection,
    /// The loop.
    pub train: TrainSection,
    /// Checkpoints.
    #[serde(default)]
    pub checkpoint: Option<CheckpointSection>,
}

/// `[model]`: a zoo preset and size overrides, or an MLIR file.
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct ModelSection {
    /// The preset (`nnscaler presets`).
    #[serde(default)]
    pub preset: Option<String>,
    /// Or a module with a `@train` forward ending in a scalar loss, reading `tokens` and
    /// `targets` (e.g. from `nnscaler import`); its shapes fix batch and block.
    #[serde(default)]
    pub file: Option<String>,
    /// Or a PyTorch module, `FILE.py:FACTORY` (the file relative to the working directory,
    /// as model.file's): its forward takes `(tokens, targets)` of
    /// `sizes.batch x sizes.block` token ids and returns the loss; imported as `nnscaler
    /// import torch` does, once in training mode and once in evaluation mode (dropout off)
    /// for evaluation. Its parameters are drawn as a zoo model's (nns.name rules and the
    /// seed), not by the module's own initializers.
    #[serde(default)]
    pub torch: Option<String>,
    /// The Python with torch for `torch` (default: $NNSCALER_PYTHON, else python3).
    #[serde(default)]
    pub python: Option<String>,
    /// For `torch`: user ops for aten ops the importer does not map (`nnscaler import torch
    /// --user-ops`; the file relative to the working directory).
    #[serde(default)]
    pub user_ops: Option<String>,
    /// Size overrides by `nnscaler import` flag name (`layers`, `heads`, `width`, `block`,
    /// `batch`, `dropout`, ...).
    #[serde(default)]
    pub sizes: BTreeMap<String, toml::Value>,
}

/// `[data]`.
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct DataSection {
    /// A directory made by `nnscaler data prepare-char`.
    pub dir: String,
    /// A text file to prepare `dir` from (as `nnscaler data prepare-char`) when `dir`
    /// has no `meta.json` yet.
    #[serde(default)]
    pub text: Option<String>,
}

/// `[plan]`: a named policy and mesh, or `auto` (the plan search).
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct PlanSection {
    /// dp | megatron | dp-megatron | megatron-sp | dp-megatron-sp | auto.
    pub policy: String,
    /// With `auto`: the cluster to plan for (a preset or a TOML file).
    #[serde(default)]
    pub cluster: Option<String>,
    /// With `auto`: how many devices.
    #[serde(default)]
    pub devices: Option<u32>,
    /// Data-parallel degree.
    #[serde(default)]
    pub dp: Option<u32>,
    /// Tensor-parallel degree.
    #[serde(default)]
    pub tp: Option<u32>,
    /// ZeRO stage (0, 1, 2 or 3).
    #[serde(default)]
    pub zero: u8,
    /// Pipeline ranks (a `pp` axis; the model is placed in stages first).
    #[serde(default)]
    pub pp: Option<u32>,
    /// Micro-batches per step (with `pp`).
    #[serde(default)]
    pub microbatches: Option<u32>,
    /// The pipeline schedule: gpipe | 1f1b | zb-h1 | interleaved | zb-v (default 1f1b).
    #[serde(default)]
    pub schedule: Option<String>,
}

/// `[optimizer]`: AdamW and the learning-rate schedule.
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct OptimizerSection {
    /// Peak learning rate.
    pub lr: f64,
    /// The floor the cosine decays to.
    pub min_lr: f64,
    /// Warm-up steps (linear from lr / (warmup + 1)).
    pub warmup: u64,
    /// Decay the learning rate until this step (default: train.steps).
    #[serde(default)]
    pub decay_steps: Option<u64>,
    /// AdamW's betas.
    #[serde(default = "default_beta1")]
    pub beta1: f64,
    /// See `beta1`.
    #[serde(default = "default_beta2")]
    pub beta2: f64,
    /// AdamW's eps.
    #[serde(default = "default_eps")]
    pub eps: f64,
    /// Weight decay of rank >= 2 parameters (or of those `no_decay` does not match).
    #[serde(default)]
    pub weight_decay: f64,
    /// Global-norm clipping (0: none).
    #[serde(default)]
    pub clip: f64,
    /// Name patterns (`*` wildcards) of the parameters without weight decay; when given,
    /// every other parameter decays.
    #[serde(default)]
    pub no_decay: Option<Vec<String>>,
}

fn default_beta1() -> f64 {
    0.9
}
fn default_beta2() -> f64 {
    0.999
}
fn default_eps() -> f64 {
    1e-8
}

/// `[train]`.
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct TrainSection {
    /// Steps to train.
    pub steps: u64,
    /// Evaluate every this many steps (0: only at the end).
    #[serde(default)]
    pub eval_every: u64,
    /// Batches per evaluation.
    #[serde(default = "default_eval_batches")]
    pub eval_batches: u64,
    /// Seed of the initial parameters and the batches.
    #[serde(default)]
    pub seed: u64,
    /// Threads for matrix products.
    #[serde(default = "default_threads")]
    pub threads: usize,
    /// JSON-lines metrics log.
    #[serde(default)]
    pub log: Option<String>,
    /// Where the step runs: reference (the CPU runtime), host (compiled kernels through
    /// nnscaler-rt on the CPU) or cuda (on GPU 0; nnscaler built with --features cuda).
    #[serde(default = "default_backend")]
    pub backend: String,
    /// With backend host or cuda: every device on a thread of its own (nnscaler-rt's
    /// ranks: on the host an in-process communicator, the same results; on cuda NCCL,
    /// device d on GPU d, or a stream per device on GPU 0 when the GPUs are fewer) instead
    /// of all devices in lockstep.
    #[serde(default)]
    pub ranks: bool,
    /// Loss-curve SVG written at the end.
    #[serde(default)]
    pub curve: Option<String>,
    /// Arithmetic: f32; bf16 (mixed precision, `--autocast=bf16`: bf16 matrix products
    /// with f32 activations, master weights, gradients and optimizer); or bf16-activations
    /// (`--autocast="bf16 activations=bf16"`: every activation in bf16, the loss, master
    /// weights, their gradients and the optimizer f32). Emulated on the CPU.
    #[serde(default = "default_precision")]
    pub precision: String,
}

fn default_precision() -> String {
    "f32".into()
}
fn default_backend() -> String {
    "reference".into()
}
fn default_eval_batches() -> u64 {
    20
}
fn default_threads() -> usize {
    1
}

/// `[checkpoint]`.
#[derive(Deserialize, Serialize, Debug, Clone)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSection {
    /// The directory (`checkpoint.safetensors` in it).
    pub dir: String,
    /// Write every this many steps (and at the end).
    pub every: u64,
}

/// Reads `path` as a config, with `--set` overrides applied to the TOML tree first.
pub fn load_config(path: &str, sets: &[String]) -> Result<Config, String> {
    let text = crate::read_input(path)?;
    let mut value: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| format!("{path}: {e}"))?;
    for s in sets {
        let (key, v) = s
            .split_once('=')
            .ok_or(format!("--set '{s}': write section.key=value"))?;
        let parsed: toml::Value = format!("x = {v}")
            .parse::<toml::Table>()
            .ok()
            .and_then(|t| t.get("x").cloned())
            .unwrap_or_else(|| toml::Value::String(v.to_string()));
        let parts: Vec<&str> = key.split('.').collect();
        let (last, sections) = parts
            .split_last()
            .ok_or(format!("--set '{s}': empty key"))?;
        let mut table = &mut value;
        for p in sections {
            table = table
                .entry(p.to_string())
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
                .ok_or(format!("--set '{s}': '{p}' is not a section"))?;
        }
        table.insert(last.to_string(), parsed);
    }
    // Deserialize from text, so an error shows the line and key: the file itself, or (with
    // --set) the config as the overrides left it.
    let (source, what) = if sets.is_empty() {
        (text, path.to_string())
    } else {
        (
            toml::to_string(&value).map_err(|e| format!("{path}: {e}"))?,
            format!("{path} (with --set)"),
        )
    };
    let c: Config = toml::from_str(&source).map_err(|e: toml::de::Error| format!("{what}: {e}"))?;
    if c.train.steps == 0 {
        return Err(format!("{path}: train.steps must be at least 1"));
    }
    if !(c.optimizer.lr > 0.0 && c.optimizer.min_lr >= 0.0 && c.optimizer.min_lr <= c.optimizer.lr)
    {
        return Err(format!(
            "{path}: optimizer.lr must be > 0 and optimizer.min_lr in [0, lr]"
        ));
    }
    if c.checkpoint.as_ref().is_some_and(|k| k.every == 0) {
        return Err(format!("{path}: checkpoint.every must be at least 1"));
    }
    Ok(c)
}

/// The compiled programs: the step (maybe partitioned) and the forward for evaluation.
struct Programs {
    step: Graph,
    /// A pipelined step: each rank's program (the `step` graph is then the single-device
    /// step, whose signature the programs' `nns.arg` / `nns.result` index).
    pipeline: Option<Vec<Graph>>,
    /// The step's whole-tensor signature (what state and batches bind to).
    view: Graph,
    mesh: Option<Mesh>,
    forward: Graph,
    batch: usize,
    block: usize,
}

/// Checks a model's `@train` reads `tokens` whose embedding has room for the corpus's
/// `vocab` ids (`what` names the model in errors).
fn check_tokens(text: &str, what: &str, vocab: usize) -> Result<(), String> {
    let ir = IrContext::new();
    let module = ir
        .parse(text, what)
        .map_err(|d| d.in_file(what).render_limited(Some(text), 20))?;
    let g = Graph::all_in(&module)
        .into_iter()
        .filter_map(Result::ok)
        .find(|g| g.name == "train")
        .ok_or(format!("{what} has no @train"))?;
    let tokens = g
        .args
        .iter()
        .position(|a| a.name() == Some("tokens"))
        .ok_or(format!("@train of {what} has no 'tokens' argument"))?;
    if let Some(Domain::Below(rows)) = domain::of_arg(&g, tokens) {
        if (rows as usize) < vocab {
            return Err(format!(
                "{what} embeds {rows} token ids; the corpus has a vocabulary of {vocab} (nnscaler import --vocab {vocab})"
            ));
        }
    }
    Ok(())
}

/// The model's module text, and the one evaluation runs (without dropout).
fn model_texts(c: &Config, vocab: usize) -> Result<(String, String), String> {
    let m = &c.model;
    if m.user_ops.is_some() && m.torch.is_none() {
        return Err("model.user_ops maps aten ops of model.torch; this model has no torch".into());
    }
    if let Some(spec) = &m.torch {
        if m.preset.is_some() || m.file.is_some() {
            return Err("model: give one of preset, file and torch".into());
        }
        let size = |k: &str| -> Result<i64, String> {
            match m.sizes.get(k) {
                Some(toml::Value::Integer(n)) if *n > 0 => Ok(*n),
                Some(other) => Err(format!("model.sizes.{k}: {other} is not a positive integer")),
                None => Err(format!(
                    "model.torch: give sizes.batch and sizes.block (the token batches its forward takes); sizes.{k} is missing"
                )),
            }
        };
        let (batch, block) = (size("batch")?, size("block")?);
        if let Some(k) = m.sizes.keys().find(|k| *k != "batch" && *k != "block") {
            return Err(format!(
                "model.sizes.{k}: a PyTorch module fixes its own sizes (only batch and block apply)"
            ));
        }
        let inputs = [
            format!("tokens={batch}x{block}:i64"),
            format!("targets={batch}x{block}:i64"),
        ];
        let python = crate::torch_import::python(m.python.as_deref());
        let user = m
            .user_ops
            .as_deref()
            .map(crate::torch_import::UserOps::load)
            .transpose()
            .map_err(|e| format!("model.user_ops: {e}"))?;
        let text = crate::torch_import::import_text(spec, &inputs, &python, false, user.as_ref())
            .map_err(|e| format!("model.torch: {e}"))?;
        let eval = crate::torch_import::import_text(spec, &inputs, &python, true, user.as_ref())
            .map_err(|e| format!("model.torch: {e}"))?;
        check_tokens(&text, spec, vocab).map_err(|e| format!("model.torch: {e}"))?;
        return Ok((text, eval));
    }
    let preset = match (&m.preset, &m.file) {
        (Some(p), None) => p,
        (None, Some(f)) => {
            if !m.sizes.is_empty() {
                return Err(
                    "model.sizes: sizes apply to a preset; model.file fixes its own".into(),
                );
            }
            let text = crate::read_input(f).map_err(|e| format!("model.file: {e}"))?;
            if text.contains("\"dnn.dropout\"") {
                return Err(format!(
                    "model.file: {f} uses dnn.dropout, which evaluation would apply; train it from a preset (which evaluates without dropout), or export it without dropout"
                ));
            }
            check_tokens(&text, f, vocab).map_err(|e| format!("model.file: {e}"))?;
            return Ok((text.clone(), text));
        }
        (Some(_), Some(_)) => return Err("model: give preset or file, not both".into()),
        (None, None) => {
            return Err(
                "model: give preset (see nnscaler presets), file (an MLIR module) or torch (FILE.py:FACTORY)"
                    .into(),
            )
        }
    };

    let mut model = nnscaler_frontends::preset(preset)
        .ok_or(format!("model.preset: unknown preset '{preset}'"))?;
    if model.family() != "gpt" && model.family() != "llama" {
        return Err(format!(
            "model.preset: '{preset}' is a {} model; training reads token sequences (gpt, llama)",
            model.family()
        ));
    }
    for (k, v) in &m.sizes {
        let v = match v {
            toml::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        model
            .set(k, &v)
            .map_err(|e| format!("model.sizes.{k}: {e}"))?;
    }
    model
        .set("vocab", &vocab.to_string())
        .map_err(|e| format!("model: {e}"))?;
    let text = nnscaler_frontends::build_module(&model).map_err(|e| e.to_string())?;
    // Evaluation runs the model without dropout (as model.eval() does).
    let mut eval_model = model.clone();
    if eval_model.family() == "gpt" {
        eval_model
            .set("dropout", "0")
            .map_err(|e| format!("model: {e}"))?;
    }
    let eval_text = nnscaler_frontends::build_module(&eval_model).map_err(|e| e.to_string())?;
    Ok((text, eval_text))
}

fn compile(c: &Config, vocab: usize) -> Result<Programs, String> {
    let (text, eval_text) = model_texts(c, vocab)?;
    let ir = IrContext::new();
    let step = |name: &str, o: &str| {
        nnscaler_passes::registry::step(name, o).map_err(|e| format!("{name}: {e}"))
    };
    let o = &c.optimizer;
    let mut opt = format!(
        "beta1={} beta2={} eps={} weight_decay={} clip={}",
        o.beta1, o.beta2, o.eps, o.weight_decay, o.clip
    );
    if let Some(pats) = &o.no_decay {
        if let Some(bad) = pats.iter().find(|p| p.is_empty() || p.contains([',', ' '])) {
            return Err(format!(
                "optimizer.no_decay: '{bad}' is not a name pattern (no commas or spaces)"
            ));
        }
        opt += &format!(" no_decay={}", pats.join(","));
    }
    // Mixed precision casts the forward before anything else sees it (evaluation too).
    let precision = crate::plan::Precision::parse(&c.train.precision)
        .map_err(|e| format!("train.precision: {e}"))?;
    let cast: Vec<Step> = match precision.autocast() {
        None => Vec::new(),
        Some(options) => vec![step("autocast", options)?],
    };
    // The single-device training step: the casts, the backward and the update.
    let single: Vec<Step> = cast
        .iter()
        .cloned()
        .chain([step("autodiff", "")?, step("optimizer", &opt)?])
        .collect();
    let mut steps = single.clone();
    if let Some(p) = c.plan.as_ref().filter(|p| p.policy == "auto") {
        // The plan search chooses the degrees, the stages, recompute and the schedule, and
        // writes them into the step; --schedule runs the schedule it chose, if any.
        let set: Vec<&str> = [
            ("dp", p.dp.is_some()),
            ("tp", p.tp.is_some()),
            ("pp", p.pp.is_some()),
            ("microbatches", p.microbatches.is_some()),
            ("schedule", p.schedule.is_some()),
            ("zero", p.zero > 0),
        ]
        .into_iter()
        .filter_map(|(k, on)| on.then_some(k))
        .collect();
        if !set.is_empty() {
            return Err(format!(
                "plan: policy 'auto' chooses {} itself; give a named policy to set them",
                set.join(", ")
            ));
        }
        let (Some(cluster), Some(devices)) = (&p.cluster, p.devices) else {
            return Err("plan: policy 'auto' needs cluster (a preset: dgx-a100, dgx-h100, h200, cpu; or a TOML file) and devices".into());
        };
        steps.push(step(
            "plan",
            &format!("auto cluster={cluster} devices={devices}"),
        )?);
        for name in ["propagate-layouts", "split-tensor", "schedule"] {
            steps.push(step(name, "")?);
        }
        // Relayouts as the search priced them: by their seconds on the cluster.
        steps.push(step("lower-relayouts", &format!("cluster={cluster}"))?);
        steps.push(step("localize", "")?);
    } else if let Some(p) = &c.plan {
        if p.cluster.is_some() || p.devices.is_some() {
            return Err(format!(
                "plan: cluster and devices go with policy 'auto', not '{}'",
                p.policy
            ));
        }
        let mut plan = p.policy.clone();
        let mut schedule = None;
        for (k, v) in [
            ("dp", p.dp),
            ("tp", p.tp),
            ("pp", p.pp),
            ("microbatches", p.microbatches),
        ] {
            if let Some(v) = v {
                plan.push_str(&format!(" {k}={v}"));
            }
        }
        if p.zero > 0 {
            plan.push_str(&format!(" zero={}", p.zero));
        }
        if let Some(pp) = p.pp {
            // Pipelines place the forward in stages first (two per rank for the
            // interleaved and V schedules).
            let name = p.schedule.clone().unwrap_or("1f1b".into());
            let per_rank = ScheduleKind::from_name(&name).map_or(1, |k| k.planned_chunks() as u32);
            steps.insert(
                cast.len(),
                step("place", &format!("stages={}", pp * per_rank))?,
            );
            schedule = Some(name);
        } else if p.schedule.is_some() || p.microbatches.is_some() {
            return Err(
                "plan.schedule and plan.microbatches need plan.pp (pp = 1 with microbatches = M accumulates gradients over M micro-batches)"
                    .into(),
            );
        }
        steps.push(step("plan", &plan)?);
        steps.push(step("propagate-layouts", "")?);
        steps.push(step("split-tensor", "")?);
        if let Some(name) = &schedule {
            steps.push(step(&format!("schedule-{name}"), "")?);
        }
        steps.push(step("lower-relayouts", "")?);
        steps.push(step("localize", "")?);
    }
    // A module compiled by `steps`: its functions as graphs, and its mesh.
    let compile = |text: &str, steps: &[Step]| -> Result<(Vec<Graph>, Option<Mesh>), String> {
        let mut m = ir
            .parse(text, "model.mlir")
            .map_err(|d| d.render_limited(Some(text), 20))?;
        let remarks = pipeline::run(&ir, &mut m, steps, &mut |_, _| {}, "model.mlir")
            .map_err(|d| d.render_limited(Some(text), 20))?;
        // The plan the search chose, without its ranking.
        for c in remarks.0.iter().filter_map(PlanChoice::of_remark) {
            eprintln!("nnscaler train: {}", c.headline);
        }
        let mut d = Default::default();
        let mesh = Meshes::collect(&m.as_operation(), &mut d)
            .0
            .first()
            .cloned();
        let all = Graph::all_in(&m)
            .into_iter()
            .filter_map(Result::ok)
            .collect();
        Ok((all, mesh))
    };
    // Its @train, linked to the functions it calls.
    let train = |all: &[Graph]| -> Result<Graph, String> {
        let mut g = all
            .iter()
            .find(|g| g.name == "train")
            .cloned()
            .ok_or("the model has no @train")?;
        g.link(all);
        Ok(g)
    };
    let forward = train(&compile(&eval_text, &cast)?.0)?;
    let (all, mesh) = compile(&text, &steps)?;
    // Pipelined: a --schedule-* pass made programs per rank (the named plan's, or the
    // schedule the plan search chose).
    let pipelined = all
        .iter()
        .any(|g| g.func_attrs.contains_key("nns.pipeline"));
    let (step_graph, pipeline_programs) = if pipelined {
        // The programs of each rank, and the single-device step whose signature they index.
        let programs = pipeline_programs(&all, "train")?;
        let single = train(&compile(&text, &single)?.0)?;
        (single, Some(programs))
    } else {
        (train(&all)?, None)
    };
    let view = match (&mesh, &pipeline_programs) {
        (Some(m), None) => global_view(&step_graph, m)?,
        _ => step_graph.clone(),
    };
    let tokens = view
        .args
        .iter()
        .find(|a| a.name() == Some("tokens"))
        .ok_or("the model has no 'tokens' input")?;
    let shape = &view.values[tokens.value].shape;
    Ok(Programs {
        batch: shape[0] as usize,
        block: shape[1] as usize,
        pipeline: pipeline_programs,
        step: step_graph,
        view,
        mesh,
        forward,
    })
}

/// The loop's settings from the config and the model's batch and block.
fn the_loop(c: &Config, p: &Programs) -> Loop {
    let o = &c.optimizer;
    Loop {
        steps: c.train.steps,
        eval_every: c.train.eval_every,
        eval_batches: c.train.eval_batches,
        seed: c.train.seed,
        batch: p.batch as u64,
        block: p.block as u64,
        log: c.train.log.clone(),
        curve: c.train.curve.clone(),
        schedule: LrSchedule {
            lr: o.lr,
            min_lr: o.min_lr,
            warmup: o.warmup,
            decay_steps: o.decay_steps,
        },
        checkpoint: c.checkpoint.as_ref().map(|k| Checkpointing {
            dir: k.dir.clone(),
            every: k.every,
        }),
    }
}

/// The training state: every state argument of the step (parameters and moments), its
/// shape and its initialization rule.
fn state_specs(view: &Graph) -> Result<Vec<StateSpec>, String> {
    (0..view.args.len())
        .filter(|&i| view.args[i].is_state())
        .map(|i| nnscaler_runtime::init::state_spec(view, i))
        .collect()
}

/// The names of a graph's arguments and results.
fn names(g: &Graph) -> (Vec<String>, Vec<String>) {
    (
        g.args
            .iter()
            .map(|a| a.name().unwrap_or("").to_string())
            .collect(),
        g.outputs
            .iter()
            .map(|o| o.name().unwrap_or("").to_string())
            .collect(),
    )
}

/// Runs the command; returns the summary to print.
pub fn main(a: &TrainArgs) -> Result<String, String> {
    let c = load_config(&a.config, &a.set)?;
    kernels::set_threads(c.train.threads.max(1));
    if let Some(text) = &c.data.text {
        if !Path::new(&c.data.dir).join("meta.json").exists() {
            eprint!("{}", crate::data::prepare_char(text, &c.data.dir, None)?);
        }
    }
    let data = Dataset::load(&c.data.dir)?;
    let p = compile(&c, data.vocab)?;
    // A corpus too short for one block is refused before anything runs.
    data.check_block(&c.data.dir, p.block)?;
    let l = the_loop(&c, &p);
    let specs = state_specs(&p.view)?;
    if let Some(dir) = &a.bundle {
        if let Some(flag) = [
            (a.until.is_some(), "--until"),
            (a.memory_limit.is_some(), "--memory-limit"),
        ]
        .iter()
        .find_map(|(on, f)| on.then_some(*f))
        {
            return Err(format!(
                "{flag} applies to a run; with --bundle give it to 'nnscaler-rt train {dir}'"
            ));
        }
        return write_bundle(a, &c, &p, &l, specs, dir, data.vocab as u64);
    }
    // Before any parameter is drawn or read: refuse a run that cannot fit in memory.
    let devices = p.mesh.as_ref().map_or(1, |m| m.devices() as u64);
    let need = nnscaler_runtime::memory::estimate(&p.step, &p.view, devices);
    nnscaler_runtime::memory::check(&need, a.memory_limit, devices.saturating_sub(1))
        .map_err(|e| format!("{}: {e}", a.config))?;
    let (state, start) = rt::initial_state(&l, &specs, None, a.resume)?;
    if c.train.ranks && c.train.backend == "reference" {
        return Err("train.ranks = true needs train.backend = \"host\" or \"cuda\"".into());
    }
    let (step_in, step_out) = names(&p.view);
    let (fwd_in, _) = names(&p.forward);
    let opts = RunOpts {
        resume: a.resume,
        until: a.until,
        lead: true,
        max_time: None,
        progress_every: None,
    };
    match c.train.backend.as_str() {
        "reference" => {
            let check = Options {
                check_finite: true,
                ..Options::default()
            };
            let step: RunFn<'_> = Box::new(|inputs: &[rt::RtTensor]| {
                let inputs = inputs.to_vec();
                match (&p.pipeline, &p.mesh) {
                    (Some(programs), Some(m)) => {
                        let by_index = inputs.into_iter().enumerate().collect();
                        run_pipeline(programs, m, "pp", &by_index, &check).map(|mut o| {
                            (0..p.view.outputs.len())
                                .filter_map(|k| o.remove(&k))
                                .collect::<Vec<_>>()
                        })
                    }
                    (_, Some(m)) => run_spmd(&p.step, m, inputs, &check),
                    _ => run(&p.step, inputs, &check),
                }
                .map_err(|e| e.message)
            });
            let forward: RunFn<'_> = Box::new(|inputs: &[rt::RtTensor]| {
                run(&p.forward, inputs.to_vec(), &Options::default()).map_err(|e| e.message)
            });
            let mut e = Whole::new(step_in, step_out, step, fwd_in, forward);
            rt::train(&mut e, &l, &data, state, start, &opts)
        }
        "host" | "cuda" => {
            // The step and the evaluation forward are compiled once, before the first step.
            let backend = &c.train.backend;
            let fail = |e: String| format!("train.backend = \"{backend}\": {e}");
            let compiled = match (&p.pipeline, &p.mesh) {
                (Some(programs), Some(m)) => {
                    crate::compile::Compiled::pipeline(programs, m, "pp", "train", backend)
                }
                _ => crate::compile::Compiled::new(&p.step, p.mesh.as_ref(), "train", backend),
            }
            .map_err(fail)?
            .with_ranks(c.train.ranks);
            let eval =
                crate::compile::Compiled::new(&p.forward, None, "eval", backend).map_err(fail)?;
            let names: Vec<String> = specs.iter().map(|s| s.name.clone()).collect();
            // One thread: the state stays where the step runs (sessions).
            if let (false, Some(sp), Some(ep)) = (compiled.ranks(), compiled.host(), eval.host()) {
                use nnscaler_rt::session::{HostResident, Session};
                let mut e = rt::Kept::new(
                    Session::new(HostResident::new(sp)),
                    Session::new(HostResident::new(ep)),
                    names,
                );
                return rt::train(&mut e, &l, &data, state, start, &opts);
            }
            #[cfg(feature = "cuda")]
            if let (false, Some(sp), Some(ep)) = (compiled.ranks(), compiled.cuda(), eval.cuda()) {
                use nnscaler_rt::cuda::CudaResident;
                use nnscaler_rt::session::Session;
                let mut e = rt::Kept::new(
                    Session::new(CudaResident::new(sp).map_err(fail)?),
                    Session::new(CudaResident::new(ep).map_err(fail)?),
                    names,
                );
                return rt::train(&mut e, &l, &data, state, start, &opts);
            }
            // Every device on a thread of its own: whole tensors in and out.
            let step: RunFn<'_> = Box::new(|inputs: &[rt::RtTensor]| compiled.run_rt(inputs));
            let forward: RunFn<'_> = Box::new(|inputs: &[rt::RtTensor]| eval.run_rt(inputs));
            let mut e = Whole::new(step_in, step_out, step, fwd_in, forward);
            rt::train(&mut e, &l, &data, state, start, &opts)
        }
        other => Err(format!(
            "train.backend: '{other}' is not a backend (reference, host, cuda)"
        )),
    }
}

/// `--bundle DIR`: the step and the evaluation forward compiled, the corpus, the state's
/// initialization (or the checkpoint's tensors with `--resume`) and the resolved config,
/// written to `DIR` whole or not at all.
fn write_bundle(
    a: &TrainArgs,
    c: &Config,
    p: &Programs,
    l: &Loop,
    mut specs: Vec<StateSpec>,
    dir: &str,
    vocab: u64,
) -> Result<String, String> {
    use nnscaler_codegen::Gpu;
    let started = Instant::now();
    let gpu = Gpu::default();
    let step = match (&p.pipeline, &p.mesh) {
        (Some(programs), Some(m)) => nnscaler_codegen::pipeline_artifact(
            programs,
            &format!("{} @train", a.config),
            m,
            "pp",
            gpu,
        ),
        _ => nnscaler_codegen::artifact(
            &p.step,
            &format!("{} @train", a.config),
            p.mesh.as_ref(),
            gpu,
        ),
    }
    .map_err(|e| format!("{}: the training step: {e}", a.config))?;
    let eval = nnscaler_codegen::artifact(
        &p.forward,
        &format!("{} @train (evaluation)", a.config),
        None,
        gpu,
    )
    .map_err(|e| format!("{}: the evaluation forward: {e}", a.config))?;
    // Every argument of the step must be something the loop binds.
    let known: std::collections::BTreeSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    for port in &step.header.inputs {
        let n = port.name.as_str();
        if !(matches!(n, "tokens" | "targets" | "step" | "lr") || known.contains(n)) {
            return Err(format!(
                "{}: the step's argument '{n}' is neither data, the step, the learning rate nor training state",
                a.config
            ));
        }
    }
    if !step.header.outputs.iter().any(|o| o.name == "loss") {
        return Err(format!("{}: the step has no 'loss' result", a.config));
    }
    let mut files: Vec<(String, Vec<u8>)> = vec![
        ("step.nnsx".into(), step.to_bytes()?),
        ("eval.nnsx".into(), eval.to_bytes()?),
    ];
    for f in ["train.bin", "val.bin", "meta.json"] {
        let path = Path::new(&c.data.dir).join(f);
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        files.push((format!("data/{f}"), bytes));
    }
    let mut start = 0;
    if a.resume {
        // The checkpoint's tensors are the bundle's initial state, and its step the
        // bundle's start.
        let (state, at) = rt::initial_state(l, &specs, None, true)?;
        let named: Vec<(String, rt::RtTensor)> = state.into_iter().collect();
        files.push((
            "init.safetensors".into(),
            nnscaler_rt::tensor::to_bytes(&named)?,
        ));
        for s in &mut specs {
            s.init = rt::Init::Stored;
        }
        start = at;
    }
    let resolved = toml::to_string(c).map_err(|e| e.to_string())?;
    files.push((
        "config.toml".into(),
        format!(
            "# {} as nnscaler train resolved it (overrides applied)\n{resolved}",
            a.config
        )
        .into_bytes(),
    ));
    let manifest = rt::Manifest {
        format: rt::FORMAT.into(),
        version: rt::VERSION,
        source: a.config.clone(),
        run: l.clone(),
        start,
        state: specs,
        step: "step.nnsx".into(),
        eval: "eval.nnsx".into(),
        data: "data".into(),
        vocab,
        devices: p.mesh.as_ref().map_or(1, |m| m.devices() as u64),
        files: Vec::new(),
    };
    let files = rt::BundleFiles { manifest, files }.finish()?;
    let total: usize = files.iter().map(|f| f.1.len()).sum();
    rt::write_dir(Path::new(dir), &files)?;
    Ok(format!(
        "bundled {} for {} device{} in {:.1} s: {dir} ({} files, {:.1} MiB); train it with: nnscaler-rt train {dir}\n",
        a.config,
        p.mesh.as_ref().map_or(1, |m| m.devices()),
        if p.mesh.as_ref().map_or(1, |m| m.devices()) == 1 { "" } else { "s" },
        started.elapsed().as_secs_f64(),
        files.len(),
        total as f64 / (1 << 20) as f64
    ))
}
