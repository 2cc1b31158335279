//! The per-op split problem that `--plan=tp-search` hands to Z3 ([`crate::planner::split_search`]
//! builds it from a training step and writes its solution back): classes of ops and
//! arguments that take one choice each, cost terms, combinations that cannot be compiled,
//! memory and a cap, the user's constraints.
//!
//! **Solving.** One Boolean per (class, choice), exactly one per class; a cost term that
//! depends on two classes (a transition between a producer's choice and the layouts its
//! consumers' choices need) gets an auxiliary Boolean implied by them. User constraints —
//! an op's `nns.split` or `nns.pin` binding the axis, `R(axis)`, an `nns.forbid` over it —
//! and the memory cap are assumptions on a `Solver` first: when they cannot hold together,
//! the unsat core, made minimal by dropping each constraint the others conflict without,
//! names them (and with the cap among them, `Optimize` finds the leanest the others
//! allow). Then `Optimize` minimises the weighted sum (weights in nanoseconds) as soft
//! constraints (MaxSAT), and among the selections that reach it the memory (a second
//! objective, lexicographically after the first). [`Problem::evaluate`] computes the same objective for any
//! selection; [`Problem::brute_force`] enumerates them (the tests compare the two).

use crate::transforms::propagate_layouts::Decided;
use nnscaler_dialects::diag::SrcLoc;
use nnscaler_dialects::sharding::{Binds, Sharding};
use std::collections::BTreeMap;
use z3::ast::{Bool, Int};
use z3::{Optimize, SatResult, Solver};

/// One thing a class may do over `tp`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Choice {
    /// `R`, the split identifier (`n`), `vocab`, or for an argument `D(d)`.
    pub label: String,
    /// The op's directive over every axis (ops only).
    pub binds: Binds,
    /// Whether the directive names `R(tp)`.
    pub closed: bool,
    /// Per operand, the layout the op reads it in (`None`: not a tensor operand).
    pub inputs: Vec<Option<Sharding>>,
    /// Per result, its layout (an argument: its own layout).
    pub outputs: Vec<Sharding>,
    /// Per operand, the layout its gradient leaves the op's backward in.
    pub grads: Vec<Option<Sharding>>,
    /// Per operand, whether the op's backward reads it again.
    pub reread: Vec<bool>,
    /// Seconds per occurrence: forward and backward on one device (collectives inside
    /// included); a parameter's optimizer update.
    pub seconds: f64,
    /// Bytes per occurrence that a device keeps: activations saved for the backward, or a
    /// parameter with its gradient and optimizer state.
    pub memory: u64,
    /// The op's backward (its VJP rule's ops, in order) as compiled alone under this
    /// choice: each op's binds and the axes it is replicated over, written as directives
    /// on the step's backward ops so that they follow it.
    pub backward: Vec<(String, Option<Decided>)>,
}

/// What a class stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Member {
    /// A forward op (node index).
    Op(usize),
    /// A function argument (index).
    Arg(usize),
}

/// A set of ops or arguments that take the same choice (one, or the same position in
/// every layer of a signature).
#[derive(Clone, Debug)]
pub struct Class {
    /// Its ops or arguments, in program order.
    pub members: Vec<Member>,
    /// What it may do (index 0 splits nothing over `tp`).
    pub choices: Vec<Choice>,
    /// A user constraint: the choices it allows and what it is (for messages).
    pub constraint: Option<(Vec<bool>, String, SrcLoc)>,
    /// For messages: the op (name and location) or argument.
    pub name: String,
    /// Its first member's location.
    pub loc: SrcLoc,
}

/// A (class, choice) pair: one Boolean of the problem.
pub type Pick = (usize, usize);

/// (class, choice, when): a combination that cannot be compiled (no transition between
/// the layouts), when the class takes the choice and (unless `when` is empty) one of the
/// picks in `when` holds.
pub type Impossible = (usize, usize, Vec<Pick>);

/// A cost term: `seconds` when class `class` takes choice `choice` and (unless `when` is
/// empty) at least one of the (class, choice) pairs in `when` holds.
#[derive(Clone, Debug, PartialEq)]
pub struct Term {
    /// The class.
    pub class: usize,
    /// Its choice.
    pub choice: usize,
    /// The condition.
    pub when: Vec<Pick>,
    /// Seconds.
    pub seconds: f64,
}

