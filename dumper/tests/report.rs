//! `heapdump report` (issue 22): the HTML page of a live process and of a
//! `watch --interval` series, opened in headless Chromium (Debian's
//! `chromium`, installed by `.ci/run`): it loads with no console error and
//! no network request (Chromium's own log of every request it made, its
//! `--log-net-log`, holds none initiated by the page; a dead proxy makes
//! sure none could succeed), and the rendered page has the chart, the
//! sites and the leak suspect (tests/c/leaky.c leaks one block every
//! 10 ms at site_leak).

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::*;
use heapdump_tests::{compile_c, preload_lib, real_dependency, Target};

const CHROMIUM: &str = "/usr/bin/chromium";

/// The page as Chromium renders it (its DOM after loading), what it
/// logged on the console, and the URLs of the requests the page made
/// (from Chromium's network log: requests with an initiator; the
/// browser's own background requests have none).
fn render(page: &Path, dir: &TempDir) -> (String, String, Vec<String>) {
    let netlog = dir.path("netlog.json");
    let out = Command::new(CHROMIUM)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            // Any request to the network would fail, and say so.
            "--proxy-server=127.0.0.1:9",
            "--enable-logging=stderr",
            "--v=0",
            "--virtual-time-budget=3000",
        ])
        .arg(format!("--user-data-dir={}", dir.str("chromium-profile")))
        .arg(format!("--log-net-log={}", netlog.display()))
        .arg("--dump-dom")
        .arg(format!("file://{}", page.display()))
        .stdin(Stdio::null())
        .output()
        .expect("run chromium");
    assert!(out.status.success(), "chromium: {out:?}");
    let log: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&netlog).expect("chromium's network log"))
            .expect("a complete network log");
    let requests = log["events"]
        .as_array()
        .expect("events")
        .iter()
        .filter_map(|e| {
            let p = &e["params"];
            let url = p["url"].as_str()?;
            let initiator = p["initiator"].as_str()?;
            (initiator != "not an origin").then(|| url.to_string())
        })
        .collect();
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        requests,
    )
}

/// Checks the page itself: nothing it would fetch from elsewhere, no
/// request made when Chromium loads it, and no console message.
fn check_offline(page: &Path, console: &str, requests: &[String]) {
    let remote: Vec<&String> = requests
        .iter()
        .filter(|u| u.starts_with("http") || u.starts_with("ws"))
        .collect();
    assert!(remote.is_empty(), "the page made requests: {remote:#?}");
    let html = std::fs::read_to_string(page).unwrap();
    for attr in [
        "src=\"http",
        "href=\"http",
        "src='http",
        "url(http",
        "@import",
    ] {
        assert!(
            !html.contains(attr),
            "the page refers to the network: {attr}"
        );
    }
    let complaints: Vec<&str> = console
        .lines()
        .filter(|l| l.contains("CONSOLE") || l.contains("net::ERR") || l.contains("Uncaught"))
        .collect();
    assert!(complaints.is_empty(), "console: {complaints:#?}");
}

fn chromium_present() -> bool {
    real_dependency("chromium", Path::new(CHROMIUM).exists())
}

