//! `heapdump serve`'s `/metrics` scraped by a real Prometheus (Debian's
//! `prometheus`): two instrumented C programs with known live sets, a
//! scrape configuration with the bearer token, and Prometheus' own HTTP
//! API asked for what it stored; a job without the token is refused and
//! shown down. dist/prometheus's configuration and rules pass promtool;
//! the classic text a scraper gets without asking for OpenMetrics passes
//! `promtool check metrics`; every query of dist/grafana's dashboard runs
//! against this Prometheus; a program that exits loses its series and the
//! collector's health says why; the shipped remote-write and federation
//! snippets carry the series to a central Prometheus.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use heapdump_tests::{compile_c, preload_lib, real_dependency, Target};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The body of `GET path` on `addr` (HTTP/1.0), or `None` when not reachable.
fn get(addr: &str, path: &str) -> Option<String> {
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(HANG_GUARD)).ok()?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").ok()?;
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).ok()?;
    let text = String::from_utf8_lossy(&resp).into_owned();
    Some(text.split_once("\r\n\r\n")?.1.to_string())
}

/// The raw HTTP response (head and body) of `GET path` with `headers`.
fn get_raw(addr: &str, path: &str, headers: &str) -> String {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(HANG_GUARD)).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{headers}\r\n").unwrap();
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).unwrap();
    String::from_utf8_lossy(&resp).into_owned()
}

/// Prometheus' status for a query: "success", or its error.
fn query_status(prom: &str, q: &str) -> String {
    let path = format!("/api/v1/query?query={}", form_urlencoded_encode(q));
    let body = get(prom, &path).unwrap_or_default();
    let j: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
    match j["status"].as_str() {
        Some("success") => "success".into(),
        _ => format!("{}: {}", j["errorType"], j["error"]),
    }
}

