//! `nnscaler`: the user CLI: `import` (model zoo -> MLIR), `run` (CPU runtime), `check-op`
//! (a user op's annotation against its body), `schedule-report` (a pipeline schedule's
//! timeline), `data` (training data), `train`, `compile`, `emit-torch` (per-rank PyTorch),
//! `calibrate`, `plan` (the plan search) and `presets`.

use clap::{Parser, Subcommand};
use nnscaler_frontends::{build_module, family_default, preset, PRESETS};
use nnscaler_tools::cli::{clap_exit, default_sigpipe};
use nnscaler_tools::run::RunArgs;
use nnscaler_tools::write_one;
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "nnscaler",
    version,
    about = "Compile single-device training programs for many devices",
    after_help = "Partition a model with nnscaler-opt (see nnscaler-opt --help), run it with \
                  'nnscaler run'."
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
    /// Show at most N errors (0: all); repeated errors are shown once.
    #[arg(long, value_name = "N", default_value_t = 20, global = true)]
    error_limit: usize,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    Import(Box<ImportArgs>),
    Run(RunArgs),
    CheckOp(nnscaler_tools::check_op::CheckOpArgs),
    ScheduleReport(nnscaler_tools::schedule_report::ScheduleArgs),
    Data(nnscaler_tools::data::DataArgs),
    Train(nnscaler_tools::train::TrainArgs),
    Compile(nnscaler_tools::compile::CompileArgs),
    EmitTorch(nnscaler_tools::emit_torch::EmitArgs),
    Calibrate(nnscaler_tools::calibrate::CalibrateArgs),
    Plan(nnscaler_tools::plan::PlanArgs),
    /// List the model presets (nnscaler import --preset, [model] preset) and the cluster
    /// presets (--cluster, cluster=).
    Presets(PresetsArgs),
}

/// `nnscaler presets`.
#[derive(clap::Args, Debug)]
struct PresetsArgs {
    /// Print cluster preset NAME as a cluster file (TOML) to edit and give to --cluster.
    #[arg(long, value_name = "NAME")]
    toml: Option<String>,
}