/// The search problem: classes, cost terms, combinations that cannot be compiled, memory.
#[derive(Clone, Debug, Default)]
pub struct Problem {
    /// The classes.
    pub classes: Vec<Class>,
    /// Cost terms that depend on more than one class (unary costs are the choices').
    pub terms: Vec<Term>,
    /// (class, choice, when): combinations with no transition between their layouts.
    pub impossible: Vec<Impossible>,
    /// Bytes each device may use, and where the cap comes from.
    pub cap: Option<(u64, String)>,
    /// Where the cap is written (the mesh).
    pub cap_loc: SrcLoc,
}

/// Why the search found nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Infeasible {
    /// These constraints (what, where) cannot hold together; when the memory cap is one of
    /// them, the fewest bytes per device the others allow.
    Conflict(Vec<(String, SrcLoc)>, Option<u64>),
    /// Z3 gave up (its reason).
    Unknown(String),
}

/// The solution: a choice per class and its predicted seconds.
#[derive(Clone, Debug, PartialEq)]
pub struct Solution {
    /// The choice of each class.
    pub choice: Vec<usize>,
    /// The objective ([`Problem::evaluate`]).
    pub seconds: f64,
    /// Bytes per device the solution keeps.
    pub memory: u64,
}

impl Problem {
    /// The objective for a selection (one choice per class).
    pub fn evaluate(&self, sel: &[usize]) -> f64 {
        let mut t: f64 = self
            .classes
            .iter()
            .zip(sel)
            .map(|(c, &k)| c.choices[k].seconds * c.members.len() as f64)
            .sum();
        for term in &self.terms {
            if sel[term.class] == term.choice
                && (term.when.is_empty() || term.when.iter().any(|&(c, k)| sel[c] == k))
            {
                t += term.seconds;
            }
        }
        t
    }

    /// Each class's choice in a selection, by label.
    pub fn labels(&self, sel: &[usize]) -> Vec<String> {
        self.classes
            .iter()
            .zip(sel)
            .map(|(c, &k)| c.choices[k].label.clone())
            .collect()
    }

    /// Bytes per device of a selection.
    pub fn memory(&self, sel: &[usize]) -> u64 {
        self.classes
            .iter()
            .zip(sel)
            .map(|(c, &k)| c.choices[k].memory * c.members.len() as u64)
            .sum()
    }

    /// Whether a selection may be compiled and respects the constraints and the cap.
    pub fn allows(&self, sel: &[usize]) -> bool {
        let ok_constraints = self.classes.iter().zip(sel).all(|(c, &k)| {
            c.constraint
                .as_ref()
                .is_none_or(|(allowed, _, _)| allowed[k])
        });
        let possible = self.impossible.iter().all(|(c, k, when)| {
            !(sel[*c] == *k && (when.is_empty() || when.iter().any(|&(x, y)| sel[x] == y)))
        });
        let fits = self
            .cap
            .as_ref()
            .is_none_or(|(cap, _)| self.memory(sel) <= *cap);
        ok_constraints && possible && fits
    }

    /// The best selection by enumerating every one (small problems; tests).
    pub fn brute_force(&self) -> Option<Solution> {
        let n = self.classes.len();
        let mut sel = vec![0usize; n];
        let mut best: Option<Solution> = None;
        loop {
            if self.allows(&sel) {
                let s = self.evaluate(&sel);
                if best.as_ref().is_none_or(|b| s < b.seconds - 1e-15) {
                    best = Some(Solution {
                        choice: sel.clone(),
                        seconds: s,
                        memory: self.memory(&sel),
                    });
                }
            }
            // The next selection (odometer).
            let mut i = 0;
            loop {
                if i == n {
                    return best;
                }
                sel[i] += 1;
                if sel[i] < self.classes[i].choices.len() {
                    break;
                }
                sel[i] = 0;
                i += 1;
            }
        }
    }

    /// How many selections there are (saturating).
    pub fn size(&self) -> u128 {
        self.classes
            .iter()
            .fold(1u128, |a, c| a.saturating_mul(c.choices.len() as u128))
    }