/// Prometheus' answer to an instant query: (labels, value) per series.
fn query(prom: &str, q: &str) -> Vec<(serde_json::Value, f64)> {
    let path = format!("/api/v1/query?query={}", form_urlencoded_encode(q));
    let Some(body) = get(prom, &path) else {
        return Vec::new();
    };
    let Ok(j) = serde_json::from_str::<serde_json::Value>(&body) else {
        return Vec::new();
    };
    j["data"]["result"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter_map(|s| {
                    let v = s["value"][1].as_str()?.parse().ok()?;
                    Some((s["metric"].clone(), v))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn form_urlencoded_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A Prometheus with `config` (written into `dir` as `name.yml`), its
/// storage in `dir`, listening on a free port: (process, address).
fn start_prometheus(
    dir: &TempDir,
    name: &str,
    config: &str,
    extra: &[&str],
) -> (std::process::Child, String) {
    let addr = format!("127.0.0.1:{}", free_port());
    let file = dir.path(&format!("{name}.yml"));
    std::fs::write(&file, config).unwrap();
    let check = Command::new("promtool")
        .args(["check", "config"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        check.status.success(),
        "{name}: {}{}",
        String::from_utf8_lossy(&check.stdout),
        String::from_utf8_lossy(&check.stderr)
    );
    let child = Command::new("prometheus")
        .arg(format!("--config.file={}", file.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.path(&format!("{name}-data")).display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    (child, addr)
}

/// Polls `q` until `done` holds (a bounded wait for Prometheus's scrapes,
/// not a sleep that decides).
fn wait_for(
    prom: &str,
    q: &str,
    done: impl Fn(&[(serde_json::Value, f64)]) -> bool,
) -> Vec<(serde_json::Value, f64)> {
    let guard = std::time::Instant::now();
    loop {
        let r = query(prom, q);
        if done(&r) {
            return r;
        }
        assert!(
            guard.elapsed() < HANG_GUARD,
            "Prometheus never answered {q} as expected: {r:?}"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
}

#[test]
fn prometheus_scrapes_each_processs_heap_with_the_token_and_marks_a_tokenless_job_down() {
    if !real_dependency(
        "prometheus and promtool (Debian's prometheus)",
        Path::new("/usr/bin/prometheus").exists() && Path::new("/usr/bin/promtool").exists(),
    ) {
        return;
    }
    let dir = TempDir::new("prometheus");
    let dist = Path::new(env!("CARGO_MANIFEST_DIR")).join("../dist/prometheus");
    // The shipped rules and configuration (its paths made this test's)
    // are valid.
    let rules = dist.join("rules.yml");
    let token = dir.path("token");
    std::fs::write(&token, "t0ken-for-prometheus\n").unwrap();
    let shipped = std::fs::read_to_string(dist.join("scrape.yml"))
        .unwrap()
        .replace(
            "/etc/prometheus/heapdump-rules.yml",
            rules.to_str().unwrap(),
        )
        .replace("/etc/heapdump/token", token.to_str().unwrap());
    std::fs::write(dir.path("shipped.yml"), shipped).unwrap();
    for (what, file) in [
        ("rules", rules.clone()),
        ("config", dir.path("shipped.yml")),
    ] {
        let out = Command::new("promtool")
            .args(["check", what])
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stdout)
        );
    }

    // Two programs with known live sets (100 blocks of 300 bytes at
    // site_hostile): one in exact mode, one sampled (one allocation per
    // 256 bytes on average; a fixed seed, so the estimate is the same at
    // every run).
    let start = |sampled: bool| {
        let mut cmd = Command::new(compile_c("hostile"));
        cmd.env("LD_PRELOAD", preload_lib());
        if sampled {
            cmd.env("HEAPDUMP_SAMPLE_RATE", "256")
                .env("HEAPDUMP_SAMPLE_SEED", "7");
        }
        let mut t = Target::spawn(cmd);
        t.send("alloc");
        t.wait_line("allocated");
        t
    };
    let a = start(false);
    let b = start(true);
    let (pa, pb) = (a.pid().to_string(), b.pid().to_string());
    let mut serve = Command::new(bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--token-file"])
        .arg(&token)
        .args([&pa, &pb])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr = listening_addr(&Lines::new(serve.stdout.take().unwrap()).next());
    // A central store fed by remote write, and a central Prometheus that
    // federates from the host's: the shipped snippets, with this test's
    // addresses.
    let (mut central_rw, rw_addr) = start_prometheus(
        &dir,
        "central-rw",
        "global:\n  scrape_interval: 1s\n",
        &["--web.enable-remote-write-receiver"],
    );
    let remote_write = std::fs::read_to_string(dist.join("remote-write.yml"))
        .unwrap()
        .replace("central-store:9090", &rw_addr);
    let config = format!(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
         scrape_configs:\n\
         \x20 - job_name: heapdump\n    metrics_path: /metrics\n\
         \x20   authorization:\n      type: Bearer\n      credentials_file: {}\n\
         \x20   static_configs:\n      - targets: [\"{addr}\"]\n\
         \x20 - job_name: notoken\n    metrics_path: /metrics\n\
         \x20   static_configs:\n      - targets: [\"{addr}\"]\n\
         {remote_write}",
        token.display()
    );
    // The host's Prometheus, which scrapes serve and remote-writes.
    let (mut prom, prom_addr) = start_prometheus(&dir, "prometheus", &config, &[]);
    let federate = std::fs::read_to_string(dist.join("federate.yml"))
        .unwrap()
        .replace("scrape_interval: 1m", "scrape_interval: 1s")
        .replace(
            "[\"host-prometheus-1:9090\", \"host-prometheus-2:9090\"]",
            &format!("[\"{prom_addr}\"]"),
        );
    assert!(federate.contains(&prom_addr), "{federate}");
    let (mut central_fed, fed_addr) = start_prometheus(&dir, "central-fed", &federate, &[]);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        // Each program's live bytes, as its snapshot gives them (the
        // programs quiescent: in sampled mode the same estimate).
        let live = wait_for(&prom_addr, "heapdump_live_bytes{job=\"heapdump\"}", |r| {
            r.len() == 2
        });
        for pid in [&pa, &pb] {
            let out = dir.str(&format!("{pid}.json"));
            assert!(heapdump(&["snapshot", pid, "-o", &out]).status.success());
            let j = read_json(Path::new(&out));
            let got = live
                .iter()
                .find(|(m, _)| m["pid"] == pid.as_str())
                .map(|(_, v)| *v);
            assert_eq!(
                got,
                Some(j["totals"]["live_bytes"].as_u64().unwrap() as f64),
                "{live:?}"
            );
        }
        // The top sites name the programs' own function.
        let sites = wait_for(
            &prom_addr,
            "heapdump_site_live_bytes{job=\"heapdump\",site=\"site_hostile ← main\"}",
            |r| r.len() == 2,
        );
        let site_of = |pid: &str| {
            sites
                .iter()
                .find(|(m, _)| m["pid"] == pid)
                .map(|(m, v)| (m["mode"].as_str().unwrap_or("").to_string(), *v))
                .unwrap()
        };
        assert_eq!(site_of(&pa), ("exact".to_string(), 30_000.0), "{sites:?}");
        // Sampled: an estimate of the 30 000 bytes; at this rate its
        // standard deviation is about 2 000 bytes (each 300-byte block is
        // sampled with probability 1 - e^(-300/256), weighed by its
        // inverse), so it lies within five of them.
        let (mode, v) = site_of(&pb);
        assert_eq!(mode, "sampled");
        assert!((20_000.0..=40_000.0).contains(&v), "{sites:?}");
        // The job without the token: refused (401), so down.
        wait_for(&prom_addr, "up{job=\"notoken\"}", |r| {
            r.len() == 1 && r[0].1 == 0.0
        });
        wait_for(&prom_addr, "up{job=\"heapdump\"}", |r| {
            r.len() == 1 && r[0].1 == 1.0
        });

        // Without asking for OpenMetrics: the classic text, which promtool
        // reads and lints.
        let raw = get_raw(
            &addr,
            "/metrics",
            "Authorization: Bearer t0ken-for-prometheus\r\n",
        );
        let (head, body) = raw.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("text/plain; version=0.0.4"), "{head}");
        assert!(!body.contains("# EOF"), "{body}");
        let mut check = Command::new("promtool")
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        check
            .stdin
            .take()
            .unwrap()
            .write_all(body.as_bytes())
            .unwrap();
        let out = check.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool check metrics: {}{}\n{body}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // Asked for OpenMetrics (as Prometheus asks): OpenMetrics.
        let raw = get_raw(
            &addr,
            "/metrics",
            "Authorization: Bearer t0ken-for-prometheus\r\n\
             Accept: application/openmetrics-text;version=1.0.0\r\n",
        );
        assert!(raw.contains("application/openmetrics-text"), "{raw}");
        assert!(raw.trim_end().ends_with("# EOF"), "{raw}");

        // The Grafana dashboard: valid JSON, every panel's query runs, the
        // live-bytes and top-sites panels show both programs, and its
        // variables list them.
        let dash: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR"))
                    .join("../dist/grafana/heapdump-dashboard.json"),
            )
            .unwrap(),
        )
        .unwrap();
        let mut exprs = Vec::new();
        for panel in dash["panels"].as_array().unwrap() {
            for t in panel["targets"].as_array().unwrap() {
                let e = t["expr"]
                    .as_str()
                    .unwrap()
                    .replace("$process", ".*")
                    .replace("$cgroup", ".*")
                    .replace("$__rate_interval", "1m");
                exprs.push((panel["title"].as_str().unwrap().to_string(), e));
            }
        }
        assert!(exprs.len() >= 6, "{exprs:?}");
        for (title, e) in &exprs {
            assert_eq!(query_status(&prom_addr, e), "success", "{title}: {e}");
        }
        let panel = |title: &str| {
            exprs
                .iter()
                .find(|(t, _)| t == title)
                .map(|(_, e)| e.clone())
                .unwrap()
        };
        wait_for(&prom_addr, &panel("Live heap per process"), |r| {
            r.len() == 2
        });
        wait_for(
            &prom_addr,
            &panel("Top allocation sites (live bytes, stacked)"),
            |r| r.len() >= 2,
        );
        let names = get(&prom_addr, "/api/v1/label/process/values").unwrap();
        assert!(names.contains("hostile"), "{names}");

        // A fleet's central view: the same two series reach the store fed
        // by remote write and the Prometheus that federates, with their
        // values and labels.
        for (what, central) in [("remote write", &rw_addr), ("federation", &fed_addr)] {
            let got = wait_for(central, "heapdump_live_bytes{job=\"heapdump\"}", |r| {
                r.len() == 2
            });
            for (m, v) in &live {
                assert!(
                    got.iter().any(|(g, w)| g["pid"] == m["pid"] && w == v),
                    "{what}: {got:?} against {live:?}"
                );
            }
        }
    }));
    // A program that exits: its series end, and the health series says so.
    let result = result.and_then(|()| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            drop(b);
            wait_for(&prom_addr, "heapdump_live_bytes{job=\"heapdump\"}", |r| {
                r.len() == 1 && r[0].0["pid"] == pa.as_str()
            });
            wait_for(
                &prom_addr,
                "heapdump_scrape_errors{job=\"heapdump\",reason=\"exited\"}",
                |r| r.len() == 1 && r[0].1 == 1.0,
            );
        }))
    });
    for p in [&mut prom, &mut central_rw, &mut central_fed] {
        let _ = p.kill();
        let _ = p.wait();
    }
    let _ = serve.kill();
    let _ = serve.wait();
    drop(a);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}
