//! Processes that meet: the launch environment (torchrun's and Slurm's variables), a
//! rendezvous (TCP at `MASTER_ADDR:MASTER_PORT`, or a file on a shared file system), and
//! a full mesh of TCP connections between the processes carrying keyed messages.
//!
//! Every message has a [`Key`]; a receiver takes the messages of a key in the order they
//! were sent. A reader thread per connection files incoming messages by key; a message
//! to this process is filed directly. A receive waits at most the timeout, and fails at
//! once when the peer it waits for stopped (it said why, or its connection closed before
//! the end of the run), or when this process failed ([`Net::fail`]). A process that
//! stops tells its peers the first cause it knows, so an error names where it began.

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Where this process stands among the run's processes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct World {
    /// This process's rank.
    pub rank: usize,
    /// How many processes.
    pub size: usize,
    /// This process's rank on its node (its GPU).
    pub local_rank: usize,
    /// Where rank 0 listens for the rendezvous: `host:port`.
    pub master: String,
    /// Which launcher's variables said so.
    pub launcher: &'static str,
}

/// The launch environment from variables (`get`: the environment, or a test's): torchrun's
/// (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`), else Slurm's
/// (`SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, the first host of
/// `SLURM_JOB_NODELIST`; `MASTER_PORT` or 29500), else one process.
pub fn world_from(get: impl Fn(&str) -> Option<String>) -> Result<World, String> {
    let num = |k: &str| -> Result<Option<usize>, String> {
        get(k)
            .map(|v| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|_| format!("{k}={v} is not a number"))
            })
            .transpose()
    };
    let port = get("MASTER_PORT").unwrap_or_else(|| "29500".into());
    if let (Some(rank), Some(size)) = (num("RANK")?, num("WORLD_SIZE")?) {
        let addr = get("MASTER_ADDR").unwrap_or_else(|| "127.0.0.1".into());
        return checked(World {
            rank,
            size,
            local_rank: num("LOCAL_RANK")?.unwrap_or(0),
            master: format!("{addr}:{port}"),
            launcher: "torchrun (RANK, WORLD_SIZE)",
        });
    }
    if let (Some(rank), Some(size)) = (num("SLURM_PROCID")?, num("SLURM_NTASKS")?) {
        let addr = match get("MASTER_ADDR") {
            Some(a) => a,
            None => first_host(
                &get("SLURM_JOB_NODELIST")
                    .or_else(|| get("SLURM_NODELIST"))
                    .ok_or("SLURM_PROCID is set but SLURM_JOB_NODELIST is not (set MASTER_ADDR)")?,
            )?,
        };
        return checked(World {
            rank,
            size,
            local_rank: num("SLURM_LOCALID")?.unwrap_or(0),
            master: format!("{addr}:{port}"),
            launcher: "Slurm (SLURM_PROCID, SLURM_NTASKS)",
        });
    }
    Ok(World {
        rank: 0,
        size: 1,
        local_rank: 0,
        master: String::new(),
        launcher: "one process",
    })
}

fn checked(w: World) -> Result<World, String> {
    if w.size == 0 || w.rank >= w.size {
        return Err(format!(
            "rank {} of {} processes ({}): the rank must be below the number of processes",
            w.rank, w.size, w.launcher
        ));
    }
    Ok(w)
}

/// The first host of a Slurm node list (`gpu[01-04,07],login2` -> `gpu01`).
pub fn first_host(list: &str) -> Result<String, String> {
    let list = list.trim();
    let end = list.find([',', '[']).unwrap_or(list.len());
    let prefix = &list[..end];
    if list[end..].starts_with('[') {
        let inner = &list[end + 1..];
        let first = inner
            .split([',', '-', ']'])
            .next()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| format!("cannot read the node list '{list}'"))?;
        return Ok(format!("{prefix}{first}"));
    }
    if prefix.is_empty() {
        return Err(format!("cannot read the node list '{list}'"));
    }
    Ok(prefix.to_string())
}

