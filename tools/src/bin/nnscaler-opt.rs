//! `nnscaler-opt`: the pass driver, with mlir-opt's conventions.

use nnscaler_dialects::context::IrContext;
use nnscaler_dialects::diag::{Diagnostic, Diagnostics, Severity, SrcLoc};
use nnscaler_dialects::dnn;
use nnscaler_dialects::nns;
use nnscaler_dialects::verify::verify_module;
use nnscaler_passes::pipeline::{self, Step};
use nnscaler_passes::registry::PASSES;
use nnscaler_tools::{expected, read_input, write_output};
use std::process::ExitCode;

struct Args {
    input: String,
    output: String,
    split_input_file: bool,
    verify_diagnostics: bool,
    print_ir_after_all: bool,
    steps: Vec<Step>,
}

fn help() -> String {
    let mut s = String::from(
        "nnscaler-opt: run nnscaler passes on MLIR files (dnn/nns dialects)\n\n\
         USAGE: nnscaler-opt [options] [passes] <input.mlir | ->\n\n\
         The input is parsed and verified, every pass runs in command-line order and is\n\
         followed by the verifier, and the result is printed. Errors are reported as\n\
         file:line:col: error: ... on stderr with exit code 1 and nothing on stdout.\n\n\
         OPTIONS:\n\
         \x20 -o <file>                    write the output there (default: stdout); written only on success\n\
         \x20 --split-input-file           treat '// -----' lines as separators of independent inputs\n\
         \x20 --verify-diagnostics         check diagnostics against expected-error/warning/note comments\n\
         \x20 --pass-pipeline=<pipeline>   run passes given as 'builtin.module(a,b{opt=v})'\n\
         \x20 --mlir-print-ir-after-all    print the IR to stderr after every pass\n\
         \x20 --list-passes                list the registered passes\n\
         \x20 --list-ops                   list the dnn and nns ops\n\
         \x20 --help                       this text\n\n\
         PASSES (each a flag; options as --pass=\"key=value ...\"):\n",
    );
    for p in PASSES {
        s.push_str(&format!("  --{:<27} {}\n", p.name, p.summary));
        for o in p.options {
            s.push_str(&format!("      {:<25} {}\n", o.name, o.help));
        }
    }
    s
}

fn parse_args(argv: &[String]) -> Result<Option<Args>, String> {
    let mut a = Args {
        input: String::new(),
        output: "-".into(),
        split_input_file: false,
        verify_diagnostics: false,
        print_ir_after_all: false,
        steps: Vec::new(),
    };
    let mut i = 0;
    while i < argv.len() {
        let arg = &argv[i];
        i += 1;
        match arg.as_str() {
            "-h" | "--help" => {
                print!("{}", help());
                return Ok(None);
            }
            "--list-passes" => {
                for p in PASSES {
                    println!("{:<16} {}", p.name, p.summary);
                }
                return Ok(None);
            }
            "--list-ops" => {
                for s in dnn::SPECS {
                    println!("{:<24} {}", s.name, s.summary);
                }
                println!("{:<24} declares a device mesh", "nns.mesh");
                for c in nns::COLLECTIVES {
                    println!("{:<24} {}", c.name, c.summary);
                }
                return Ok(None);
            }
            "-o" => {
                a.output = argv.get(i).cloned().ok_or("-o needs a file name")?;
                i += 1;
            }
            "--split-input-file" => a.split_input_file = true,
            "--verify-diagnostics" => a.verify_diagnostics = true,
            "--mlir-print-ir-after-all" => a.print_ir_after_all = true,
            "-" => a.input = "-".into(),
            s if s.starts_with("--pass-pipeline=") => a
                .steps
                .extend(pipeline::parse_pipeline(&s["--pass-pipeline=".len()..])?),
            s if s.starts_with("--") => {
                let (name, opts) = s[2..].split_once('=').unwrap_or((&s[2..], ""));
                let opts = opts.trim_matches('"');
                if nnscaler_passes::registry::lookup(name).is_none() {
                    return Err(format!("unknown option '{s}' (see --help)"));
                }
                a.steps.push(Step::new(name, opts)?);
            }
            s if s.starts_with('-') => return Err(format!("unknown option '{s}' (see --help)")),
            s => {
                if !a.input.is_empty() {
                    return Err(format!(
                        "more than one input file ('{}' and '{s}')",
                        a.input
                    ));
                }
                a.input = s.to_string();
            }
        }
    }
    if a.input.is_empty() {
        a.input = "-".into();
    }
    Ok(Some(a))
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

/// Processes one buffer: parse, verify, passes. Returns the printed IR or diagnostics.
fn process(ir: &IrContext, src: &str, name: &str, args: &Args) -> Result<String, Diagnostics> {
    let mut module = ir.parse(src, name)?;
    let d = verify_module(&module);
    if d.has_errors() {
        return Err(d);
    }
    let print_after = args.print_ir_after_all;
    pipeline::run(
        ir,
        &mut module,
        &args.steps,
        &mut |pass, m| {
            if print_after {
                eprintln!(
                    "// -----// IR Dump After {pass} //----- //\n{}",
                    m.as_operation()
                );
            }
        },
        name,
    )?;
    Ok(module.as_operation().to_string())
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let args = match parse_args(&argv) {
        Ok(Some(a)) => a,
        Ok(None) => return ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nnscaler-opt: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let source = match read_input(&args.input) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("nnscaler-opt: error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let name = if args.input == "-" {
        "<stdin>"
    } else {
        args.input.as_str()
    };
    let ir = IrContext::new();
    let mut outputs = Vec::new();
    let mut failed = false;
    for chunk in chunks(&source, args.split_input_file) {
        let result = process(&ir, &chunk, name, &args);
        if args.verify_diagnostics {
            let got: Vec<Diagnostic> = match &result {
                Ok(_) => Vec::new(),
                Err(d) => d.0.clone(),
            };
            let problems = match expected::parse(&chunk, name) {
                Ok(want) => expected::check(name, &want, &got),
                Err(bad) => vec![bad],
            };
            for p in &problems {
                eprintln!("{}", p.render(Some(&source)));
            }
            failed |= !problems.is_empty();
            if let Ok(out) = result {
                outputs.push(out);
            }
            continue;
        }
        match result {
            Ok(out) => outputs.push(out),
            Err(d) => {
                failed = true;
                for x in &d.0 {
                    eprintln!("{}", x.render(Some(&source)));
                }
            }
        }
    }
    if failed {
        return ExitCode::FAILURE;
    }
    let text = outputs.join("// -----\n");
    if let Err(e) = write_output(&args.output, &text) {
        let d = Diagnostic {
            loc: SrcLoc::default(),
            severity: Severity::Error,
            message: e,
        };
        eprintln!("nnscaler-opt: {}", d.message);
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
