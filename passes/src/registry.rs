//! The single table of passes: name (= flag = module in `transforms/` = test folder),
//! summary, options.

use crate::pass::Native;
use crate::pass::{Anchor, Factory, OptionInfo, PassInfo};
use crate::pipeline::Step;
use crate::planner::schedule::ScheduleKind;
use crate::transforms::autocast::Autocast;
use crate::transforms::autodiff::Autodiff;
use crate::transforms::localize::Localize;
use crate::transforms::lower_relayouts::LowerRelayouts;
use crate::transforms::optimizer::Optimizer;
use crate::transforms::place::Place;
use crate::transforms::plan::Plan;
use crate::transforms::print_stats::PrintStats;
use crate::transforms::propagate_layouts::PropagateLayouts;
use crate::transforms::recompute::Recompute;
use crate::transforms::schedule::SchedulePass;
use crate::transforms::split_tensor::SplitTensor;
use melior::pass::transform::{create_canonicalizer, create_cse};

const SCHEDULE_OPTIONS: &[OptionInfo] = &[
    OptionInfo {
        name: "microbatches",
        help: "the micro-batches (default: the size of the mesh's micro-batch axis, 1 without one; a different number is an error: --plan's microbatches= cuts the batch)",
    },
    AXIS,
];

/// The other schedule passes' `microbatches` and `axis`.
const MICROBATCHES_AS_1F1B: OptionInfo = OptionInfo {
    name: "microbatches",
    help: "as for --schedule-1f1b",
};
const AXIS: OptionInfo = OptionInfo {
    name: "axis",
    help: "the mesh axis of the pipeline ranks (default: pp)",
};

const INTERLEAVED_OPTIONS: &[OptionInfo] = &[
    OptionInfo {
        name: "chunks",
        help: "stages per rank (default: 2); the program must be placed in pp x chunks stages, stage s on rank s mod pp",
    },
    MICROBATCHES_AS_1F1B,
    AXIS,
];

const SCHEDULE_CHOSEN_OPTIONS: &[OptionInfo] = &[
    OptionInfo {
        name: "chunks",
        help: "when the chosen schedule is interleaved: stages per rank (default: the stages the step is placed in over the ranks, else 2)",
    },
    MICROBATCHES_AS_1F1B,
    AXIS,
];

const SCHEDULE_FROM_OPTIONS: &[OptionInfo] = &[
    OptionInfo {
        name: "file",
        help: "the schedule: one line per rank of actions <stage><F|B|W><micro-batch> (0F0 0F1 0B0 ...), '#' comments; may be written alone: --schedule-from=FILE",
    },
    AXIS,
];

