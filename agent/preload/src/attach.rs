//! `heapdump attach` / `detach`, the agent's half: the entry points the
//! injector calls in a running process after it `dlopen`ed this library,
//! and the housekeeping thread an attached agent keeps.
//!
//! Invariants:
//! - Attach, detach and the housekeeping pass hold [`STATE`]'s lock, so
//!   slots are redirected and restored by one thread at a time.
//! - The agent's settings are fixed by the first attach (the recording
//!   mode cannot change under records already made): a later attach that
//!   asks for other settings is refused and changes nothing.
//! - A re-attach after a detach forgets every record first (the frees made
//!   while detached were not seen), before any slot leads to a hook again.
//!   That work grows with what the first attach left live (a million
//!   records: hundreds of milliseconds), so it is not done in the thread
//!   the injector borrowed (held stopped meanwhile): `heapdump_attach`
//!   hands it to the housekeeping thread and returns [`codes::RESUMING`] at
//!   once; that thread forgets, redirects the slots and then stamps the
//!   header attached, which `heapdump attach` waits for. Without a
//!   housekeeping thread (it could not be started) it is done in place.
//! - Nothing here runs in a hook: every function is called by the
//!   injector's thread or the housekeeping thread, where allocating and
//!   locking are fine.

use std::ffi::{c_char, c_int, CStr};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use heapdump_table::header::HeapSource;

use crate::slot_redirection::{self, Hooks};

/// `heapdump_attach`'s refusals (its positive results count slots).
pub mod codes {
    /// Not x86_64, or the program's `malloc`/`free` could not be found.
    pub const UNSUPPORTED: i32 = -1;
    /// Attached already.
    pub const ALREADY_ATTACHED: i32 = -2;
    /// Attached before with other settings (the mode is fixed once started).
    pub const OTHER_SETTINGS: i32 = -3;
    /// The agent could not start (disabled, or no shared memory).
    pub const NOT_STARTED: i32 = -4;
    /// The library was preloaded: the process is recorded from its start.
    pub const PRELOADED: i32 = -5;
    /// Not a refusal: a re-attach, finished by the housekeeping thread
    /// (forget the previous records, redirect the slots, stamp the header
    /// attached); the caller waits for the stamp.
    pub const RESUMING: i32 = -6;
}

/// What the attach has done so far.
struct State {
    /// Our hooks, found at the first attach (`None`: never attached).
    hooks: Option<Hooks>,
    /// Recording now (false after a detach; the regions stay readable).
    recording: bool,
    /// A re-attach the housekeeping thread is to finish.
    resume: bool,
    /// The housekeeping thread runs.
    housekeeping: bool,
}

static STATE: Mutex<State> = Mutex::new(State {
    hooks: None,
    recording: false,
    resume: false,
    housekeeping: false,
});

/// Wakes the housekeeping thread (a re-attach to finish).
static WAKE: Condvar = Condvar::new();