/// A message's key: its kind and three numbers (the kinds' users choose their meaning).
pub type Key = [u64; 4];

#[derive(Debug, Default)]
struct Mail {
    queues: HashMap<Key, VecDeque<Vec<u8>>>,
    /// This process failed (a device, a timeout): every wait fails.
    failed: Option<String>,
    /// Peers that failed or went away, with why: waits for their messages fail.
    peers: HashMap<usize, String>,
    /// The first cause of any failure, local or a peer's (what this process tells its
    /// peers when it stops).
    first: Option<String>,
    closing: bool,
    /// Ranks that said goodbye ([`Net::close`]): their connections may end.
    gone: std::collections::HashSet<usize>,
}

/// The key of a goodbye: the sender is done and closes its connection.
const BYE: Key = [u64::MAX; 4];
/// The key of a failure: the sender stops, and says why (the first cause it knows).
const FAIL: Key = [u64::MAX, u64::MAX, u64::MAX, 0];

/// This process's connections to the others.
#[derive(Debug)]
pub struct Net {
    /// Where this process stands.
    pub world: World,
    mail: Arc<(Mutex<Mail>, Condvar)>,
    /// Per rank, the connection's writing half (`None` for this process).
    links: Vec<Option<Mutex<TcpStream>>>,
    timeout: Duration,
}

/// How the processes find rank 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Rendezvous {
    /// Rank 0 listens at the world's `master` address.
    Tcp,
    /// Rank 0 listens on a free port and writes `host:port` into this file (on a file
    /// system every process sees); the others read it, and rank 0 removes it once all
    /// have arrived (a path per job keeps jobs apart).
    File(String),
}

const HELLO: u64 = 0x6e6e_735f_6865_6c6f;
/// Sent instead of the address table (then a length and the reason) when rank 0 gives up
/// the rendezvous, so that the ranks that did arrive report why rather than a closed
/// connection.
const GAVE_UP: u64 = u64::MAX;

fn put_u64s(w: &mut impl Write, xs: &[u64]) -> std::io::Result<()> {
    let mut b = Vec::with_capacity(xs.len() * 8);
    for x in xs {
        b.extend_from_slice(&x.to_le_bytes());
    }
    w.write_all(&b)
}

fn get_u64s<const N: usize>(r: &mut impl Read) -> std::io::Result<[u64; N]> {
    let mut b = vec![0u8; N * 8];
    r.read_exact(&mut b)?;
    let mut out = [0u64; N];
    for (i, c) in b.chunks_exact(8).enumerate() {
        out[i] = u64::from_le_bytes(c.try_into().expect("8 bytes"));
    }
    Ok(out)
}

