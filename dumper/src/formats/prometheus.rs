//! `GET /metrics` of `heapdump serve`: each instrumented process's heap as
//! Prometheus series, in the OpenMetrics text format, built with
//! `prometheus-client` (the Prometheus project's Rust client).
//!
//! One series set per process, labelled `pid`, `process` (its name, as
//! the encoder escapes it), `mode` (`exact` or `sampled`: live figures
//! are then estimates) and `cgroup` (the last part of its cgroup path: a
//! systemd unit such as `redis-server.service`, or a container's scope):
//!
//! - gauges `heapdump_live_bytes`, `heapdump_live_blocks`,
//!   `heapdump_peak_bytes` (the one peak of a snapshot) and
//!   `heapdump_peak_time_seconds`, `heapdump_recording_start_time_seconds`
//!   (for an attached process), `heapdump_allocator_heap_bytes` (the
//!   allocator's own whole-heap figure of an attached process, `source`
//!   labelled);
//! - counters `heapdump_allocated_bytes_total`,
//!   `heapdump_allocated_blocks_total`, `heapdump_dropped_events_total`
//!   (`reason` labelled);
//! - `heapdump_site_live_bytes` for the top sites by live bytes, labelled
//!   `site` (the frames that tell it apart, past the program's allocation
//!   wrappers: [`crate::formats::site_names`]) and `stack` (a short hash of
//!   the whole stack's addresses, stable across scrapes of one process);
//! - the collector's own health: `heapdump_scrape_duration_seconds` per
//!   process and `heapdump_scrape_errors` (processes that could not be
//!   read, by `reason`).
//!
//! The text is OpenMetrics when the scraper asks for it (Prometheus does,
//! in its `Accept` header), else Prometheus' classic text format 0.0.4
//! ([`to_classic_text`]): what `curl`, older agents and `promtool check
//! metrics` read.
//!
//! Invariant: a process that exits between scrapes has no series in the
//! next one (every scrape builds a fresh registry), so no stale gauge
//! claims memory.

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use std::sync::atomic::AtomicU64;
use std::time::{Duration, SystemTime};

use crate::formats::site_names::Wrappers;
use crate::process::snapshot::{Site, Snapshot};