fn lock() -> std::sync::MutexGuard<'static, State> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// `heapdump_attach(settings)`: starts recording in a process that was
/// running without the agent. `settings` (may be NULL) holds
/// `HEAPDUMP_*=value` lines that take the place of the environment
/// variables. Returns the number of relocation slots redirected (> 0), or
/// one of [`codes`].
///
/// # Safety
/// `settings` is NULL or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn heapdump_attach(settings: *const c_char) -> c_int {
    use heapdump_agent::recorder::{forget_all_records, forwarding, start_attached};
    let settings: &[u8] = if settings.is_null() {
        b""
    } else {
        // SAFETY: the caller passes a NUL-terminated string.
        unsafe { CStr::from_ptr(settings) }.to_bytes()
    };
    if crate::preloaded::preloaded() {
        return codes::PRELOADED;
    }
    let mut state = lock();
    if state.recording || state.resume {
        return codes::ALREADY_ATTACHED;
    }
    let first = state.hooks.is_none();
    if first {
        if !heapdump_agent::config::set_overrides(settings) {
            return codes::OTHER_SETTINGS;
        }
        let Some(hooks) = forwarding(slot_redirection::prepare) else {
            return codes::UNSUPPORTED;
        };
        // Held-back frees are not used when attached: after a detach no
        // hook would run to release what a thread still holds.
        crate::cxx::note_next_operators();
        forwarding(crate::in_place_realloc::choose);
        state.hooks = Some(hooks);
    } else {
        // Attached before and detached: the mode is fixed, and the frees
        // made while detached were not seen, so every record is stale.
        if settings != heapdump_agent::config::overrides() {
            return codes::OTHER_SETTINGS;
        }
        if state.housekeeping {
            state.resume = true;
            WAKE.notify_all();
            return codes::RESUMING;
        }
        forget_all_records();
    }
    if !start_attached() {
        return codes::NOT_STARTED;
    }
    let hooks = state.hooks.as_ref().expect("set above");
    let n = forwarding(|| slot_redirection::redirect_all(hooks));
    state.recording = true;
    drop(state);
    if first {
        // What the spawn allocates is the agent's, not the program's.
        forwarding(start_housekeeping);
    }
    n as c_int
}

/// `heapdump_detach()`: puts every redirected slot back, so the process
/// calls its allocator directly again; the regions stay readable. Returns
/// the number of slots restored, or -1 when not attached.
#[no_mangle]
pub extern "C" fn heapdump_detach() -> c_int {
    let mut state = lock();
    let (true, Some(hooks)) = (state.recording, state.hooks.as_ref()) else {
        return -1;
    };
    let n = heapdump_agent::recorder::forwarding(|| slot_redirection::restore_all(hooks));
    heapdump_agent::recorder::mark_detached();
    state.recording = false;
    n as c_int
}

/// Starts the thread that, once a second while attached, redirects the
/// slots of libraries `dlopen`ed since and stores the allocator's own
/// whole-heap figure in the header.
fn start_housekeeping() {
    // A bare pthread, not `std::thread`: std's spawn registers thread-local
    // destructors (its spawn hooks) with `__cxa_thread_atexit_impl`, which
    // allocates, in the spawning thread (the program's, borrowed by the
    // injector) and in the new one; those blocks showed in every snapshot
    // of an attached process as the program's heap. Here what may allocate
    // runs inside `forwarding`, and the spawn allocates nothing.
    extern "C" fn housekeeping(_: *mut libc::c_void) -> *mut libc::c_void {
        use heapdump_agent::recorder::{self, forwarding};
        // Everything that may allocate runs inside `forwarding`; the lock,
        // the wait and the forgetting (whose frees must be seen by the
        // recorder, and whose reading of the table is wrapped itself)
        // allocate nothing.
        let mut state = lock();
        // When to read the allocator's own figure next (`None`: never
        // again, see `heap_read_pause`).
        let mut next_heap_read = Some(std::time::Instant::now());
        loop {
            if state.resume {
                // A re-attach: nothing records meanwhile (the slots still
                // lead to the allocator), so the stale records go without
                // a race, then the slots are redirected and the header
                // says attached.
                recorder::forget_all_records();
                if let Some(hooks) = state.hooks.as_ref() {
                    forwarding(|| slot_redirection::redirect_all(hooks));
                }
                state.recording = true;
                state.resume = false;
                forwarding(recorder::start_attached);
            }
            if let (true, Some(hooks)) = (state.recording, state.hooks.as_ref()) {
                forwarding(|| {
                    slot_redirection::redirect_all(hooks);
                    let now = std::time::Instant::now();
                    if next_heap_read.is_some_and(|at| now >= at) {
                        let figure = allocator_heap();
                        let took = now.elapsed();
                        if let Some((source, bytes)) = figure {
                            recorder::set_allocator_heap(source, bytes);
                        }
                        next_heap_read = heap_read_pause(took).map(|pause| now + took + pause);
                    }
                });
            }
            state = WAKE
                .wait_timeout(state, Duration::from_secs(1))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
    // The thread blocks every signal, from its first instruction: it is
    // created with all of them blocked (a new thread inherits its
    // creator's mask; the creator, the program's thread the injector
    // borrowed, gets its own mask back at once). Otherwise the kernel
    // may hand it a signal sent to the process that the program's own
    // threads block, and the program's handler then runs on our thread,
    // beside the program's code: postgres's postmaster blocks signals
    // outside `select`, so its SIGCHLD handler ran here (found by
    // `scripts/compat_services.py`), inside gettext's read lock of the
    // locale, while the main thread forked a backend, which then waited
    // forever for that lock in `setlocale`. A single-threaded program's
    // handlers must never run concurrently with it.
    //
    // SAFETY: plain pthread calls with valid pointers to locals; the
    // attribute object is initialised before use and destroyed after;
    // the signal sets are initialised by `sigfillset`/`pthread_sigmask`
    // before they are read. Without the thread, later libraries are not
    // redirected and no heap figure is shown; recording goes on.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_attr_init(&mut attr) != 0 {
            return;
        }
        libc::pthread_attr_setstacksize(&mut attr, 256 << 10);
        libc::pthread_attr_setdetachstate(&mut attr, libc::PTHREAD_CREATE_DETACHED);
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        let masked = libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old) == 0;
        let mut t: libc::pthread_t = 0;
        // No thread that could run the program's handlers.
        let created =
            masked && libc::pthread_create(&mut t, &attr, housekeeping, std::ptr::null_mut()) == 0;
        if masked {
            libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        }
        if created {
            libc::pthread_setname_np(t, c"heapdump-attach".as_ptr());
            lock().housekeeping = true;
        }
        libc::pthread_attr_destroy(&mut attr);
    }
}

