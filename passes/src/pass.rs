//! The pass interface: what a pass is ([`ModulePass`], [`FunctionPass`], [`Native`]), how
//! it is described ([`PassInfo`]: name, summary, options, anchor, constructor) and its
//! options ([`PassOptions`]). Every pass and the drivers depend on it; it depends on none
//! of them (the function passes' driver is [`crate::rewrite`], the table of passes
//! [`crate::registry`], pipelines [`crate::pipeline`]).

use melior::ir::OperationRef;
use nnscaler_dialects::diag::Diagnostics;
use nnscaler_dialects::graph::Graph;
use std::collections::BTreeMap;

/// A table of passes by name (the registry's [`crate::registry::lookup`]): what drivers
/// that run passes by name are given, so they need not import the table.
pub type Lookup = fn(&str) -> Option<&'static PassInfo>;

/// One option of a pass.
#[derive(Clone, Copy, Debug)]
pub struct OptionInfo {
    /// Option name, as in `--pass="name=value"`.
    pub name: &'static str,
    /// One line for `--help`.
    pub help: &'static str,
}

/// How a pass is made.
#[derive(Clone, Copy, Debug)]
pub enum Factory {
    /// One of ours.
    Native(fn(&PassOptions) -> Result<Native, String>),
    /// An upstream MLIR pass.
    Upstream(fn() -> melior::pass::Pass),
}

/// What a pass works on, as MLIR anchors passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Anchor {
    /// The whole module (it adds or reads module-level ops).
    Module,
    /// One function at a time: may be nested in `func.func(...)`.
    Function,
}

/// A registered pass.
#[derive(Clone, Copy, Debug)]
pub struct PassInfo {
    /// Kebab-case name: the flag (`--print-stats`), the file and the test folder.
    pub name: &'static str,
    /// One line for `--list-passes` and `--help`.
    pub summary: &'static str,
    /// Its options.
    pub options: &'static [OptionInfo],
    /// What it works on.
    pub anchor: Anchor,
    /// Constructor.
    pub factory: Factory,
}

/// A pass that works on the whole module (it adds or reads module-level ops), like an MLIR
/// pass anchored on `builtin.module`.
pub trait ModulePass {
    /// Runs the pass on `module` (a `builtin.module` op), editing it in place.
    fn run(&mut self, module: &OperationRef<'_, '_>) -> Result<(), Diagnostics>;
    /// Takes the remarks made by the last run (decisions the user may want to know about).
    fn take_remarks(&mut self) -> Diagnostics {
        Diagnostics::default()
    }
}

/// A pass that transforms one function at a time, like an MLIR pass anchored on
/// `func.func`: it reads a function as a [`Graph`] and returns the graph to write back in
/// place (see [`crate::rewrite`]). It may read, never change, the module around the
/// function ([`FunctionPass::prepare`]).
pub trait FunctionPass {
    /// Reads what the pass needs from the module holding the functions (its mesh). Called
    /// before the first function of a module.
    fn prepare(&mut self, _module: &OperationRef<'_, '_>) -> Result<(), Diagnostics> {
        Ok(())
    }
    /// Transforms one function; `None` leaves it untouched.
    fn run_on_function(&mut self, g: Graph) -> Result<Option<Graph>, Diagnostics>;
    /// Takes the remarks made so far (decisions the user may want to know about, such as
    /// an op without a spec run replicated).
    fn take_remarks(&mut self) -> Diagnostics {
        Diagnostics::default()
    }
    /// Called after every function of a module was seen (e.g. to report that `func=NAME`
    /// matched none). Not called when the pass is run on one function alone.
    fn finish(&mut self) -> Result<(), Diagnostics> {
        Ok(())
    }
}

/// One of our passes, by its anchor.
pub enum Native {
    /// A module pass.
    Module(Box<dyn ModulePass>),
    /// A function pass.
    Function(Box<dyn FunctionPass>),
}

impl std::fmt::Debug for Native {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Native::Module(_) => "Native::Module",
            Native::Function(_) => "Native::Function",
        })
    }
}

/// Options of one pass instance: `key=value` pairs, checked against the pass's declared
/// options.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PassOptions(pub BTreeMap<String, String>);

impl PassOptions {
    /// Parses MLIR-style options `key=value key2=value2` for pass `info`.
    pub fn parse(info: &PassInfo, text: &str) -> Result<Self, String> {
        let mut map = BTreeMap::new();
        // A pass with a `policy`, `file` or `to` option takes it unnamed: `--plan=dp`,
        // `--schedule-from=s.txt`, `--autocast=bf16`.
        let positional = info
            .options
            .iter()
            .find(|o| matches!(o.name, "policy" | "file" | "to"))
            .map(|o| o.name);
        for item in text.split_whitespace() {
            let (k, v) = match item.split_once('=') {
                Some(kv) => kv,
                None if positional.is_some() => (positional.unwrap_or_default(), item),
                None if info.options.iter().any(|o| o.name == item) => {
                    return Err(format!(
                        "option '{item}' of pass '{}' needs a value ({item}=...)",
                        info.name
                    ))
                }
                None => (item, ""),
            };
            if !info.options.iter().any(|o| o.name == k) {
                let known: Vec<&str> = info.options.iter().map(|o| o.name).collect();
                return Err(format!(
                    "pass '{}' has no option '{k}' (options: {})",
                    info.name,
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                ));
            }
            if v.is_empty() {
                return Err(format!(
                    "option '{k}' of pass '{}' has an empty value",
                    info.name
                ));
            }
            if map.insert(k.to_string(), v.to_string()).is_some() {
                return Err(format!(
                    "option '{k}' of pass '{}' is given twice",
                    info.name
                ));
            }
        }
        Ok(PassOptions(map))
    }

    /// The value of option `key`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    /// Option `key` as a positive integer (`None` when absent); the error names `pass`, the
    /// key and the value.
    pub fn positive(&self, key: &str, pass: &str) -> Result<Option<u64>, String> {
        self.get(key)
            .map(|v| {
                v.parse::<u64>()
                    .ok()
                    .filter(|&n| n > 0)
                    .ok_or(format!("{pass}: '{key}={v}' must be a positive integer"))
            })
            .transpose()
    }
}