    /// The best selection, by Z3 (see the module docs).
    pub fn solve(&self) -> Result<Solution, Infeasible> {
        let x: Vec<Vec<Bool>> = self
            .classes
            .iter()
            .enumerate()
            .map(|(c, class)| {
                (0..class.choices.len())
                    .map(|k| Bool::new_const(format!("x{c}_{k}")))
                    .collect()
            })
            .collect();
        let one_each: Vec<Bool> = x
            .iter()
            .map(|xs| {
                let terms: Vec<(&Bool, i32)> = xs.iter().map(|b| (b, 1)).collect();
                Bool::pb_eq(&terms, 1)
            })
            .collect();
        let any = |when: &[(usize, usize)]| any_of(&x, when);
        let impossible: Vec<Bool> = self
            .impossible
            .iter()
            .map(|(c, k, when)| {
                if when.is_empty() {
                    x[*c][*k].not()
                } else {
                    Bool::and(&[&x[*c][*k], &any(when)]).not()
                }
            })
            .collect();
        // Tracked: user constraints and the memory cap.
        let mut tracked: Vec<(Bool, (String, SrcLoc))> = Vec::new();
        for (c, class) in self.classes.iter().enumerate() {
            if let Some((allowed, what, loc)) = &class.constraint {
                let ok: Vec<&Bool> = x[c]
                    .iter()
                    .zip(allowed)
                    .filter(|(_, &a)| a)
                    .map(|(b, _)| b)
                    .collect();
                tracked.push((Bool::or(&ok), (what.clone(), loc.clone())));
            }
        }
        let mut terms: Vec<Int> = Vec::new();
        for (c, class) in self.classes.iter().enumerate() {
            for (k, ch) in class.choices.iter().enumerate() {
                let bytes = ch.memory.saturating_mul(class.members.len() as u64);
                if bytes > 0 {
                    terms.push(x[c][k].ite(&Int::from_u64(bytes), &Int::from_u64(0)));
                }
            }
        }
        let memory_sum = if terms.is_empty() {
            Int::from_u64(0)
        } else {
            Int::add(&terms)
        };
        // The cap is tracked last.
        if let Some((cap, what)) = &self.cap {
            tracked.push((
                memory_sum.le(Int::from_u64(*cap)),
                (what.clone(), self.cap_loc.clone()),
            ));
        }
        // Feasibility first, with the constraints tracked.
        let hard: Vec<&Bool> = one_each.iter().chain(&impossible).collect();
        let solver = Solver::new();
        for b in &hard {
            solver.assert(*b);
        }
        let lits: Vec<Bool> = (0..tracked.len())
            .map(|i| Bool::new_const(format!("constraint{i}")))
            .collect();
        for ((c, _), lit) in tracked.iter().zip(&lits) {
            solver.assert(lit.implies(c));
        }
        match solver.check_assumptions(&lits) {
            SatResult::Sat => {}
            SatResult::Unsat => {
                return Err(self.conflict(&solver, &lits, &tracked, &hard, &memory_sum));
            }
            SatResult::Unknown => {
                return Err(Infeasible::Unknown(
                    solver.get_reason_unknown().unwrap_or_default(),
                ))
            }
        }
        // Then the optimum.
        let opt = Optimize::new();
        for b in one_each.iter().chain(&impossible) {
            opt.assert(b);
        }
        for (c, _) in &tracked {
            opt.assert(c);
        }
        self.objective(&opt, &x);
        match opt.check(&[]) {
            SatResult::Sat => {}
            SatResult::Unsat => return Err(Infeasible::Conflict(Vec::new(), None)),
            SatResult::Unknown => {
                return Err(Infeasible::Unknown(
                    opt.get_reason_unknown().unwrap_or_default(),
                ))
            }
        }
        let model = opt
            .get_model()
            .ok_or(Infeasible::Unknown("no model".into()))?;
        let choice: Vec<usize> = x
            .iter()
            .map(|xs| {
                xs.iter()
                    .position(|b| {
                        model
                            .eval(b, true)
                            .and_then(|v| v.as_bool())
                            .unwrap_or(false)
                    })
                    .unwrap_or(0)
            })
            .collect();
        Ok(Solution {
            seconds: self.evaluate(&choice),
            memory: self.memory(&choice),
            choice,
        })
    }