/// The longest a read of the allocator's own figure may hold the
/// program's allocator (DESIGN's bound for stopping a thread of an
/// attached process).
const HEAP_READ_MAX: Duration = Duration::from_millis(20);

/// How long to wait after a read of the allocator's figure that took
/// `took` before the next one; `None`: no more reads.
///
/// glibc's `mallinfo2` holds each arena's lock while it counts every free
/// chunk in the arena's bins: on a fragmented heap that is long (tens to
/// hundreds of milliseconds for a million free chunks), and every thread
/// allocating in that arena waits meanwhile.
/// So the reads take at most a thousandth of the time (a wait of 1 000
/// times the last read, at least a second), and a read that held the
/// allocator longer than [`HEAP_READ_MAX`] is the last: the figure stays
/// with the time it was read, which every snapshot shows.
fn heap_read_pause(took: Duration) -> Option<Duration> {
    (took <= HEAP_READ_MAX).then(|| (took * 1000).max(Duration::from_secs(1)))
}

/// The allocator's own figure for the bytes its program holds, from the
/// allocator that defines the `malloc` the program calls.
fn allocator_heap() -> Option<(HeapSource, u64)> {
    let malloc = crate::next_allocator::malloc()? as usize;
    let base = crate::next_allocator::object_base_of(malloc);
    let sym = |name: &CStr| {
        // SAFETY: dlsym with a NUL-terminated name.
        let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) } as usize;
        (f != 0 && crate::next_allocator::object_base_of(f) == base).then_some(f)
    };
    if let Some(mallctl) = sym(c"mallctl") {
        type Mallctl = unsafe extern "C" fn(
            *const c_char,
            *mut libc::c_void,
            *mut usize,
            *mut libc::c_void,
            usize,
        ) -> c_int;
        // SAFETY: jemalloc's mallctl, with the types its documentation
        // gives: "epoch" takes a uint64_t to refresh the statistics,
        // "stats.allocated" yields a size_t.
        unsafe {
            let f: Mallctl = std::mem::transmute(mallctl);
            let mut epoch: u64 = 1;
            let mut len = std::mem::size_of::<u64>();
            f(
                c"epoch".as_ptr(),
                (&mut epoch as *mut u64).cast(),
                &mut len,
                (&mut epoch as *mut u64).cast(),
                len,
            );
            let mut v: usize = 0;
            let mut len = std::mem::size_of::<usize>();
            if f(
                c"stats.allocated".as_ptr(),
                (&mut v as *mut usize).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            ) == 0
            {
                return Some((HeapSource::JemallocStatsAllocated, v as u64));
            }
        }
        return None;
    }
    if let Some(get) = sym(c"MallocExtension_GetNumericProperty") {
        type Get = unsafe extern "C" fn(*const c_char, *mut usize) -> c_int;
        // SAFETY: gperftools' C API: (property name, size_t *out) -> int.
        unsafe {
            let f: Get = std::mem::transmute(get);
            let mut v: usize = 0;
            if f(c"generic.current_allocated_bytes".as_ptr(), &mut v) != 0 {
                return Some((HeapSource::TcmallocCurrentAllocated, v as u64));
            }
        }
        return None;
    }
    if crate::next_allocator::defined_in(malloc, b"libc.so") {
        /// glibc's `struct mallinfo2` (2.33+): ten `size_t`s.
        #[repr(C)]
        #[allow(dead_code)] // the layout needs every field; two are read
        struct MallInfo2 {
            arena: usize,
            ordblks: usize,
            smblks: usize,
            hblks: usize,
            hblkhd: usize,
            usmblks: usize,
            fsmblks: usize,
            uordblks: usize,
            fordblks: usize,
            keepcost: usize,
        }
        if let Some(f) = sym(c"mallinfo2") {
            // SAFETY: glibc's `struct mallinfo2 mallinfo2(void)`, returned
            // in memory (the struct is larger than two words) as the C ABI
            // says; the Rust declaration has the same layout and ABI.
            let m = unsafe {
                let f: unsafe extern "C" fn() -> MallInfo2 = std::mem::transmute(f);
                f()
            };
            return Some((HeapSource::GlibcMallinfo2, (m.uordblks + m.hblkhd) as u64));
        }
        /// glibc's `struct mallinfo` (before 2.33 the only one): ten `int`s.
        #[repr(C)]
        #[allow(dead_code)] // the layout needs every field; two are read
        struct MallInfo {
            arena: c_int,
            ordblks: c_int,
            smblks: c_int,
            hblks: c_int,
            hblkhd: c_int,
            usmblks: c_int,
            fsmblks: c_int,
            uordblks: c_int,
            fordblks: c_int,
            keepcost: c_int,
        }
        // glibc before 2.33: 32-bit counters, which wrap past 4 GiB (the
        // source's name says so in every report).
        let f = sym(c"mallinfo")?;
        // SAFETY: glibc's `struct mallinfo mallinfo(void)`, returned in
        // memory as the C ABI says; same layout and ABI here.
        let m = unsafe {
            let f: unsafe extern "C" fn() -> MallInfo = std::mem::transmute(f);
            f()
        };
        let bytes = u64::from(m.uordblks as u32) + u64::from(m.hblkhd as u32);
        return Some((HeapSource::GlibcMallinfo, bytes));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_allocators_figure_is_read_at_most_a_thousandth_of_the_time_and_never_after_a_long_read()
    {
        let ms = Duration::from_millis;
        // Cheap reads: once a second.
        assert_eq!(heap_read_pause(Duration::from_micros(30)), Some(ms(1000)));
        assert_eq!(heap_read_pause(ms(1)), Some(ms(1000)));
        // Dearer ones: a thousand times their length.
        assert_eq!(heap_read_pause(ms(5)), Some(ms(5000)));
        assert_eq!(heap_read_pause(HEAP_READ_MAX), Some(ms(20_000)));
        // A read that held the allocator past the bound is the last.
        assert_eq!(heap_read_pause(ms(21)), None);
        assert_eq!(heap_read_pause(ms(145)), None);
    }
}