/// Connects to `addr`, retrying until `deadline`.
fn connect(addr: &str, deadline: Instant, what: &str) -> Result<TcpStream, String> {
    let mut last = String::new();
    while Instant::now() < deadline {
        let addrs: Vec<_> = match addr.to_socket_addrs() {
            Ok(a) => a.collect(),
            Err(e) => {
                last = e.to_string();
                Vec::new()
            }
        };
        for a in addrs {
            match TcpStream::connect_timeout(&a, Duration::from_secs(2)) {
                Ok(s) => {
                    let _ = s.set_nodelay(true);
                    return Ok(s);
                }
                Err(e) => last = e.to_string(),
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!("cannot reach {what} at {addr}: {last}"))
}

/// Accepts a connection from each rank of `expect` on `l` until `deadline`, each
/// introducing itself with [`HELLO`], its rank, the world's size, `token` and a number;
/// returns them by rank with that number, or names the ranks that never arrived.
fn accept_all(
    l: &TcpListener,
    expect: &[usize],
    size: usize,
    token: u64,
    deadline: Instant,
    at: &str,
    tell: bool,
) -> Result<HashMap<usize, (TcpStream, u64)>, String> {
    let mut got: HashMap<usize, (TcpStream, u64)> = HashMap::new();
    let r = accept_into(l, expect, size, token, deadline, at, &mut got);
    if let (Err(why), true) = (&r, tell) {
        // The ranks that arrived wait for an answer (rank 0's table): tell them why there
        // is none.
        for (s, _) in got.values_mut() {
            let _ =
                put_u64s(s, &[GAVE_UP, why.len() as u64]).and_then(|_| s.write_all(why.as_bytes()));
        }
    }
    r.map(|()| got)
}

fn accept_into(
    l: &TcpListener,
    expect: &[usize],
    size: usize,
    token: u64,
    deadline: Instant,
    at: &str,
    got: &mut HashMap<usize, (TcpStream, u64)>,
) -> Result<(), String> {
    l.set_nonblocking(true).map_err(|e| e.to_string())?;
    while got.len() < expect.len() {
        match l.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false).map_err(|e| e.to_string())?;
                let _ = s.set_nodelay(true);
                let _ = s.set_read_timeout(Some(Duration::from_secs(10)));
                let [magic, rank, world, their, extra] = match get_u64s::<5>(&mut s) {
                    Ok(h) => h,
                    Err(_) => continue,
                };
                let _ = s.set_read_timeout(None);
                if magic != HELLO {
                    continue;
                }
                if world as usize != size {
                    return Err(format!(
                        "rank {rank} says the run has {world} processes; this one says {size}"
                    ));
                }
                if their != token {
                    return Err(format!(
                        "rank {rank} runs another bundle (checksum {their:016x}, here {token:016x})"
                    ));
                }
                let rank = rank as usize;
                if !expect.contains(&rank) || got.contains_key(&rank) {
                    return Err(format!("rank {rank} arrived twice or unexpectedly at {at}"));
                }
                got.insert(rank, (s, extra));
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let missing: Vec<String> = expect
                        .iter()
                        .filter(|r| !got.contains_key(r))
                        .map(|r| r.to_string())
                        .collect();
                    return Err(format!(
                        "rank{} {} never arrived at {at} (the rendezvous timed out)",
                        if missing.len() > 1 { "s" } else { "" },
                        missing.join(", "),
                    ));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(format!("{at}: {e}")),
        }
    }
    Ok(())
}

