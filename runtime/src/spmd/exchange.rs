//! Where the simulated devices of one run meet: collectives' slots (each member's deposit,
//! read where it is), point-to-point mail, the serial clock's turn, and deadlock detection
//! (every live device waiting with no progress).

use crate::tensor::Tensor;
use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Condvar, Mutex};

/// One collective in flight: each member's deposit (shared: members read it where it is)
/// with its arrival time on the serial clock, and how many have read them.
type Slot = (Vec<Option<(Arc<Tensor>, f64)>>, usize);

/// A collective's meeting place: (its axes, the group, the group's n-th collective over
/// those axes). Members of a group run the same collectives in the same order, so the
/// n-th matches however often a function (a pipeline fragment) runs.
pub(super) type SlotKey = (Vec<usize>, usize, usize);

#[derive(Default)]
struct State {
    slots: HashMap<SlotKey, Slot>,
    /// Point-to-point messages in flight: (from device, to device, tag) → the piece and
    /// when it was sent on the serial clock.
    mail: HashMap<(usize, usize, String), (Tensor, f64)>,
    /// Under serial timing, the device computing (holding the baton).
    turn: Option<usize>,
    failed: bool,
    /// Why the run stopped, when the exchange itself found out (a deadlock).
    why: Option<String>,
    /// The devices told to stop because another device failed (their errors are not
    /// theirs).
    stopped: HashSet<usize>,
    /// Devices still running, and how many of them are waiting.
    live: usize,
    waiting: usize,
    /// Counts every deposit, read, send and receive: a wait that sees no progress for a
    /// while with every live device waiting is a deadlock.
    progress: u64,
}

/// How long a device looks for what it waits on before it sleeps.
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// Where the devices of one run meet for collectives.
#[derive(Default)]
pub struct Exchange {
    state: Mutex<State>,
    cv: Condvar,
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
        let x = Exchange {
            serial,
            ..Exchange::default()
        };
        if let Ok(mut st) = x.state.lock() {
            st.live = n;
        }
        x
    }

    /// Waits on the condition variable until `ready` holds. Fails when another device
    /// failed, or when every live device has been waiting with no progress for a second
    /// (a deadlock: the program's sends and receives or collectives do not match).
    fn wait_until<'a>(
        &'a self,
        me: usize,
        mut st: std::sync::MutexGuard<'a, State>,
        what: &dyn Fn() -> String,
        ready: &dyn Fn(&State) -> bool,
    ) -> Result<std::sync::MutexGuard<'a, State>, String> {
        st.waiting += 1;
        // Spin briefly first (yielding between looks): a partner about to arrive is met
        // without the condition variable's sleep and wake-up, which costs tens of
        // microseconds and varies with the scheduler.
        let spin = std::time::Instant::now();
        while !st.failed && !ready(&st) && spin.elapsed() < SPIN {
            drop(st);
            std::thread::yield_now();
            st = self.state.lock().map_err(|_| "a device thread panicked")?;
        }
        let mut seen = st.progress;
        let mut still = 0u32;
        let out = loop {
            if st.failed {
                break Err(match &st.why {
                    Some(why) => why.clone(),
                    None => {
                        st.stopped.insert(me);
                        "another device failed".into()
                    }
                });
            }
            if ready(&st) {
                break Ok(());
            }
            let (next, _) = self
                .cv
                .wait_timeout(st, std::time::Duration::from_millis(50))
                .map_err(|_| "a device thread panicked")?;
            st = next;
            if st.progress != seen {
                seen = st.progress;
                still = 0;
            } else if st.waiting == st.live {
                still += 1;
                if still >= 20 {
                    let why = format!(
                        "deadlock: every device is waiting (this one for {})",
                        what()
                    );
                    st.failed = true;
                    st.why = Some(why.clone());
                    self.cv.notify_all();
                    break Err(why);
                }
            }
        };
        st.waiting -= 1;
        out.map(|()| st)
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
        let mut st = self.state.lock().map_err(|_| "a device thread panicked")?;
        {
            let slot = st
                .slots
                .entry(key.clone())
                .or_insert_with(|| (vec![None; size], 0));
            slot.0[member] = Some((t, at));
            st.progress += 1;
        }
        self.pass_turn(&mut st, me);
        self.cv.notify_all();
        let k2 = key.clone();
        let serial = self.serial;
        let mut st = self.wait_until(me, st, &|| "a collective".to_string(), &|st: &State| {
            st.slots
                .get(&k2)
                .is_some_and(|s| s.0.iter().all(Option::is_some))
                && (!serial || st.turn.is_none())
        })?;
        self.take_turn(&mut st, me);
        st.progress += 1;
        let slot = st
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
            st.slots.remove(&key);
        }
        Ok((parts, latest))
    }

    /// Under serial timing: device `me` stops computing and lets another take its turn.
    fn pass_turn(&self, st: &mut State, me: usize) {
        if self.serial && st.turn == Some(me) {
            st.turn = None;
            st.progress += 1;
        }
    }

    /// Under serial timing: device `me` takes the turn (the caller waited until it was
    /// free).
    fn take_turn(&self, st: &mut State, me: usize) {
        if self.serial {
            st.turn = Some(me);
        }
    }

    /// Under serial timing: waits until no device computes, then device `me` does.
    pub(super) fn start_turn(&self, me: usize) -> Result<(), String> {
        if !self.serial {
            return Ok(());
        }
        let st = self.state.lock().map_err(|_| "a device thread panicked")?;
        let mut st = self.wait_until(me, st, &|| "its turn".to_string(), &|st: &State| {
            st.turn.is_none()
        })?;
        self.take_turn(&mut st, me);
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
        let mut st = self.state.lock().map_err(|_| "a device thread panicked")?;
        if st
            .mail
            .insert((from, to, tag.to_string()), (t, at))
            .is_some()
        {
            return Err(format!("'{tag}' is sent twice to device {to}"));
        }
        st.progress += 1;
        self.cv.notify_all();
        Ok(())
    }

    /// Waits for the message `tag` from device `from` to device `to` and takes it, with
    /// when it was sent on the serial clock. Device `to` gives up its turn while it waits
    /// (serial timing).
    pub(super) fn recv(&self, from: usize, to: usize, tag: &str) -> Result<(Tensor, f64), String> {
        let mut st = self.state.lock().map_err(|_| "a device thread panicked")?;
        self.pass_turn(&mut st, to);
        self.cv.notify_all();
        let key = (from, to, tag.to_string());
        let serial = self.serial;
        let mut st = self.wait_until(
            to,
            st,
            &|| format!("'{tag}' from device {from}"),
            &|st: &State| st.mail.contains_key(&key) && (!serial || st.turn.is_none()),
        )?;
        self.take_turn(&mut st, to);
        st.progress += 1;
        Ok(st.mail.remove(&key).expect("the message is there"))
    }

    /// Device `me` is done (its program ended or failed); it gives up its turn.
    pub(super) fn finished(&self, me: usize) {
        if let Ok(mut st) = self.state.lock() {
            st.live = st.live.saturating_sub(1);
            st.progress += 1;
            self.pass_turn(&mut st, me);
        }
        self.cv.notify_all();
    }

    /// Whether device `d` failed only because another device did (it was told to stop).
    pub(super) fn stopped(&self, d: usize) -> bool {
        self.state.lock().is_ok_and(|st| st.stopped.contains(&d))
    }

    pub(super) fn fail(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.failed = true;
        }
        self.cv.notify_all();
    }
}
