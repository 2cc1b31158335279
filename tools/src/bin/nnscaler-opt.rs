//! `nnscaler-opt`: the pass driver, with mlir-opt's conventions.

use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command, CommandFactory, FromArgMatches, Parser};
use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::{Diagnostic, Diagnostics};
use nnscaler_dialects::dnn;
use nnscaler_dialects::nns;
use nnscaler_dialects::verify::verify_module;
use nnscaler_passes::pipeline::{self, Step};
use nnscaler_passes::registry::PASSES;
use nnscaler_tools::{expected, read_input, write_one, Outputs};
use std::process::ExitCode;
use std::time::{Duration, Instant};

/// The fixed options; pass flags are added from the registry (see [`command`]).
#[derive(Parser, Debug)]
#[command(
    name = "nnscaler-opt",
    version,
    about = "Run nnscaler passes on MLIR files (dnn/nns dialects)",
    long_about = "Run nnscaler passes on MLIR files (dnn/nns dialects).\n\n\
        The input is parsed and verified, every pass runs in command-line order and is followed \
        by the verifier, and the result is printed. Errors are reported as \
        file:line:col: error: ... on stderr with exit code 1, nothing on stdout and no output \
        file.\n\n\
        Pass options use MLIR's spelling: --plan=\"dp-megatron dp=2 tp=2\", or \
        --pass-pipeline='builtin.module(autodiff,plan{dp dp=2},cse)'.",
    after_help = "Passes run in the order their flags are given; see --list-passes."
)]
struct Cli {
    /// Input file ('-' reads standard input).
    #[arg(value_name = "INPUT", default_value = "-")]
    input: String,
    /// Write the output to FILE ('-': standard output); written only on success.
    #[arg(short = 'o', value_name = "FILE", default_value = "-")]
    output: String,
    /// Treat '// -----' lines as separators of independent inputs.
    #[arg(long)]
    split_input_file: bool,
    /// Check diagnostics against expected-error/warning/note comments.
    #[arg(long)]
    verify_diagnostics: bool,
    /// Print the IR to stderr after every pass.
    #[arg(long = "mlir-print-ir-after-all")]
    print_ir_after_all: bool,
    /// Run passes given as a pipeline, 'builtin.module(a,b{opt=v})'.
    #[arg(long, value_name = "PIPELINE", action = ArgAction::Append)]
    pass_pipeline: Vec<String>,
    /// List the registered passes and exit.
    #[arg(long)]
    list_passes: bool,
    /// List the dnn and nns ops and exit.
    #[arg(long)]
    list_ops: bool,
    /// Print the dnn dialect, or both dnn and nns (all), as IRDL for mlir-opt-19
    /// --irdl-file=... and exit; the committed copies are dialects/irdl/dnn.irdl.mlir and
    /// dialects/irdl/nnscaler.irdl.mlir.
    #[arg(long, value_name = "DIALECT", value_parser = ["dnn", "all"])]
    print_irdl: Option<String>,
    /// Show at most N errors (0: all); repeated errors are shown once.
    #[arg(long, value_name = "N", default_value_t = 20)]
    error_limit: usize,
    /// Print the time of parsing, verifying, every pass and printing (to stderr).
    #[arg(long = "mlir-timing")]
    timing: bool,
    /// Write the passes' remarks (what a pass decided: the plan search's ranking, the
    /// placement, ...) to FILE instead of stderr; written with the output, on success.
    #[arg(long, value_name = "FILE")]
    remarks_file: Option<String>,
    /// Print locations (loc(...)) in the output, as mlir-opt does.
    #[arg(long = "mlir-print-debuginfo")]
    print_debuginfo: bool,
    /// Print without aliases (locations and attributes written where they are used).
    #[arg(long = "mlir-print-local-scope")]
    print_local_scope: bool,
}

/// Marks a pass flag given without '=' (argv never holds a NUL, so no user value equals it).
const NO_OPTIONS: &str = "\0";

/// The command line: the fixed options plus one flag per registered pass.
fn command() -> Command {
    let mut cmd = Cli::command().next_help_heading("Passes");
    for p in PASSES {
        let mut long = format!("{}.", p.summary);
        if !p.options.is_empty() {
            long.push_str("\nOptions:");
            for o in p.options {
                long.push_str(&format!("\n  {}: {}", o.name, o.help));
            }
        }
        let arg = Arg::new(p.name)
            .long(p.name)
            .help(p.summary)
            .long_help(long);
        cmd = cmd.arg(if p.options.is_empty() {
            arg.num_args(0)
                .default_missing_value(NO_OPTIONS)
                .action(ArgAction::Append)
        } else {
            arg.value_name("OPTIONS")
                .num_args(0..=1)
                .require_equals(true)
                .default_missing_value(NO_OPTIONS)
                .action(ArgAction::Append)
        });
    }
    cmd
}