/// `nnscaler import`: size flags override the preset (or the family's default).
#[derive(clap::Args, Debug)]
#[command(
    about = "Build a zoo model's training forward (ending in a scalar loss) as dnn IR, or import a PyTorch nn.Module",
    long_about = "Build a zoo model's training forward (ending in a scalar loss) as dnn IR, or \
        import a PyTorch nn.Module.\n\n\
        Size flags override the preset (or the family's default: mlp-tiny, nanogpt-cpu, \
        llama-tiny). They apply by family:\n  \
        mlp:   --batch --inputs --hidden --layers --classes\n  \
        gpt:   --batch --block --vocab --layers --heads --width --dropout\n  \
        llama: --batch --seq --vocab --layers --heads --kv-heads --width --ffn --rope-theta\n\
        torch FILE.py:FACTORY --input NAME=SHAPE:DTYPE ... [--params FILE]: FACTORY() returns \
        an nn.Module whose forward takes the inputs in that order and returns a scalar loss; \
        it is traced on example inputs (torch.jit.trace) with a Python that has torch \
        (--python), each aten op a dnn op located at its line of FILE.py; parameters become \
        nns.param arguments named by their state_dict keys (their values in --params). \
        docs/pytorch.md lists the ops it maps; --user-ops FILE maps others to user ops.\n\
        The output is written only on success."
)]
struct ImportArgs {
    /// Model family, or torch (a PyTorch module: FILE.py:FACTORY follows).
    #[arg(value_parser = ["mlp", "gpt", "llama", "torch"])]
    family: Option<String>,
    /// torch: the Python file and the function returning the module (FILE.py:FACTORY).
    #[arg(value_name = "FILE.py:FACTORY")]
    source: Option<String>,
    /// torch: an input of forward, in order, as NAME=SHAPE:DTYPE (SHAPE like 8x16 or
    /// scalar; DTYPE f32 or i64); repeatable.
    #[arg(long = "input", value_name = "NAME=SHAPE:DTYPE")]
    input: Vec<String>,
    /// torch: write the parameters' values here (safetensors, by state_dict key).
    #[arg(long, value_name = "FILE")]
    params: Option<String>,
    /// torch: the Python with torch to trace with (default: $NNSCALER_PYTHON, else python3).
    #[arg(long, value_name = "PATH")]
    python: Option<String>,
    /// torch: user ops for aten ops the importer does not map: the functions of FILE (MLIR)
    /// with `nns.torch = "aten::NAME(x, 1)"` (names: the tensor operands, in order;
    /// literals: the values the call's other arguments must have) are called where the
    /// model makes that call, and FILE's functions join the module.
    #[arg(long, value_name = "FILE")]
    user_ops: Option<String>,
    /// Start from a preset (see 'nnscaler presets').
    #[arg(long, value_name = "NAME")]
    preset: Option<String>,
    /// Write the module to FILE ('-': standard output).
    #[arg(short = 'o', long = "output", value_name = "FILE", default_value = "-")]
    output: String,
    /// Samples (sequences) per step.
    #[arg(long, value_name = "N")]
    batch: Option<String>,
    /// mlp: input features.
    #[arg(long, value_name = "N")]
    inputs: Option<String>,
    /// mlp: hidden width.
    #[arg(long, value_name = "N")]
    hidden: Option<String>,
    /// Layers (mlp: hidden layers; gpt, llama: transformer blocks).
    #[arg(long, value_name = "N")]
    layers: Option<String>,
    /// mlp: output classes.
    #[arg(long, value_name = "N")]
    classes: Option<String>,
    /// gpt, llama: tokens per sequence.
    #[arg(long, visible_alias = "seq", value_name = "N")]
    block: Option<String>,
    /// gpt, llama: vocabulary size.
    #[arg(long, value_name = "N")]
    vocab: Option<String>,
    /// gpt, llama: attention heads.
    #[arg(long, value_name = "N")]
    heads: Option<String>,
    /// llama: key/value heads.
    #[arg(long, value_name = "N")]
    kv_heads: Option<String>,
    /// gpt, llama: model width.
    #[arg(long, value_name = "N")]
    width: Option<String>,
    /// llama: SwiGLU hidden width.
    #[arg(long, value_name = "N")]
    ffn: Option<String>,
    /// gpt: dropout probability in [0, 1).
    #[arg(long, value_name = "P")]
    dropout: Option<String>,
    /// llama: RoPE base (positive).
    #[arg(long, value_name = "THETA", allow_hyphen_values = true)]
    rope_theta: Option<String>,
}

fn import(a: &ImportArgs) -> Result<(), String> {
    if a.family.as_deref() == Some("torch") {
        let spec = a
            .source
            .as_deref()
            .ok_or("import torch needs FILE.py:FACTORY (a function returning the nn.Module)")?;
        if a.preset.is_some() {
            return Err("import torch takes no --preset: the module is FILE.py:FACTORY's".into());
        }
        let python = nnscaler_tools::torch_import::python(a.python.as_deref());
        return nnscaler_tools::torch_import::import(
            spec,
            &a.input,
            a.params.as_deref(),
            &python,
            &a.output,
            a.user_ops.as_deref(),
        );
    }
    if a.source.is_some()
        || !a.input.is_empty()
        || a.params.is_some()
        || a.python.is_some()
        || a.user_ops.is_some()
    {
        return Err(
            "FILE.py:FACTORY, --input, --params, --python and --user-ops are for 'import torch'"
                .into(),
        );
    }
    let mut config = match (&a.preset, &a.family) {
        (Some(p), _) => preset(p).ok_or_else(|| {
            let names: Vec<&str> = PRESETS.iter().map(|p| p.0).collect();
            format!("unknown preset '{p}' (presets: {})", names.join(", "))
        })?,
        (None, Some(f)) => {
            family_default(f).ok_or(format!("unknown model '{f}' (models: mlp, gpt, llama)"))?
        }
        (None, None) => return Err("import needs a model (mlp, gpt, llama) or --preset".into()),
    };
    if let (Some(f), Some(p)) = (&a.family, &a.preset) {
        if config.family() != f {
            return Err(format!(
                "preset '{p}' is a {} model, not {f}",
                config.family()
            ));
        }
    }
    let sizes = [
        ("batch", &a.batch),
        ("inputs", &a.inputs),
        ("hidden", &a.hidden),
        ("layers", &a.layers),
        ("classes", &a.classes),
        ("block", &a.block),
        ("vocab", &a.vocab),
        ("heads", &a.heads),
        ("kv-heads", &a.kv_heads),
        ("width", &a.width),
        ("ffn", &a.ffn),
        ("dropout", &a.dropout),
        ("rope-theta", &a.rope_theta),
    ];
    for (k, v) in sizes {
        if let Some(v) = v {
            config.set(k, v)?;
        }
    }
    let text = build_module(&config).map_err(|e| e.to_string())?;
    write_one(&a.output, text.into_bytes())
}

