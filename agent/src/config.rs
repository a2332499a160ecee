//! Configuration from environment variables, read once at start-up.
//!
//! Invariant: reading the configuration never allocates (it uses
//! `secure_getenv`, which returns a pointer into the environment block), so
//! it is safe inside the first `malloc` of a process. `secure_getenv`
//! reads nothing in a process started set-user-ID, set-group-ID or with
//! file capabilities (`AT_SECURE`): the day the agent is preloaded
//! system-wide, an unprivileged user cannot steer it inside a privileged
//! program through the environment.

use std::ffi::CStr;

use heapdump_table::stack_compression::MAX_FRAMES;

/// Default signal that requests a snapshot.
pub const DEFAULT_SIGNAL: libc::c_int = libc::SIGUSR2;

/// How the agent walks a stack (`HEAPDUMP_UNWIND`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnwindMode {
    /// `auto`: CFI (`.eh_frame`) where a program counter has it, the frame
    /// pointer where it has none (JIT code, a module without `.eh_frame`).
    Auto,
    /// `cfi`: CFI only; the walk stops at a program counter without it.
    Cfi,
    /// `fp`: frame pointers only (the cheapest; stacks stop at code built
    /// without them).
    FramePointer,
}

impl UnwindMode {
    /// The number recorded in the region header (`offsets::UNWINDER`).
    pub fn code(self) -> u64 {
        use heapdump_table::header::Unwinder;
        match self {
            UnwindMode::FramePointer => Unwinder::FramePointer,
            UnwindMode::Auto => Unwinder::CfiWithFramePointerFallback,
            UnwindMode::Cfi => Unwinder::Cfi,
        }
        .code()
    }
}

/// The agent's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Config {
    /// `HEAPDUMP_DISABLE=1`: record nothing, create no regions.
    pub disabled: bool,
    /// `HEAPDUMP_MAX_FRAMES` (1..=64, default 64).
    pub max_frames: usize,
    /// `HEAPDUMP_SIGNAL`: signal number, or 0 for none (default SIGUSR2).
    pub signal: libc::c_int,
    /// `HEAPDUMP_CAPACITY`: most live blocks recorded (default 16 Mi).
    pub capacity: u64,
    /// `HEAPDUMP_SHARDS`: allocation table shards (power of two, default 256).
    pub shards: u64,
    /// `HEAPDUMP_RESOURCES_MB`: size of the resources region in MiB
    /// (default 256; sparse, only used pages cost memory).
    pub resources_bytes: u64,
    /// `HEAPDUMP_QUIET=1`: no messages on stderr.
    pub quiet: bool,
    /// `HEAPDUMP_UNWIND`: how stacks are walked (default `auto`).
    pub unwind: UnwindMode,
    /// `HEAPDUMP_MODULE_LOOKUP=table`: find a counter's module (for CFI)
    /// in the agent's own table even where glibc has `_dl_find_object`,
    /// as on glibc before 2.35 (`auto`, the default: glibc's where it has
    /// one). See `module_table`.
    pub module_table: bool,
    /// `HEAPDUMP_SAMPLE_RATE`: mean bytes between sampled allocations
    /// (`512KiB`, `2MiB`, `524288`); 0 (the default): every allocation.
    pub sample_rate: u64,
    /// `HEAPDUMP_SAMPLE_SEED`: seed of the sampling's random source
    /// (0, the default: from the clock), for reproducible runs.
    pub sample_seed: u64,
    /// `HEAPDUMP_ABLATE`: parts of the work left out, for benchmarks only
    /// (read only in builds with the `ablation` feature; see
    /// [`crate::ablation`]).
    pub ablate: u8,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            disabled: false,
            max_frames: MAX_FRAMES,
            signal: DEFAULT_SIGNAL,
            capacity: 16 << 20,
            shards: 256,
            resources_bytes: 256 << 20,
            quiet: false,
            unwind: UnwindMode::Auto,
            module_table: false,
            sample_rate: 0,
            sample_seed: 0,
            ablate: 0,
        }
    }
}

/// Longest settings text [`set_overrides`] keeps.
pub const OVERRIDES_MAX: usize = 1024;