/// The steps of the command line, in the order they were given.
fn steps(m: &ArgMatches) -> Result<Vec<Step>, String> {
    let mut at: Vec<(usize, Vec<Step>)> = Vec::new();
    for p in PASSES {
        if m.value_source(p.name) != Some(ValueSource::CommandLine) {
            continue;
        }
        let Some(idx) = m.indices_of(p.name) else {
            continue;
        };
        if p.options.is_empty() {
            for i in idx {
                at.push((i, vec![nnscaler_passes::registry::step(p.name, "")?]));
            }
            continue;
        }
        let values = m.get_many::<String>(p.name).into_iter().flatten();
        for (v, i) in values.zip(idx) {
            let opts = match v.as_str() {
                NO_OPTIONS => "",
                "" => {
                    return Err(format!(
                        "--{}= has no options; write --{} alone or --{}=\"key=value ...\"",
                        p.name, p.name, p.name
                    ))
                }
                v => v,
            };
            at.push((i, vec![nnscaler_passes::registry::step(p.name, opts)?]));
        }
    }
    if let (Some(texts), Some(idx)) = (
        m.get_many::<String>("pass_pipeline"),
        m.indices_of("pass_pipeline"),
    ) {
        for (text, i) in texts.zip(idx) {
            at.push((i, nnscaler_passes::registry::parse_pipeline(text)?));
        }
    }
    at.sort_by_key(|(i, _)| *i);
    Ok(at.into_iter().flat_map(|(_, s)| s).collect())
}

/// Splits at `// -----` lines; each chunk is padded with empty lines so that line numbers
/// stay those of the whole file.
fn chunks(source: &str, split: bool) -> Vec<String> {
    if !split {
        return vec![source.to_string()];
    }
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut start = 0;
    for (line, l) in source.split_inclusive('\n').enumerate() {
        if l.trim_end() == "// -----" {
            out.push(format!("{}{cur}", "\n".repeat(start)));
            cur.clear();
            start = line + 1;
        } else {
            cur.push_str(l);
        }
    }
    out.push(format!("{}{cur}", "\n".repeat(start)));
    out
}

/// Processes one buffer: parse, verify, passes. Returns the printed IR and the passes'
/// remarks, or the diagnostics that stopped it.
fn process(
    ir: &IrContext,
    src: &str,
    name: &str,
    cli: &Cli,
    steps: &[Step],
) -> Result<(String, Diagnostics), Diagnostics> {
    let mut timing = Timing::default();
    let start = Instant::now();
    nnscaler_tools::parse_guard::check_parses(src, name)?;
    timing.add("parse (guard: in a child process)", start.elapsed());
    let start = Instant::now();
    let mut module = ir.parse(src, name)?;
    timing.add("parse", start.elapsed());
    let start = Instant::now();
    let d = verify_module(&module);
    if d.has_errors() {
        return Err(d);
    }
    timing.add("verify", start.elapsed());
    let print_after = cli.print_ir_after_all;
    let debuginfo = PrintFlags {
        debuginfo: cli.print_debuginfo,
        local_scope: cli.print_local_scope,
    };
    let remarks = pipeline::run(
        ir,
        &mut module,
        steps,
        &mut |done, m| {
            timing.add(done.name, done.pass);
            timing.add("verify", done.verify);
            if print_after {
                eprintln!(
                    "// -----// IR Dump After {} //----- //\n{}",
                    done.name,
                    print(&m.as_operation(), debuginfo)
                );
            }
        },
        name,
    )?;
    let start = Instant::now();
    let text = print(&module.as_operation(), debuginfo);
    timing.add("print", start.elapsed());
    if cli.timing {
        eprint!("{}", timing.report());
    }
    Ok((text, remarks))
}

/// How to print the IR: `--mlir-print-debuginfo`, `--mlir-print-local-scope`.
#[derive(Clone, Copy)]
struct PrintFlags {
    debuginfo: bool,
    local_scope: bool,
}

/// Prints `op` as the flags say.
fn print(op: &melior::ir::OperationRef<'_, '_>, f: PrintFlags) -> String {
    if !f.debuginfo && !f.local_scope {
        return op.to_string();
    }
    let mut flags = melior::ir::operation::OperationPrintingFlags::new();
    if f.debuginfo {
        flags = flags.enable_debug_info(true, false);
    }
    if f.local_scope {
        flags = flags.use_local_scope();
    }
    op.to_string_with_flags(flags)
        .unwrap_or_else(|_| op.to_string())
}