impl Net {
    /// Meets the other processes of `world` (`token`: a checksum every process must agree
    /// on, e.g. the bundle's) and connects every pair; waits at most `timeout` for each
    /// stage, naming the ranks that never arrived.
    pub fn connect(
        world: World,
        how: &Rendezvous,
        token: u64,
        timeout: Duration,
    ) -> Result<Net, String> {
        let (rank, size) = (world.rank, world.size);
        let deadline = Instant::now() + timeout;
        let mut links: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
        // This process's listener for the ranks above it.
        let listener = if rank == 0 {
            let bind = match how {
                Rendezvous::Tcp => {
                    let port = world.master.rsplit(':').next().unwrap_or("29500");
                    format!("0.0.0.0:{port}")
                }
                Rendezvous::File(_) => "0.0.0.0:0".into(),
            };
            TcpListener::bind(&bind).map_err(|e| {
                format!("rank 0 cannot listen at {bind} for the rendezvous: {e} (another run on this port? set MASTER_PORT)")
            })?
        } else {
            TcpListener::bind("0.0.0.0:0").map_err(|e| format!("cannot listen: {e}"))?
        };
        let my_port = listener.local_addr().map_err(|e| e.to_string())?.port();
        let master = match how {
            Rendezvous::Tcp => world.master.clone(),
            Rendezvous::File(path) => {
                if rank == 0 {
                    let host = hostname();
                    let tmp = format!("{path}.tmp{}", std::process::id());
                    std::fs::write(&tmp, format!("{host}:{my_port}\n"))
                        .and_then(|_| std::fs::rename(&tmp, path))
                        .map_err(|e| format!("{path}: {e}"))?;
                    format!("{host}:{my_port}")
                } else {
                    loop {
                        if let Ok(t) = std::fs::read_to_string(path) {
                            if t.ends_with('\n') {
                                break t.trim().to_string();
                            }
                        }
                        if Instant::now() >= deadline {
                            return Err(format!(
                                "{path}: rank 0 never wrote its address within {} s",
                                timeout.as_secs()
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            }
        };
        // Addresses of every rank's listener: rank 0 learns them and tells everyone.
        let mut table: Vec<String> = vec![String::new(); size];
        if rank == 0 {
            let others: Vec<usize> = (1..size).collect();
            let got = accept_all(&listener, &others, size, token, deadline, &master, true)?;
            let mut streams = Vec::new();
            for (r, (s, port)) in got {
                let ip = s.peer_addr().map_err(|e| e.to_string())?.ip();
                table[r] = std::net::SocketAddr::new(ip, port as u16).to_string();
                streams.push((r, s));
            }
            let text = table.join("\n").into_bytes();
            for (r, mut s) in streams {
                put_u64s(&mut s, &[text.len() as u64])
                    .and_then(|_| s.write_all(&text))
                    .map_err(|e| format!("rank {r}: {e}"))?;
                links[r] = Some(s);
            }
        } else {
            let mut s = connect(&master, deadline, "rank 0")?;
            put_u64s(
                &mut s,
                &[HELLO, rank as u64, size as u64, token, u64::from(my_port)],
            )
            .map_err(|e| format!("rank 0: {e}"))?;
            let left = deadline.saturating_duration_since(Instant::now());
            let _ = s.set_read_timeout(Some(left.max(Duration::from_millis(1))));
            let [n] = get_u64s::<1>(&mut s).map_err(|e| match e.kind() {
                std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => {
                    format!(
                        "rank 0 at {master} closed the rendezvous before every rank arrived \
                         (it exited or failed; its error says why)"
                    )
                }
                _ => format!(
                    "rank 0 at {master} did not answer (every rank must arrive within {} s): {e}",
                    timeout.as_secs()
                ),
            })?;
            if n == GAVE_UP {
                let why = get_u64s::<1>(&mut s).and_then(|[len]| {
                    let mut b = vec![0u8; len.min(1 << 16) as usize];
                    s.read_exact(&mut b)
                        .map(|_| String::from_utf8_lossy(&b).into_owned())
                });
                return Err(format!(
                    "rank 0 at {master} gave up the rendezvous: {}",
                    why.unwrap_or_else(|e| e.to_string())
                ));
            }
            let mut text = vec![0u8; n as usize];
            s.read_exact(&mut text)
                .map_err(|e| format!("rank 0: {e}"))?;
            let _ = s.set_read_timeout(None);
            table = String::from_utf8_lossy(&text)
                .split('\n')
                .map(String::from)
                .collect();
            links[0] = Some(s);
            // Connect to the ranks between 0 and this one; accept those above it.
            for (p, addr) in table.iter().enumerate().take(rank).skip(1) {
                let mut s = connect(addr, deadline, &format!("rank {p}"))?;
                put_u64s(&mut s, &[HELLO, rank as u64, size as u64, token, 0])
                    .map_err(|e| format!("rank {p}: {e}"))?;
                links[p] = Some(s);
            }
            let above: Vec<usize> = (rank + 1..size).collect();
            let got = accept_all(
                &listener,
                &above,
                size,
                token,
                deadline,
                &format!("rank {rank}"),
                false,
            )?;
            for (r, (s, _)) in got {
                links[r] = Some(s);
            }
        }
        // Every rank read the address file before it reached rank 0: a later run finds
        // none (not this run's stale address).
        if let (0, Rendezvous::File(path)) = (rank, how) {
            let _ = std::fs::remove_file(path);
        }
        let mail = Arc::new((Mutex::new(Mail::default()), Condvar::new()));
        let mut writers = Vec::with_capacity(size);
        for (r, link) in links.into_iter().enumerate() {
            let Some(s) = link else {
                writers.push(None);
                continue;
            };
            let reader = s.try_clone().map_err(|e| e.to_string())?;
            let mail = Arc::clone(&mail);
            std::thread::spawn(move || read_loop(reader, r, mail));
            writers.push(Some(Mutex::new(s)));
        }
        Ok(Net {
            world,
            mail,
            links: writers,
            timeout,
        })
    }

    /// Sends `bytes` under `key` to rank `to` (this process's own mail when it is this
    /// one); does not wait for the receive.
    pub fn send(&self, to: usize, key: Key, bytes: &[u8]) -> Result<(), String> {
        if to == self.world.rank {
            let (m, cv) = &*self.mail;
            let mut mail = m.lock().unwrap_or_else(|e| e.into_inner());
            mail.queues
                .entry(key)
                .or_default()
                .push_back(bytes.to_vec());
            cv.notify_all();
            return Ok(());
        }
        let link = self.links[to]
            .as_ref()
            .ok_or_else(|| format!("no connection to rank {to}"))?;
        let mut s = link.lock().unwrap_or_else(|e| e.into_inner());
        let sent = put_u64s(
            &mut *s,
            &[key[0], key[1], key[2], key[3], bytes.len() as u64],
        )
        .and_then(|_| s.write_all(bytes));
        drop(s);
        sent.map_err(|e| {
            use std::io::ErrorKind::*;
            let why = match e.kind() {
                BrokenPipe | ConnectionReset | ConnectionAborted => "the connection ended".into(),
                _ => e.to_string(),
            };
            // The peer's own last word, if it said why it stopped.
            let (m, cv) = &*self.mail;
            let mut mail = m.lock().unwrap_or_else(|e| e.into_inner());
            let e = mail
                .peers
                .entry(to)
                .or_insert_with(|| format!("rank {to} is gone ({why}): it exited or failed"))
                .clone();
            mail.first.get_or_insert_with(|| e.clone());
            cv.notify_all();
            e
        })
    }

    /// Takes the next message under `key` (from rank `from`, named in errors), waiting
    /// at most the timeout; `what` says what it is.
    pub fn take(
        &self,
        from: usize,
        key: Key,
        what: &dyn Fn() -> String,
    ) -> Result<Vec<u8>, String> {
        let (m, cv) = &*self.mail;
        let deadline = Instant::now() + self.timeout;
        let mut mail = m.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(b) = mail.queues.get_mut(&key).and_then(VecDeque::pop_front) {
                return Ok(b);
            }
            if let Some(e) = mail.failed.as_ref().or_else(|| mail.peers.get(&from)) {
                return Err(e.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                let e = format!(
                    "rank {} waited {} s for {} from rank {from}, which never sent it (raise --timeout if it is still busy)",
                    self.world.rank,
                    self.timeout.as_secs(),
                    what()
                );
                mail.failed.get_or_insert(e.clone());
                mail.first.get_or_insert(e.clone());
                cv.notify_all();
                return Err(e);
            }
            mail = cv
                .wait_timeout(mail, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Fails every wait of this process (a device failed).
    pub fn fail(&self, e: &str) {
        let (m, cv) = &*self.mail;
        let mut mail = m.lock().unwrap_or_else(|e| e.into_inner());
        mail.failed.get_or_insert_with(|| e.to_string());
        mail.first.get_or_insert_with(|| e.to_string());
        cv.notify_all();
    }

    /// Something to wait on for this process's failure from another thread.
    pub fn watcher(&self) -> Watcher {
        Watcher(Arc::clone(&self.mail))
    }

    /// This process stops with error `e`: tells every peer the first cause it knows (a
    /// peer that went away, or `e`), so their errors name it too, whichever connection
    /// they see end first.
    pub fn abort(&self, e: &str) {
        let (m, _) = &*self.mail;
        let why = {
            let mut mail = m.lock().unwrap_or_else(|e| e.into_inner());
            mail.closing = true;
            mail.first
                .clone()
                .unwrap_or_else(|| format!("rank {} failed: {e}", self.world.rank))
        };
        for s in self.links.iter().flatten() {
            let mut s = s.lock().unwrap_or_else(|e| e.into_inner());
            let b = why.as_bytes();
            let _ = put_u64s(
                &mut *s,
                &[FAIL[0], FAIL[1], FAIL[2], FAIL[3], b.len() as u64],
            )
            .and_then(|_| s.write_all(b));
            let _ = s.shutdown(Shutdown::Write);
        }
    }

    /// The end of the run (every process got what it needs from this one): says
    /// goodbye to every peer, so its connection ending is not a failure there, and
    /// closes; connections ending here from now on are not failures either.
    pub fn close(&self) {
        let (m, cv) = &*self.mail;
        m.lock().unwrap_or_else(|e| e.into_inner()).closing = true;
        cv.notify_all();
        for s in self.links.iter().flatten() {
            let mut s = s.lock().unwrap_or_else(|e| e.into_inner());
            let _ = put_u64s(&mut *s, &[BYE[0], BYE[1], BYE[2], BYE[3], 0]);
            let _ = s.shutdown(Shutdown::Write);
        }
    }
}

/// A process's failure, awaited from another thread ([`Net::watcher`]): a GPU's
/// communicators are aborted when it comes, so calls waiting on a peer that is gone
/// return instead of waiting for ever.
#[derive(Debug, Clone)]
pub struct Watcher(Arc<(Mutex<Mail>, Condvar)>);

impl Watcher {
    /// Blocks until the process failed (its first cause) or the run ended (`None`).
    pub fn wait(&self) -> Option<String> {
        let (m, cv) = &*self.0;
        let mut mail = m.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if mail.failed.is_some() || !mail.peers.is_empty() {
                return mail.first.clone();
            }
            if mail.closing {
                return None;
            }
            mail = cv.wait(mail).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// Files the messages from rank `from` by key until the connection ends; an end before
/// [`Net::close`] fails the run, naming the rank.
fn read_loop(s: TcpStream, from: usize, mail: Arc<(Mutex<Mail>, Condvar)>) {
    let mut r = BufReader::with_capacity(1 << 20, s);
    let why = loop {
        let ended = |e: std::io::Error| {
            use std::io::ErrorKind::*;
            match e.kind() {
                UnexpectedEof | ConnectionReset | ConnectionAborted | BrokenPipe => {
                    "the connection ended".to_string()
                }
                _ => e.to_string(),
            }
        };
        let head = match get_u64s::<5>(&mut r) {
            Ok(h) => h,
            Err(e) => break ended(e),
        };
        let mut b = vec![0u8; head[4] as usize];
        if let Err(e) = r.read_exact(&mut b) {
            break ended(e);
        }
        let (m, cv) = &*mail;
        let mut mail = m.lock().unwrap_or_else(|e| e.into_inner());
        let key = [head[0], head[1], head[2], head[3]];
        if key == BYE {
            mail.gone.insert(from);
        } else if key == FAIL {
            let why = String::from_utf8_lossy(&b).into_owned();
            mail.first.get_or_insert_with(|| why.clone());
            mail.peers.entry(from).or_insert(why);
        } else {
            mail.queues.entry(key).or_default().push_back(b);
        }
        cv.notify_all();
    };
    let (m, cv) = &*mail;
    let mut mail = m.lock().unwrap_or_else(|e| e.into_inner());
    if !mail.closing && !mail.gone.contains(&from) {
        let e = format!("rank {from} is gone ({why}): it exited or failed");
        mail.first.get_or_insert_with(|| e.clone());
        mail.peers.entry(from).or_insert(e);
    }
    cv.notify_all();
}

/// This machine's name (for a file rendezvous's address).
fn hostname() -> String {
    let mut b = [0u8; 256];
    // SAFETY: the buffer is valid for its length; gethostname NUL-terminates within it
    // (or truncates, which the length bound below handles).
    let r = unsafe { libc::gethostname(b.as_mut_ptr().cast(), b.len()) };
    if r != 0 {
        return "127.0.0.1".into();
    }
    let n = b.iter().position(|&c| c == 0).unwrap_or(b.len());
    String::from_utf8_lossy(&b[..n]).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|v| v.0 == k).map(|v| v.1.to_string())
    }

    #[test]
    fn the_launchers_variables_give_the_world() {
        let w = world_from(env(&[
            ("RANK", "3"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("MASTER_ADDR", "node7"),
            ("MASTER_PORT", "1234"),
        ]))
        .unwrap();
        assert_eq!((w.rank, w.size, w.local_rank), (3, 4, 1));
        assert_eq!(w.master, "node7:1234");
        let w = world_from(env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_JOB_NODELIST", "gpu[03-04,07],login"),
        ]))
        .unwrap();
        assert_eq!((w.rank, w.size, w.local_rank), (5, 8, 1));
        assert_eq!(w.master, "gpu03:29500");
        assert_eq!(world_from(env(&[])).unwrap().size, 1);
        let e = world_from(env(&[("RANK", "4"), ("WORLD_SIZE", "4")])).unwrap_err();
        assert!(e.contains("rank 4 of 4"), "{e}");
        assert_eq!(first_host("a1,b2").unwrap(), "a1");
        assert_eq!(first_host("n[9]").unwrap(), "n9");
    }

    #[test]
    fn processes_meet_exchange_and_name_the_one_that_left() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let nets: Vec<Net> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..3)
                .map(|rank| {
                    sc.spawn(move || {
                        let w = World {
                            rank,
                            size: 3,
                            local_rank: 0,
                            master: format!("127.0.0.1:{port}"),
                            launcher: "test",
                        };
                        Net::connect(w, &Rendezvous::Tcp, 7, Duration::from_secs(20)).unwrap()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (r, n) in nets.iter().enumerate() {
            for to in 0..3 {
                n.send(to, [1, r as u64, to as u64, 0], &[r as u8; 5])
                    .unwrap();
            }
        }
        for (r, n) in nets.iter().enumerate() {
            for from in 0..3 {
                let b = n
                    .take(from, [1, from as u64, r as u64, 0], &|| "x".into())
                    .unwrap();
                assert_eq!(b, vec![from as u8; 5]);
            }
        }
        // Rank 2 goes away without closing: rank 0's wait for it fails, naming it.
        let mut nets = nets;
        let gone = nets.pop().unwrap();
        for s in gone.links.iter().flatten() {
            s.lock().unwrap().shutdown(Shutdown::Both).unwrap();
        }
        let e = nets[0]
            .take(2, [9, 9, 9, 9], &|| "a message".into())
            .unwrap_err();
        assert!(e.contains("rank 2 is gone"), "{e}");
    }

    #[test]
    fn a_rank_that_never_arrives_is_named() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let w = World {
            rank: 0,
            size: 3,
            local_rank: 0,
            master: format!("127.0.0.1:{port}"),
            launcher: "test",
        };
        let e = Net::connect(w, &Rendezvous::Tcp, 7, Duration::from_millis(500)).unwrap_err();
        assert!(e.contains("ranks 1, 2 never arrived"), "{e}");
        // A rank that did arrive hears why rank 0 gave up, not a closed connection.
        let master = format!("127.0.0.1:{port}");
        let world = |rank| World {
            rank,
            size: 3,
            local_rank: rank,
            master: master.clone(),
            launcher: "test",
        };
        let one = world(1);
        let arrived = std::thread::spawn(move || {
            Net::connect(one, &Rendezvous::Tcp, 7, Duration::from_secs(20)).map(|_| ())
        });
        let e = Net::connect(world(0), &Rendezvous::Tcp, 7, Duration::from_secs(1)).unwrap_err();
        assert!(e.contains("rank 2 never arrived"), "{e}");
        let e = arrived.join().unwrap().unwrap_err();
        assert!(
            e.contains("gave up the rendezvous: rank 2 never arrived"),
            "{e}"
        );
    }
}
