//! `heapdump serve`: Go-compatible `GET /debug/pprof/heap` over HTTP, so
//! `go tool pprof http://ADDR/debug/pprof/heap`, Grafana Alloy / Pyroscope
//! and Parca can scrape a host's instrumented processes.
//!
//! Blocking HTTP/1.1 with no async runtime, which is all a scrape endpoint
//! needs: `http_connections` accepts and reads the connections (how many
//! each client may hold is bounded there), and requests are served one at
//! a time, so at most one snapshot is being taken; what a client that
//! does not read its response can hold serve for is bounded in
//! `slow_clients`.
//!
//! Routes, as Go's `net/http/pprof` answers them:
//! `/debug/pprof/heap` (gzipped pprof, `inuse_space` shown first) and
//! `/debug/pprof/allocs` (the same profile, `alloc_space` shown first);
//! `?seconds=N` makes either a delta profile (two snapshots N seconds
//! apart, the first subtracted from the second); `gc=1` is accepted and
//! ignored (there is no collector to run). The target is `?pid=N` or
//! `?name=NAME` (its process or program name, stable across restarts),
//! needed when several are served; `per_thread=1` adds `thread` labels.
//! `/debug/pprof/heap.json?pid=N` gives the JSON schema, and `/` an index
//! of the targets.

use std::collections::HashMap;

use crate::commands::cost_pacing::{cost_allows, UserShares};
use crate::commands::http_connections::{AcceptingEnded, Reply, Request, Server};
use crate::commands::process_shares::Shares;
use crate::commands::slow_clients::Responder;
use crate::process::age::{self, AgeFilter, When};
use crate::process::discovery::{instrumented_pids, open_target, Target};
use crate::process::loopback_peer;
use crate::process::snapshot;
use crate::symbolization::maps::{read_maps, BuildIds};
use crate::symbolization::symbolizer::Symbolizer;

use clap::Args;
use std::io::Write as _;

/// What `serve` serves.
#[derive(Clone, Debug, Default)]
pub struct ServeOptions {
    /// Only these pids (empty: every instrumented process found).
    pub pids: Vec<u32>,
    /// Symbolize frames.
    pub symbolize: bool,
    /// Keep allocator plumbing frames at the leaf end of stacks.
    pub keep_allocator_frames: bool,
    /// Every request must carry `Authorization: Bearer TOKEN`.
    pub token: Option<String>,
    /// How many top sites `/metrics` gives per process.
    pub metrics_sites: usize,
    /// Serve each client only the processes its user may read (the user
    /// owning the client's socket, [`loopback_peer`]): set when listening
    /// on loopback without a token, where any user of the machine can
    /// connect.
    pub per_user: bool,
    /// How much reading a user's processes may cost the server at once
    /// before they are held back ([`UserShares`]).
    pub user_burst: std::time::Duration,
}

/// The age filter of a request: `older_than` and `newer_than` query
/// parameters, each a duration before the snapshot or an RFC 3339 time
/// (never a file: a request must not name files on the server).
fn age_filter(params: &HashMap<String, String>) -> Result<AgeFilter, Reply> {
    let one = |name: &str| -> Result<Option<When>, Reply> {
        params
            .get(name)
            .map(|v| {
                age::parse_when_value(v, false).map_err(|e| text(400, format!("bad {name}: {e}\n")))
            })
            .transpose()
    };
    Ok(AgeFilter {
        older_than: one("older_than")?,
        newer_than: one("newer_than")?,
    })
}

/// Longest `?seconds=N` delta a request may ask for.
pub const MAX_DELTA_SECONDS: u64 = 300;

/// Most `?seconds=N` deltas waiting for their second snapshot at once, per
/// user served (see [`ServeOptions::per_user`]; with a token, or on
/// loopback for root, one user): a delta waits beside the other requests,
/// never in front of them, and its first snapshot is held meanwhile.
pub const MAX_PENDING_DELTAS: usize = 8;

/// A `?seconds=N` delta whose first snapshot is taken: answered once
/// `due` has come, with the difference to a second one.
struct Delta {
    due: std::time::Instant,
    pid: u32,
    ages: AgeFilter,
    before: snapshot::Snapshot,
    default_type: &'static str,
}

/// A [`Delta`] waiting, with its request and the user it is served for
/// ([`State::reader`]).
struct PendingDelta {
    req: Request,
    reader: Option<u32>,
    delta: Box<Delta>,
}

