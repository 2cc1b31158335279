//! Where the simulated devices of one run meet: collectives' slots (each member's deposit,
//! read where it is), point-to-point mail and the serial clock's turn, on a
//! [`Board`] (rt's, which rt's ranks meet on too): it holds each device's wait and
//! finds deadlocks (no device running, and no wait that can end), naming every wait.

use crate::tensor::Tensor;
use nnscaler_rt::board::{Board, Guard, Mailbox};
use std::collections::HashMap;
use std::sync::Arc;

/// One collective in flight: each member's deposit (shared: members read it where it is)
/// with its arrival time on the serial clock, and how many have read them.
type Slot = (Vec<Option<(Arc<Tensor>, f64)>>, usize);

/// A collective's meeting place: (its axes, the group, the group's n-th collective over
/// those axes). Members of a group run the same collectives in the same order, so the
/// n-th matches however often a function (a pipeline fragment) runs.
pub(super) type SlotKey = (Vec<usize>, usize, usize);

/// What the devices wait on.
#[derive(Default)]
struct State {
    slots: HashMap<SlotKey, Slot>,
    /// Point-to-point messages in flight: (from device, to device, tag) → the piece and
    /// when it was sent on the serial clock.
    mail: Mailbox<(usize, usize, String), (Tensor, f64)>,
    /// Under serial timing, the device computing (holding the baton).
    turn: Option<usize>,
}

/// Where the devices of one run meet for collectives.
pub struct Exchange {
    board: Board<State>,
    /// The devices take turns (serial timing).
    pub(super) serial: bool,
}

impl std::fmt::Debug for Exchange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Exchange")
    }
}

impl Exchange {
    pub(super) fn with_devices(n: usize, serial: bool) -> Self {
        Exchange {
            board: Board::new(n, State::default()),
            serial,
        }
    }

    /// Deposits `t` as member `member` of a `size`-member group at `key`, arriving at
    /// `at` on the serial clock, waits for the others, and returns every member's tensor
    /// in member order (shared, not copied) and the latest arrival. Device `me` gives up
    /// its turn while it waits (serial timing).
    pub(super) fn all(
        &self,
        key: SlotKey,
        (member, size, me): (usize, usize, usize),
        t: Arc<Tensor>,
        at: f64,
    ) -> Result<(Vec<Arc<Tensor>>, f64), String> {
        let mut g = self.board.lock();
        g.state
            .slots
            .entry(key.clone())
            .or_insert_with(|| (vec![None; size], 0))
            .0[member] = Some((t, at));
        self.pass_turn(&mut g, me);
        self.board.notify();
        let k2 = key.clone();
        let serial = self.serial;
        let what = || {
            format!(
                "collective {} over mesh axes {:?} (member {member} of {size})",
                key.2 - 1,
                key.0
            )
        };
        let mut g = self.board.wait(g, me, what, move |st: &State| {
            st.slots
                .get(&k2)
                .is_some_and(|s| s.0.iter().all(Option::is_some))
                && (!serial || st.turn.is_none())
        })?;
        self.take_turn(&mut g, me);
        let slot = g
            .state
            .slots
            .get_mut(&key)
            .expect("slot exists while members read it");
        let mut latest = f64::NEG_INFINITY;
        let parts: Vec<Arc<Tensor>> = slot
            .0
            .iter()
            .map(|p| {
                let (t, at) = p.as_ref().expect("full");
                latest = latest.max(*at);
                Arc::clone(t)
            })
            .collect();
        slot.1 += 1;
        if slot.1 == size {
            g.state.slots.remove(&key);
        }
        Ok((parts, latest))
    }

    /// Under serial timing: device `me` stops computing and lets another take its turn.
    fn pass_turn(&self, g: &mut Guard<'_, State>, me: usize) {
        if self.serial && g.state.turn == Some(me) {
            g.state.turn = None;
        }
    }

    /// Under serial timing: device `me` takes the turn (the caller waited until it was
    /// free).
    fn take_turn(&self, g: &mut Guard<'_, State>, me: usize) {
        if self.serial {
            g.state.turn = Some(me);
        }
    }

    /// Under serial timing: waits until no device computes, then device `me` does.
    pub(super) fn start_turn(&self, me: usize) -> Result<(), String> {
        if !self.serial {
            return Ok(());
        }
        let g = self.board.lock();
        let mut g = self.board.wait(
            g,
            me,
            || "its turn".to_string(),
            |st: &State| st.turn.is_none(),
        )?;
        self.take_turn(&mut g, me);
        Ok(())
    }

    /// Leaves `t` for device `to` under `tag`, sent at `at` on the serial clock (does not
    /// wait).
    pub(super) fn send(
        &self,
        from: usize,
        to: usize,
        tag: &str,
        t: Tensor,
        at: f64,
    ) -> Result<(), String> {
        let mut g = self.board.lock();
        let key = (from, to, tag.to_string());
        if g.state.mail.has(&key) {
            return Err(format!("'{tag}' is sent twice to device {to}"));
        }
        g.state.mail.post(key, (t, at));
        self.board.notify();
        Ok(())
    }

    /// Waits for the message `tag` from device `from` to device `to` and takes it, with
    /// when it was sent on the serial clock. Device `to` gives up its turn while it waits
    /// (serial timing).
    pub(super) fn recv(&self, from: usize, to: usize, tag: &str) -> Result<(Tensor, f64), String> {
        let mut g = self.board.lock();
        self.pass_turn(&mut g, to);
        self.board.notify();
        let key = (from, to, tag.to_string());
        let k2 = key.clone();
        let serial = self.serial;
        let mut g = self.board.wait(
            g,
            to,
            || format!("'{tag}' from device {from}"),
            move |st: &State| st.mail.has(&k2) && (!serial || st.turn.is_none()),
        )?;
        self.take_turn(&mut g, to);
        Ok(g.state.mail.take(&key).expect("the message is there"))
    }

    /// Device `me` is done (its program ended or failed); it gives up its turn.
    pub(super) fn finished(&self, me: usize) {
        {
            let mut g = self.board.lock();
            self.pass_turn(&mut g, me);
        }
        self.board.finish(me);
    }

    /// A message sent and never received, if one was (after every device ended).
    pub(super) fn unreceived(&self) -> Option<String> {
        let g = self.board.lock();
        g.state.mail.left().map(|((from, to, tag), _)| {
            format!("device {from} sent '{tag}' to device {to}, which never received it")
        })
    }

    /// Whether device `d` failed only because another device did (it was told to stop).
    pub(super) fn stopped(&self, d: usize) -> bool {
        self.board.stopped(d)
    }

    /// A device failed on its own: every other device stops where it waits.
    pub(super) fn fail(&self) {
        self.board.fail("another device failed".into());
    }
}
