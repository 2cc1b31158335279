//! `nnscaler train --config FILE.toml [--set key=value ...]`: trains a zoo model on a
//! character corpus (`nnscaler data prepare-char`, or `[data] text` to prepare it on the
//! first run), single-device or partitioned over
//! simulated devices, with the optimizer step compiled into the IR (`--optimizer`).
//!
//! Each step: a batch of random blocks of the training data (a counter-based draw from the
//! seed and the step, so a resumed run sees the same batches), the learning rate of the
//! schedule (linear warm-up, then cosine to `min_lr`, nanoGPT's), one run of the compiled
//! step, whose `next.*` results replace the parameters and moments. Every `eval_every`
//! steps the mean loss over `eval_batches` batches of train and val data (the forward alone,
//! on one device). Outputs: a progress bar on a terminal, a line per evaluation on stdout
//! (step, train and val loss, lr, tokens/s), one JSON line per step and per
//! evaluation in `log`, a loss-curve SVG in `curve`, and checkpoints (all parameters and
//! moments as whole tensors, with the step) written atomically every `checkpoint.every`
//! steps and at the end; `--resume` continues from the last one exactly.

use crate::data::{Dataset, Split};
use crate::output::Outputs;
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::domain::{self, Domain};
use nnscaler_dialects::graph::Graph;
use nnscaler_dialects::nns::Mesh;
use nnscaler_dialects::types::Elem;
use nnscaler_dialects::verify::Meshes;
use nnscaler_passes::pipeline::{self, Step};
use nnscaler_runtime::spmd::{global_view, pipeline_programs, run_pipeline, run_spmd};
use nnscaler_runtime::tensor::Tensor;
use nnscaler_runtime::{init, io, kernels, run, Options};
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
    /// Arithmetic of the matrix products: f32, or bf16 (mixed precision, `--autocast=bf16`:
    /// bf16 products with f32 master weights, gradients and optimizer; emulated on the CPU).
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

/// The learning rate at 0-based step `it` (nanoGPT's schedule).
pub fn learning_rate(o: &OptimizerSection, steps: u64, it: u64) -> f64 {
    let decay = o.decay_steps.unwrap_or(steps);
    if it < o.warmup {
        return o.lr * (it + 1) as f64 / (o.warmup + 1) as f64;
    }
    if it > decay {
        return o.min_lr;
    }
    let ratio = (it - o.warmup) as f64 / (decay - o.warmup).max(1) as f64;
    let coeff = 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos());
    o.min_lr + coeff * (o.lr - o.min_lr)
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