/// What a request gets: its answer now, or later.
enum Answer {
    Now(Reply),
    Later(Box<Delta>),
}

impl From<Reply> for Answer {
    fn from(r: Reply) -> Self {
        Answer::Now(r)
    }
}

/// Errors starting the server.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {msg}")]
    Bind {
        /// Address.
        addr: String,
        /// Cause.
        msg: String,
    },
}

struct State {
    opts: ServeOptions,
    /// The user the request being answered is served for (`None`: every
    /// process served; see [`ServeOptions::per_user`]).
    reader: Option<u32>,
    /// How many of that user's delta profiles wait (shown by the index).
    waiting: usize,
    /// The targets kept open between requests, with their real user ids
    /// when opened (`None`: unreadable), within [`Shares`].
    targets: HashMap<u32, (Target, Option<u32>)>,
    /// How many targets each user may have kept open.
    shares: Shares,
    /// The start times of the targets served but not kept open (past
    /// their user's share), so that what is kept of them (mappings,
    /// scrapes, profiles) is forgotten once they exit, as a kept target's.
    served_once: HashMap<u32, Option<u64>>,
    /// Each served target's mappings when last read: the files the
    /// caches below keep.
    mapped: HashMap<u32, Vec<crate::symbolization::maps::Mapping>>,
    symbolizer: Symbolizer,
    build_ids: BuildIds,
    /// Each process's part of the last `/metrics` that read it, and when
    /// that reading started: a process whose reading took long is read
    /// again only once [`crate::commands::cost_pacing::COST_PACE`] times as long
    /// has passed, its last series served meanwhile, so that one process
    /// (libraries of big debug information cycled through, each read
    /// anew) cannot make every scrape of the host slow.
    scrapes: HashMap<u32, (std::time::Instant, crate::formats::prometheus::Scraped)>,
    /// The same for profiles (`/debug/pprof/heap` and the like, all of a
    /// process's blocks): each process's last one that took at least
    /// [`COSTLY_PROFILE`], when it started and how long it took. A
    /// profile carries its own time, so a client served an older one
    /// sees when it was taken.
    profiles: HashMap<u32, (std::time::Instant, std::time::Duration, snapshot::Snapshot)>,
    /// What reading each user's processes cost the server (every fresh
    /// reading, profile or scrape, charged to the process's real user):
    /// while a user's share is spent, none of its processes is read
    /// afresh, so that one user's many costly processes cannot hold the
    /// server, each within its own pace.
    users: UserShares,
    /// When each process was last read afresh: `/metrics` reads the
    /// longest unread first, so that a user whose share runs out in the
    /// middle of a scrape has its other processes read at the next one.
    read_at: HashMap<u32, std::time::Instant>,
}

/// How [`State::snapshot`] may answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Freshness {
    /// From the process's last costly profile while its cost says so.
    MayBeKept,
    /// Taken now (a delta's first end), unless its user's share is spent.
    Now,
    /// Taken now whatever the share: a delta's second end, whose request
    /// was let in with its first.
    Owed,
}

/// Why `/metrics` has no series of a process this scrape, when its user's
/// share is spent and nothing of it was kept (see [`State::users`]).
pub const HELD_BACK: &str = "held back: its user's processes cost much to read";

/// A profile that took at least this long is kept, to be served again
/// until [`crate::commands::cost_pacing::COST_PACE`] times as long has passed
/// (a cheaper one is taken afresh at each request, and nothing is kept).
pub const COSTLY_PROFILE: std::time::Duration = std::time::Duration::from_millis(250);

/// Why a served snapshot could not be taken.
enum TakeError {
    /// The target could not be opened.
    Open(crate::process::discovery::DiscoveryError),
    /// Its regions could not be read.
    Read(heapdump_table::TableError),
}

fn text(status: u16, body: String) -> Reply {
    Reply::text(status, body)
}

