//! What `heapdump --version` says: the version, the git revision and the
//! target it was built from, the oldest glibc it runs on (read from its
//! own dynamic symbol versions, so it is true of this very file), and
//! where its agent libraries come from.

use std::path::Path;

use object::{Object, ObjectSection};

/// The oldest glibc the executable at `exe` can run on: the highest
/// `GLIBC_2.N` version it asks for (`None` if it names none, e.g. a
/// static build, or cannot be read).
pub fn glibc_needed(exe: &Path) -> Option<(u32, u32)> {
    let file = std::fs::File::open(exe).ok()?;
    // SAFETY: a private, read-only mapping of our own executable, which a
    // running program's file cannot be truncated under (ETXTBSY on
    // writes); it is dropped before returning.
    let map = unsafe { memmap2::Mmap::map(&file) }.ok()?;
    let obj = object::File::parse(&*map).ok()?;
    let dynstr = obj.section_by_name(".dynstr")?.data().ok()?;
    dynstr
        .split(|b| *b == 0)
        .filter_map(|s| s.strip_prefix(b"GLIBC_"))
        .filter_map(|v| {
            let v = std::str::from_utf8(v).ok()?;
            let mut it = v.split('.');
            let major = it.next()?.parse().ok()?;
            let minor = it.next().unwrap_or("0").parse().ok()?;
            Some((major, minor))
        })
        .max()
}

/// The long `--version` text.
pub fn long_version() -> String {
    let exe = Path::new("/proc/self/exe");
    let glibc = match glibc_needed(exe) {
        Some((a, b)) => format!("glibc {a}.{b} or later"),
        None => "glibc version unknown".into(),
    };
    let agent = match crate::agent_bundle::read_from(exe) {
        Ok(Some(libs)) => format!(
            "agent libraries carried in this file ({:.1} MiB{})",
            libs.preload.len() as f64 / (1 << 20) as f64,
            if libs.jemalloc.is_some() {
                ", with the jemalloc companion"
            } else {
                ""
            }
        ),
        Ok(None) => "agent libraries not carried (found next to this file or through \
                     HEAPDUMP_PRELOAD)"
            .into(),
        Err(e) => format!("agent libraries: {e:#}"),
    };
    format!(
        "{} (git {}, {}, {})\n{}",
        env!("CARGO_PKG_VERSION"),
        env!("HEAPDUMP_GIT_REVISION"),
        env!("HEAPDUMP_TARGET"),
        glibc,
        agent
    )
}