/// Settings given by `heapdump attach` (`NAME=value` lines), which take
/// precedence over the environment of a process that was started long
/// before anyone chose them. Written once, before the agent starts
/// (`OVERRIDES_LEN` published with Release after the bytes), read with
/// Acquire; never changed after (a later attach must ask for the same
/// settings, see the preload's `heapdump_attach`).
struct Overrides(std::cell::UnsafeCell<[u8; OVERRIDES_MAX]>);
// SAFETY: written only before OVERRIDES_LEN is published, never after.
unsafe impl Sync for Overrides {}
static OVERRIDES: Overrides = Overrides(std::cell::UnsafeCell::new([0; OVERRIDES_MAX]));
static OVERRIDES_LEN: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Sets the settings that override `HEAPDUMP_*` environment variables
/// (`NAME=value` lines). Only the first call takes effect; returns false
/// (and changes nothing) after that or if `lines` is longer than
/// [`OVERRIDES_MAX`]. Call before the agent starts.
pub fn set_overrides(lines: &[u8]) -> bool {
    use std::sync::atomic::{AtomicBool, Ordering};
    static TAKEN: AtomicBool = AtomicBool::new(false);
    if lines.len() > OVERRIDES_MAX || TAKEN.swap(true, Ordering::AcqRel) {
        return false;
    }
    // SAFETY: the one winner of TAKEN writes the buffer before publishing
    // its length; readers read only `..OVERRIDES_LEN` after an Acquire
    // load of it.
    unsafe { (&mut *OVERRIDES.0.get())[..lines.len()].copy_from_slice(lines) };
    OVERRIDES_LEN.store(lines.len(), Ordering::Release);
    true
}

/// The value an override line gives `name`, if any.
fn overridden(name: &CStr) -> Option<&'static [u8]> {
    let n = OVERRIDES_LEN.load(std::sync::atomic::Ordering::Acquire);
    if n == 0 {
        return None;
    }
    // SAFETY: the first `n` bytes were written before the length was
    // published and never change again.
    let text: &'static [u8] = unsafe { &(&*OVERRIDES.0.get())[..n] };
    let name = name.to_bytes();
    text.split(|&b| b == b'\n').find_map(|line| {
        let rest = line.strip_prefix(name)?;
        rest.strip_prefix(b"=")
    })
}

/// The settings text given to [`set_overrides`] (empty if none).
pub fn overrides() -> &'static [u8] {
    let n = OVERRIDES_LEN.load(std::sync::atomic::Ordering::Acquire);
    // SAFETY: as in `overridden`.
    unsafe { &(&*OVERRIDES.0.get())[..n] }
}

extern "C" {
    /// glibc 2.17+: `getenv`, except that it returns NULL in a process
    /// with `AT_SECURE` set (set-user-ID, set-group-ID, capabilities).
    fn secure_getenv(name: *const libc::c_char) -> *mut libc::c_char;
}

fn env(name: &CStr) -> Option<&'static [u8]> {
    if let Some(v) = overridden(name) {
        return Some(v);
    }
    // SAFETY: secure_getenv is given a NUL-terminated name; the returned
    // pointer, if non-null, points at a NUL-terminated string in the
    // environment block, which lives for the process (we never call
    // setenv).
    unsafe {
        let p = secure_getenv(name.as_ptr());
        if p.is_null() {
            None
        } else {
            Some(CStr::from_ptr(p).to_bytes())
        }
    }
}

fn parse_u64(v: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(v).ok()?.trim();
    s.parse().ok()
}

fn truthy(v: &[u8]) -> bool {
    !matches!(v, b"" | b"0" | b"false" | b"no" | b"off")
}

/// Parses a signal given by number (`12`), name (`SIGUSR2`, `USR2`) or
/// real-time offset (`SIGRTMIN+3`); `0`/`none`/`off` disables. `None` if
/// unrecognised.
pub fn parse_signal(v: &[u8]) -> Option<libc::c_int> {
    parse_any_signal(v).filter(|&n| !REFUSED_SIGNALS.contains(&n))
}