fn main() -> ExitCode {
    default_sigpipe();
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => return clap_exit(e),
    };
    let result = match &cli.command {
        Cmd::Import(a) => import(a),
        Cmd::Run(a) => nnscaler_tools::run::main(a, cli.error_limit),
        Cmd::CheckOp(a) => nnscaler_tools::check_op::check_op(a, cli.error_limit).and_then(
            |(report, ok)| {
                write_one("-", report.into_bytes())?;
                if ok {
                    Ok(())
                } else {
                    Err(format!(
                        "{}: the annotation of {} allows a split the op does not compute (see above)",
                        a.module, a.op
                    ))
                }
            },
        ),
        Cmd::Data(a) => nnscaler_tools::data::main(a).map(|r| print!("{r}")),
        Cmd::Train(a) => nnscaler_tools::train::main(a).map(|r| print!("{r}")),
        Cmd::Calibrate(a) => nnscaler_tools::calibrate::main(a).map(|r| print!("{r}")),
        Cmd::Plan(a) => nnscaler_tools::plan::main(a).and_then(|r| write_one("-", r.into_bytes())),
        Cmd::Compile(a) => {
            nnscaler_tools::compile::main(a, cli.error_limit).map(|r| print!("{r}"))
        }
        Cmd::EmitTorch(a) => nnscaler_tools::emit_torch::main(a, cli.error_limit),
        Cmd::ScheduleReport(a) => nnscaler_tools::schedule_report::main(a)
            .and_then(|report| write_one("-", report.into_bytes())),
        Cmd::Presets(PresetsArgs { toml: Some(name) }) => nnscaler_passes::planner::cost::preset(name)
            .ok_or_else(|| {
                format!(
                    "unknown cluster preset '{name}' (presets: {})",
                    nnscaler_passes::planner::cost::PRESETS.join(", ")
                )
            })
            .and_then(|c| c.to_toml())
            .and_then(|t| write_one("-", t.into_bytes())),
        Cmd::Presets(PresetsArgs { toml: None }) => {
            let mut text = String::from("models (nnscaler import --preset NAME, [model] preset = NAME):\n");
            for (n, d) in PRESETS {
                text += &format!("  {n:<14} {d}\n");
            }
            text += "clusters (--cluster NAME, cluster=NAME; or a TOML file, see nnscaler calibrate):\n";
            for n in nnscaler_passes::planner::cost::PRESETS {
                if let Some(c) = nnscaler_passes::planner::cost::preset(n) {
                    text += &format!("  {n:<14} {}\n", cluster_line(&c));
                }
            }
            write_one("-", text.into_bytes())
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nnscaler: error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// One line about a cluster preset: its device's peaks and memory, the network levels.
fn cluster_line(c: &nnscaler_passes::planner::cost::Cluster) -> String {
    let d = &c.device;
    let rate = |x: f64, unit: &str| match x {
        x if x >= 1e12 => format!("{:.1} T{unit}/s", x / 1e12),
        x => format!("{:.1} G{unit}/s", x / 1e9),
    };
    let mut s = format!(
        "{}: {} f32 matrix products",
        d.name,
        rate(d.matrix_flops, "FLOP")
    );
    if let Some(b) = d.matrix_flops_bf16 {
        s += &format!(", {} bf16", rate(b, "FLOP"));
    }
    s += &format!(
        ", {:.0} GiB at {}",
        d.memory as f64 / (1u64 << 30) as f64,
        rate(d.memory_bandwidth, "B")
    );
    for l in &c.network {
        // Collectives that move at their own rate (NVLink SHARP's all_reduce).
        let own: String = l
            .bandwidths
            .iter()
            .map(|(op, b)| format!(", {} {:.1} GB/s", op.trim_start_matches("nns."), b / 1e9))
            .collect();
        s += &format!(
            "; {} ({} devices, {:.1} GB/s{own})",
            l.name,
            l.devices,
            l.bandwidth / 1e9
        );
    }
    s
}