#[test]
fn a_report_of_a_live_process_opens_offline_with_its_chart_sites_and_leak_suspect() {
    if !chromium_present() {
        return;
    }
    let mut cmd = Command::new(compile_c("leaky"));
    cmd.arg("100").env("LD_PRELOAD", preload_lib());
    let t = Target::spawn_until(cmd, "done");
    let dir = TempDir::new("report-live");
    let page = dir.path("r.html");
    let out = heapdump(&["report", &t.pid().to_string(), "-o", page.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (dom, console, requests) = render(&page, &dir);
    check_offline(&page, &console, &requests);
    assert!(dom.contains("id=\"memory-chart\""), "no chart");
    assert!(dom.contains("<polyline class=\"curve\""), "no curve");
    // The sites now and at the peak, and the suspect.
    let now = dom.split("id=\"sites-now\"").nth(1).expect("sites now");
    assert!(
        now.contains("site_leak") && now.contains("site_steady"),
        "sites"
    );
    assert!(dom.contains("id=\"sites-peak\""), "no peak table");
    let suspects = dom.split("id=\"suspects\"").nth(1).expect("suspects");
    // The whole suspects section (it ends where the next heading starts),
    // not its first suspect only.
    let suspects = suspects.split("<h2").next().unwrap();
    assert!(suspects.contains("site_leak"), "the leak: {suspects}");
    assert!(
        !suspects.contains("site_steady"),
        "a steady site suspected: {suspects}"
    );
    // The flamegraph is there, as a document of its own.
    assert!(dom.contains("id=\"flamegraph\""));
    assert!(t.finish().success());
}

#[test]
fn a_report_of_a_watch_series_stacks_the_top_sites_and_finds_the_growing_one() {
    if !chromium_present() {
        return;
    }
    // It leaks until told to stop; the watch writes a snapshot every
    // 200 ms; the test stops the program once the watch wrote five, so the
    // series has at least six snapshots however slow the machine is.
    let mut cmd = Command::new(compile_c("leaky"));
    cmd.arg("0").env("LD_PRELOAD", preload_lib());
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let lines = Lines::new(child.stdout.take().unwrap());
    let dir = TempDir::new("report-series");
    let out_dir = dir.str("series");
    // The agent makes its regions at the program's first allocation: the
    // watch starts once they exist (a bounded poll of a state; started
    // sooner, it found the program not instrumented yet).
    let guard = std::time::Instant::now();
    while !std::fs::read_to_string(format!("/proc/{}/maps", child.id()))
        .unwrap_or_default()
        .contains("heapdump.allocations")
    {
        assert!(
            guard.elapsed() < HANG_GUARD,
            "the agent never made its regions"
        );
        std::thread::yield_now();
    }
    let mut watch = Command::new(bin())
        .args([
            "watch",
            &child.id().to_string(),
            "-d",
            &out_dir,
            "--format",
            "json",
            "--interval",
            "200ms",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let wlines = Lines::new(watch.stdout.take().unwrap());
    assert!(wlines.next().contains("watching"));
    for _ in 0..5 {
        let wrote = wlines.next();
        assert!(wrote.starts_with("wrote"), "{wrote}");
    }
    {
        use std::io::Write;
        child.stdin.as_mut().unwrap().write_all(b"stop\n").unwrap();
    }
    let done = lines.next();
    assert!(done.starts_with("done"), "{done}");
    // Stop the watch (its final snapshot), then the program.
    // SAFETY: kill(2) on the watch this test started.
    unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
    assert!(watch.wait().unwrap().success());
    drop(child.stdin.take());
    assert!(child.wait().unwrap().success());
    let page = dir.path("s.html");
    let out = heapdump(&["report", &out_dir, "-o", page.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let (dom, console, requests) = render(&page, &dir);
    check_offline(&page, &console, &requests);
    assert!(dom.contains("id=\"series-chart\""), "no series chart");
    assert!(dom.contains("class=\"band\""), "no bands");
    let suspects = dom.split("id=\"suspects\"").nth(1).expect("suspects");
    let suspects = suspects.split("</div></div>").next().unwrap();
    assert!(suspects.contains("site_leak"), "the leak: {suspects}");
    assert!(suspects.contains("grew in"), "{suspects}");
    assert!(!suspects.contains("site_steady"), "{suspects}");
}

#[test]
fn the_offline_check_sees_a_page_that_fetches_or_fails() {
    // The check itself must be able to fail: a page with an image from the
    // network and a console error is caught.
    if !chromium_present() {
        return;
    }
    let dir = TempDir::new("report-bad");
    let page = dir.path("bad.html");
    std::fs::write(
        &page,
        "<html><body><img src=\"https://example.com/x.png\">\
         <script>console.error('boom')</script></body></html>",
    )
    .unwrap();
    let (_, console, requests) = render(&page, &dir);
    assert!(
        requests.iter().any(|u| u.contains("example.com")),
        "{requests:?}"
    );
    assert!(console.contains("CONSOLE"), "{console}");
}

#[test]
fn a_report_of_a_saved_snapshot_file_shows_its_curve_and_sites() {
    // From a JSON snapshot taken earlier (no process needed any more).
    let mut cmd = Command::new(compile_c("leaky"));
    cmd.arg("20").env("LD_PRELOAD", preload_lib());
    let t = Target::spawn_until(cmd, "done");
    let dir = TempDir::new("report-file");
    let snap = dir.str("s.json");
    let out = heapdump(&["snapshot", &t.pid().to_string(), "-o", &snap]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(t.finish().success());
    let page = dir.path("f.html");
    let out = heapdump(&["report", &snap, "-o", page.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(html.contains("id=\"memory-chart\""));
    let now = html.split("id=\"sites-now\"").nth(1).expect("sites now");
    assert!(now.contains("site_leak") && now.contains("site_steady"));
    // A bad source is refused with what it is not.
    let out = heapdump(&["report", "/nonexistent/x", "-o", page.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("neither a running"),
        "{}",
        stderr(&out)
    );
}