/// The query's parameters, percent-decoded (`+` is a space).
fn query_params(url: &str) -> HashMap<String, String> {
    url.split_once('?')
        .map(|(_, q)| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

impl State {
    fn candidates(&self) -> Vec<u32> {
        let mut pids = if self.opts.pids.is_empty() {
            instrumented_pids()
        } else {
            self.opts.pids.clone()
        };
        if let Some(uid) = self.reader {
            pids.retain(|&p| loopback_peer::may_read(uid, p));
        }
        pids
    }

    /// Refuses `pid` to a client whose user may not read it.
    fn readable(&self, pid: u32) -> Result<u32, Reply> {
        match self.reader {
            Some(uid) if !loopback_peer::may_read(uid, pid) => Err(text(
                403,
                format!(
                    "pid {pid} is not yours to read (this connection is user {uid}'s): over \
                     loopback without a token, each user is served only the processes it may \
                     read; the server's operator can give it --token-file to serve everything \
                     to whoever holds the token\n"
                ),
            )),
            _ => Ok(pid),
        }
    }

    fn pick(&self, params: &HashMap<String, String>) -> Result<u32, Reply> {
        if let Some(name) = params.get("name") {
            if name.parse::<u32>().is_ok() {
                return Err(text(400, format!("name={name} is a number: use pid=\n")));
            }
            let pid = crate::process::discovery::resolve_target(name)
                .map_err(|e| text(404, format!("{e}\n")))?;
            let pid = self.readable(pid)?;
            if !self.opts.pids.is_empty() && !self.opts.pids.contains(&pid) {
                return Err(text(
                    404,
                    format!("{name} (pid {pid}) is not served here\n"),
                ));
            }
            return Ok(pid);
        }
        if let Some(p) = params.get("pid") {
            let pid: u32 = p
                .parse()
                .map_err(|_| text(400, format!("bad pid {p:?}\n")))?;
            let pid = self.readable(pid)?;
            if !self.opts.pids.is_empty() && !self.opts.pids.contains(&pid) {
                return Err(text(
                    404,
                    format!(
                        "pid {pid} is not served here; served pids: {:?}\n",
                        self.opts.pids
                    ),
                ));
            }
            return Ok(pid);
        }
        match self.candidates().as_slice() {
            [one] => Ok(*one),
            [] => Err(text(404, "no instrumented process found\n".into())),
            many => Err(text(
                400,
                format!("several instrumented processes: add ?pid=N (one of {many:?})\n"),
            )),
        }
    }

    /// A snapshot of `pid` (opened once and kept while it runs) and the
    /// mappings it was taken with; symbolized when `symbolize`. Its
    /// caller has called [`Self::forget_exited`] once for the request
    /// (not once per process: `/metrics` takes every process).
    fn take(
        &mut self,
        pid: u32,
        ages: AgeFilter,
        symbolize: bool,
        addresses_only: bool,
    ) -> Result<(snapshot::Snapshot, Vec<crate::symbolization::maps::Mapping>), TakeError> {
        // A target past its user's share of what serve keeps open is
        // opened for this snapshot only (any user may run hundreds of
        // instrumented processes, and kept open they took every
        // descriptor serve had: root's processes then could not be read).
        let mut once = None;
        if !self.targets.contains_key(&pid) {
            let target = open_target(pid).map_err(TakeError::Open)?;
            let uid = crate::process::discovery::process_uids(pid).map(|ids| ids[0]);
            if self
                .shares
                .admits(uid, self.targets.values().map(|(_, u)| *u))
                .is_ok()
            {
                self.targets.insert(pid, (target, uid));
            } else {
                self.served_once.insert(pid, target.start_time);
                once = Some(target);
            }
        }
        let maps = read_maps(pid, &mut self.build_ids).unwrap_or_default();
        if !maps.is_empty() {
            let same = self
                .mapped
                .get(&pid)
                .is_some_and(|m| crate::symbolization::maps::same_files(m, &maps));
            if !same {
                self.mapped.insert(pid, maps.clone());
                self.forget_unserved_files();
            }
        }
        let target = match &once {
            Some(t) => t,
            None => &self.targets[&pid].0,
        };
        let r = snapshot::take(
            target,
            &maps,
            snapshot::Options {
                peak: false,
                symbolizer: symbolize.then_some(&mut self.symbolizer),
                progress: false,
                request: None,
                keep_allocator_frames: self.opts.keep_allocator_frames,
                ages,
                addresses_only,
            },
        );
        // A target that exited is forgotten once served (its pid may be
        // reused later).
        if crate::commands::watch::ExitWatch::new(pid).exited() {
            self.forget(pid);
        }
        r.map(|s| (s, maps)).map_err(TakeError::Read)
    }

    /// Forgets every target that exited since it was last served (whether
    /// or not it is asked for again), whose pid another process now has
    /// (its start time is not the one the target was opened with), or
    /// that executed another program (its regions open are its program's
    /// before): that process is opened afresh, never served from regions
    /// that are not its own now.
    fn forget_exited(&mut self) {
        let gone = |p: u32, start_time: Option<u64>| {
            crate::commands::watch::ExitWatch::new(p).exited()
                || crate::process::discovery::start_time(p) != start_time
        };
        let mut exited: Vec<u32> = self
            .targets
            .iter()
            .filter(|(&p, (t, _))| gone(p, t.start_time) || t.replaced())
            .map(|(&p, _)| p)
            .collect();
        exited.extend(
            self.served_once
                .iter()
                .filter(|(&p, &start)| gone(p, start))
                .map(|(&p, _)| p),
        );
        for pid in exited {
            self.forget(pid);
        }
    }

    /// Forgets a target that exited: its regions, and the files only it
    /// mapped.
    fn forget(&mut self, pid: u32) {
        self.targets.remove(&pid);
        self.served_once.remove(&pid);
        self.scrapes.remove(&pid);
        self.profiles.remove(&pid);
        self.read_at.remove(&pid);
        if self.mapped.remove(&pid).is_some() {
            self.forget_unserved_files();
        }
    }

    /// Forgets the files (parsed symbols, build IDs) no served target maps
    /// any more, so the server's memory and `HEAPDUMP_MAX_TOTAL_READ`
    /// follow the processes it serves now, not every one it served.
    fn forget_unserved_files(&mut self) {
        let maps = || self.mapped.values().flatten();
        self.symbolizer.retain_mapped(maps());
        self.build_ids.retain_mapped(maps());
    }

    /// A profile of `pid`: taken now, unless `fresh` allows its last one
    /// and that one's cost says it is to be served again
    /// ([`COSTLY_PROFILE`]), or its user's share is spent ([`State::users`]:
    /// then its last one, or 503 until the share allows).
    fn snapshot(
        &mut self,
        pid: u32,
        ages: AgeFilter,
        fresh: Freshness,
    ) -> Result<snapshot::Snapshot, Reply> {
        self.forget_exited();
        let whole = ages == AgeFilter::default();
        let kept = self
            .profiles
            .get(&pid)
            .filter(|_| whole && fresh == Freshness::MayBeKept);
        if let Some((started, cost, last)) = kept {
            if !cost_allows(started.elapsed(), *cost) {
                return Ok(last.clone());
            }
        }
        let uid = user_of(pid);
        if let Some(wait) = self.users.holding(uid).filter(|_| fresh != Freshness::Owed) {
            if let Some((_, _, last)) = kept {
                return Ok(last.clone());
            }
            let secs = wait.as_secs() + 1;
            return Err(text(
                503,
                format!(
                    "pid {pid} is not read now: reading the processes of its user (uid {}) has \
                     cost this server much of late, and they are read again in {secs} s (each \
                     user's processes take at most a quarter of the server's time); ask again \
                     then\n",
                    uid.unwrap_or_default()
                ),
            )
            .with_header("Retry-After", secs.to_string()));
        }
        let started = std::time::Instant::now();
        let taken = self.take(pid, ages, self.opts.symbolize, false);
        let cost = started.elapsed();
        self.users.charge(uid, cost);
        self.read_at.insert(pid, started);
        if let Ok((s, _)) = &taken {
            if whole && cost >= COSTLY_PROFILE {
                self.profiles.insert(pid, (started, cost, s.clone()));
            } else if whole {
                self.profiles.remove(&pid);
            }
        }
        match taken {
            Ok((s, _)) => Ok(s),
            Err(TakeError::Open(e)) => Err(text(404, format!("{e}\n"))),
            Err(TakeError::Read(e)) => {
                Err(text(500, format!("snapshot of pid {pid} failed: {e}\n")))
            }
        }
    }

    /// `GET /metrics`: every served process's series (see
    /// [`crate::formats::prometheus`]). Each process is walked as `top`
    /// does, without symbolizing; only its top sites are symbolized (the
    /// symbolizer caches every file it read).
    fn metrics(&mut self, accept: Option<&str>) -> Reply {
        use crate::formats::prometheus::{self, ProcessLabels, Scraped};
        use crate::process::discovery::DiscoveryError;
        let mut scraped = Vec::new();
        let mut errors = Vec::new();
        self.forget_exited();
        let mut pids = self.candidates();
        // The longest unread first (never read: first of all), see
        // `read_at`.
        pids.sort_by_key(|p| self.read_at.get(p).copied());
        for pid in pids {
            let t0 = std::time::Instant::now();
            // A process that exited has no series (its regions may still be
            // open here, from an earlier request: forgotten now).
            if crate::commands::watch::ExitWatch::new(pid).exited() {
                self.forget(pid);
                errors.push((pid, "exited".to_string()));
                continue;
            }
            let kept = self.scrapes.get(&pid);
            let serve_kept = |(started, last): &(std::time::Instant, Scraped)| Scraped {
                age: started.elapsed(),
                ..last.clone()
            };
            if let Some(k) =
                kept.filter(|(started, last)| !cost_allows(started.elapsed(), last.took))
            {
                scraped.push(serve_kept(k));
                continue;
            }
            let uid = user_of(pid);
            if self.users.holding(uid).is_some() {
                match kept {
                    Some(k) => scraped.push(serve_kept(k)),
                    None => errors.push((pid, HELD_BACK.to_string())),
                }
                continue;
            }
            let cgroup = prometheus::cgroup_of(pid);
            let (mut snap, maps) = match self.take(pid, AgeFilter::default(), false, true) {
                Ok(t) => t,
                Err(TakeError::Open(err)) => {
                    let why = match err {
                        DiscoveryError::NoSuchProcess { .. } => "exited",
                        DiscoveryError::PermissionDenied { .. } => "permission denied",
                        DiscoveryError::NotInstrumented { .. } => "not instrumented",
                        _ => "regions unreadable",
                    };
                    errors.push((pid, why.to_string()));
                    continue;
                }
                Err(TakeError::Read(_)) => {
                    errors.push((pid, "regions unreadable".to_string()));
                    continue;
                }
            };
            let name = snap.process.clone();
            let mut top: Vec<snapshot::Site> = std::mem::take(&mut snap.sites)
                .into_iter()
                .filter(|x| x.live_bytes > 0)
                .collect();
            top.sort_by_key(|x| std::cmp::Reverse(x.live_bytes));
            top.truncate(self.opts.metrics_sites);
            // Only these sites get frames (the snapshot was taken with
            // addresses only: building frames for every site of a big
            // process was most of a scrape's time).
            let symbolizer = self.opts.symbolize.then_some(&mut self.symbolizer);
            snap.sites = snapshot::symbolize_sites(top, &maps, symbolizer, false, false);
            scraped.push(Scraped {
                labels: ProcessLabels {
                    pid: pid.to_string(),
                    process: name,
                    mode: if snap.sampling.is_some() {
                        "sampled"
                    } else {
                        "exact"
                    }
                    .to_string(),
                    cgroup,
                },
                snapshot: snap,
                took: t0.elapsed(),
                age: std::time::Duration::ZERO,
            });
            self.users.charge(uid, t0.elapsed());
            self.read_at.insert(pid, t0);
            if let Some(last) = scraped.last() {
                self.scrapes.insert(pid, (t0, last.clone()));
            }
        }
        let text = prometheus::render(&scraped, &errors);
        let (text, content_type) = if prometheus::wants_openmetrics(accept) {
            (text, prometheus::CONTENT_TYPE)
        } else {
            (
                prometheus::to_classic_text(&text),
                prometheus::CLASSIC_CONTENT_TYPE,
            )
        };
        Reply::new(text.into_bytes()).with_header("Content-Type", content_type)
    }

    fn handle(&mut self, req: &Request) -> Answer {
        let url = req.url().to_string();
        let path = url.split('?').next().unwrap_or("");
        let params = query_params(&url);
        match path {
            "/metrics" => {
                let accept = req.header("Accept").next().map(str::to_string);
                self.metrics(accept.as_deref()).into()
            }
            "/debug/pprof/heap" | "/debug/pprof/allocs" | "/debug/pprof/heap.json" => {
                let pid = match self.pick(&params) {
                    Ok(p) => p,
                    Err(r) => return r.into(),
                };
                let ages = match age_filter(&params) {
                    Ok(a) => a,
                    Err(r) => return r.into(),
                };
                let seconds = match params.get("seconds").map(|s| s.parse::<u64>()) {
                    None => None,
                    Some(Ok(n)) if (1..=MAX_DELTA_SECONDS).contains(&n) => Some(n),
                    Some(_) => {
                        return text(400, format!("seconds must be 1..={MAX_DELTA_SECONDS}\n"))
                            .into()
                    }
                };
                let default_type = if path == "/debug/pprof/allocs" {
                    "alloc_space"
                } else {
                    "inuse_space"
                };
                let delta = seconds.filter(|_| !path.ends_with(".json"));
                let fresh = if delta.is_some() {
                    Freshness::Now
                } else {
                    Freshness::MayBeKept
                };
                let snap = match self.snapshot(pid, ages, fresh) {
                    Ok(s) => s,
                    Err(r) => return r.into(),
                };
                if let Some(n) = delta {
                    // A delta profile: the second snapshot once N seconds
                    // have passed, other requests answered meanwhile.
                    return Answer::Later(Box::new(Delta {
                        due: std::time::Instant::now() + std::time::Duration::from_secs(n),
                        pid,
                        ages,
                        before: snap,
                        default_type,
                    }));
                }
                if path.ends_with(".json") {
                    return Reply::new(crate::formats::json::render(&snap))
                        .with_header("Content-Type", "application/json")
                        .into();
                }
                let per_thread = params
                    .get("per_thread")
                    .is_some_and(|v| v == "1" || v == "true");
                let name = format!("attachment; filename=\"heap-{pid}.pb.gz\"");
                let mut profile = crate::formats::pprof::from_snapshot(&snap, per_thread);
                crate::formats::pprof::set_default_sample_type(&mut profile, default_type);
                Reply::new(crate::formats::pprof::encode_gzip(&profile))
                    .with_header("Content-Type", "application/octet-stream")
                    .with_header("Content-Disposition", name)
                    .into()
            }
            "/" | "/debug/pprof" | "/debug/pprof/" => {
                let mut body = String::from(
                    "heapdump serve\n\nGET /debug/pprof/heap?pid=N   gzipped pprof (Go heap layout, inuse_space first)\n\
                     GET /debug/pprof/allocs?pid=N   the same, alloc_space first\n\
                     \x20 either with &seconds=N: a delta profile over N seconds; name=NAME instead of pid=N\n\
                     GET /debug/pprof/heap.json?pid=N   heapdump JSON\n\
                     GET /metrics   Prometheus series of every process served\n\
                     either with &older_than=WHEN or &newer_than=WHEN (1h, 10m, or an RFC 3339 time):\n\
                     \x20 only the live blocks allocated before / at or after WHEN\n\ntargets:\n",
                );
                body.insert_str(
                    body.find("targets:").unwrap_or(body.len()),
                    &format!(
                        "delta profiles waiting: {} (at most {MAX_PENDING_DELTAS})\n\n",
                        self.waiting
                    ),
                );
                for pid in self.candidates() {
                    body.push_str(&format!(
                        "  {pid} {}\n",
                        crate::process::discovery::process_name(pid)
                    ));
                }
                text(200, body).into()
            }
            _ => text(
                404,
                format!("no such endpoint {path}; try /debug/pprof/heap\n"),
            )
            .into(),
        }
    }

    /// The answer to a delta whose time has come: what changed between its
    /// first snapshot and one taken now.
    fn finish_delta(&mut self, pending: PendingDelta) -> (Request, Reply) {
        let PendingDelta { req, reader, delta } = pending;
        let d = *delta;
        self.reader = reader;
        let after = match self.snapshot(d.pid, d.ages, Freshness::Owed) {
            Ok(s) => s,
            Err(r) => return (req, r),
        };
        let delta =
            crate::commands::diff::render_pprof(&crate::commands::diff::diff(d.before, after));
        let body = match crate::formats::pprof::decode(&delta) {
            Ok(mut p) => {
                crate::formats::pprof::set_default_sample_type(&mut p, d.default_type);
                crate::formats::pprof::encode_gzip(&p)
            }
            Err(_) => delta,
        };
        let reply = Reply::new(body).with_header("Content-Type", "application/octet-stream");
        (req, reply)
    }
}

/// The real user of process `pid`, whose share its readings are charged
/// to. `None`: paced by its own cost only: a process whose user cannot be
/// read, and root's (a process of root's can stop the server anyway, and
/// a host's many daemons of root's, each cheap, are not to be held back
/// together).
fn user_of(pid: u32) -> Option<u32> {
    crate::process::discovery::process_uids(pid)
        .map(|ids| ids[0])
        .filter(|&uid| uid != 0)
}

/// Binds `addr`; returns the server and the address actually bound (useful
/// with port 0).
pub fn bind(addr: &str) -> Result<(Server, String), ServeError> {
    let bind_error = |msg: String| ServeError::Bind {
        addr: addr.to_string(),
        msg,
    };
    // SAFETY: geteuid has no preconditions.
    let own_uid = unsafe { libc::geteuid() };
    let server = Server::bind(addr, &[0, own_uid]).map_err(|e| bind_error(e.to_string()))?;
    let bound = server.local_addr().to_string();
    Ok((server, bound))
}

/// Serves requests until the process is stopped.
pub fn serve(server: Server, opts: ServeOptions) {
    let user_burst = opts.user_burst;
    // SAFETY: geteuid has no preconditions.
    let own_uid = unsafe { libc::geteuid() };
    let mut state = State {
        opts,
        reader: None,
        waiting: 0,
        targets: HashMap::new(),
        // The untrusted clients' connections may hold as many descriptors
        // at once: the processes kept open never take theirs.
        shares: Shares::new(
            crate::commands::descriptor_limit::current()
                .saturating_sub(crate::commands::http_connections::MAX_CONNECTIONS as u64),
        ),
        served_once: HashMap::new(),
        mapped: HashMap::new(),
        symbolizer: Symbolizer::new(),
        scrapes: HashMap::new(),
        profiles: HashMap::new(),
        users: UserShares::new(user_burst),
        read_at: HashMap::new(),
        build_ids: BuildIds::default(),
    };
    let mut pending: Vec<PendingDelta> = Vec::new();
    let mut responder = Responder::default();
    loop {
        // The deltas whose time has come, then the next request (waiting
        // no longer than the next delta's time).
        let now = std::time::Instant::now();
        let (due, waiting): (Vec<_>, Vec<_>) = pending.drain(..).partition(|p| p.delta.due <= now);
        pending = waiting;
        for d in due {
            let reader = d.reader;
            let (req, reply) = state.finish_delta(d);
            responder.respond(req, reply, reader);
        }
        let next = match pending.iter().map(|p| p.delta.due).min() {
            Some(due) => server.recv_timeout(due.saturating_duration_since(now)),
            None => server.recv().ok_or(AcceptingEnded).map(Some),
        };
        let req = match next {
            Ok(Some(req)) => req,
            Ok(None) => continue,
            // Accepting ended (it does not while serve runs).
            Err(AcceptingEnded) => return,
        };
        if let Some(token) = &state.opts.token {
            if !authorized(&req, token) {
                let reply = text(
                    401,
                    "a bearer token is required (Authorization: Bearer ...)\n".into(),
                )
                .with_header("WWW-Authenticate", "Bearer realm=\"heapdump\"");
                responder.respond(req, reply, None);
                continue;
            }
        }
        state.reader = None;
        if state.opts.per_user {
            match req.peer_uid() {
                // Root, or the server's own user: what it may read itself.
                Some(uid) if uid == 0 || uid == own_uid => {}
                Some(uid) => state.reader = Some(uid),
                None => {
                    let reply = text(
                        403,
                        "cannot tell which user this connection is from: over loopback \
                         without a token, each user is served only the processes it may read\n"
                            .into(),
                    );
                    responder.respond(req, reply, None);
                    continue;
                }
            }
        }
        // A user whose clients stalled their responses, while it pays back.
        let Some(req) = responder.admit(req, state.reader) else {
            continue;
        };
        state.waiting = pending.iter().filter(|d| d.reader == state.reader).count();
        match state.handle(&req) {
            Answer::Now(reply) => responder.respond(req, reply, state.reader),
            Answer::Later(_) if state.waiting >= MAX_PENDING_DELTAS => {
                let reply = text(
                    503,
                    format!(
                        "{MAX_PENDING_DELTAS} delta profiles (seconds=N) are already waiting for \
                         this user: ask again when one is answered\n"
                    ),
                );
                responder.respond(req, reply, state.reader);
            }
            Answer::Later(delta) => pending.push(PendingDelta {
                req,
                reader: state.reader,
                delta,
            }),
        }
    }
}

/// Whether `req` carries `Authorization: Bearer TOKEN` (compared in time
/// independent of where the first difference is).
fn authorized(req: &Request, token: &str) -> bool {
    let expected = format!("Bearer {token}");
    req.header("Authorization").any(|v| {
        let got = v.trim().as_bytes();
        got.len() == expected.len()
            && got
                .iter()
                .zip(expected.as_bytes())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    })
}

/// Options of `heapdump serve`.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on, e.g. 127.0.0.1:6060 (port 0: any free port).
    #[arg(short, long, default_value = "127.0.0.1:6060")]
    pub(crate) listen: String,
    /// Serve only these pids (default: every instrumented process; then
    /// ?pid=N selects one when there are several).
    pub(crate) pids: Vec<u32>,
    /// Do not symbolize.
    #[arg(long)]
    pub(crate) no_symbolize: bool,
    /// Keep the allocator plumbing frames at the leaf end of each stack
    /// (see `snapshot --help`).
    #[arg(long)]
    pub(crate) keep_allocator_frames: bool,
    /// Require `Authorization: Bearer TOKEN` on every request, TOKEN being
    /// this file's content (Prometheus' `authorization` setting, Alloy's
    /// `bearer_token_file`). Needed to listen on an address other than
    /// loopback. Without it, on loopback, each connection is served only
    /// the processes its user may read (root: all).
    #[arg(long, value_name = "FILE")]
    pub(crate) token_file: Option<std::path::PathBuf>,
    /// Listen on an address other than loopback without a token (anyone
    /// who can reach the port reads the processes' call stacks).
    #[arg(long)]
    pub(crate) insecure_listen: bool,
    /// How many top allocation sites `/metrics` gives per process.
    #[arg(long, default_value_t = 10)]
    pub(crate) metrics_sites: usize,
    /// Seconds of reading a user's processes may cost the server at once
    /// (their profiles and series read afresh) before they are held back:
    /// each user's processes take at most a quarter of the server's time
    /// beyond that, their last series served meanwhile, their profiles
    /// answered 503 with Retry-After. So that one user's processes that
    /// cost much to read (big debug information) cannot keep the server
    /// from the others'.
    #[arg(long, value_name = "SECONDS", default_value_t = 2.0)]
    pub(crate) user_burst: f64,
}

/// `heapdump serve`: returns the exit status.
pub fn command(a: ServeArgs) -> anyhow::Result<i32> {
    use anyhow::Context as _;
    let token = match &a.token_file {
        Some(f) => {
            let t = std::fs::read_to_string(f)
                .with_context(|| format!("reading the token file {}", f.display()))?;
            let t = t.trim().to_string();
            if t.is_empty() || t.contains(char::is_whitespace) {
                anyhow::bail!(
                    "the token file {} must hold one token, without spaces",
                    f.display()
                );
            }
            Some(t)
        }
        None => None,
    };
    let user_burst = std::time::Duration::try_from_secs_f64(a.user_burst).map_err(|_| {
        anyhow::anyhow!(
            "--user-burst {}: give a number of seconds, 0 or more",
            a.user_burst
        )
    })?;
    // serve starts no program, so nothing inherits the raised limit.
    crate::commands::descriptor_limit::raise();
    let (server, bound) = crate::commands::serve::bind(&a.listen)?;
    let loopback = server.local_addr().ip().is_loopback();
    if !loopback && token.is_none() && !a.insecure_listen {
        anyhow::bail!(
            "refusing to listen on {bound} without a token: anyone who can reach it would read \
             the call stacks of every process served; give --token-file FILE (clients send \
             Authorization: Bearer TOKEN), or --insecure-listen to insist"
        );
    }
    println!("listening on http://{bound}/debug/pprof/heap");
    std::io::stdout().flush()?;
    crate::commands::serve::serve(
        server,
        crate::commands::serve::ServeOptions {
            pids: a.pids,
            symbolize: !a.no_symbolize,
            keep_allocator_frames: a.keep_allocator_frames,
            per_user: token.is_none() && loopback,
            token,
            metrics_sites: a.metrics_sites,
            user_burst,
        },
    );
    Ok(0)
}