/// Signals the agent never takes for snapshot requests: the faults
/// (a handler that returns would re-run the faulting instruction for
/// ever instead of letting the process crash), those that cannot be
/// caught, and job control (the shell's, not ours).
pub const REFUSED_SIGNALS: &[libc::c_int] = &[
    libc::SIGSEGV,
    libc::SIGBUS,
    libc::SIGILL,
    libc::SIGFPE,
    libc::SIGABRT,
    libc::SIGTRAP,
    libc::SIGSYS,
    libc::SIGKILL,
    libc::SIGSTOP,
    libc::SIGTSTP,
    libc::SIGTTIN,
    libc::SIGTTOU,
    libc::SIGCONT,
    libc::SIGCHLD,
];

fn parse_any_signal(v: &[u8]) -> Option<libc::c_int> {
    let s = std::str::from_utf8(v).ok()?.trim();
    if let Ok(n) = s.parse::<libc::c_int>() {
        return (0..=libc::SIGRTMAX()).contains(&n).then_some(n);
    }
    if s.eq_ignore_ascii_case("none") || s.eq_ignore_ascii_case("off") {
        return Some(0);
    }
    let name = match s.get(..3) {
        Some(p) if p.eq_ignore_ascii_case("SIG") => &s[3..],
        _ => s,
    };
    if name.len() >= 5 && name[..5].eq_ignore_ascii_case("RTMIN") {
        let rest = &name[5..];
        let off: libc::c_int = if rest.is_empty() {
            0
        } else {
            rest.strip_prefix('+')?.parse().ok()?
        };
        let n = libc::SIGRTMIN() + off;
        return (n <= libc::SIGRTMAX()).then_some(n);
    }
    let is = |n: &str| name.eq_ignore_ascii_case(n);
    [
        ("USR1", libc::SIGUSR1),
        ("USR2", libc::SIGUSR2),
        ("HUP", libc::SIGHUP),
        ("URG", libc::SIGURG),
        ("WINCH", libc::SIGWINCH),
        ("PROF", libc::SIGPROF),
        ("PWR", libc::SIGPWR),
    ]
    .into_iter()
    .find(|(n, _)| is(n))
    .map(|(_, v)| v)
}

/// Whether the agent may write its messages on this process's stderr.
///
/// `heapdump run` sets `HEAPDUMP_RUN_PID` to its own pid. The program it
/// started is its child; the programs *that* program runs inherit the
/// variable (and `LD_PRELOAD`) but have another parent, and their output
/// is not the agent's to write into (varnishd compiles its configuration
/// with cc, whose stderr varnish reads). So: no variable (a by-hand
/// `LD_PRELOAD`), or a parent that is `heapdump run`, speaks; everything
/// else is quiet. Decided once per loaded image, at its first call, and
/// kept across `fork` (a forked child is the same program).
pub fn speaks_here() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    static DECIDED: AtomicU8 = AtomicU8::new(0);
    match DECIDED.load(Ordering::Relaxed) {
        1 => return true,
        2 => return false,
        _ => {}
    }
    let speak = match env(c"HEAPDUMP_RUN_PID") {
        None => true,
        // SAFETY: getppid has no preconditions.
        Some(v) => parse_u64(v) == Some(unsafe { libc::getppid() } as u64),
    };
    // Relaxed: a racing first call decides the same (same environment,
    // same parent), so either store is right.
    DECIDED.store(if speak { 1 } else { 2 }, Ordering::Relaxed);
    speak
}