/// The model's module text, and the one evaluation runs (without dropout).
fn model_texts(c: &Config, vocab: usize) -> Result<(String, String), String> {
    let m = &c.model;
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
            // The corpus's ids must fit the model's embedding.
            let ir = IrContext::new();
            let module = ir
                .parse(&text, f)
                .map_err(|d| d.in_file(f).render_limited(Some(&text), 20))?;
            let g = Graph::all_in(&module)
                .into_iter()
                .filter_map(Result::ok)
                .find(|g| g.name == "train")
                .ok_or(format!("model.file: {f} has no @train"))?;
            let tokens = g
                .args
                .iter()
                .position(|a| a.name() == Some("tokens"))
                .ok_or(format!(
                    "model.file: @train of {f} has no 'tokens' argument"
                ))?;
            if let Some(Domain::Below(rows)) = domain::of_arg(&g, tokens) {
                if (rows as usize) < vocab {
                    return Err(format!(
                        "model.file: {f} embeds {rows} token ids; the corpus has a vocabulary of {vocab} (nnscaler import --vocab {vocab})"
                    ));
                }
            }
            return Ok((text.clone(), text));
        }
        (Some(_), Some(_)) => return Err("model: give preset or file, not both".into()),
        (None, None) => {
            return Err("model: give preset (see nnscaler presets) or file (an MLIR module)".into())
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
    let step = |name: &str, o: &str| Step::new(name, o).map_err(|e| format!("{name}: {e}"));
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
    let cast: Vec<Step> = match c.train.precision.as_str() {
        "f32" => Vec::new(),
        "bf16" => vec![step("autocast", "bf16")?],
        other => {
            return Err(format!(
                "train.precision: unknown precision '{other}' (f32 or bf16)"
            ))
        }
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
        for name in [
            "propagate-layouts",
            "split-tensor",
            "schedule",
            "lower-relayouts",
            "localize",
        ] {
            steps.push(step(name, "")?);
        }
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
            let per_rank = if matches!(name.as_str(), "interleaved" | "zb-v") {
                2
            } else {
                1
            };
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
        for r in remarks
            .0
            .iter()
            .filter(|r| r.message.starts_with("plan: auto chose"))
        {
            let chosen = r
                .message
                .split("; predicted per device")
                .next()
                .unwrap_or_default();
            eprintln!("nnscaler train: {chosen}");
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

const CHECKPOINT: &str = "checkpoint.safetensors";
const STEP_TENSOR: &str = "train.step";

/// Runs the command; returns the summary to print.
pub fn main(a: &TrainArgs) -> Result<String, String> {
    let c = load_config(&a.config, &a.set)?;
    kernels::set_threads(c.train.threads.max(1));
    // The outputs' directories are made now, so a bad path fails before any training.
    for path in [&c.train.log, &c.train.curve].into_iter().flatten() {
        if let Some(dir) = Path::new(path)
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
        {
            std::fs::create_dir_all(dir)
                .map_err(|e| format!("{path}: cannot make its directory: {e}"))?;
        }
    }
    if let Some(text) = &c.data.text {
        if !Path::new(&c.data.dir).join("meta.json").exists() {
            eprint!("{}", crate::data::prepare_char(text, &c.data.dir, None)?);
        }
    }
    let data = Dataset::load(&c.data.dir)?;
    let p = compile(&c, data.vocab)?;
    // A corpus too short for one block is refused before anything runs.
    for (part, ids) in [("train.bin", &data.train), ("val.bin", &data.val)] {
        if ids.len() <= p.block + 1 {
            return Err(format!(
                "{}/{part}: {} tokens, too few for one block of {} (the model's context needs {})",
                c.data.dir,
                ids.len(),
                p.block,
                p.block + 2
            ));
        }
    }
    // Before any parameter is drawn or read: refuse a run that cannot fit in memory.
    let devices = p.mesh.as_ref().map_or(1, |m| m.devices() as u64);
    let need = nnscaler_runtime::memory::estimate(&p.step, &p.view, devices);
    nnscaler_runtime::memory::check(&need, a.memory_limit, devices.saturating_sub(1))
        .map_err(|e| format!("{}: {e}", a.config))?;
    // The state: every parameter and moment, whole, by name.
    let mut state: BTreeMap<String, Tensor> = BTreeMap::new();
    let mut start = 0u64;
    let ckpt_path = c
        .checkpoint
        .as_ref()
        .map(|k| Path::new(&k.dir).join(CHECKPOINT));
    if a.resume {
        let path = ckpt_path
            .as_ref()
            .ok_or("--resume needs [checkpoint] dir in the config")?;
        let stored = io::load(path)?;
        for s in stored {
            if s.name == STEP_TENSOR {
                // An integer since 2026-12-04 (f32 before: exact only to 2^24).
                start = match s.tensor.ints() {
                    Ok(v) => v.first().copied().filter(|&x| x > 0).unwrap_or(0) as u64,
                    Err(_) => {
                        let v = s.tensor.f()?.first().copied().unwrap_or(0.0);
                        if v.fract() == 0.0 && v > 0.0 {
                            v as u64
                        } else {
                            0
                        }
                    }
                };
            } else {
                state.insert(s.name, s.tensor);
            }
        }
        if start == 0 {
            return Err(format!(
                "{}: not a training checkpoint (no '{STEP_TENSOR}')",
                path.display()
            ));
        }
    }
    for (i, arg) in p.view.args.iter().enumerate() {
        if !arg.is_state() {
            continue;
        }
        let name = arg.name().unwrap_or("").to_string();
        let want = nnscaler_runtime::tensor::dims(&p.view.values[arg.value]);
        match state.get(&name) {
            Some(t) if t.shape == want => {}
            Some(t) => {
                return Err(format!(
                    "checkpoint: '{name}' is {:?} but the model's is {want:?}",
                    t.shape
                ))
            }
            None if a.resume => {
                return Err(format!("checkpoint: no tensor '{name}' for this model"))
            }
            None => {
                state.insert(name, init::init_param(&p.view, i, c.train.seed)?);
            }
        }
    }
    if start >= c.train.steps {
        return Err(format!(
            "the checkpoint is at step {start}, at or past train.steps = {}",
            c.train.steps
        ));
    }
    let mut log = String::new();
    let mut curve: Vec<(u64, f64)> = Vec::new();
    let mut evals: Vec<(u64, f64, f64)> = Vec::new();
    let opts = Options {
        check_finite: true,
        ..Options::default()
    };
    // A compiled step (--backend host or cuda) is compiled once, before the first step.
    if c.train.ranks && c.train.backend == "reference" {
        return Err("train.ranks = true needs train.backend = \"host\" or \"cuda\"".into());
    }
    let compiled = match c.train.backend.as_str() {
        "reference" => None,
        "host" | "cuda" => {
            let compiled = match (&p.pipeline, &p.mesh) {
                (Some(programs), Some(m)) => {
                    crate::compile::Compiled::pipeline(programs, m, "pp", "train", &c.train.backend)
                }
                _ => crate::compile::Compiled::new(
                    &p.step,
                    p.mesh.as_ref(),
                    "train",
                    &c.train.backend,
                ),
            };
            Some(
                compiled
                    .map_err(|e| format!("train.backend = \"{}\": {e}", c.train.backend))?
                    .with_ranks(c.train.ranks),
            )
        }
        other => {
            return Err(format!(
                "train.backend: '{other}' is not a backend (reference, host, cuda)"
            ))
        }
    };
    let bar = indicatif::ProgressBar::new(c.train.steps);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:30} {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
        )
        .map_err(|e| e.to_string())?,
    );
    bar.set_position(start);
    let tokens = (p.batch * p.block) as f64;
    let started = Instant::now();
    let end = a.until.unwrap_or(c.train.steps).min(c.train.steps);
    if end <= start {
        return Err(format!("--until {end}: the run is already at step {start}"));
    }
    // The last checkpoint on disk (a resumed run's is its start).
    let mut last_ckpt = a.resume.then_some(start);
    // Training time and steps since the last evaluation line (its tokens/s).
    let (mut since_eval, mut steps_since_eval) = (0.0f64, 0u64);
    for t in start + 1..=end {
        let lr = learning_rate(&c.optimizer, c.train.steps, t - 1);
        let (x, y) = data.batch(Split::Train, p.batch, p.block, c.train.seed, t)?;
        let t0 = Instant::now();
        let mut inputs = Vec::with_capacity(p.view.args.len());
        for arg in &p.view.args {
            let name = arg.name().unwrap_or("");
            inputs.push(match name {
                "tokens" => x.clone(),
                "targets" => y.clone(),
                "step" => Tensor::f32(&[], vec![t as f32]),
                "lr" => Tensor::f32(&[], vec![lr as f32]),
                n => state
                    .get(n)
                    .cloned()
                    .ok_or(format!("no value for the step's argument '{n}'"))?,
            });
        }
        let outs = match (&p.pipeline, &p.mesh) {
            _ if compiled.is_some() => {
                let prog = compiled.as_ref().expect("checked");
                Ok(prog.run(&inputs).map_err(|e| format!("step {t}: {e}"))?)
            }
            (Some(programs), Some(m)) => {
                let by_index = inputs.into_iter().enumerate().collect();
                run_pipeline(programs, m, "pp", &by_index, &opts).map(|mut o| {
                    (0..p.view.outputs.len())
                        .filter_map(|k| o.remove(&k))
                        .collect()
                })
            }
            (_, Some(m)) => run_spmd(&p.step, m, inputs, &opts),
            _ => run(&p.step, inputs, &opts),
        }
        .map_err(|e| format!("step {t}: {}", e.message))?;
        let mut loss = f64::NAN;
        for (o, v) in p.view.outputs.iter().zip(outs) {
            match o.name() {
                Some("loss") => loss = f64::from(v.f()?[0]),
                Some(n) => {
                    if let Some(key) = n.strip_prefix("next.") {
                        state.insert(key.to_string(), v);
                    }
                }
                None => {}
            }
        }
        let secs = t0.elapsed().as_secs_f64();
        let tps = tokens / secs;
        since_eval += secs;
        steps_since_eval += 1;
        // A diverged run stops here: its log keeps this step's line, and no checkpoint is
        // written over the last good one.
        let ckpt_now = c
            .checkpoint
            .as_ref()
            .is_some_and(|k| t % k.every == 0 || t == end);
        // The state is scanned only before it is saved (a non-finite value in it makes the
        // next step's loss non-finite anyway).
        let diverged = if !loss.is_finite() {
            Some(format!("the loss is {loss}"))
        } else if ckpt_now {
            first_non_finite(&state)
        } else {
            None
        };
        // The step's line (a non-finite loss left out), kept in the log either way.
        log.push_str(&line(&Line {
            kind: "step",
            step: t,
            loss: loss.is_finite().then_some(loss),
            val_loss: None,
            lr: Some(lr),
            tokens_per_s: Some(tps),
        })?);
        if let Some(what) = diverged {
            if let Some(path) = &c.train.log {
                append(path, &log, t == start + 1 && start == 0)?;
            }
            bar.finish_and_clear();
            let kept = match (&c.checkpoint, last_ckpt) {
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
        let eval_now =
            t == c.train.steps || (c.train.eval_every > 0 && t % c.train.eval_every == 0);
        if eval_now {
            let train_loss = evaluate(&p, &data, &state, Split::Train, &c)?;
            let val_loss = evaluate(&p, &data, &state, Split::Val, &c)?;
            evals.push((t, train_loss, val_loss));
            // A line per evaluation stays in the terminal (stdout, above the bar; the
            // same lines when stdout is a file or pipe).
            let rate = tokens * steps_since_eval as f64 / since_eval.max(1e-9);
            let said = format!(
                "step {t}: train loss {train_loss:.4}, val loss {val_loss:.4} (lr {lr:.3e}, {rate:.0} tokens/s)"
            );
            bar.suspend(|| println!("{said}"));
            (since_eval, steps_since_eval) = (0.0, 0);
            log.push_str(&line(&Line {
                kind: "eval",
                step: t,
                loss: Some(train_loss),
                val_loss: Some(val_loss),
                lr: None,
                tokens_per_s: None,
            })?);
        }
        if ckpt_now {
            save_checkpoint(&c, &state, t)?;
            last_ckpt = Some(t);
        }
        // The log is appended as it goes (a killed run keeps its lines).
        if let Some(path) = &c.train.log {
            append(path, &log, t == start + 1 && start == 0)?;
        }
        log.clear();
    }
    bar.finish_and_clear();
    if let Some(path) = &c.train.curve {
        crate::write_one(path, svg(&curve, &evals).into_bytes())?;
    }
    let secs = started.elapsed().as_secs_f64();
    let steps = end - start;
    let (last_t, last_train, last_val) = evals.last().copied().unwrap_or((0, f64::NAN, f64::NAN));
    Ok(format!(
        "trained steps {}..{end} in {secs:.1} s ({:.0} tokens/s); step {last_t}: train loss {last_train:.4}, val loss {last_val:.4}{}\n",
        start + 1,
        tokens * steps as f64 / secs,
        c.train
            .curve
            .as_ref()
            .map(|p| format!("; loss curve in {p}"))
            .unwrap_or_default()
    ))
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

/// The first non-finite value of the training state (parameters and moments after a
/// step): the tensor and the element.
fn first_non_finite(state: &BTreeMap<String, Tensor>) -> Option<String> {
    state.iter().find_map(|(name, t)| {
        let v = t.f().ok()?;
        let i = v.iter().position(|x| !x.is_finite())?;
        Some(format!("'{name}' has {} at element {i}", v[i]))
    })
}

/// The mean loss over `eval_batches` batches of `split`, the forward on one device.
fn evaluate(
    p: &Programs,
    data: &Dataset,
    state: &BTreeMap<String, Tensor>,
    split: Split,
    c: &Config,
) -> Result<f64, String> {
    let n = c.train.eval_batches.max(1);
    let mut sum = 0.0;
    for k in 0..n {
        // Evaluation batches are drawn from their own seed stream, the same every time.
        let (x, y) = data.batch(split, p.batch, p.block, c.train.seed ^ 0x5eed_e7a1, k)?;
        let inputs = p
            .forward
            .args
            .iter()
            .map(|a| match a.name().unwrap_or("") {
                "tokens" => Ok(x.clone()),
                "targets" => Ok(y.clone()),
                n => state
                    .get(n)
                    .cloned()
                    .ok_or(format!("no parameter '{n}' to evaluate with")),
            })
            .collect::<Result<Vec<_>, String>>()?;
        let outs = run(&p.forward, inputs, &Options::default())
            .map_err(|e| format!("evaluation: {}", e.message))?;
        sum += f64::from(outs[0].f()?[0]);
    }
    Ok(sum / n as f64)
}

/// Writes every parameter and moment (whole) and the step, atomically.
fn save_checkpoint(c: &Config, state: &BTreeMap<String, Tensor>, t: u64) -> Result<(), String> {
    let Some(k) = &c.checkpoint else {
        return Ok(());
    };
    std::fs::create_dir_all(&k.dir).map_err(|e| format!("{}: {e}", k.dir))?;
    // The step as an integer (an f32 is exact only to 2^24 steps).
    let step = Tensor::i64(&[], vec![t as i64]);
    let mut named: Vec<(String, Elem, &Tensor)> = state
        .iter()
        .map(|(n, t)| (n.clone(), Elem::F32, t))
        .collect();
    named.push((STEP_TENSOR.into(), Elem::I64, &step));
    let mut out = Outputs::new();
    let path = Path::new(&k.dir).join(CHECKPOINT).display().to_string();
    out.stage(&path, io::to_bytes(&named)?)?;
    out.commit()
}

/// The loss curve: each step's loss, and the evaluations' train and val losses.
fn svg(curve: &[(u64, f64)], evals: &[(u64, f64, f64)]) -> String {
    use nnscaler_passes::schedule::ticks;
    // The plot area: left margin for the loss ticks, bottom for the step ticks, top for
    // the title and legend.
    let (w, h) = (760.0, 440.0);
    let (left, right, top, bottom) = (64.0, 20.0, 46.0, 52.0);
    let last = curve.last().map_or(1, |c| c.0).max(1) as f64;
    let first = curve.first().map_or(0, |c| c.0) as f64;
    let losses = curve
        .iter()
        .map(|c| c.1)
        .chain(evals.iter().flat_map(|e| [e.1, e.2]));
    let (lo, hi) = losses
        .filter(|x| x.is_finite())
        .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let (lo, hi) = if lo < hi { (lo, hi) } else { (0.0, 1.0) };
    let x = |s: f64| left + (s - first) / (last - first).max(1.0) * (w - left - right);
    let y = |v: f64| top + (hi - v) / (hi - lo) * (h - top - bottom);
    let points: Vec<String> = curve
        .iter()
        .filter(|c| c.1.is_finite())
        .map(|c| format!("{:.1},{:.1}", x(c.0 as f64), y(c.1)))
        .collect();
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n\
         <text x=\"4\" y=\"15\">training loss (cross-entropy, nats per token) by step</text>\n"
    );
    // Axes with round ticks.
    let (x0, y0, x1, y1) = (left, h - bottom, w - right, top);
    s.push_str(&format!(
        "<line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x1}\" y2=\"{y0}\" stroke=\"#333\"/><line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x0}\" y2=\"{y1}\" stroke=\"#333\"/>\n"
    ));
    let (steps, _) = ticks(first, last, 8.0);
    for t in steps {
        let px = x(t);
        s.push_str(&format!(
            "<line x1=\"{px:.1}\" y1=\"{y0}\" x2=\"{px:.1}\" y2=\"{:.1}\" stroke=\"#333\"/><text x=\"{px:.1}\" y=\"{:.1}\" text-anchor=\"middle\">{t:.0}</text>\n",
            y0 + 4.0,
            y0 + 16.0
        ));
    }
    let (marks, decimals) = ticks(lo, hi, 6.0);
    for v in marks {
        let py = y(v);
        s.push_str(&format!(
            "<line x1=\"{:.1}\" y1=\"{py:.1}\" x2=\"{x1}\" y2=\"{py:.1}\" stroke=\"#ddd\"/><line x1=\"{:.1}\" y1=\"{py:.1}\" x2=\"{x0}\" y2=\"{py:.1}\" stroke=\"#333\"/><text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"end\">{v:.decimals$}</text>\n",
            x0 + 1.0,
            x0 - 4.0,
            x0 - 6.0,
            py + 4.0
        ));
    }
    s.push_str(&format!(
        "<text x=\"{:.1}\" y=\"{:.1}\" text-anchor=\"middle\">step</text>\n\
         <text transform=\"translate(14,{:.1}) rotate(-90)\" text-anchor=\"middle\">loss (nats)</text>\n",
        (x0 + x1) / 2.0,
        h - 12.0,
        (y0 + y1) / 2.0
    ));
    s.push_str(&format!(
        "<polyline fill=\"none\" stroke=\"#8ecae6\" points=\"{}\"/>\n",
        points.join(" ")
    ));
    for (t, tr, va) in evals {
        s.push_str(&format!(
            "<circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"#219ebc\"/><circle cx=\"{:.1}\" cy=\"{:.1}\" r=\"3\" fill=\"#fb8500\"/>\n",
            x(*t as f64),
            y(*tr),
            x(*t as f64),
            y(*va)
        ));
    }
    // The legend.
    s.push_str(
        "<line x1=\"4\" y1=\"30\" x2=\"20\" y2=\"30\" stroke=\"#8ecae6\" stroke-width=\"2\"/><text x=\"24\" y=\"34\">loss of each step's batch</text>\n\
         <circle cx=\"180\" cy=\"30\" r=\"3\" fill=\"#219ebc\"/><text x=\"188\" y=\"34\">evaluation: train</text>\n\
         <circle cx=\"300\" cy=\"30\" r=\"3\" fill=\"#fb8500\"/><text x=\"308\" y=\"34\">evaluation: val</text>\n</svg>\n",
    );
    s
}