/// Every pass nnscaler-opt knows, in `--help` order.
pub static PASSES: &[PassInfo] = &[
    PassInfo {
        name: "autodiff",
        summary: "Append the backward graph: explicit VJP ops, summed gradients of reused values, and a grad.<name> result for every nns.param; calls of user ops call their nns.vjp or a derived @<op>.vjp function it adds",
        options: &[OptionInfo {
            name: "func",
            help: "only this function (default: every function)",
        }],
        anchor: Anchor::Module,
        factory: Factory::Native(|o| Ok(Native::Module(Box::new(Autodiff::new(o)?)))),
    },
    PassInfo {
        name: "autocast",
        summary: "Mixed precision (run before --autodiff): matrix products (matmul, linear, attention) read bf16 casts of their f32 operands and their bf16 results are cast back to f32 (with activations=bf16: every forward op but the loss reads and writes bf16); the parameters stay f32, and the backward derived from the casts gives f32 gradients",
        options: &[
            OptionInfo {
                name: "to",
                help: "bf16 (the only type; may be written alone: --autocast=bf16)",
            },
            OptionInfo {
                name: "activations",
                help: "f32 (default: only the matrix products in bf16, as PyTorch's autocast) or bf16 (every activation in bf16, the loss and other scalars, user ops and the optimizer in f32, as Megatron-LM's --bf16)",
            },
        ],
        anchor: Anchor::Function,
        factory: Factory::Native(|o| Ok(Native::Function(Box::new(Autocast::new(o)?)))),
    },
    PassInfo {
        name: "print-stats",
        summary: "Print ops by kind, parameters, FLOPs per training step and activation bytes (to stderr)",
        options: &[
            OptionInfo {
                name: "func",
                help: "only this function (default: every function)",
            },
            OptionInfo {
                name: "cluster",
                help: "also predict the time of one run on a device of this cluster: a preset (dgx-a100, dgx-h100, h200, cpu) or a TOML file (nnscaler calibrate writes one)",
            },
        ],
        anchor: Anchor::Module,
        factory: Factory::Native(|o| Ok(Native::Module(Box::new(PrintStats::new(o)?)))),
    },
    PassInfo {
        name: "optimizer",
        summary: "Append the optimizer's update to a training step (after --autodiff): AdamW as in torch.optim.AdamW (dnn.adamw; no weight decay on rank-1 parameters: norms, biases), optional global-norm clipping (dnn.clip_scale); moments, step and lr become arguments and the next parameters and moments results",
        options: &[
            OptionInfo {
                name: "kind",
                help: "adamw (default; the only kind)",
            },
            OptionInfo {
                name: "beta1",
                help: "first moment decay (default 0.9)",
            },
            OptionInfo {
                name: "beta2",
                help: "second moment decay (default 0.999)",
            },
            OptionInfo {
                name: "eps",
                help: "added to the root of the second moment (default 1e-8)",
            },
            OptionInfo {
                name: "weight_decay",
                help: "decoupled weight decay of rank >= 2 parameters (default 0.01, torch's)",
            },
            OptionInfo {
                name: "clip",
                help: "clip the gradients' global norm to this (default 0: no clipping)",
            },
            OptionInfo {
                name: "no_decay",
                help: "comma-separated name patterns ('*' matches any run of characters) of the parameters without weight decay; the others decay (default: decay exactly the parameters of rank >= 2)",
            },
        ],
        anchor: Anchor::Function,
        factory: Factory::Native(|o| Ok(Native::Function(Box::new(Optimizer::new(o)?)))),
    },
    PassInfo {
        name: "plan",
        summary: "Write a named policy's split directives and layouts: dp (data parallel), megatron (column->row tensor parallel), dp-megatron (both), megatron-sp (with sequence parallelism), dp-megatron-sp (dp and megatron-sp), tp-search (each op's tp split searched with Z3 over the cost model); --plan=\"dp-megatron dp=2 tp=4\"",
        options: &[
            OptionInfo {
                name: "policy",
                help: "dp | megatron | dp-megatron | megatron-sp | dp-megatron-sp (may be written alone: --plan=dp) | tp-search: data parallel over dp, and every forward op's split over tp (an annotation id or none), every parameter's and data input's layout over tp, chosen by Z3 to minimise the step's predicted time on cluster= under the ops' nns.split/nns.pin/nns.forbid and the mesh's memory_cap (repeated layers solved once; the choices in a remark) | auto: the data x context x tensor parallel plan the cost model predicts fastest on cluster= for devices= (the ranking in a remark)",
            },
            OptionInfo {
                name: "dp",
                help: "size of mesh axis dp when the module has no mesh",
            },
            OptionInfo {
                name: "tp",
                help: "size of mesh axis tp when the module has no mesh",
            },
            OptionInfo {
                name: "pp",
                help: "pipeline stages: a mesh axis pp (outermost) when the module has no mesh; stage s runs on the devices at pp = s",
            },
            OptionInfo {
                name: "sp",
                help: "context parallelism: a mesh axis sp (after dp, before tp) when the module has no mesh, splitting the data inputs' positions (dim 1); attention's queries and rotary run on each device's positions, keys and values gathered over sp (tp-search plans it as it plans dp, then searches tp)",
            },
            OptionInfo {
                name: "microbatches",
                help: "cut the batch into this many micro-batches: a micro-batch axis mb (last) splitting the data inputs' dim 0 after dp",
            },
            OptionInfo {
                name: "zero",
                help: "0 (default) | 1: ZeRO-1, the optimizer state (--optimizer) split over dp, so gradients arrive by reduce_scatter and next parameters leave by all_gather | 2: ZeRO-2, the same layouts (the gradients already reach the update as reduce_scatter shards) | 3: ZeRO-3, the parameters split over dp too, gathered for the forward and again for the backward, next parameters left as shards",
            },
            OptionInfo {
                name: "cluster",
                help: "with policies tp-search and auto: the cluster the plan is for (a preset: dgx-a100, dgx-h100, h200, cpu; or a TOML file), recorded on the module as nns.cluster, on which --lower-relayouts then prices the relayouts (so that they become the collectives the search priced)",
            },
            OptionInfo {
                name: "schedule",
                help: "with pp= or microbatches=: the pipeline schedule --schedule runs (gpipe, 1f1b, interleaved, zb-h1, zb-v), recorded on the step as nns.schedule",
            },
            OptionInfo {
                name: "devices",
                help: "with policy auto: how many devices to plan for",
            },
            OptionInfo {
                name: "max_pp",
                help: "with policy auto: the largest pipeline degree to try (1: no pipelines nor micro-batches; default: no limit)",
            },
            OptionInfo {
                name: "top",
                help: "with policy auto: how many ranked plans the remark lists (default: 20)",
            },
            OptionInfo {
                name: "max_sp",
                help: "with policy auto: the largest context-parallel degree to try (default: the innermost network level's devices, and no fewer than 1024 positions per device)",
            },
        ],
        anchor: Anchor::Module,
        factory: Factory::Native(|o| {
            if o.get("policy") == Some("auto") {
                Ok(Native::Module(Box::new(
                    crate::planner::plan_search::PlanSearch::new(o, lookup)?,
                )))
            } else {
                Ok(Native::Module(Box::new(Plan::new(o)?)))
            }
        }),
    },
    PassInfo {
        name: "place",
        summary: "Assign every op a pipeline stage (nns.stage), contiguous in program order, minimising the slowest stage's FLOPs with Z3 over layers, keeping ops' nns.stage pins, nns.stage_bounds and the mesh's memory_cap (conflicts named from the unsat core); or an explicit Megatron-style layout; run before --autodiff",
        options: &[
            OptionInfo {
                name: "stages",
                help: "the number of pipeline stages (required unless layout= gives them)",
            },
            OptionInfo {
                name: "solver",
                help: "z3 (default: bisection on the slowest stage, memory caps, unsat cores) | dp (exact dynamic program, no memory caps)",
            },
            OptionInfo {
                name: "layout",
                help: "explicit stages: E (ops before the layers), t (a layer; t*N), L (ops after), items split by ',' and stages by '|', e.g. layout=E,t*2|t*2,L",
            },
            OptionInfo {
                name: "schedule",
                help: "whose in-flight micro-batches the memory cap counts, per stage as the schedule orders its actions: 1f1b (default; min(p - r, m) on rank r), gpipe (m), zb-h1 (as 1f1b), zb-v, interleaved",
            },
            OptionInfo {
                name: "microbatches",
                help: "micro-batches for the memory model (default: the mesh's micro-batch axis, else 1)",
            },
        ],
        anchor: Anchor::Function,
        factory: Factory::Native(|o| Ok(Native::Function(Box::new(Place::new(o)?)))),
    },
    PassInfo {
        name: "recompute",
        summary: "Recompute forward ops inside the backward instead of keeping their results: full (each layer's whole forward, only its inputs kept) or selective (each layer's ops other than matrix products: attention core, norms, activations); layers from nns.layer or parameter names (h.3.*, layers.3.*); run after --autodiff",
        options: &[OptionInfo {
            name: "policy",
            help: "full | selective (default: full; may be written alone: --recompute=selective)",
        }],
        anchor: Anchor::Function,
        factory: Factory::Native(|o| Ok(Native::Function(Box::new(Recompute::new(o)?)))),
    },
    PassInfo {
        name: "propagate-layouts",
        summary: "Give every value a layout: arguments' nns.layout, ops' split directives, and ops without one following their operands (writes nns.split, nns.layouts and result nns.layout)",
        options: &[],
        anchor: Anchor::Function,
        factory: Factory::Native(|o| Ok(Native::Function(Box::new(PropagateLayouts::new(o)?)))),
    },
    PassInfo {
        name: "split-tensor",
        summary: "Insert nns.relayout wherever an operand's layout differs from what its consumer's split needs (and before results whose layout differs from their nns.layout)",
        options: &[],
        anchor: Anchor::Function,
        factory: Factory::Native(|o| Ok(Native::Function(Box::new(SplitTensor::new(o)?)))),
    },
    PassInfo {
        name: "schedule",
        summary: "Pipeline the training step with the schedule its plan chose (nns.schedule, from --plan ... schedule=NAME or --plan=auto), as the --schedule-NAME pass would; a step whose plan chose none is left as it is when its mesh has no pipeline axis or micro-batches (so one pipeline serves every plan --plan=auto may choose), and is an error when it has them (nnscaler plan -o records the schedule it chose)",
        options: SCHEDULE_CHOSEN_OPTIONS,
        anchor: Anchor::Module,
        factory: Factory::Native(|o| Ok(Native::Module(Box::new(SchedulePass::chosen(o)?)))),
    },
    PassInfo {
        name: "schedule-gpipe",
        summary: "Pipeline the training step as MPMD programs, one per rank of the pp axis, calling per-stage fragments: GPipe (all forwards, then all backwards); micro-batches from the mesh's micro-batch axis; explicit nns.send/nns.recv, gradients accumulated over micro-batches; checked deadlock-free",
        options: SCHEDULE_OPTIONS,
        anchor: Anchor::Module,
        factory: Factory::Native(|o| Ok(Native::Module(Box::new(SchedulePass::named(ScheduleKind::GPipe, o)?)))),
    },
    PassInfo {
        name: "schedule-1f1b",
        summary: "Pipeline the training step as MPMD programs (see --schedule-gpipe): 1F1B (warm-up forwards, then one forward one backward; at most pp - r micro-batches in flight on rank r)",
        options: SCHEDULE_OPTIONS,
        anchor: Anchor::Module,
        factory: Factory::Native(|o| Ok(Native::Module(Box::new(SchedulePass::named(ScheduleKind::OneFOneB, o)?)))),
    },
    PassInfo {
        name: "schedule-interleaved",
        summary: "Pipeline the training step as MPMD programs (see --schedule-gpipe): interleaved 1F1B, chunks stages per rank (bubble divided by chunks)",
        options: INTERLEAVED_OPTIONS,
        anchor: Anchor::Module,
        factory: Factory::Native(|o| Ok(Native::Module(Box::new(SchedulePass::named(ScheduleKind::Interleaved, o)?)))),
    },
    PassInfo {
        name: "schedule-zb-h1",
        summary: "Pipeline the training step as MPMD programs (see --schedule-gpipe): zero-bubble ZB-H1, the backward split into B (input gradients, what earlier stages wait for) and W (weight gradients), W filling the bubble",
        options: SCHEDULE_OPTIONS,
        anchor: Anchor::Module,
        factory: Factory::Native(|o| Ok(Native::Module(Box::new(SchedulePass::named(ScheduleKind::ZbH1, o)?)))),
    },
    PassInfo {
        name: "schedule-zb-v",
        summary: "Pipeline the training step as MPMD programs (see --schedule-gpipe): zero-bubble ZB-V, 2 stages per rank in a V (rank r holds stages r and 2pp-1-r, so the first and last stage share rank 0), backward split into B and W; place 2 x pp stages",
        options: SCHEDULE_OPTIONS,
        anchor: Anchor::Module,
        factory: Factory::Native(|o| Ok(Native::Module(Box::new(SchedulePass::named(ScheduleKind::ZbV, o)?)))),
    },
    PassInfo {
        name: "schedule-from",
        summary: "Pipeline the training step as MPMD programs (see --schedule-gpipe) in the order a schedule file gives (verified: every fragment once, F before B before W, no deadlock)",
        options: SCHEDULE_FROM_OPTIONS,
        anchor: Anchor::Module,
        factory: Factory::Native(|o| Ok(Native::Module(Box::new(SchedulePass::from_file(o)?)))),
    },
    PassInfo {
        name: "lower-relayouts",
        summary: "Turn each nns.relayout into the cheapest sequence of collectives (all_reduce, reduce_scatter, all_gather, all_to_all, slice): by default the fewest bytes sent, each collective counted as 64 KiB more; with cluster= the fewest seconds the cost model predicts on that cluster (what --plan=tp-search and auto assume for the same cluster)",
        options: &[OptionInfo {
            name: "cluster",
            help: "choose each relayout's collectives by their predicted seconds on this cluster: a preset (dgx-a100, dgx-h100, h200, cpu) or a TOML file (nnscaler calibrate writes one); without it, the cluster the module records (nns.cluster, written by --plan=tp-search and auto), else by bytes",
        }],
        anchor: Anchor::Function,
        factory: Factory::Native(|o| Ok(Native::Function(Box::new(LowerRelayouts::new(o)?)))),
    },
    PassInfo {
        name: "localize",
        summary: "Make the per-device (SPMD) program: local shapes, shape attributes and mean denominators fixed; marks the function nns.localized; calls of user ops call a specialization of the callee for their layouts",
        options: &[],
        anchor: Anchor::Module,
        factory: Factory::Native(|o| Ok(Native::Module(Box::new(Localize::new(o)?)))),
    },
    PassInfo {
        name: "canonicalize",
        summary: "Upstream MLIR canonicalizer (folds and simplifies upstream ops)",
        options: &[],
        anchor: Anchor::Function,
        factory: Factory::Upstream(create_canonicalizer),
    },
    PassInfo {
        name: "cse",
        summary: "Upstream MLIR common-subexpression elimination",
        options: &[],
        anchor: Anchor::Function,
        factory: Factory::Upstream(create_cse),
    },
];

