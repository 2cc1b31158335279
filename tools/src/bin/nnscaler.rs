//! `nnscaler`: the user CLI: `import` (model zoo -> MLIR), `run` (CPU runtime) and `presets`.

use nnscaler_frontends::{build_module, family_default, preset, PRESETS};
use nnscaler_tools::write_output;
use std::process::ExitCode;

const HELP: &str = "nnscaler: compile single-device training programs for many devices\n\n\
USAGE:\n\
\x20 nnscaler import [mlp|gpt|llama] [--preset NAME] [size flags] [-o FILE]\n\
\x20     Build a zoo model's training forward (ending in a scalar loss) as dnn IR.\n\
\x20     Size flags override the preset (or the family default):\n\
\x20       mlp:   --batch --inputs --hidden --layers --classes\n\
\x20       gpt:   --batch --block --vocab --layers --heads --width --dropout\n\
\x20       llama: --batch --seq --vocab --layers --heads --kv-heads --width --ffn --rope-theta\n\
\x20     Output goes to FILE (written only on success) or stdout.\n\
\x20 nnscaler presets\n\
\x20     List the presets.\n";

fn import(argv: &[String]) -> Result<(), String> {
    let mut family: Option<String> = None;
    let mut preset_name: Option<String> = None;
    let mut sizes: Vec<(String, String)> = Vec::new();
    let mut output = "-".to_string();
    let mut i = 0;
    while i < argv.len() {
        let a = &argv[i];
        i += 1;
        let mut value = || -> Result<String, String> {
            let v = argv.get(i).cloned().ok_or(format!("{a} needs a value"))?;
            i += 1;
            Ok(v)
        };
        match a.as_str() {
            "-o" => output = value()?,
            "--preset" => preset_name = Some(value()?),
            s if s.starts_with("--") => {
                let (k, v) = match s[2..].split_once('=') {
                    Some((k, v)) => (k.to_string(), v.to_string()),
                    None => (s[2..].to_string(), value()?),
                };
                sizes.push((k, v));
            }
            s if family.is_none() && !s.starts_with('-') => family = Some(s.to_string()),
            s => return Err(format!("unexpected argument '{s}'")),
        }
    }
    let mut config = match (&preset_name, &family) {
        (Some(p), _) => preset(p).ok_or_else(|| {
            let names: Vec<&str> = PRESETS.iter().map(|p| p.0).collect();
            format!("unknown preset '{p}' (presets: {})", names.join(", "))
        })?,
        (None, Some(f)) => {
            family_default(f).ok_or(format!("unknown model '{f}' (models: mlp, gpt, llama)"))?
        }
        (None, None) => return Err("import needs a model (mlp, gpt, llama) or --preset".into()),
    };
    if let (Some(f), Some(p)) = (&family, &preset_name) {
        if config.family() != f {
            return Err(format!(
                "preset '{p}' is a {} model, not {f}",
                config.family()
            ));
        }
    }
    for (k, v) in &sizes {
        config.set(k, v)?;
    }
    let text = build_module(&config).map_err(|e| e.to_string())?;
    write_output(&output, &text)
}

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let result = match argv.first().map(String::as_str) {
        Some("import") => import(&argv[1..]),
        Some("run") => nnscaler_tools::run::main(&argv[1..]),
        Some("presets") => {
            for (n, d) in PRESETS {
                println!("{n:<14} {d}");
            }
            Ok(())
        }
        Some("-h" | "--help") | None => {
            print!("{HELP}{}", nnscaler_tools::run::HELP);
            Ok(())
        }
        Some(other) => Err(format!("unknown command '{other}' (see nnscaler --help)")),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("nnscaler: error: {e}");
            ExitCode::FAILURE
        }
    }
}
