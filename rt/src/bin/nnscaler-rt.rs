//! `nnscaler-rt`: runs a compiled program (`nnscaler compile` makes the `.nnsx` artifact).

use clap::{Parser, Subcommand};
use nnscaler_rt::tensor::{self, Tensor};
use nnscaler_rt::{Artifact, HostProgram};
use std::process::ExitCode;

#[derive(Parser, Debug)]
#[command(
    name = "nnscaler-rt",
    version,
    about = "Run a compiled nnscaler program (.nnsx, made by 'nnscaler compile')",
    long_about = "Run a compiled nnscaler program (.nnsx, made by 'nnscaler compile'). \
        It needs no MLIR or LLVM: copy this binary and the artifact to a machine and run. \
        Backends: host (the artifact's kernels compiled for the CPU). The CUDA backend is \
        not built yet."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Print an artifact's signature, memory plan and steps.
    Info {
        /// The artifact.
        artifact: String,
    },
    /// Run a program once: arguments from safetensors files by name, results to one.
    Run {
        /// The artifact.
        artifact: String,
        /// Tensors for the arguments, by name (repeatable; later files override).
        #[arg(long = "inputs", value_name = "FILE.safetensors", required = true)]
        inputs: Vec<String>,
        /// Where to write the results (safetensors, by name), written only on success.
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        output: String,
        /// Where the kernels run.
        #[arg(long, default_value = "host", value_parser = ["host"])]
        backend: String,
    },
}

fn load(path: &str) -> Result<Artifact, String> {
    let bytes = std::fs::read(path).map_err(|e| format!("{path}: {e}"))?;
    Artifact::from_bytes(&bytes, path)
}

fn info(path: &str) -> Result<String, String> {
    let a = load(path)?;
    let h = &a.header;
    let mut s = format!(
        "{path}: {} for sm_{} (PTX {}.{}); {} kernels, {} steps, arena {} bytes\n",
        h.source,
        h.target.sm,
        h.target.ptx / 10,
        h.target.ptx % 10,
        h.kernels.len(),
        h.steps.len(),
        h.arena_bytes
    );
    if !h.mesh.is_empty() {
        let axes: Vec<String> = h
            .mesh
            .iter()
            .map(|a| format!("{} = {}", a.name, a.size))
            .collect();
        s += &format!(
            "one device's program, run on {} virtual devices: mesh <{}>\n",
            a.devices(),
            axes.join(", ")
        );
    }
    for (what, ports) in [("input", &h.inputs), ("output", &h.outputs)] {
        for p in ports {
            let b = &h.buffers[p.buffer];
            let piece = if p.global_shape != b.shape {
                format!(" (piece {:?})", b.shape)
            } else {
                String::new()
            };
            s += &format!(
                "{what} {} {:?} {:?}{piece}{}\n",
                p.name,
                b.elt,
                p.global_shape,
                if p.param { " (param)" } else { "" }
            );
        }
    }
    for (name, bytes) in &a.sections {
        s += &format!("section {name}: {} bytes\n", bytes.len());
    }
    Ok(s)
}

fn run(path: &str, inputs: &[String], output: &str) -> Result<String, String> {
    let a = load(path)?;
    let mut given = std::collections::BTreeMap::new();
    for f in inputs {
        given.extend(tensor::read(f)?);
    }
    let args: Vec<Tensor> = a
        .header
        .inputs
        .iter()
        .map(|p| {
            given.remove(&p.name).ok_or_else(|| {
                format!(
                    "no tensor '{}' in {} (the program's argument)",
                    p.name,
                    inputs.join(", ")
                )
            })
        })
        .collect::<Result<_, _>>()?;
    let names: Vec<String> = a.header.outputs.iter().map(|p| p.name.clone()).collect();
    let devices = a.devices();
    let prog = HostProgram::load(a)?;
    let started = std::time::Instant::now();
    let outs = prog.run(&args)?;
    let secs = started.elapsed().as_secs_f64();
    let named: Vec<(String, Tensor)> = names.into_iter().zip(outs).collect();
    write(output, &tensor::to_bytes(&named)?)?;
    Ok(format!(
        "ran {path} on the host ({} device{}) in {secs:.3} s; {} results in {output}\n",
        devices,
        if devices == 1 { "" } else { "s" },
        named.len()
    ))
}

/// Writes `bytes` to `path` whole or not at all: a regular file or a new path through a
/// temporary and a rename; anything else (`/dev/null`, a FIFO) written through.
fn write(path: &str, bytes: &[u8]) -> Result<(), String> {
    let p = std::path::Path::new(path);
    let special = std::fs::metadata(p).is_ok_and(|m| !m.is_file());
    if special {
        return std::fs::write(p, bytes).map_err(|e| format!("{path}: {e}"));
    }
    let tmp = p.with_file_name(format!(
        ".{}.{}.partial",
        p.file_name().and_then(|n| n.to_str()).unwrap_or("out"),
        std::process::id()
    ));
    std::fs::write(&tmp, bytes).map_err(|e| format!("{path}: {e}"))?;
    std::fs::rename(&tmp, p).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("{path}: {e}")
    })
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match &cli.cmd {
        Cmd::Info { artifact } => info(artifact),
        Cmd::Run {
            artifact,
            inputs,
            output,
            backend: _,
        } => run(artifact, inputs, output),
    };
    match r {
        Ok(s) => {
            print!("{s}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("nnscaler-rt: error: {e}");
            ExitCode::FAILURE
        }
    }
}