/// Looks up a pass by name.
pub fn lookup(name: &str) -> Option<&'static PassInfo> {
    PASSES.iter().find(|p| p.name == name)
}

/// A step of pass `name` with option text `opts` (`key=value ...`).
pub fn step(name: &str, opts: &str) -> Result<Step, String> {
    Step::named(lookup, name, opts)
}

/// The steps of a pass pipeline's text ([`crate::pipeline::parse_pipeline`] over this
/// table).
pub fn parse_pipeline(text: &str) -> Result<Vec<Step>, String> {
    crate::pipeline::parse_pipeline(text, lookup)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipelines_parse() {
        let s = parse_pipeline("builtin.module(print-stats{func=train}, cse)").unwrap();
        assert_eq!(s.len(), 2);
        assert_eq!(s[0].options.get("func"), Some("train"));
        assert!(parse_pipeline("nope")
            .unwrap_err()
            .contains("unknown pass 'nope'"));
        assert!(parse_pipeline("cse{x=1}")
            .unwrap_err()
            .contains("has no option 'x'"));
        let nested = parse_pipeline(
            "builtin.module(plan{dp dp=2},func.func(propagate-layouts,cse{}),localize)",
        )
        .unwrap();
        let names: Vec<&str> = nested.iter().map(|s| s.info.name).collect();
        assert_eq!(names, ["plan", "propagate-layouts", "cse", "localize"]);
        assert!(parse_pipeline("builtin.module(func.func(plan{dp dp=2}))")
            .unwrap_err()
            .contains("works on the whole module"));
        for bad in [
            "",
            "builtin.module()",
            "builtin.module(,,)",
            "cse,,cse",
            "cse,",
            "func.func()",
            "func.func(cse",
            "func.func(func.func(cse))",
        ] {
            assert!(parse_pipeline(bad).is_err(), "{bad:?} is accepted");
        }
        assert!(parse_pipeline("plan{dp dp=2 dp=4}")
            .unwrap_err()
            .contains("option 'dp' of pass 'plan' is given twice"));
        assert!(parse_pipeline("autodiff{func}")
            .unwrap_err()
            .contains("needs a value"));
        assert!(parse_pipeline("autodiff{func=}")
            .unwrap_err()
            .contains("empty value"));
    }
}
