//! Where the threads of one in-process run wait for each other: the one core of both
//! in-process communicators, rt's ranks ([`crate::ranks`]: a thread per device of an
//! artifact) and the CPU runtime's simulated devices (`nnscaler_runtime::spmd`).
//!
//! A [`Board`] holds the communicator's own state `S` (its collectives in flight, its
//! mail) behind one lock, with each device's status: running, done, or waiting for
//! something, named, with the condition that ends the wait. That makes deadlock
//! detection exact and immediate: when a device starts to wait or ends, and no device
//! runs and no waiting device's condition holds, none ever will (only running devices
//! change the state); the run fails with every wait named. A failure (a deadlock, or a
//! device's own error, [`Board::fail`]) ends every wait; a device whose wait ended so is
//! [`Board::stopped`]: its error is not its own.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;
use std::sync::{Condvar, Mutex, MutexGuard};

/// How long a device looks for what it waits on before it sleeps: a partner about to
/// arrive is met without the condition variable's sleep and wake-up, which costs tens
/// of microseconds and varies with the scheduler.
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// What ends a wait: a condition on the communicator's state.
type Ready<S> = Box<dyn Fn(&S) -> bool + Send>;

/// What a device is doing.
enum Status<S> {
    Running,
    /// Blocked: what it waits for, and the condition that ends the wait.
    Waiting(String, Ready<S>),
    Done,
}

/// The state behind a board's lock: the communicator's own (`state`) and the devices'.
pub struct Core<S> {
    /// The communicator's state (what the waits' conditions look at).
    pub state: S,
    status: Vec<Status<S>>,
    /// Devices whose wait was ended by a failure that was not theirs.
    stopped: Vec<bool>,
    failed: Option<String>,
}

impl<S> std::fmt::Debug for Core<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl<S> Core<S> {
    /// Why the run failed, if it did.
    pub fn failed(&self) -> Option<&String> {
        self.failed.as_ref()
    }

    /// Fails the run with `why`, unless it failed already (the first failure is kept).
    pub fn fail(&mut self, why: String) {
        self.failed.get_or_insert(why);
    }

    /// When no device runs and no waiting device's condition holds, the run fails,
    /// naming what each waits for.
    fn check_deadlock(&mut self) {
        if self.failed.is_some() || self.status.iter().any(|s| matches!(s, Status::Running)) {
            return;
        }
        let mut waits = Vec::new();
        for (d, s) in self.status.iter().enumerate() {
            if let Status::Waiting(what, ready) = s {
                if ready(&self.state) {
                    return;
                }
                waits.push(format!("device {d} waits for {what}"));
            }
        }
        if !waits.is_empty() {
            self.failed = Some(format!("deadlock: {}", waits.join("; ")));
        }
    }
}

/// Messages in flight between the devices of a run, by key (sender, receiver and what
/// matches a receive to its send: a lane for rt's ranks, a tag for the simulated
/// devices), each key's in the order sent. It lives in a board's state; a receive waits
/// on the board until [`Mailbox::has`] its key.
#[derive(Debug)]
pub struct Mailbox<K, M> {
    queues: HashMap<K, VecDeque<M>>,
}

impl<K, M> Default for Mailbox<K, M> {
    fn default() -> Self {
        Mailbox {
            queues: HashMap::new(),
        }
    }
}

impl<K: Eq + Hash + Ord, M> Mailbox<K, M> {
    /// Posts `m` under `k`, after what was posted there before.
    pub fn post(&mut self, k: K, m: M) {
        self.queues.entry(k).or_default().push_back(m);
    }

    /// Whether a message waits under `k`.
    pub fn has(&self, k: &K) -> bool {
        self.queues.get(k).is_some_and(|q| !q.is_empty())
    }

    /// Takes the first message under `k`.
    pub fn take(&mut self, k: &K) -> Option<M> {
        self.queues.get_mut(k).and_then(VecDeque::pop_front)
    }

    /// The first message left unreceived, of the least key (after every device ended, a
    /// send without its receive).
    pub fn left(&self) -> Option<(&K, &M)> {
        self.queues
            .iter()
            .filter_map(|(k, q)| q.front().map(|m| (k, m)))
            .min_by(|a, b| a.0.cmp(b.0))
    }
}

/// Where the devices of one run meet (see the module's docs).
pub struct Board<S> {
    core: Mutex<Core<S>>,
    cv: Condvar,
}

impl<S> std::fmt::Debug for Board<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Board")
    }
}

/// A board's state, locked.
pub type Guard<'a, S> = MutexGuard<'a, Core<S>>;

impl<S> Board<S> {
    /// A board of `devices` devices, every one running, over the communicator's `state`.
    pub fn new(devices: usize, state: S) -> Board<S> {
        Board {
            core: Mutex::new(Core {
                state,
                status: (0..devices).map(|_| Status::Running).collect(),
                stopped: vec![false; devices],
                failed: None,
            }),
            cv: Condvar::new(),
        }
    }

    /// The state, locked (a thread that panicked holding it does not poison it: every
    /// change is complete when the lock is released).
    pub fn lock(&self) -> Guard<'_, S> {
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every waiting device to look at the state again (after a change to it).
    pub fn notify(&self) {
        self.cv.notify_all();
    }