/// Wall-clock time by phase and pass, in first-seen order (`--mlir-timing`).
#[derive(Default)]
struct Timing(Vec<(&'static str, Duration, usize)>);

impl Timing {
    fn add(&mut self, what: &'static str, t: Duration) {
        match self.0.iter_mut().find(|e| e.0 == what) {
            Some(e) => {
                e.1 += t;
                e.2 += 1;
            }
            None => self.0.push((what, t, 1)),
        }
    }

    fn report(&self) -> String {
        let total: Duration = self.0.iter().map(|e| e.1).sum();
        let mut s = String::from("===-------------------------------------------------------===\n  nnscaler-opt timing (wall clock)\n===-------------------------------------------------------===\n");
        for (what, t, n) in &self.0 {
            s.push_str(&format!(
                "  {:>10.4} s  {:>5.1}%  {what}{}\n",
                t.as_secs_f64(),
                100.0 * t.as_secs_f64() / total.as_secs_f64().max(1e-12),
                if *n > 1 {
                    format!(" (x{n})")
                } else {
                    String::new()
                }
            ));
        }
        s.push_str(&format!(
            "  {:>10.4} s  100.0%  total\n",
            total.as_secs_f64()
        ));
        s
    }
}

fn main() -> ExitCode {
    nnscaler_tools::cli::default_sigpipe();
    let mut matches = match command().try_get_matches() {
        Ok(m) => m,
        Err(e) => return nnscaler_tools::cli::clap_exit(e),
    };
    // Read before `from_arg_matches_mut`, which takes the values it knows out of `matches`.
    let steps = steps(&matches);
    let cli = match Cli::from_arg_matches_mut(&mut matches) {
        Ok(c) => c,
        Err(e) => return nnscaler_tools::cli::clap_exit(e),
    };
    let fail = |e: String| {
        eprintln!("nnscaler-opt: error: {e}");
        ExitCode::FAILURE
    };
    if cli.list_passes {
        let text: String = PASSES
            .iter()
            .map(|p| format!("{:<18} {}\n", p.name, p.summary))
            .collect();
        return print_or_fail(&text);
    }
    if let Some(d) = &cli.print_irdl {
        let text = if d == "dnn" {
            nnscaler_dialects::irdl::dnn()
        } else {
            nnscaler_dialects::irdl::all()
        };
        return print_or_fail(&text);
    }
    if cli.list_ops {
        let mut text = String::new();
        for s in dnn::SPECS {
            text.push_str(&format!("{:<24} {}\n", s.name, s.summary));
        }
        text.push_str(&format!("{:<24} declares a device mesh\n", "nns.mesh"));
        for c in nns::COLLECTIVES {
            text.push_str(&format!("{:<24} {}\n", c.name, c.summary));
        }
        return print_or_fail(&text);
    }
    let steps = match steps {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let source = match read_input(&cli.input) {
        Ok(s) => s,
        Err(e) => return fail(e),
    };
    let name = if cli.input == "-" {
        "<stdin>"
    } else {
        cli.input.as_str()
    };
    let ir = IrContext::new();
    let mut outputs = Vec::new();
    let mut remark_text = String::new();
    let mut failed = false;
    for chunk in chunks(&source, cli.split_input_file) {
        let result = process(&ir, &chunk, name, &cli, &steps).map_err(|d| d.in_file(name));
        if cli.verify_diagnostics {
            let got: Vec<Diagnostic> = match &result {
                Ok((_, remarks)) => remarks.0.clone(),
                Err(d) => d.0.clone(),
            };
            let problems = match expected::parse(&chunk, name) {
                Ok(want) => expected::check(name, &want, &got),
                Err(bad) => vec![bad],
            };
            if !problems.is_empty() {
                eprintln!(
                    "{}",
                    Diagnostics(problems).render_limited(Some(&source), cli.error_limit)
                );
                failed = true;
            }
            if let Ok((out, _)) = result {
                outputs.push(out);
            }
            continue;
        }
        match result {
            Ok((out, remarks)) => {
                if !remarks.is_empty() {
                    let r = remarks.render_limited(Some(&source), cli.error_limit);
                    if cli.remarks_file.is_some() {
                        remark_text += &r;
                        remark_text.push('\n');
                    } else {
                        eprintln!("{r}");
                    }
                }
                outputs.push(out)
            }
            Err(d) => {
                failed = true;
                eprintln!("{}", d.render_limited(Some(&source), cli.error_limit));
            }
        }
    }
    if failed {
        return ExitCode::FAILURE;
    }
    let text = outputs.join("// -----\n");
    let mut out = Outputs::new();
    let staged = out
        .stage(&cli.output, text.into_bytes())
        .and_then(|()| match &cli.remarks_file {
            Some(f) => out.stage(f, remark_text.into_bytes()),
            None => Ok(()),
        });
    match staged.and_then(|()| out.commit()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(e),
    }
}

/// Prints a listing; a closed pipe (`| head`) ends the program quietly, as for any Unix tool.
fn print_or_fail(text: &str) -> ExitCode {
    match write_one("-", text.as_bytes().to_vec()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nnscaler-opt: error: {e}");
            ExitCode::FAILURE
        }
    }
}