    /// Why the tracked constraints (`lits` standing for `tracked`, each implying its
    /// constraint) cannot hold together on `solver`: the core Z3 found made minimal, and
    /// with the cap in it, the leanest memory the other constraints allow.
    fn conflict(
        &self,
        solver: &Solver,
        lits: &[Bool],
        tracked: &[(Bool, (String, SrcLoc))],
        hard: &[&Bool],
        memory_sum: &Int,
    ) -> Infeasible {
        let core = solver.get_unsat_core();
        let mut in_core: Vec<bool> = lits.iter().map(|l| core.contains(l)).collect();
        // Z3's core need not be minimal: drop each constraint that the others
        // conflict without.
        for i in 0..lits.len() {
            if !in_core[i] {
                continue;
            }
            in_core[i] = false;
            let rest: Vec<Bool> = lits
                .iter()
                .zip(&in_core)
                .filter(|(_, &c)| c)
                .map(|(l, _)| l.clone())
                .collect();
            if solver.check_assumptions(&rest) != SatResult::Unsat {
                in_core[i] = true;
            }
        }
        let named = tracked
            .iter()
            .zip(&in_core)
            .filter(|(_, &c)| c)
            .map(|((_, w), _)| w.clone())
            .collect();
        // With the cap in the core: the leanest the other constraints allow.
        let capped = self.cap.is_some() && in_core.last() == Some(&true);
        let least = capped.then(|| {
            let opt = Optimize::new();
            for b in hard {
                opt.assert(*b);
            }
            for (c, _) in &tracked[..tracked.len() - 1] {
                opt.assert(c);
            }
            opt.minimize(memory_sum);
            match opt.check(&[]) {
                SatResult::Sat => opt
                    .get_model()
                    .and_then(|m| m.eval(memory_sum, true))
                    .and_then(|v| v.as_u64()),
                _ => None,
            }
        });
        Infeasible::Conflict(named, least.flatten())
    }

    /// The objective on `opt` as soft constraints over the choices `x`: the predicted seconds (nanoseconds as weights), then,
    /// among equally fast selections, the leanest.
    fn objective(&self, opt: &Optimize, x: &[Vec<Bool>]) {
        let ns = |s: f64| (s * 1e9).round().max(0.0) as u64;
        // The objective as weighted literals (each costs its weight when true).
        let mut costs: Vec<(Bool, u64)> = Vec::new();
        // Unary costs relative to the class's cheapest choice (smaller weights).
        for (c, class) in self.classes.iter().enumerate() {
            let each: Vec<f64> = class
                .choices
                .iter()
                .map(|ch| ch.seconds * class.members.len() as f64)
                .collect();
            let least = each.iter().copied().fold(f64::INFINITY, f64::min);
            for (k, s) in each.iter().enumerate() {
                let w = ns(s - least);
                if w > 0 {
                    costs.push((x[c][k].clone(), w));
                }
            }
        }
        // Terms sharing (class, choice, condition) are summed.
        let mut grouped: BTreeMap<(usize, usize, Vec<Pick>), f64> = BTreeMap::new();
        for t in &self.terms {
            let mut when = t.when.clone();
            when.sort_unstable();
            when.dedup();
            *grouped.entry((t.class, t.choice, when)).or_default() += t.seconds;
        }
        for (i, ((c, k, when), s)) in grouped.iter().enumerate() {
            let w = ns(*s);
            if w == 0 {
                continue;
            }
            if when.is_empty() {
                costs.push((x[*c][*k].clone(), w));
                continue;
            }
            let y = Bool::new_const(format!("y{i}"));
            opt.assert(&Bool::and(&[&x[*c][*k], &any_of(x, when)]).implies(&y));
            costs.push((y, w));
        }
        for (b, w) in &costs {
            opt.assert_soft(&b.not(), *w, None);
        }
        // Among equally fast selections the leanest (a second objective, after the first
        // in Z3's lexicographic order): without it the one Z3 happens on first, which
        // differed from run to run when other solves ran on other threads.
        let lean = z3::Symbol::String("memory".into());
        for (c, class) in self.classes.iter().enumerate() {
            let bytes: Vec<u64> = class
                .choices
                .iter()
                .map(|ch| ch.memory.saturating_mul(class.members.len() as u64))
                .collect();
            let least = bytes.iter().copied().min().unwrap_or(0);
            for (k, &b) in bytes.iter().enumerate() {
                if b > least {
                    opt.assert_soft(&x[c][k].not(), b - least, Some(lean.clone()));
                }
            }
        }
    }
}

/// Whether any of the choices `when` ((class, choice) pairs) is taken.
fn any_of(x: &[Vec<Bool>], when: &[(usize, usize)]) -> Bool {
    let v: Vec<&Bool> = when.iter().map(|&(c, k)| &x[c][k]).collect();
    Bool::or(&v)
}