impl Config {
    /// Reads `HEAPDUMP_*` variables; invalid values keep the default (and
    /// are reported once on stderr by the caller via `warnings`).
    pub fn from_env() -> (Config, Warnings) {
        let mut c = Config::default();
        let mut w = Warnings::default();
        if let Some(v) = env(c"HEAPDUMP_DISABLE") {
            c.disabled = truthy(v);
        }
        if let Some(v) = env(c"HEAPDUMP_QUIET") {
            c.quiet = truthy(v);
        }
        if !speaks_here() {
            c.quiet = true;
        }
        if let Some(v) = env(c"HEAPDUMP_MAX_FRAMES") {
            match parse_u64(v) {
                Some(n) if (1..=MAX_FRAMES as u64).contains(&n) => c.max_frames = n as usize,
                _ => w.bad_max_frames = true,
            }
        }
        if let Some(v) = env(c"HEAPDUMP_SIGNAL") {
            match parse_signal(v) {
                Some(s) => c.signal = s,
                None => w.bad_signal = true,
            }
        }
        if let Some(v) = env(c"HEAPDUMP_CAPACITY") {
            match parse_u64(v) {
                Some(n) if (1..=heapdump_table::allocations_table::MAX_NODES).contains(&n) => {
                    c.capacity = n
                }
                _ => w.bad_capacity = true,
            }
        }
        if let Some(v) = env(c"HEAPDUMP_SHARDS") {
            match parse_u64(v) {
                Some(n) if n.is_power_of_two() && n <= 65536 => c.shards = n,
                _ => w.bad_shards = true,
            }
        }
        if let Some(v) = env(c"HEAPDUMP_RESOURCES_MB") {
            match parse_u64(v) {
                Some(n) if (1..=1 << 20).contains(&n) => c.resources_bytes = n << 20,
                _ => w.bad_resources = true,
            }
        }
        if let Some(v) = env(c"HEAPDUMP_UNWIND") {
            match v {
                b"auto" => c.unwind = UnwindMode::Auto,
                b"cfi" => c.unwind = UnwindMode::Cfi,
                b"fp" => c.unwind = UnwindMode::FramePointer,
                _ => w.bad_unwind = true,
            }
        }
        if let Some(v) = env(c"HEAPDUMP_MODULE_LOOKUP") {
            match v {
                b"auto" => c.module_table = false,
                b"table" => c.module_table = true,
                _ => w.bad_module_lookup = true,
            }
        }
        if let Some(v) = env(c"HEAPDUMP_SAMPLE_RATE") {
            let n = std::str::from_utf8(v)
                .ok()
                .and_then(|v| heapdump_table::byte_size::parse_byte_size(v).ok());
            match n {
                Some(n) if n <= heapdump_table::sampling::MAX_RATE => c.sample_rate = n,
                _ => w.bad_sample_rate = true,
            }
        }
        if let Some(v) = env(c"HEAPDUMP_SAMPLE_SEED") {
            match parse_u64(v) {
                Some(n) => c.sample_seed = n,
                None => w.bad_sample_rate = true,
            }
        }
        if cfg!(feature = "ablation") {
            if let Some(v) = env(c"HEAPDUMP_ABLATE") {
                c.ablate = crate::ablation::parse(v);
            }
        }
        (c, w)
    }
}

/// Which variables were set to values the agent could not use.
#[derive(Clone, Copy, Debug, Default)]
pub struct Warnings {
    /// `HEAPDUMP_MAX_FRAMES` invalid.
    pub bad_max_frames: bool,
    /// `HEAPDUMP_SIGNAL` invalid.
    pub bad_signal: bool,
    /// `HEAPDUMP_CAPACITY` invalid.
    pub bad_capacity: bool,
    /// `HEAPDUMP_SHARDS` invalid.
    pub bad_shards: bool,
    /// `HEAPDUMP_RESOURCES_MB` invalid.
    pub bad_resources: bool,
    /// `HEAPDUMP_UNWIND` invalid.
    pub bad_unwind: bool,
    /// `HEAPDUMP_MODULE_LOOKUP` invalid.
    pub bad_module_lookup: bool,
    /// `HEAPDUMP_SAMPLE_RATE` or `HEAPDUMP_SAMPLE_SEED` invalid.
    pub bad_sample_rate: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_parse_by_name_number_and_rt_offset() {
        assert_eq!(parse_signal(b"SIGUSR1"), Some(libc::SIGUSR1));
        assert_eq!(parse_signal(b"usr2"), Some(libc::SIGUSR2));
        assert_eq!(parse_signal(b"10"), Some(10));
        assert_eq!(parse_signal(b"none"), Some(0));
        assert_eq!(parse_signal(b"SIGRTMIN+2"), Some(libc::SIGRTMIN() + 2));
        assert_eq!(parse_signal(b"SIGKILLME"), None);
        assert_eq!(parse_signal(b"999"), None);
        for refused in [
            &b"11"[..],
            b"SIGSEGV",
            b"bus",
            b"7",
            b"4",
            b"8",
            b"6",
            b"9",
            b"19",
            b"20",
        ] {
            assert_eq!(parse_signal(refused), None, "{refused:?}");
        }
    }
}