    /// Device `device` waits until `ready` holds of the state, or the run fails; `what`
    /// names what it waits for (asked only when it must wait). Returns the state, locked,
    /// with `ready` holding; an error is the run's failure (the device is then
    /// [`Board::stopped`]).
    pub fn wait<'a>(
        &'a self,
        mut g: Guard<'a, S>,
        device: usize,
        what: impl FnOnce() -> String,
        ready: impl Fn(&S) -> bool + Send + 'static,
    ) -> Result<Guard<'a, S>, String> {
        if !ready(&g.state) {
            if let Some(e) = &g.failed {
                let e = e.clone();
                g.stopped[device] = true;
                return Err(e);
            }
            g.status[device] = Status::Waiting(what(), Box::new(ready));
            g.check_deadlock();
            self.cv.notify_all();
            let held = |g: &Core<S>| match &g.status[device] {
                Status::Waiting(_, ready) => ready(&g.state),
                _ => true,
            };
            let spin = std::time::Instant::now();
            while g.failed.is_none() && !held(&g) && spin.elapsed() < SPIN {
                drop(g);
                std::thread::yield_now();
                g = self.lock();
            }
            while g.failed.is_none() && !held(&g) {
                g = self.cv.wait(g).unwrap_or_else(|e| e.into_inner());
            }
            let ok = held(&g);
            g.status[device] = Status::Running;
            if !ok {
                g.stopped[device] = true;
                return Err(g.failed.clone().unwrap_or_default());
            }
        }
        Ok(g)
    }

    /// Marks `device` finished (its steps ended, or it failed: then [`Board::fail`] first).
    pub fn finish(&self, device: usize) {
        let mut g = self.lock();
        g.status[device] = Status::Done;
        g.check_deadlock();
        self.cv.notify_all();
    }

    /// Fails the run with `why` (unless it failed already), ending every wait.
    pub fn fail(&self, why: String) {
        self.lock().fail(why);
        self.cv.notify_all();
    }

    /// Why the run failed, if it did (the first failure; a deadlock names every wait).
    pub fn failure(&self) -> Option<String> {
        self.lock().failed.clone()
    }

    /// Whether device `device`'s wait was ended by a failure (its error is not its own).
    pub fn stopped(&self, device: usize) -> bool {
        self.lock().stopped[device]
    }

    /// Every device running again, none stopped (a new run of the steps, every device
    /// having finished the last one and none waiting).
    pub fn restart(&self) {
        let mut g = self.lock();
        for s in &mut g.status {
            *s = Status::Running;
        }
        g.stopped.fill(false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two devices each waiting for the other's message: a deadlock, named at once,
    /// with both waits; each device's error is then the run's failure.
    #[test]
    fn a_deadlock_names_every_wait() {
        let b = Board::new(2, [false; 2]);
        let errs: Vec<String> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2)
                .map(|d| {
                    let b = &b;
                    s.spawn(move || {
                        let g = b.lock();
                        let r = b
                            .wait(
                                g,
                                d,
                                || format!("a message from device {}", 1 - d),
                                move |m| m[d],
                            )
                            .map(|_| ());
                        b.finish(d);
                        r.unwrap_err()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let want = "deadlock: device 0 waits for a message from device 1; \
                    device 1 waits for a message from device 0";
        assert_eq!(errs, vec![want.to_string(), want.to_string()]);
        assert!(b.stopped(0) && b.stopped(1));
    }

    /// A device that waits for what another then provides is not deadlocked, whichever
    /// comes first; a device waiting while another ends without providing it is.
    #[test]
    fn waits_end_when_the_state_changes() {
        for _ in 0..50 {
            let b = Board::new(2, 0u32);
            std::thread::scope(|s| {
                s.spawn(|| {
                    let g = b.lock();
                    let g = b.wait(g, 0, || "a count of 1".into(), |n| *n >= 1).unwrap();
                    drop(g);
                    b.finish(0);
                });
                s.spawn(|| {
                    b.lock().state += 1;
                    b.notify();
                    b.finish(1);
                });
            });
            assert_eq!(b.failure(), None);
        }
        let b = Board::new(2, 0u32);
        b.finish(1);
        let err = b
            .wait(b.lock(), 0, || "a count of 1".into(), |n| *n >= 1)
            .unwrap_err();
        assert_eq!(err, "deadlock: device 0 waits for a count of 1");
    }

    /// Messages under one key come out in the order sent; keys are independent; what is
    /// left is reported by the least key.
    #[test]
    fn the_mailbox_keeps_each_key_in_order() {
        let mut m: Mailbox<(usize, usize), &str> = Mailbox::default();
        m.post((1, 0), "b1");
        m.post((0, 1), "a1");
        m.post((0, 1), "a2");
        assert!(m.has(&(0, 1)) && !m.has(&(2, 0)));
        assert_eq!(m.take(&(0, 1)), Some("a1"));
        assert_eq!(m.left(), Some((&(0, 1), &"a2")));
        assert_eq!(m.take(&(0, 1)), Some("a2"));
        assert_eq!(m.take(&(0, 1)), None);
        assert_eq!(m.left(), Some((&(1, 0), &"b1")));
        assert_eq!(m.take(&(1, 0)), Some("b1"));
        assert_eq!(m.left(), None);
    }

    /// A failure ends the waits; the waiting devices are stopped, not failed.
    #[test]
    fn a_failure_stops_the_waiting_devices() {
        let b = Board::new(2, ());
        std::thread::scope(|s| {
            s.spawn(|| {
                let g = b.lock();
                let e = b.wait(g, 0, || "never".into(), |_| false).unwrap_err();
                assert_eq!(e, "device 1: broken");
                b.finish(0);
            });
            s.spawn(|| {
                std::thread::sleep(std::time::Duration::from_millis(20));
                b.fail("device 1: broken".into());
                b.finish(1);
            });
        });
        assert!(b.stopped(0) && !b.stopped(1));
    }
}