/// Labels of a process's series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ProcessLabels {
    /// Process id.
    pub pid: String,
    /// Process name.
    pub process: String,
    /// `exact` or `sampled`.
    pub mode: String,
    /// The last part of its cgroup path (a systemd unit, a container).
    pub cgroup: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SiteLabels {
    pid: String,
    process: String,
    mode: String,
    cgroup: String,
    site: String,
    stack: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    pid: String,
    process: String,
    mode: String,
    cgroup: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SourceLabels {
    pid: String,
    process: String,
    mode: String,
    cgroup: String,
    source: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PidLabels {
    pid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ErrorLabels {
    reason: String,
}

/// One process's part of a scrape.
#[derive(Clone, Debug)]
pub struct Scraped {
    /// Its labels.
    pub labels: ProcessLabels,
    /// Its snapshot (sites: the top ones, symbolized).
    pub snapshot: Snapshot,
    /// How long reading it took.
    pub took: Duration,
    /// How long ago it was read: zero when read for this scrape (a
    /// process whose reading took long is read again only after a while,
    /// its last series served meanwhile: see `serve`).
    pub age: Duration,
}

/// The cgroup label of `pid`: the last component of its cgroup (v2, or
/// the first v1 hierarchy listed), empty when unknown.
pub fn cgroup_of(pid: u32) -> String {
    crate::process::proc_text::read(format!("/proc/{pid}/cgroup"))
        .ok()
        .and_then(|s| {
            let line = s
                .lines()
                .find(|l| l.starts_with("0::"))
                .or(s.lines().next())?;
            let path = line.splitn(3, ':').nth(2)?;
            Some(path.rsplit('/').next().unwrap_or("").to_string())
        })
        .unwrap_or_default()
}

/// A short, stable hash of a stack's addresses (FNV-1a, 32 bits, hex).
pub fn stack_hash(site: &Site) -> String {
    let mut h: u32 = 0x811c_9dc5;
    for a in &site.addresses {
        for b in a.to_le_bytes() {
            h ^= u32::from(b);
            h = h.wrapping_mul(0x0100_0193);
        }
    }
    format!("{h:08x}")
}

fn seconds_since_epoch(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Longest site label kept (characters).
const MAX_SITE_LABEL: usize = 160;

/// The exposition of a scrape: every process read, the reasons others
/// could not be, and how long each took.
pub fn render(scraped: &[Scraped], errors: &[(u32, String)]) -> String {
    let mut r = Registry::default();
    let live_bytes = Family::<ProcessLabels, Gauge>::default();
    let live_blocks = Family::<ProcessLabels, Gauge>::default();
    let peak_bytes = Family::<ProcessLabels, Gauge>::default();
    let peak_time = Family::<ProcessLabels, Gauge<f64, AtomicU64>>::default();
    let start_time = Family::<ProcessLabels, Gauge<f64, AtomicU64>>::default();
    let allocator = Family::<SourceLabels, Gauge>::default();
    let alloc_bytes = Family::<ProcessLabels, Counter>::default();
    let alloc_blocks = Family::<ProcessLabels, Counter>::default();
    let dropped = Family::<ReasonLabels, Counter>::default();
    let sites = Family::<SiteLabels, Gauge>::default();
    let took = Family::<PidLabels, Gauge<f64, AtomicU64>>::default();
    let age = Family::<PidLabels, Gauge<f64, AtomicU64>>::default();
    let failed = Family::<ErrorLabels, Gauge>::default();
    r.register(
        "heapdump_live_bytes",
        "Bytes in live heap blocks (an estimate in sampled mode)",
        live_bytes.clone(),
    );
    r.register(
        "heapdump_live_blocks",
        "Live heap blocks (an estimate in sampled mode)",
        live_blocks.clone(),
    );
    r.register(
        "heapdump_peak_bytes",
        "The heap's high-water mark since recording started",
        peak_bytes.clone(),
    );
    r.register(
        "heapdump_peak_time_seconds",
        "When the heap was at its peak (Unix time)",
        peak_time.clone(),
    );
    r.register(
        "heapdump_recording_start_time_seconds",
        "When heapdump attach started recording (Unix time; attached processes)",
        start_time.clone(),
    );
    r.register(
        "heapdump_allocator_heap_bytes",
        "The allocator's own figure for the whole heap (attached processes)",
        allocator.clone(),
    );
    r.register(
        "heapdump_allocated_bytes",
        "Bytes allocated since recording started",
        alloc_bytes.clone(),
    );
    r.register(
        "heapdump_allocated_blocks",
        "Blocks allocated since recording started",
        alloc_blocks.clone(),
    );
    r.register(
        "heapdump_dropped_events",
        "Allocation events the agent could not record, by reason",
        dropped.clone(),
    );
    r.register(
        "heapdump_site_live_bytes",
        "Live bytes of the top allocation sites",
        sites.clone(),
    );
    r.register(
        "heapdump_scrape_duration_seconds",
        "How long reading each process took",
        took.clone(),
    );
    r.register(
        "heapdump_scrape_age_seconds",
        "How long ago each process's series were read (0: for this scrape; a process whose \
         reading took long is read again once four times as long has passed, and a user's \
         processes are read afresh only while the user's share of the server allows)",
        age.clone(),
    );
    r.register(
        "heapdump_scrape_errors",
        "Processes that could not be read in this scrape, by reason",
        failed.clone(),
    );
    for s in scraped {
        let l = &s.labels;
        let snap = &s.snapshot;
        let t = &snap.totals;
        let g = |v: u64| v.min(i64::MAX as u64) as i64;
        live_bytes.get_or_create(l).set(g(t.live_bytes));
        live_blocks.get_or_create(l).set(g(t.live_blocks));
        peak_bytes.get_or_create(l).set(g(t.peak_bytes));
        if let Some(pt) = snap
            .timeline
            .as_ref()
            .and_then(|tl| tl.peak())
            .filter(|p| p.live_bytes == t.peak_bytes)
        {
            peak_time.get_or_create(l).set(seconds_since_epoch(pt.time));
        }
        alloc_bytes.get_or_create(l).inc_by(t.alloc_bytes);
        alloc_blocks.get_or_create(l).inc_by(t.alloc_blocks);
        for (reason, n) in &snap.dropped {
            dropped
                .get_or_create(&ReasonLabels {
                    pid: l.pid.clone(),
                    process: l.process.clone(),
                    mode: l.mode.clone(),
                    cgroup: l.cgroup.clone(),
                    reason: reason.clone(),
                })
                .inc_by(*n);
        }
        if let Some(rec) = &snap.recording {
            if let Some(at) = rec.attached_at {
                start_time.get_or_create(l).set(seconds_since_epoch(at));
            }
            if let Some((source, bytes)) = &rec.allocator_heap {
                allocator
                    .get_or_create(&SourceLabels {
                        pid: l.pid.clone(),
                        process: l.process.clone(),
                        mode: l.mode.clone(),
                        cgroup: l.cgroup.clone(),
                        source: source.clone(),
                    })
                    .set(g(*bytes));
            }
        }
        let wrappers = Wrappers::of(snap);
        for site in snap.sites.iter().filter(|x| x.live_bytes > 0) {
            let name: String = wrappers
                .name(site)
                .title
                .chars()
                .take(MAX_SITE_LABEL)
                .collect();
            sites
                .get_or_create(&SiteLabels {
                    pid: l.pid.clone(),
                    process: l.process.clone(),
                    mode: l.mode.clone(),
                    cgroup: l.cgroup.clone(),
                    site: name,
                    stack: stack_hash(site),
                })
                // Sites with one name and hash have one stack: summed.
                .inc_by(g(site.live_bytes));
        }
        took.get_or_create(&PidLabels { pid: l.pid.clone() })
            .set(s.took.as_secs_f64());
        age.get_or_create(&PidLabels { pid: l.pid.clone() })
            .set(s.age.as_secs_f64());
    }
    let mut reasons: std::collections::BTreeMap<String, i64> = Default::default();
    for (_, why) in errors {
        *reasons.entry(why.clone()).or_default() += 1;
    }
    for (reason, n) in reasons {
        failed.get_or_create(&ErrorLabels { reason }).set(n);
    }
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = encode(&mut out, &r);
    out
}

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The content type of [`to_classic_text`]'s text.
pub const CLASSIC_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether a scraper's `Accept` header asks for OpenMetrics.
pub fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| {
        a.split(',').any(|part| {
            let mut fields = part.split(';').map(str::trim);
            let is_om = fields.next() == Some("application/openmetrics-text");
            // `q=0` declines it.
            is_om && !fields.any(|f| f.replace(' ', "") == "q=0")
        })
    })
}

/// [`render`]'s OpenMetrics text in Prometheus' classic text format
/// 0.0.4: a counter's `# HELP`/`# TYPE` name its samples' `_total` name,
/// `# UNIT` lines and the closing `# EOF` go; samples are the same lines.
pub fn to_classic_text(openmetrics: &str) -> String {
    let mut counters = std::collections::HashSet::new();
    for line in openmetrics.lines() {
        if let Some(name) = line
            .strip_prefix("# TYPE ")
            .and_then(|r| r.strip_suffix(" counter"))
        {
            counters.insert(name.to_string());
        }
    }
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|p| {
            let rest = line.strip_prefix(p)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{p}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_classic_text_names_counters_by_their_samples_and_drops_eof() {
        let om = "# HELP heapdump_allocated_bytes Bytes allocated.\n\
                  # TYPE heapdump_allocated_bytes counter\n\
                  heapdump_allocated_bytes_total{pid=\"1\"} 5\n\
                  # HELP heapdump_live_bytes Live.\n\
                  # TYPE heapdump_live_bytes gauge\n\
                  heapdump_live_bytes{pid=\"1\"} 3\n\
                  # EOF\n";
        assert_eq!(
            to_classic_text(om),
            "# HELP heapdump_allocated_bytes_total Bytes allocated.\n\
             # TYPE heapdump_allocated_bytes_total counter\n\
             heapdump_allocated_bytes_total{pid=\"1\"} 5\n\
             # HELP heapdump_live_bytes Live.\n\
             # TYPE heapdump_live_bytes gauge\n\
             heapdump_live_bytes{pid=\"1\"} 3\n"
        );
    }

    #[test]
    fn openmetrics_only_when_asked_for() {
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(wants_openmetrics(Some(
            "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
             version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
        )));
        assert!(!wants_openmetrics(Some(
            "application/openmetrics-text; q=0, text/plain"
        )));
    }

    #[test]
    fn series_carry_the_processes_figures_and_names_are_escaped() {
        let mut snap = Snapshot::default();
        snap.totals.live_bytes = 30_000;
        snap.totals.live_blocks = 100;
        snap.totals.peak_bytes = 40_000;
        snap.totals.alloc_bytes = 50_000;
        snap.totals.alloc_blocks = 200;
        snap.sites.push(Site {
            live_bytes: 30_000,
            live_blocks: 100,
            addresses: vec![1, 2, 3],
            frames: vec![crate::symbolization::symbolizer::Frame {
                function: Some("site_x".into()),
                ..Default::default()
            }],
            ..Site::default()
        });
        let labels = ProcessLabels {
            pid: "42".into(),
            process: "a\"b\\c".into(),
            mode: "exact".into(),
            cgroup: "x.service".into(),
        };
        let text = render(
            &[Scraped {
                labels,
                snapshot: snap,
                took: Duration::from_millis(3),
                age: Duration::ZERO,
            }],
            &[(7, "permission denied".into())],
        );
        assert!(text.contains("heapdump_live_bytes{pid=\"42\",process=\"a\\\"b\\\\c\",mode=\"exact\",cgroup=\"x.service\"} 30000"), "{text}");
        assert!(text.contains("heapdump_allocated_bytes_total{"), "{text}");
        assert!(text.contains("site=\"site_x\""), "{text}");
        assert!(
            text.contains("heapdump_scrape_errors{reason=\"permission denied\"} 1"),
            "{text}"
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }
}
