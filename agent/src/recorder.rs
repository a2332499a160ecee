//! The recorder: process-wide agent state and the work done for each
//! allocation event, shared by the `GlobalAlloc` wrapper and the
//! `LD_PRELOAD` library.
//!
//! Invariants:
//! - State machine `UNINIT -> INITIALIZING -> READY` (or `DISABLED`). One
//!   thread wins the CAS to INITIALIZING and builds the regions with its
//!   `busy` flag set; other threads' events meanwhile pass through
//!   unrecorded and are counted as dropped (`not_ready`). READY is stored
//!   with Release after the region statics are written; every reader
//!   loads it with Acquire before touching them.
//! - Nothing on the event path allocates, blocks on a lock another process
//!   holds, or panics into the caller: failures become dropped counts.
//! - A block is removed from the table *before* the memory is returned to
//!   the allocator (free, and realloc, which may move), so an address
//!   reused by another thread can never be removed by a late free.
//! - After `fork`, the child unmaps its parent's regions in the atfork
//!   child handler (closing their descriptors only where `fstat` proves
//!   they are still the memfds: the program may have closed them and
//!   reused the numbers, see `heapdump_table::region`), and creates its own
//!   at once, so a child is visible and dumpable from birth even if it
//!   never records an event (a sampled child may not for a long time): it
//!   never writes into its parent's regions. Its new table holds the
//!   records the parent copied for it in the prepare handler, when that
//!   copy is exact (`fork_inheritance`), else nothing from before the
//!   fork.
//!
//! The exact-mode allocation path, top to bottom (the preload's
//! `malloc_family::malloc_slow` and `cxx::new_slow`, with the path
//! inlined: [`on_alloc_inlined`], [`on_alloc_decided`]; every other hook
//! and the Rust `Agent`: [`on_alloc`] -> `record_weighted`): the thread's
//! state (`thread_state::with`, busy flag), `prepare_thread`, `stack_key` (the thread's `trace_shortcut`, which
//! answers a walk it has seen from the same start with every stack word
//! unchanged; else the walk, `cfi_unwind::walk_trace` with the thread's
//! `stack_memo`; then the thread's stack cache, a block of the
//! resources region; interning on a miss), the clock, the table insert
//! (into the thread's young ring, or straight into the index while the
//! thread's blocks outlive the ring: `young_policy`), the per-stack
//! counters (in the stack cache's slot). A free:
//! [`on_free_deferred`] -> `remove_block`. Budget (DESIGN §6, issue 30):
//! at most 350 instructions added per malloc+free pair at 4 frames, 700 on
//! the churn, 3 L1 data misses; `bench/instructions --parts` counts them
//! per part (session 31, 2026-11-28: +751 and +1396 instructions, +3.2
//! and +6.7 misses on this machine's cache model, +623 on a young block's
//! pair, +633 on a C++ one: far over; see docs/benchmarks.md), and CI
//! fails when they grow past `bench/instructions-budget.json`. A
//! `realloc` on jemalloc of a block in the thread's young ring keeps its
//! record ([`on_realloc_in_place`]).

use std::cell::UnsafeCell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};

use heapdump_table::allocations_table::YOUNG_RINGS;
use heapdump_table::allocations_table::{NodeCache, OWNER_TABLES};
use heapdump_table::header::{DroppedReason, HeaderCounters};
use heapdump_table::resources_table::CacheSlot;
use heapdump_table::stack_compression::{encode_into, MAX_ENCODED_LEN, MAX_FRAMES};
use heapdump_table::{
    AllocationRecord, AllocationsConfig, AllocationsWriter, InsertError, OwnedInsert, RegionWriter,
    ResourceKey, ResourcesReader, ResourcesWriter, YoungRegistry,
};

use crate::ablation;
use crate::cfi_unwind::Trace;
use crate::config::{Config, UnwindMode, Warnings};
use crate::stack_capture;
use crate::thread_state::{ThreadState, NO_RING};

const UNINIT: u8 = 0;
const INITIALIZING: u8 = 1;
const READY: u8 = 2;
const DISABLED: u8 = 3;

static STATE: AtomicU8 = AtomicU8::new(UNINIT);
static GENERATION: AtomicU64 = AtomicU64::new(1);
static NOT_READY: AtomicU64 = AtomicU64::new(0);
static ONCE_HOOKS: AtomicBool = AtomicBool::new(false);
/// The [`Role`] of the hook that first started the agent (as `u8`), so a
/// fork child starts its own regions in the same role.
static ROLE: AtomicU8 = AtomicU8::new(Role::Preload as u8);
/// Bumped when every thread is to look at itself again at its next event
/// (`look_at_thread`): after a thread is renamed ([`thread_renamed`]), and
/// once a release function is set ([`set_release`]: threads may then hold
/// freed blocks back).
static NAME_EPOCH: AtomicU64 = AtomicU64::new(0);
/// In a fork child, the pid of the process whose regions it let go of at
/// the fork (written into its own regions' header: its table starts empty,
/// the blocks it inherited are that process's records); 0 otherwise.
static FORKED_FROM: AtomicU64 = AtomicU64::new(0);
/// pthread key whose destructor settles a thread's node cache at exit.
static EXIT_KEY: AtomicU64 = AtomicU64::new(u64::MAX);
/// The allocator's own free (`unsafe extern "C" fn(*mut c_void)`), set by
/// the preload library; 0 = frees are never deferred.
static RELEASE: AtomicUsize = AtomicUsize::new(0);

/// The threads' young rings (exact mode: each thread's last 16 blocks,
/// kept out of the table's shared index; see
/// `heapdump_table::allocations_table`'s `young.rs`).
static YOUNG: YoungRegistry = YoungRegistry::new();

/// Frees of recorded blocks up to this size may have their release to the
/// allocator deferred (bounds what a quiet thread keeps back:
/// `DEFER_DEPTH` blocks of at most this size).
pub const DEFER_MAX_SIZE: u64 = 16 << 10;

/// A static slot written once per generation before READY is published.
struct Slot<T>(UnsafeCell<MaybeUninit<T>>);
// SAFETY: the slot is written only by the one thread that owns the
// INITIALIZING state (or the single thread of a freshly forked child), and
// read only after observing READY with Acquire, which orders the write
// before every read.
unsafe impl<T> Sync for Slot<T> {}

static RESOURCES_REGION: Slot<RegionWriter> = Slot(UnsafeCell::new(MaybeUninit::uninit()));
static ALLOCATIONS_REGION: Slot<RegionWriter> = Slot(UnsafeCell::new(MaybeUninit::uninit()));
static WRITERS: Slot<Writers> = Slot(UnsafeCell::new(MaybeUninit::uninit()));

struct Writers {
    resources: ResourcesWriter<'static>,
    allocations: AllocationsWriter<'static>,
    counters: HeaderCounters,
    /// The peak words, for the free path.
    peak: heapdump_table::peak::PeakProbe,
    clock_base_ns: u64,
    /// The settings in force (`unwind` is the unwinder actually used: frame
    /// pointers where CFI cannot be read).
    config: Config,
}

/// The writers, if the agent is READY.
#[inline]
fn writers() -> Option<&'static Writers> {
    if STATE.load(Ordering::Acquire) == READY {
        if crate::fork_guard::forked() {
            // A fork child that the atfork handler did not run in.
            return forked_without_handlers();
        }
        // SAFETY: READY (Acquire) is published only after WRITERS was
        // written (see `init`), and WRITERS is not rewritten while READY
        // (in a fork child, not before the guard word is set again: see
        // `fork_guard`, whose Acquire load orders this read after the
        // child's own writers).
        Some(unsafe { (*WRITERS.0.get()).assume_init_ref() })
    } else {
        None
    }
}

/// A fork child made without the atfork handlers (`fork_guard`): lets go
/// of the parent's regions as [`after_fork_child`] does; the event that
/// found out passes unrecorded, and `ready_writers` makes the child's own
/// regions at once. One thread does it (the child's first event is made
/// by its one thread, unless it started threads without allocating);
/// others pass through meanwhile.
#[cold]
#[inline(never)]
fn forked_without_handlers() -> Option<&'static Writers> {
    if STATE
        .compare_exchange(READY, INITIALIZING, Ordering::Acquire, Ordering::Relaxed)
        .is_ok()
    {
        forget_parent(true, false);
    }
    None
}

fn stderr(msg: &[u8]) {
    // SAFETY: write(2) on fd 2 with a valid buffer; the result is ignored
    // (a closed stderr must not matter).
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
    }
}

fn report_warnings(w: &Warnings) {
    let pairs = [
        (
            w.bad_max_frames,
            &b"heapdump: ignoring invalid HEAPDUMP_MAX_FRAMES (1..=64)\n"[..],
        ),
        (
            w.bad_signal,
            b"heapdump: ignoring HEAPDUMP_SIGNAL: not a signal, or one the agent never takes (faults, SIGKILL, SIGSTOP, job control)\n",
        ),
        (
            w.bad_capacity,
            b"heapdump: ignoring invalid HEAPDUMP_CAPACITY\n",
        ),
        (
            w.bad_shards,
            b"heapdump: ignoring invalid HEAPDUMP_SHARDS (power of two <= 65536)\n",
        ),
        (
            w.bad_resources,
            b"heapdump: ignoring invalid HEAPDUMP_RESOURCES_MB\n",
        ),
        (
            w.bad_unwind,
            b"heapdump: ignoring invalid HEAPDUMP_UNWIND (auto, cfi or fp)\n",
        ),
        (
            w.bad_module_lookup,
            b"heapdump: ignoring invalid HEAPDUMP_MODULE_LOOKUP (auto or table)\n",
        ),
        (
            w.bad_sample_rate,
            b"heapdump: ignoring invalid HEAPDUMP_SAMPLE_RATE / HEAPDUMP_SAMPLE_SEED (bytes such as 512KiB; a number)\n",
        ),
    ];
    for (bad, msg) in pairs {
        if bad {
            stderr(msg);
        }
    }
}

/// Makes the agent READY if it can. Returns the writers, or `None` while
/// another thread initialises, or if the agent is disabled.
/// Must be called with this thread's `busy` flag set.
#[cold]
fn init(role: Role) -> Option<&'static Writers> {
    if STATE
        .compare_exchange(UNINIT, INITIALIZING, Ordering::Acquire, Ordering::Acquire)
        .is_err()
    {
        return writers();
    }
    let (config, warnings) = Config::from_env();
    if !config.quiet {
        report_warnings(&warnings);
    }
    if config.disabled || SANDBOXED.load(Ordering::Relaxed) {
        STATE.store(DISABLED, Ordering::Release);
        return None;
    }
    ROLE.store(role as u8, Ordering::Relaxed);
    if role == Role::GlobalAlloc && preload_present() {
        // The program also runs under libheapdump_preload.so, which records
        // the same blocks (the inner allocator's malloc): one agent is
        // enough, and two pairs of regions would confuse the dumper.
        if !config.quiet {
            stderr(
                b"heapdump: libheapdump_preload.so is active; the Agent allocator steps aside\n",
            );
        }
        STATE.store(DISABLED, Ordering::Release);
        return None;
    }
    let made = ResourcesWriter::create_region(
        config.resources_bytes,
        heapdump_table::resources_table::DEFAULT_BUCKETS,
    )
    .and_then(|r| {
        AllocationsWriter::create_region(AllocationsConfig {
            capacity: config.capacity,
            shards: config.shards,
        })
        .map(|a| (r, a))
    });
    let (res, alloc) = match made {
        Ok(p) => p,
        Err(e) => {
            if !config.quiet {
                stderr(b"heapdump: cannot create shared regions, not recording: ");
                let mut buf = [0u8; 256];
                let mut cur = std::io::Cursor::new(&mut buf[..]);
                let _ = std::io::Write::write_fmt(&mut cur, format_args!("{e}\n"));
                let n = cur.position() as usize;
                stderr(&buf[..n]);
            }
            STATE.store(DISABLED, Ordering::Release);
            return None;
        }
    };
    // SAFETY: we own INITIALIZING, so nobody reads or writes these slots
    // concurrently; previous contents (a forked child's parent regions)
    // were already released by `after_fork_child`, so overwriting without
    // dropping leaks nothing.
    let w = unsafe {
        (*RESOURCES_REGION.0.get()).write(res);
        (*ALLOCATIONS_REGION.0.get()).write(alloc);
        let res: &'static RegionWriter = (*RESOURCES_REGION.0.get()).assume_init_ref();
        let alloc: &'static RegionWriter = (*ALLOCATIONS_REGION.0.get()).assume_init_ref();
        let (Ok(resources), Ok(allocations)) =
            (ResourcesWriter::new(res), AllocationsWriter::new(alloc))
        else {
            STATE.store(DISABLED, Ordering::Release);
            return None;
        };
        let mut config = config;
        let wanted = config.unwind;
        config.unwind = effective_unwind(wanted, config.module_table);
        alloc.set_unwinder(if config.unwind != wanted {
            // Said in every snapshot: stacks stop at code without frame
            // pointers here, and why.
            heapdump_table::header::Unwinder::FramePointerNoCfi.code()
        } else {
            config.unwind.code()
        });
        alloc.set_sample_rate(config.sample_rate);
        alloc.set_agent_kind(match role {
            Role::Preload => heapdump_table::header::AgentKind::Preload,
            Role::GlobalAlloc => heapdump_table::header::AgentKind::RustAgent,
        });
        alloc.set_header_word(
            heapdump_table::header::offsets::FORKED_FROM,
            FORKED_FROM.load(Ordering::Relaxed),
        );
        crate::sampling::configure(config.sample_rate, config.sample_seed);
        (*WRITERS.0.get()).write(Writers {
            resources,
            allocations,
            counters: alloc.counters(),
            peak: match heapdump_table::peak::PeakProbe::new(alloc.view()) {
                Some(p) => p,
                None => {
                    STATE.store(DISABLED, Ordering::Release);
                    return None;
                }
            },
            clock_base_ns: alloc.header().clock_monotonic_ns,
            config,
        })
    };
    let missed = NOT_READY.swap(0, Ordering::Relaxed);
    w.counters.on_dropped_n(DroppedReason::NotReady, missed);
    if !ONCE_HOOKS.swap(true, Ordering::Relaxed) {
        if !config.quiet && stack_capture::frame_pointers_kept() == Some(false) {
            stderr(
                b"heapdump: this build of the agent has no frame pointers, so stack traces \
                  miss their innermost frames; rebuild with -C force-frame-pointers=yes \
                  (a RUSTFLAGS variable replaces the workspace's setting)\n",
            );
        }
        crate::signal::install(config.signal, config.quiet);
        // SAFETY: registering plain `extern "C"` functions without
        // arguments; pthread_atfork may allocate, which passes through
        // because this thread is busy.
        unsafe {
            libc::pthread_atfork(
                Some(before_fork),
                Some(after_fork_parent),
                Some(after_fork_child),
            );
            let mut key: libc::pthread_key_t = 0;
            if libc::pthread_key_create(&mut key, Some(thread_exit)) == 0 {
                EXIT_KEY.store(u64::from(key), Ordering::Relaxed);
            }
        }
    }
    {
        // The memory curve starts where recording starts, at zero.
        // SAFETY: written above, in this same initialisation.
        let alloc = unsafe { (*ALLOCATIONS_REGION.0.get()).assume_init_ref() };
        heapdump_table::timeline::append(
            &alloc.view(),
            heapdump_table::timeline::Point {
                time_ns: heapdump_table::monotonic_ns(),
                ..Default::default()
            },
        );
    }
    if ATTACHED_MODE.load(Ordering::Relaxed) {
        // Loaded by `heapdump attach`: this process (or this fork child of
        // an attached process) is recorded from now on.
        // SAFETY: written above, in this same initialisation.
        let alloc = unsafe { (*ALLOCATIONS_REGION.0.get()).assume_init_ref() };
        alloc.set_header_word(
            heapdump_table::header::offsets::ATTACHED_AT,
            heapdump_table::monotonic_ns(),
        );
    }
    GENERATION.fetch_add(1, Ordering::Relaxed);
    // The filters the regions were made under (a fork child under others
    // makes none, see `after_fork_child`).
    crate::seccomp_guard::note_start();
    if SANDBOXED.load(Ordering::Relaxed) {
        // The program sandboxed itself while this thread was starting the
        // agent (`sandboxed` found INITIALIZING, not READY).
        STATE.store(DISABLED, Ordering::Release);
        return None;
    }
    // A fork child made without the atfork handlers will read the guard
    // word 0 (`fork_guard`); set after the slots above.
    crate::fork_guard::arm();
    // Release: the slots above are written before any thread sees READY.
    STATE.store(READY, Ordering::Release);
    Some(w)
}

/// The unwinder that can be used for `wanted`: CFI needs a way to find a
/// counter's module (glibc's `_dl_find_object`, 2.35+, or
/// the agent's own table: `module_table` forces it); otherwise frame
/// pointers. May allocate (dlsym): called during set-up only.
fn effective_unwind(wanted: UnwindMode, module_table: bool) -> UnwindMode {
    if wanted != UnwindMode::FramePointer && crate::cfi_unwind::init(module_table) {
        return wanted;
    }
    UnwindMode::FramePointer
}

/// Which hook started the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Role {
    /// The `Agent` global allocator of a Rust program.
    GlobalAlloc = 0,
    /// The `LD_PRELOAD` library.
    Preload = 1,
}

/// True when `libheapdump_preload.so` is loaded in this process (its C
/// API symbol is visible). May allocate (dlsym): called during set-up only.
fn preload_present() -> bool {
    // SAFETY: dlsym with a valid NUL-terminated name; the result is only
    // compared with null.
    !unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"heapdump_request_snapshot".as_ptr()) }.is_null()
}

/// atfork prepare handler, in the parent: a copy of the live records for
/// the child, when it can be exact (`fork_inheritance`: the preload's
/// agent, a process of one thread, not forking from inside the agent).
extern "C" fn before_fork() {
    if ROLE.load(Ordering::Relaxed) != Role::Preload as u8 {
        // The Rust `Agent` may keep node numbers in its blocks' headers,
        // which would name other nodes in the child's table.
        return;
    }
    let Some(w) = writers() else {
        return;
    };
    if SANDBOXED.load(Ordering::Relaxed) {
        // A filter installed since the regions were made may forbid the
        // copy's calls (`may_copy` looks for one installed otherwise).
        return;
    }
    let detached = allocations_region()
        .and_then(|r| {
            r.view()
                .load_u64(heapdump_table::header::offsets::DETACHED_AT)
        })
        .is_some_and(|at| at != 0);
    if detached {
        // After `heapdump detach` the frees went unseen: the records are
        // stale, and would be blocks the child does not hold.
        return;
    }
    crate::thread_state::with(|t| {
        if t.busy.get() {
            // A fork from a signal handler that interrupted an event.
            return;
        }
        t.busy.set(true);
        if crate::fork_inheritance::may_copy() {
            crate::fork_inheritance::copy(&w.allocations, t.allocs.get());
        }
        t.busy.set(false);
    });
}

/// atfork parent handler: the parent lets go of the copy it made for the
/// child.
extern "C" fn after_fork_parent() {
    crate::fork_inheritance::release();
}

/// atfork child handler: release the parent's regions (unmap them, and
/// close their memfds where the descriptors still name them) so the child
/// can never write into them, then build the child's own at once, with
/// the records the parent copied for it (`fork_inheritance`), if it did.
extern "C" fn after_fork_child() {
    // First: anything below may count allocations.
    let allocs = crate::thread_state::with(|t| t.allocs.get());
    let was_ready = STATE.load(Ordering::Acquire) == READY;
    // SAFETY: the records are used below and released before returning.
    let inherited = allocs
        .filter(|_| was_ready)
        .and_then(|n| unsafe { crate::fork_inheritance::records(n) });
    let parent = forget_parent(was_ready, inherited.is_some());
    if was_ready && STATE.load(Ordering::Relaxed) == UNINIT {
        // The child's own regions now, not at its first recorded event: in
        // sampled mode that may be never (a postgres checkpointer), and the
        // child would look uninstrumented and get no final snapshot. A few
        // system calls; the forking thread is not inside the agent, and
        // anything `init` allocates passes through (busy flag).
        let role = if ROLE.load(Ordering::Relaxed) == Role::GlobalAlloc as u8 {
            Role::GlobalAlloc
        } else {
            Role::Preload
        };
        with_thread(|t| {
            let w = ready_writers(role);
            if let (Some(w), Some(records), Some(parent)) = (w, inherited, parent.as_ref()) {
                // Its own allocations (the key maps) pass through, not
                // counted as dropped events.
                t.internal.set(true);
                adopt_inherited(w, t, records, parent);
                t.internal.set(false);
            }
        });
    }
    drop(parent);
    crate::fork_inheritance::release();
}

/// What a fork child keeps of its parent's regions while it adopts the
/// records the parent copied for it: the parent's resources region
/// (mapped, read only here: the records' stack and thread keys are its
/// offsets, and what lies at a key never changes) and the clock base of
/// the records' times.
struct Parent {
    resources: RegionWriter,
    clock_base_ns: u64,
}

/// Inserts the records the parent copied at the fork
/// (`fork_inheritance`) into this fork child's new table: their stacks
/// and threads interned into its resources, their times moved to its
/// clock base (a block older than the child's regions is dated at their
/// making), each counted as an allocation of its stack. Says how many in
/// the header ([`heapdump_table::header::offsets::INHERITED`]). In the
/// atfork child handler, with this thread's busy flag set (what it
/// allocates passes through).
fn adopt_inherited(w: &Writers, t: &ThreadState, records: &[AllocationRecord], parent: &Parent) {
    enter_generation(t);
    // SAFETY: the parent's resources region stays mapped while `parent`
    // lives, which outlives the reader.
    let Ok(reader) = (unsafe { ResourcesReader::from_view(parent.resources.view()) }) else {
        return;
    };
    let rate = crate::sampling::rate();
    // The parent's keys to the child's (`KeyMap`). Nothing here allocates:
    // the child's heap stays as the fork left it, to the byte.
    let mut stacks = KeyMap::<true>::default();
    let mut threads = KeyMap::<false>::default();
    let mut bytes = [0u8; MAX_ENCODED_LEN];
    let mut name = [0u8; heapdump_table::resources_table::MAX_THREAD_NAME];
    // SAFETY: `with_thread` set this thread's busy flag.
    let nodes = unsafe { t.nodes() };
    let mut copied = 0u64;
    for r in records {
        let stack = stacks.get_or(r.stack, || {
            let n = reader.stack_bytes_into(r.stack, &mut bytes).ok()?;
            // Most are never looked up again: in one page of chains.
            let (k, _) = w.resources.intern_stack_trace_compact(&bytes[..n]).ok()?;
            Some(k)
        });
        let Some(stack) = stack else {
            w.counters.on_dropped(DroppedReason::ResourcesFull);
            continue;
        };
        let thread = threads
            .get_or(r.thread, || {
                let (tid, n) = reader.thread_into(r.thread, &mut name).ok()?;
                w.resources.insert_thread_info(tid, &name[..n]).ok()
            })
            .unwrap_or(ResourceKey(0));
        let at_ns = parent
            .clock_base_ns
            .saturating_add(r.timestamp_us.saturating_mul(1000));
        let rec = AllocationRecord {
            stack,
            thread,
            timestamp_us: at_ns.saturating_sub(w.clock_base_ns) / 1000,
            ..*r
        };
        if w.allocations.insert_cached(&rec, nodes).is_err() {
            continue;
        }
        copied += 1;
        // What the block stands for in the cumulative counts: one block in
        // exact mode, its estimate in sampled mode (its sample's own
        // weight was the parent's sampler's).
        let weight = if rate == 0 {
            1
        } else {
            crate::sampling::note_recorded(rec.address as usize);
            curve_sampled(rec.size, rate, true);
            (heapdump_table::sampling::weight(rec.size, rate).round() as u64).max(1)
        };
        // SAFETY: no cache slot: counted on the stack's record.
        unsafe { count_on_stack(w, stack, None, weight, rec.size.wrapping_mul(weight)) };
    }
    // SAFETY: made in this same initialisation, READY (see `writers`).
    let alloc = unsafe { (*ALLOCATIONS_REGION.0.get()).assume_init_ref() };
    alloc.set_header_word(heapdump_table::header::offsets::INHERITED, copied + 1);
}

/// A small map of a fork child's adopted keys, from the parent's to its
/// own, on the stack (the fork handler allocates nothing): a key is
/// looked for in 8 slots from its hash. Where all 8 hold other keys, a
/// stack map (`EVICT`) replaces the first, and a miss later interns the
/// stack again, which finds it in its chain and stores nothing; a thread
/// map gives `None` (the block's thread unnamed) rather than storing the
/// thread's record twice.
struct KeyMap<const EVICT: bool>([(u64, Option<ResourceKey>); 256]);

impl<const EVICT: bool> Default for KeyMap<EVICT> {
    fn default() -> Self {
        KeyMap([(u64::MAX, None); 256])
    }
}

impl<const EVICT: bool> KeyMap<EVICT> {
    /// The child's key for the parent's `key`, from the map or `make`.
    fn get_or(
        &mut self,
        key: ResourceKey,
        make: impl FnOnce() -> Option<ResourceKey>,
    ) -> Option<ResourceKey> {
        // Keys are 8-aligned offsets; the bits above vary.
        let start = (key.0 >> 3) as usize;
        for i in 0..8 {
            let slot = &mut self.0[(start + i) % 256];
            if slot.0 == key.0 {
                return slot.1;
            }
            if slot.0 == u64::MAX {
                *slot = (key.0, make());
                return slot.1;
            }
        }
        if !EVICT {
            return None;
        }
        let slot = &mut self.0[start % 256];
        *slot = (key.0, make());
        slot.1
    }
}

/// Lets a fork child go of its parent's regions (`was_ready`: it had
/// them), rings and tables, and leaves the agent UNINIT (its own regions
/// are made at the next event) or DISABLED. With `keep_resources`, the
/// parent's resources region is handed back (to read, never to write)
/// rather than let go of. Only in a child with one thread in the agent
/// (the atfork handler's, or the one that found the fork in
/// `forked_without_handlers`, which owns INITIALIZING).
fn forget_parent(was_ready: bool, keep_resources: bool) -> Option<Parent> {
    let mut kept = None;
    if was_ready {
        // SAFETY: as below (a single thread in the agent); the slot holds
        // the parent's region, initialised (READY was seen).
        let parent = unsafe { (*ALLOCATIONS_REGION.0.get()).assume_init_ref() }.header();
        let clock_base_ns = parent.clock_monotonic_ns;
        FORKED_FROM.store(u64::from(parent.writer_pid), Ordering::Relaxed);
        // SAFETY: the child has a single thread in the agent: the atfork
        // handler's, inside fork() and not inside the agent, or the one
        // in `forked_without_handlers`, whose event has not got the
        // writers (every event gets them from `writers`, which sent it
        // here; other threads' `writers` find READY gone or the guard
        // word 0). So nobody holds references into the slots. (A child
        // forked by a signal handler that interrupted an event in the
        // agent would; no handler may allocate, nor should it fork.)
        // Dropping the writers unmaps, and closes each memfd only if its
        // descriptor still names it (no allocation).
        unsafe {
            if keep_resources {
                // Moved out: the slot is uninitialised from here, and
                // `init` writes it without dropping.
                kept = Some(Parent {
                    resources: std::ptr::read((*RESOURCES_REGION.0.get()).as_ptr()),
                    clock_base_ns,
                });
            } else {
                std::ptr::drop_in_place((*RESOURCES_REGION.0.get()).as_mut_ptr());
            }
            std::ptr::drop_in_place((*ALLOCATIONS_REGION.0.get()).as_mut_ptr());
        }
    }
    // A parent thread may have held the tables pool's lock, or been
    // rebuilding the module table.
    crate::thread_tables::after_fork_child();
    crate::module_table::after_fork_child();
    // The rings and owner tables hold the parent's blocks, in the parent's
    // regions (memory stores only: see below for the tables' pages).
    YOUNG.reset();
    // A parent thread was initialising: its half-built state is not ours.
    GENERATION.fetch_add(1, Ordering::Relaxed);
    // The child's curve starts afresh (blocks inherited are added back as
    // `adopt_inherited` inserts them).
    EST_LIVE_BYTES.store(0, Ordering::Relaxed);
    EST_LIVE_BLOCKS_X1024.store(0, Ordering::Relaxed);
    EST_ALLOC_BYTES.store(0, Ordering::Relaxed);
    if SANDBOXED.load(Ordering::Relaxed) || (was_ready && !crate::seccomp_guard::same_as_start()) {
        // A seccomp filter installed since the regions were made may kill
        // the child on the calls that make its own: it runs unrecorded.
        STATE.store(DISABLED, Ordering::Release);
        return kept;
    }
    // The child records: its owner tables are emptied (system calls,
    // which only now are known to be allowed).
    YOUNG.empty_owner_tables();
    STATE.store(UNINIT, Ordering::Release);
    kept
}

/// Makes [`thread_exit`] run when this thread exits (again, if it has run
/// already and the thread took its tables back since).
fn arm_thread_exit() {
    let key = EXIT_KEY.load(Ordering::Relaxed);
    if key != u64::MAX {
        // SAFETY: a key we created; a non-null value makes its destructor
        // run at thread exit. Keys below 32 need no allocation here.
        unsafe {
            libc::pthread_setspecific(
                key as libc::pthread_key_t,
                std::ptr::dangling::<libc::c_void>(),
            );
        }
    }
}

/// This thread's tables (see `thread_tables`), taken at its first
/// recorded event; `None` (the event dropped) when there is no memory for
/// them. Must be called with this thread's `busy` flag set.
#[inline]
fn tables<'t>(w: &Writers, t: &'t ThreadState) -> Option<&'t crate::thread_tables::ThreadTables> {
    // SAFETY: the caller set this thread's busy flag.
    if let Some(tables) = unsafe { t.tables() } {
        return Some(tables);
    }
    // SAFETY: as above, and the thread has no tables.
    match unsafe { t.acquire_tables() } {
        Some(tables) => {
            // Given back at thread exit.
            arm_thread_exit();
            note_batching_threads();
            Some(tables)
        }
        None => {
            w.counters.on_dropped(DroppedReason::NotReady);
            None
        }
    }
}

/// Stores how many threads may hold unsettled live bytes at once (each
/// takes its tables first; see `thread_tables::mapped`) for the peak's
/// tolerance. Out of line: only a thread's first event gets here.
#[cold]
#[inline(never)]
fn note_batching_threads() {
    if let Some(r) = allocations_region() {
        r.set_header_word(
            heapdump_table::header::offsets::BATCHING_THREADS,
            crate::thread_tables::mapped(),
        );
    }
}

/// pthread key destructor: returns the exiting thread's cached nodes and
/// pending live bytes to the table, and its tables to the pool.
extern "C" fn thread_exit(_value: *mut libc::c_void) {
    with_thread(|t| {
        // Frees after this point (other TLS destructors) are released at
        // once; the ones held back are released now.
        t.no_defer.set(true);
        t.defers.set(false);
        release_deferred(t);
        if let Some(w) = writers() {
            if t.generation.get() == GENERATION.load(Ordering::Relaxed) {
                // SAFETY: `with_thread` set this thread's busy flag.
                w.allocations.flush_cache(unsafe { t.nodes() });
                // Its young blocks stay in the ring, found by any thread's
                // free, until the ring's next owner promotes them.
                if let Some(k) = held_ring(t) {
                    YOUNG.release(k);
                }
                // Its owner table likewise keeps its blocks.
                if let Some((k, _)) = held_table(t) {
                    YOUNG.release_owner_table(k);
                }
                t.owner_table.set(NO_RING);
                if let Some(cache) = t.stack_cache.take() {
                    w.resources.release_stack_cache(cache);
                }
                if let Some(block) = t.peak_block.take() {
                    // SAFETY: gettid has no preconditions.
                    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u64;
                    w.resources.for_other_peak_blocks(tid, block, |b| {
                        w.resources.release_counters(b);
                        false
                    });
                    w.resources.release_counters(block);
                }
            }
        }
        // Blocks it allocates from now on (other TLS destructors) go
        // straight to the shared index.
        t.young.set(NO_RING);
        // SAFETY: `with_thread` set this thread's busy flag, and no
        // reference to the tables is live here.
        unsafe { t.release_tables() };
    });
}

/// Runs `f` with this thread's state marked busy; returns `None` (and
/// records nothing) when the agent is already busy on this thread or the
/// thread's TLS is gone.
#[inline(always)]
fn with_thread<R>(f: impl FnOnce(&ThreadState) -> R) -> Option<R> {
    crate::thread_state::with(|t| {
        if t.busy.get() {
            if !t.internal.get() {
                if let Some(w) = writers() {
                    w.counters.on_dropped(DroppedReason::Reentrant);
                }
            }
            return None;
        }
        t.busy.set(true);
        let r = f(t);
        t.busy.set(false);
        Some(r)
    })
    .flatten()
}

#[inline]
fn ready_writers(role: Role) -> Option<&'static Writers> {
    match writers() {
        Some(w) => Some(w),
        None => match STATE.load(Ordering::Acquire) {
            DISABLED => None,
            _ => {
                let w = crate::thread_state::with(|t| {
                    t.internal.set(true);
                    let w = init(role);
                    t.internal.set(false);
                    w
                })
                .flatten();
                if w.is_none() && STATE.load(Ordering::Relaxed) != DISABLED {
                    NOT_READY.fetch_add(1, Ordering::Relaxed);
                }
                w
            }
        },
    }
}

fn coarse_now_ns() -> u64 {
    heapdump_table::region::clock_ns(libc::CLOCK_MONOTONIC_COARSE)
}

#[cold]
fn register_thread(w: &Writers, t: &ThreadState) {
    // SAFETY: gettid has no preconditions.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u64;
    let mut name = [0u8; 16];
    // SAFETY: PR_GET_NAME writes at most 16 bytes into the buffer.
    unsafe {
        libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr());
    }
    let len = name.iter().position(|b| *b == 0).unwrap_or(16);
    arm_thread_exit();
    if t.stack_cache.get().is_none() {
        t.stack_cache.set(w.resources.claim_stack_cache(tid));
    }
    // A thread with a record already was renamed: its new record keeps
    // the thread's serial, so readers show it once, under the new name.
    let inserted = match t.thread_key.get() {
        0 => w.resources.insert_thread_info(tid, &name[..len]),
        k => w
            .resources
            .insert_renamed_thread_info(ResourceKey(k), tid, &name[..len]),
    };
    match inserted {
        Ok(k) => t.thread_key.set(k.0),
        Err(_) => w.counters.on_dropped(DroppedReason::ResourcesFull),
    }
    t.name.set(name);
}

#[cold]
fn name_changed(t: &ThreadState) -> bool {
    let mut name = [0u8; 16];
    // SAFETY: PR_GET_NAME writes at most 16 bytes into the buffer.
    unsafe {
        libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr());
    }
    name != t.name.get()
}

/// Forgets this thread's keys and cached nodes if they belong to an older
/// generation of regions (first event after a fork, or ever).
#[inline]
fn enter_generation(t: &ThreadState) {
    let generation = GENERATION.load(Ordering::Relaxed);
    if t.generation.get() != generation {
        // In a forked child, blocks the parent thread held back are still
        // allocated in the child's copy of the heap: release them.
        release_deferred(t);
        t.reset(generation);
    }
}

/// Releases the blocks this thread holds back (see [`on_free_deferred`]).
fn release_deferred(t: &ThreadState) {
    for addr in t.deferred.take() {
        release(addr);
    }
}

/// Hands `addr` to the allocator's own free (set by [`set_release`]).
fn release(addr: usize) {
    let f = RELEASE.load(Ordering::Relaxed);
    if f != 0 && addr != 0 {
        // SAFETY: RELEASE only ever holds a value stored by `set_release`
        // from a function pointer of exactly this type.
        let f: unsafe extern "C" fn(*mut libc::c_void) = unsafe { std::mem::transmute(f) };
        // SAFETY: `addr` is a block the program freed, held back by this
        // thread and released exactly once (taken out of `deferred`).
        unsafe { f(addr as *mut libc::c_void) }
    }
}

/// [`set_release`] unless a release function is already set (the Rust
/// `Agent` calls this on every deallocation: one relaxed load).
#[inline]
pub fn use_release(free: unsafe extern "C" fn(*mut libc::c_void)) {
    if RELEASE.load(Ordering::Relaxed) == 0 {
        set_release(free);
    }
}

/// Lets [`on_free_deferred`] hold freed blocks back, releasing them later
/// with `free` (the allocator's own, not an interposed one). Called once
/// by the preload library at start.
pub fn set_release(free: unsafe extern "C" fn(*mut libc::c_void)) {
    RELEASE.store(free as usize, Ordering::Relaxed);
    // Every thread looks again (and sets `ThreadState::defers`). Release:
    // a thread that sees the new epoch (and fences, see `look_at_thread`)
    // sees the function set.
    NAME_EPOCH.fetch_add(1, Ordering::Release);
}

#[inline(always)]
fn prepare_thread(w: &Writers, t: &ThreadState) {
    enter_generation(t);
    let n = t.allocs.get();
    t.allocs.set(n + 1);
    // A rename through the preload's hooks bumps NAME_EPOCH: look at the
    // name again on the next event. Relaxed: a rename of another thread
    // is seen once that thread synchronises with the renamer, or later.
    // Otherwise one compare per event (see `look_at_thread`).
    let epoch = NAME_EPOCH.load(Ordering::Relaxed);
    if epoch != t.name_epoch.get() || n == t.next_look.get() {
        look_at_thread(w, t, n, epoch);
    }
}

/// The thread's first event (in a generation), a rename through the hooks,
/// or a periodic look: finds the stack top once, registers the thread if
/// it is not (or its name changed; a thread the resources region had no
/// room for is tried again at the next look), and sets the next look. Threads
/// renamed some other way (the Rust Agent has no hooks) are caught by
/// looking again at the 16th and 256th event, then every 4096th.
#[cold]
#[inline(never)]
fn look_at_thread(w: &Writers, t: &ThreadState, n: u64, epoch: u64) {
    // Pairs with the Release of whatever bumped the epoch (`set_release`):
    // what it stored before is seen below.
    std::sync::atomic::fence(Ordering::Acquire);
    if !t.stack_known.get() {
        t.stack_known.set(true);
        t.stack_hi
            .set(stack_capture::thread_stack_top(stack_capture::stack_pointer()).unwrap_or(0));
    }
    let look = epoch != t.name_epoch.get() || n == 16 || n == 256 || n % 4096 == 4095;
    if t.thread_key.get() == 0 || (look && name_changed(t)) {
        register_thread(w, t);
    }
    t.defers.set(may_hold_back(t));
    t.name_epoch.set(epoch);
    t.next_look.set(next_look_after(n));
}

/// The event count after `n` at which [`look_at_thread`] looks again: the
/// 16th, the 256th, then every 4096th (counts 4095, 8191, ...).
fn next_look_after(n: u64) -> u64 {
    if n < 16 {
        16
    } else if n < 256 {
        256
    } else {
        let c = n - n % 4096 + 4095;
        if c > n {
            c
        } else {
            c + 4096
        }
    }
}

/// Whether the thread's trace shortcut is asked about this walk, and its
/// answer (frame count and hash). The shortcut answers most walks from a
/// call site it saw before with their hash alone: enough when the trace
/// is in the stack cache (else the walk finds the frames). It is asked
/// only for a thread with a stack cache (`cached`: without one the hash
/// alone is of no use), where the walk is a CFI walk (which keeps them),
/// and while it answers enough walks to pay for being asked. (A function
/// of its own so that its temporaries do not grow `stack_key`'s frame in
/// debug builds, where a thread with a 32 KiB stack has little room.)
#[inline]
fn ask_shortcut(
    w: &Writers,
    shortcuts: &mut crate::trace_shortcut::Shortcuts,
    cached: bool,
    fixed: bool,
    fp: usize,
    sp: usize,
    hi: usize,
) -> (bool, Option<crate::trace_shortcut::Answer>) {
    let asks = cached
        && !fixed
        && matches!(w.config.unwind, UnwindMode::Auto | UnwindMode::Cfi)
        && shortcuts.worth_asking();
    if !asks || !stack_capture::walkable(sp, hi) {
        return (asks, None);
    }
    // The shortcut reads the stack as the walk would: `walkable` holds.
    (true, crate::cfi_unwind::shortcut(fp, sp, hi, shortcuts))
}

/// The stack key of the calling allocation (whose hook's frame pointer is
/// `fp`), and the slot of the thread's stack cache that counts it (`None`:
/// the thread has no stack cache; count on the stack's record). With
/// `fixed` (`ablation::STACK` only), no walk: every block gets one trace,
/// looked up and counted as any other.
#[inline]
fn stack_key(
    w: &Writers,
    t: &ThreadState,
    fp: usize,
    fixed: bool,
) -> Option<(ResourceKey, Option<CacheSlot>)> {
    // Not zero-initialised: `walk` writes the first `n` entries and only
    // those are read (saves a 512-byte memset per event).
    let mut frames = std::mem::MaybeUninit::<[u64; MAX_FRAMES]>::uninit();
    let max = w.config.max_frames.min(MAX_FRAMES);
    // SAFETY: a `[u64; N]` slice over uninitialised memory is only written
    // by the walk (u64 has no invalid bit patterns and no drop); the slice
    // we read back is the prefix the walk reported as written, completed
    // by `Trace::fill` first.
    let frames = unsafe { &mut *frames.as_mut_ptr() };
    let tables = tables(w, t)?;
    let sp = stack_capture::stack_pointer();
    let hi = t.stack_hi.get();
    // SAFETY: `with_thread` set this thread's busy flag.
    let memo = unsafe { tables.memo() };
    let cache = t.stack_cache.get();
    // SAFETY: as for `memo`.
    let shortcuts = unsafe { tables.shortcuts() };
    let (asks, answer) = ask_shortcut(w, shortcuts, cache.is_some(), fixed, fp, sp, hi);
    // (Debug builds, the tests', walk anyway and check the answer below.)
    #[cfg(not(debug_assertions))]
    if let (Some(cache), Some(a)) = (cache, answer) {
        if let Some((slot, key, i)) = w.resources.cache_find_hinted(cache, a.hash, a.hint) {
            if i != a.hint {
                shortcuts.hint(&a, i);
            }
            return Some((key, Some(slot)));
        }
    }
    // A walk the shortcut answered is kept there already.
    let keep = (asks && answer.is_none() && crate::cfi_unwind::SHORTCUT).then_some(shortcuts);
    // The CFI walk leaves the frames it took from the memo there until the
    // cache below misses (see `cfi_unwind::Trace`).
    let trace = if fixed {
        frames[0] = 0x1000;
        Trace::whole((1, 0x1000_0001))
    } else if !stack_capture::walkable(sp, hi) {
        Trace::whole(stack_capture::walk(0, 1, 0, &mut []))
    } else {
        match w.config.unwind {
            UnwindMode::Auto | UnwindMode::Cfi => crate::cfi_unwind::walk_trace(
                fp,
                sp,
                hi,
                &mut frames[..max],
                &tables.rules,
                memo,
                keep,
                w.config.unwind == UnwindMode::Auto,
            ),
            _ => Trace::whole(stack_capture::walk(fp, sp, hi, &mut frames[..max])),
        }
    };
    let (n, h) = (trace.frames, trace.hash);
    debug_assert!(
        answer.is_none_or(|a| (a.frames, a.hash) == (n, h)),
        "trace shortcut"
    );
    // The thread's stack cache: 4-way sets in the resources region, whose
    // slots also count the allocations (one line for both). A hit writes
    // nothing but the counts; a miss replaces the set's ways in turn
    // (first in, first out), after any empty one.
    if let Some(cache) = cache {
        if let Some((slot, key)) = w.resources.cache_find(cache, h) {
            return Some((key, Some(slot)));
        }
    }
    trace.fill(&mut frames[..max], memo);
    let frames = &frames[..n];
    let mut buf = [0u8; MAX_ENCODED_LEN];
    let len = encode_into(frames, &mut buf)?;
    match w.resources.intern_stack_trace(&buf[..len]) {
        Ok((key, _)) => Some((
            key,
            cache.map(|cache| {
                let next = &tables.next_way[ResourcesWriter::cache_set_of(h)];
                let slot = w.resources.cache_insert(cache, h, key, next.get());
                next.set(next.get().wrapping_add(1));
                slot
            }),
        )),
        Err(_) => {
            w.counters.on_dropped(DroppedReason::ResourcesFull);
            None
        }
    }
}

/// Records a new block at `addr` of `size` bytes, allocated by the hook
/// whose frame pointer is `fp` (found again by its address at free).
#[inline]
pub fn on_alloc(addr: usize, size: usize, fp: usize, role: Role) {
    record_alloc::<false>(addr, size, fp, role);
}

/// [`on_alloc`] for a hook that keeps the returned token with the block
/// (the Rust `Agent`'s block header) and gives it back to
/// [`on_free_direct`] or [`on_free_deferred_direct`]: the record is found
/// by it, with no index lookup. 0 = not recorded.
#[inline]
pub fn on_alloc_direct(addr: usize, size: usize, fp: usize, role: Role) -> u64 {
    record_alloc::<true>(addr, size, fp, role)
}

/// A sampling decision taken for an allocation before the allocator is
/// called ([`decide`]). For a hook that has already looked at the
/// countdown (a fast path that sends only allocations at the sample point
/// on) and whose allocator calls back into the hooks (a C++ `new`
/// forwarded to libstdc++'s, whose `malloc` is hooked too): the nested
/// `malloc` reaches the sample point first and draws a fresh distance (it
/// cannot record, see `sampling`), so a decision taken after the call
/// would sample such a block with probability `p²`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision(u64);

impl Decision {
    /// Whether the block is to be recorded.
    pub fn records(self) -> bool {
        self.0 != 0
    }
}

/// Takes the sampling decision for an allocation of `size` bytes now
/// (counting it down): in exact mode every block is recorded.
#[inline]
pub fn decide(size: usize) -> Decision {
    Decision(sample_weight(size).unwrap_or(0))
}

/// [`on_alloc`] for a block whose sampling decision [`decide`] took
/// before the allocation. The recording path is inlined into the caller,
/// as by [`on_alloc_inlined`]: its one caller is the preload's C++
/// `operator new`, as hot in C++ programs as `malloc`.
#[inline(always)]
pub fn on_alloc_decided(addr: usize, size: usize, fp: usize, role: Role, decision: Decision) {
    if addr != 0 && decision.records() {
        record_weighted_here::<false>(addr, size, fp, role, decision.0);
    }
}

/// The work of [`on_alloc`] (`DIRECT = false`, returns 0) and
/// [`on_alloc_direct`] (returns node + 1, or 0).
#[inline(always)]
fn record_alloc<const DIRECT: bool>(addr: usize, size: usize, fp: usize, role: Role) -> u64 {
    if addr == 0 {
        return 0;
    }
    match sample_weight(size) {
        Some(weight) => record_weighted::<DIRECT>(addr, size, fp, role, weight),
        None => 0,
    }
}

/// Whether an allocation of `size` bytes is recorded, and how many
/// allocations it then stands for in the cumulative counters: 1 in exact
/// mode; in sampled mode, `None` for most allocations, which stop here
/// before any other work (a thread-local subtraction and compare). The
/// rate is 0 until the agent is READY.
#[inline(always)]
fn sample_weight(size: usize) -> Option<u64> {
    let rate = crate::sampling::rate();
    if rate == 0 {
        return Some(1);
    }
    if crate::sampling::skips(size as u64) {
        return None;
    }
    crate::thread_state::with(|t| {
        if t.busy.get() {
            // Not recordable now: a fresh distance keeps the next
            // allocation's weight right (see `sampling`).
            t.sampler.redraw(rate);
            None
        } else {
            t.sampler.reached(size as u64, rate)
        }
    })
    .flatten()
}

/// Records a block that is to be recorded, standing for `weight`
/// allocations in the cumulative counters (see [`record_alloc`]). Out of
/// line, and the one caller of its closure, so that the whole recording
/// path is one function (a closure called from several places would be a
/// function of its own: one more call and frame per event).
#[inline(never)]
fn record_weighted<const DIRECT: bool>(
    addr: usize,
    size: usize,
    fp: usize,
    role: Role,
    weight: u64,
) -> u64 {
    record_weighted_here::<DIRECT>(addr, size, fp, role, weight)
}

/// [`on_alloc`] with the recording path inlined into the caller: for the
/// one hook that runs most (the preload's `malloc`), so that its frame is
/// the recorder's (one call, one frame and its register saves fewer per
/// allocation). C++ `operator new` has the same through
/// [`on_alloc_decided`]; every other hook calls [`on_alloc`].
#[inline(always)]
pub fn on_alloc_inlined(addr: usize, size: usize, fp: usize, role: Role) {
    if addr == 0 {
        return;
    }
    if let Some(weight) = sample_weight(size) {
        record_weighted_here::<false>(addr, size, fp, role, weight);
    }
}

/// The body of [`record_weighted`], inlined into it and into
/// [`on_alloc_inlined`].
#[inline(always)]
fn record_weighted_here<const DIRECT: bool>(
    addr: usize,
    size: usize,
    fp: usize,
    role: Role,
    weight: u64,
) -> u64 {
    let rate = crate::sampling::rate();
    with_thread(|t| {
        let Some(w) = ready_writers(role) else {
            return 0;
        };
        let ablate = w.config.ablate;
        if ablation::off(ablate, ablation::ALL) {
            return 0;
        }
        // Sampled mode: start fetching the index slot now; the stack walk
        // below hides the miss (a direct block uses no index slot, a
        // young one none yet).
        let prefetched = (!DIRECT && rate != 0).then(|| w.allocations.prefetch(addr as u64));
        // Exact mode: the same for the block this one's insert will move
        // from the thread's young ring into the index, if any (a stale
        // ring number, before `prepare_thread` catches a new generation,
        // only makes the hint useless; a thread bypassing its ring has
        // none, see `own_ring`).
        let promoting = if !DIRECT && rate == 0 {
            own_ring(t).and_then(|k| w.allocations.prefetch_young(&YOUNG, k))
        } else {
            None
        };
        prepare_thread(w, t);
        let young = if !DIRECT && rate == 0 {
            young_ring(w, t)
        } else {
            None
        };
        let Some((stack, slot)) = stack_key(w, t, fp, ablation::off(ablate, ablation::STACK))
        else {
            return 0;
        };
        let rec = record_now(w, t, addr, size, stack);
        // SAFETY: `with_thread` set this thread's busy flag.
        let nodes = unsafe { t.nodes() };
        let mut token = 0;
        if !ablation::off(ablate, ablation::TABLE) {
            if DIRECT {
                match w.allocations.insert_direct(&rec, nodes) {
                    Ok(node) => token = u64::from(node) + 1,
                    Err(_) => return 0,
                }
            } else if let Some(k) = young {
                // `promoting`: the ring's oldest entry still held a block
                // (the insert promotes it), as the policy counts.
                if promoting.is_some() && t.young_policy.promoted(t.allocs.get()) {
                    // Its blocks outlive the ring: straight into the index
                    // for a while (`young_policy`).
                    t.young.set(t.young.get() | BYPASSING);
                }
                if w.allocations
                    .insert_young_prefetched(&rec, &YOUNG, k, promoting, nodes)
                    .is_err()
                {
                    return 0;
                }
            } else if let Some((table, ring)) = bypass_table::<DIRECT>(w, t, rate) {
                // Bypassing the ring into the thread's owner table
                // (`young_policy`).
                match w.allocations.insert_owned(&rec, &YOUNG, table, ring, nodes) {
                    Ok(OwnedInsert::Kept) => {}
                    Ok(OwnedInsert::Evicted) => t.young_policy.evicted_one(),
                    Ok(OwnedInsert::Full | OwnedInsert::FreedElsewhere) => {
                        // The thread's blocks outlive even its table, or
                        // other threads free them: drained into the index,
                        // where this one goes too.
                        t.young_policy.table_full();
                        drain_owner_table(w, t, nodes);
                        if w.allocations.insert_cached(&rec, nodes).is_err() {
                            return 0;
                        }
                    }
                    Err(_) => return 0,
                }
                count_bypass(w, t, nodes);
            } else {
                if !DIRECT && rate == 0 {
                    count_bypass(w, t, nodes);
                }
                let inserted = match prefetched {
                    Some(p) => w.allocations.insert_cached_prefetched(&rec, p, nodes),
                    None => w.allocations.insert_cached(&rec, nodes),
                };
                match inserted {
                    Ok(()) => {
                        if rate != 0 {
                            crate::sampling::note_recorded(addr);
                            curve_sampled(rec.size, rate, true);
                        }
                    }
                    // A free we never saw (memory released behind the
                    // allocator's back): the stale record is replaced by
                    // the new block.
                    Err(InsertError::Duplicate) => {
                        let _ = w.allocations.replace(rec.address, &rec);
                    }
                    Err(_) => return 0,
                }
            }
        }
        // SAFETY: `slot` is what `stack_key` gave with `stack` above, from
        // `w.resources`.
        unsafe { count_on_stack(w, stack, slot, weight, rec.size.wrapping_mul(weight)) };
        token
    })
    .unwrap_or(0)
}

/// A `realloc` of the block at `addr` to `size` bytes that the allocator
/// may do in place: `resize` asks it to (and must change nothing when it
/// answers false). Exact mode, for a block in this thread's young ring
/// (where a block `realloc`ed over and over, such as redis's list nodes,
/// stays): the block keeps its record, rewritten with the new size, the
/// `realloc`'s stack (walked from `fp`, the hook's frame) and time, and
/// is counted as a free and an allocation, exactly as the free and
/// allocation of a `realloc` that moves it would be; no table insert,
/// no removal. True when the block was resized in place (recorded, or
/// counted as dropped); false when nothing changed, `resize` included:
/// the caller then `realloc`s the usual way ([`on_free`], the
/// allocator's `realloc`, [`on_alloc`]).
///
/// The block is claimed from the ring before `resize` runs, and given
/// back unchanged if it answers false: while the allocator resizes it,
/// no other thread's free (only a double free could race here) finds it.
#[inline(never)]
pub fn on_realloc_in_place(
    addr: usize,
    size: usize,
    fp: usize,
    resize: impl FnOnce() -> bool,
) -> bool {
    if addr == 0 || size == 0 || crate::sampling::rate() != 0 {
        return false;
    }
    with_thread(|t| {
        let Some(w) = writers() else {
            return false;
        };
        let ablate = w.config.ablate;
        if ablation::off(ablate, ablation::ALL | ablation::TABLE) {
            return false;
        }
        enter_generation(t);
        let Some(k) = own_ring(t) else {
            return false;
        };
        let Some(claim) = w.allocations.claim_own_young(addr as u64, &YOUNG, k) else {
            return false;
        };
        if !resize() {
            w.allocations.unclaim(claim, &YOUNG);
            return false;
        }
        // Resized: from here on the block is the new one, the ring's newest
        // (see `rewrite_claimed`): start fetching the index slot of the
        // block it promotes, if any, as an insert does. An allocation
        // event for the thread's books (its name, its event count).
        let promoting = w.allocations.prefetch_young(&YOUNG, k);
        prepare_thread(w, t);
        // SAFETY: `with_thread` set this thread's busy flag.
        let nodes = unsafe { t.nodes() };
        let Some((stack, slot)) = stack_key(w, t, fp, ablation::off(ablate, ablation::STACK))
        else {
            // No stack key (counted as dropped): the block goes unrecorded,
            // as a moved one would.
            let old = w.allocations.free_claimed(claim, &YOUNG, nodes);
            after_removal(t, w, addr, old, true);
            return true;
        };
        let rec = record_now(w, t, addr, size, stack);
        match w
            .allocations
            .rewrite_claimed(claim, &rec, &YOUNG, promoting, nodes)
        {
            Ok(old) => {
                // As at insert (`young_policy`).
                if promoting.is_some() && t.young_policy.promoted(t.allocs.get()) {
                    t.young.set(t.young.get() | BYPASSING);
                }
                // The old block's free, for the peak's composition.
                after_removal(t, w, addr, old, true);
                // SAFETY: `slot` is what `stack_key` gave with `stack`
                // above, from `w.resources`.
                unsafe { count_on_stack(w, stack, slot, 1, rec.size) };
            }
            // Not representable (a key out of range, which the resources
            // region never hands out): freed instead, unrecorded, as an
            // insert would refuse it.
            Err(old) => {
                after_removal(t, w, addr, old, true);
            }
        }
        true
    })
    .unwrap_or(false)
}

/// The record of a block of `size` bytes at `addr` allocated now on this
/// thread, with stack `stack`.
#[inline(always)]
fn record_now(
    w: &Writers,
    t: &ThreadState,
    addr: usize,
    size: usize,
    stack: ResourceKey,
) -> AllocationRecord {
    let now_us = if ablation::off(w.config.ablate, ablation::CLOCK) {
        0
    } else {
        // Never the peak's own reading once the peak has moved: a block
        // allocated after it, in its clock tick, is after it.
        (coarse_now_ns().saturating_sub(w.clock_base_ns) / 1000).max(w.peak.first_after_us())
    };
    AllocationRecord {
        address: addr as u64,
        size: size as u64,
        stack,
        thread: ResourceKey(t.thread_key.get()),
        timestamp_us: now_us,
    }
}

/// Counts `weight` allocations of `bytes` in all on `stack`'s cumulative
/// counters: in the thread's stack cache slot `slot`, else on the stack's
/// record.
///
/// # Safety
/// `slot` is what `stack_key` gave with `stack` during this event, from
/// this same writer `w.resources`.
#[inline(always)]
unsafe fn count_on_stack(
    w: &Writers,
    stack: ResourceKey,
    slot: Option<CacheSlot>,
    weight: u64,
    bytes: u64,
) {
    if ablation::off(w.config.ablate, ablation::COUNTERS) {
        return;
    }
    match slot {
        // SAFETY: the caller's contract.
        Some(slot) => unsafe { w.resources.cache_count(slot, weight, bytes) },
        None => w.resources.record_allocations(stack, weight, bytes),
    }
}

/// Removes the block at `addr` from the table; call *before* releasing
/// the memory. Returns the recorded size, if the block was recorded.
#[inline]
pub fn on_free(addr: usize) -> Option<u64> {
    on_free_direct(addr, 0)
}

/// [`on_free`] for a block recorded by [`on_alloc_direct`], with its token
/// (0: not recorded that way; the block is looked up by address, as by
/// [`on_free`]).
#[inline]
pub fn on_free_direct(addr: usize, token: u64) -> Option<u64> {
    if addr == 0 || (token == 0 && not_sampled(addr)) {
        return None;
    }
    with_thread(|t| remove_block(t, writers()?, addr, token)).flatten()
}

/// True when no recorded block can be at `addr`: in sampled mode, the
/// cheap answer for a block that was not sampled (one load of the
/// filter). In exact mode it is never true once the agent is configured
/// (one load of a flag, see
/// [`sampling::maybe_sampled`](crate::sampling::maybe_sampled)), and before that
/// nothing is recorded. A hook may then release the block without
/// calling [`on_free`].
#[inline(always)]
pub fn not_sampled(addr: usize) -> bool {
    !crate::sampling::maybe_sampled(addr)
}

/// In sampled mode, true when an allocation of `size` bytes is not
/// sampled; it has then been counted down, and a hook need not call
/// [`on_alloc`] (which would answer the same, later). Always false in
/// exact mode (see [`sampling::skips`](crate::sampling::skips)). A hook
/// may ask this before it calls the allocator, so that an allocation
/// that is not sampled goes straight to it: the countdown depends on the
/// size asked for, not on the block returned (a failed allocation is then
/// counted down too, which biases nothing: by the exponential's lack of
/// memory, every later allocation is still sampled with probability
/// `p(s)`).
#[inline(always)]
pub fn sampled_out(size: usize) -> bool {
    crate::sampling::skips(size as u64)
}

/// Takes the block at `addr` out of the table (the common part of
/// [`on_free`] and [`on_free_deferred`]); its size if it was recorded.
/// Must be called with this thread's `busy` flag set.
/// `token` is [`on_alloc_direct`]'s for a direct block, else 0 (found by
/// address).
#[inline(always)]
fn remove_block(t: &ThreadState, w: &Writers, addr: usize, token: u64) -> Option<u64> {
    if ablation::off(w.config.ablate, ablation::ALL | ablation::TABLE) {
        return None;
    }
    enter_generation(t);
    // SAFETY: the caller set this thread's busy flag.
    let nodes = unsafe { t.nodes() };
    if token != 0 {
        // A token from a region generation before a fork names a node of
        // the parent's table: in this one its node does not hold `addr`
        // (the inherited block was never recorded here), so nothing is
        // removed.
        let node = u32::try_from(token - 1).ok()?;
        let freed = w
            .allocations
            .remove_direct_freed(addr as u64, node, nodes)?;
        return Some(after_removal(t, w, addr, freed, false));
    }
    // With held-back frees (glibc only, see `set_release`), glibc reads
    // the chunk header just below the block when the block is finally
    // released: start that miss now. Other allocators keep their metadata
    // elsewhere, and a prefetch can never fault, but it would only cost a
    // useless line fetch there.
    if RELEASE.load(Ordering::Relaxed) != 0 {
        heapdump_table::allocations_table::prefetch_line((addr as *const u8).wrapping_sub(16));
    }
    let freed = if crate::sampling::rate() == 0 {
        // Exact mode: in this thread's young ring (most frees: settled on
        // a path of its own), the index, or another thread's ring (a
        // thread bypassing its ring names none: its ring is searched after
        // the index, with the others).
        let own = own_ring(t);
        if let Some(k) = own {
            if let Some(f) = w
                .allocations
                .remove_own_young(addr as u64, &YOUNG, k, nodes)
            {
                return Some(after_removal(t, w, addr, f, true));
            }
        }
        w.allocations
            .remove_any_but_own_young(addr as u64, &YOUNG, own, own_table(t), nodes)?
    } else {
        w.allocations.remove_cached_freed(addr as u64, nodes)?
    };
    Some(after_removal(t, w, addr, freed, true))
}

/// Set in [`ThreadState::young`] beside the ring's number while the
/// thread bypasses its ring (`young_policy`): [`own_ring`] and
/// [`young_ring`] then answer `None`, so its blocks go straight into the
/// index and its frees look there first, at no cost to a thread that does
/// not bypass (the number's range check is the one they always made).
const BYPASSING: u32 = 1 << 30;
const _: () = assert!(YOUNG_RINGS < BYPASSING as usize && NO_RING & BYPASSING != 0);
// Owner-table values pack a ring and a table number in 16 bits each,
// below `DRAINED_TABLE`.
const _: () = assert!(YOUNG_RINGS < 0x3fff && OWNER_TABLES < 0xffff);

/// This thread's young ring for a new block, claiming one at its first
/// young block (`None`: the thread bypasses its ring for now, every ring
/// is taken, or the thread is exiting). Call after `enter_generation` (a
/// forked child's rings were all reset).
#[inline(always)]
fn young_ring(w: &Writers, t: &ThreadState) -> Option<u32> {
    match t.young.get() {
        0 => claim_ring(w, t),
        k => ring_of(k),
    }
}

/// The ring named by a [`ThreadState::young`] value, unless it says none
/// or bypassing: one range check.
#[inline(always)]
fn ring_of(young: u32) -> Option<u32> {
    let k = young.wrapping_sub(1);
    (k < YOUNG_RINGS as u32).then_some(k)
}

/// An allocation that went straight into the index: counts it against
/// the thread's bypass, if it is bypassing, and takes the ring up again
/// when the bypass is over.
#[inline(always)]
fn count_bypass(w: &Writers, t: &ThreadState, nodes: &mut NodeCache) {
    let young = t.young.get();
    if young != NO_RING && young & BYPASSING != 0 && t.young_policy.bypassed_one() {
        t.young.set(young & !BYPASSING);
        if t.young_policy.take_drain() {
            drain_owner_table(w, t, nodes);
        }
    }
}

/// Moves the blocks of this thread's owner table into the index (its
/// blocks outlive the table, see `young_policy`).
#[cold]
#[inline(never)]
fn drain_owner_table(w: &Writers, t: &ThreadState, nodes: &mut NodeCache) {
    if let Some((k, ring)) = own_table(t) {
        w.allocations.drain_owner_table(&YOUNG, k, ring, nodes);
        t.owner_table.set(t.owner_table.get() | DRAINED_TABLE);
    }
}

#[cold]
#[inline(never)]
fn claim_ring(w: &Writers, t: &ThreadState) -> Option<u32> {
    let k = w.allocations.claim_young(&YOUNG);
    t.young.set(k.map_or(NO_RING, |k| k + 1));
    if k.is_some() {
        // Given back at thread exit.
        arm_thread_exit();
    }
    k
}

/// This thread's young ring if it has one and is not bypassing it
/// (frees never claim one).
#[inline(always)]
fn own_ring(t: &ThreadState) -> Option<u32> {
    ring_of(t.young.get())
}

/// The owner table (and the young ring whose writer line counts it) for
/// a block that bypasses the ring, claiming the table at the first such
/// block; `None` when the block goes into the index (sampled mode, a
/// direct block, a bypass that the policy sends to the index, or no table
/// to be had). Call only when the block does not go into the ring.
#[inline(always)]
fn bypass_table<const DIRECT: bool>(w: &Writers, t: &ThreadState, rate: u64) -> Option<(u32, u32)> {
    if DIRECT || rate != 0 {
        return None;
    }
    let v = t.owner_table.get();
    if let Some(own) = table_of(v & !DRAINED_TABLE) {
        // A thread with a table holds its ring: it is bypassing it.
        if !t.young_policy.into_owner_table() {
            return None;
        }
        t.owner_table.set(v & !DRAINED_TABLE);
        return Some(own);
    }
    let young = t.young.get();
    if v != 0 || young == NO_RING || young & BYPASSING == 0 {
        return None;
    }
    claim_owner_table(w, t, ring_of(young & !BYPASSING)?)
}

#[cold]
#[inline(never)]
fn claim_owner_table(w: &Writers, t: &ThreadState, ring: u32) -> Option<(u32, u32)> {
    // Given back at thread exit, with the ring (already armed).
    let k = w.allocations.claim_owner_table(&YOUNG, ring);
    t.owner_table
        .set(k.map_or(NO_RING, |k| (ring + 1) << 16 | (k + 1)));
    k.map(|k| (k, ring))
}

/// Set in [`ThreadState::owner_table`] while the thread's table is empty
/// (drained, and nothing inserted since: other threads never insert), so
/// that its frees skip it without reading its memory.
const DRAINED_TABLE: u32 = 1 << 30;

/// The owner table and ring named by a [`ThreadState::owner_table`] value,
/// unless it names none or is [`DRAINED_TABLE`]: one compare.
#[inline(always)]
fn table_of(v: u32) -> Option<(u32, u32)> {
    (v.wrapping_sub(1) < DRAINED_TABLE - 1).then(|| ((v & 0xffff) - 1, (v >> 16) - 1))
}

/// This thread's owner table, with the young ring whose writer line
/// counts it, for a free (looked in after the ring, before the index),
/// unless it is empty.
#[inline(always)]
fn own_table(t: &ThreadState) -> Option<(u32, u32)> {
    table_of(t.owner_table.get())
}

/// This thread's owner table, empty or not (to drain or give it back).
fn held_table(t: &ThreadState) -> Option<(u32, u32)> {
    match t.owner_table.get() {
        NO_RING => None,
        v => table_of(v & !DRAINED_TABLE),
    }
}

/// This thread's young ring if it holds one, bypassing it or not (to give
/// it back).
fn held_ring(t: &ThreadState) -> Option<u32> {
    match t.young.get() {
        NO_RING => None,
        k => ring_of(k & !BYPASSING),
    }
}

/// The accounting of a removed block: sampled mode's filter and curve, and
/// the peak's composition. `filtered`: the block went through the sampled
/// filter at insert (direct blocks do not). Returns its size.
#[inline]
fn after_removal(
    t: &ThreadState,
    w: &Writers,
    addr: usize,
    freed: heapdump_table::allocations_table::Freed,
    filtered: bool,
) -> u64 {
    let rate = crate::sampling::rate();
    if rate != 0 && filtered {
        crate::sampling::note_removed(addr);
        // (Direct blocks stay out of the sampled curve, as at insert.)
        curve_sampled(freed.size, rate, false);
    }
    // A block from before the heap's peak, freed after it: counted for the
    // composition at the peak (see `heapdump_table::peak`). One load and a
    // compare for every other free.
    let (gen, peak_us) = w.peak.current();
    if gen != 0 && freed.timestamp_us <= peak_us {
        count_peak_freed(t, w, gen, &freed, rate);
    }
    freed.size
}

/// Most peak blocks one thread holds (each counts the frees of several
/// hundred to a thousand stacks; see `heapdump_table::resources_table`).
const MAX_PEAK_BLOCKS: usize = 8;

/// Counts `freed` in this thread's peak block (claimed at its first use).
/// A block with no room for the stack is followed by another of the
/// thread's, up to [`MAX_PEAK_BLOCKS`]; past them the free is counted as
/// `PeakUncounted`, which `--peak` reports. When a block starts a new
/// generation, the thread's other blocks (stale now) are given back.
#[cold]
fn count_peak_freed(
    t: &ThreadState,
    w: &Writers,
    gen: u64,
    freed: &heapdump_table::allocations_table::Freed,
    rate: u64,
) {
    use heapdump_table::PeakAdd;
    if t.peak_full_gen.get() == gen {
        // Every block this thread may hold is full in this generation.
        w.counters.on_dropped(DroppedReason::PeakUncounted);
        return;
    }
    // SAFETY: gettid has no preconditions.
    let tid = || unsafe { libc::syscall(libc::SYS_gettid) } as u64;
    let block = match t.peak_block.get() {
        Some(b) => b,
        None => {
            let Some(b) = w.resources.claim_peak_block(tid()) else {
                w.counters.on_dropped(DroppedReason::PeakUncounted);
                return;
            };
            t.peak_block.set(Some(b));
            b
        }
    };
    // Sampled mode: what the block stood for (blocks x1024).
    let (count, bytes) = if rate == 0 {
        (1, freed.size)
    } else {
        weighed(freed.size, rate)
    };
    // SAFETY: every block handed to `add` below is one of this region's
    // peak blocks: the thread's (claimed from `w.resources` in this
    // generation: a new generation forgets it), one `claim_peak_block`
    // just made, or one `for_other_peak_blocks` found on this region's
    // list.
    let add = |b| unsafe {
        w.resources
            .add_peak_freed(b, gen, freed.stack, count, bytes)
    };
    match add(block) {
        PeakAdd::Added => {}
        PeakAdd::AddedInNewGeneration => {
            w.resources.for_other_peak_blocks(tid(), block, |b| {
                w.resources.release_counters(b);
                false
            });
        }
        PeakAdd::Full => {
            let tid = tid();
            let (mut held, mut taken) = (1, None);
            w.resources.for_other_peak_blocks(tid, block, |b| {
                held += 1;
                if add(b) != PeakAdd::Full {
                    taken = Some(b);
                }
                taken.is_some() || held >= MAX_PEAK_BLOCKS
            });
            if taken.is_none() && held < MAX_PEAK_BLOCKS {
                if let Some(b) = w.resources.claim_peak_block(tid) {
                    if add(b) != PeakAdd::Full {
                        taken = Some(b);
                    } else {
                        w.resources.release_counters(b);
                    }
                }
            }
            match taken {
                Some(b) => t.peak_block.set(Some(b)),
                None => {
                    t.peak_full_gen.set(gen);
                    w.counters.on_dropped(DroppedReason::PeakUncounted);
                }
            }
        }
    }
}

/// Whether this thread may hold a freed block back (see
/// [`on_free_deferred`]): it is not exiting, its exit hook is registered
/// (so held-back blocks are released when it ends), and a release function
/// is set. Kept in [`ThreadState::defers`] by [`look_at_thread`] (so a
/// thread defers from its first look after all of this holds) and cleared
/// when the thread starts exiting.
fn may_hold_back(t: &ThreadState) -> bool {
    !t.no_defer.get()
        && t.thread_key.get() != 0
        && EXIT_KEY.load(Ordering::Relaxed) != u64::MAX
        && RELEASE.load(Ordering::Relaxed) != 0
}

/// [`may_hold_back`] as last looked at: one flag.
#[inline(always)]
fn can_hold_back(t: &ThreadState) -> bool {
    t.defers.get()
}

/// [`on_free`] for a `free(3)` whose caller then releases the returned
/// address (0: nothing) to the allocator.
///
/// The block leaves the table at once, so snapshots and counters are exact
/// as soon as `free` returns; only its release to the allocator may wait
/// for this thread's next two frees (a recorded block of at most
/// [`DEFER_MAX_SIZE`] bytes, on a thread with an exit hook, once
/// [`set_release`] was called). Its allocator header was prefetched now,
/// so the allocator's own misses on it overlap with the program's work in
/// between instead of stalling it. Held-back blocks are released at
/// thread exit and in a forked child.
#[inline]
pub fn on_free_deferred(addr: usize) -> usize {
    on_free_deferred_direct(addr, 0, addr)
}

/// [`on_free_deferred`] for a block recorded with `token` by
/// [`on_alloc_direct`] (0: found by address), whose memory is released to
/// the allocator as `release` (the start of the allocator's block, which
/// a header may put before `addr`). Returns what to release now (0:
/// nothing).
#[inline]
pub fn on_free_deferred_direct(addr: usize, token: u64, release: usize) -> usize {
    if addr == 0 || (token == 0 && not_sampled(addr)) {
        return release;
    }
    with_thread(|t| {
        let Some(w) = writers() else { return release };
        match remove_block(t, w, addr, token) {
            Some(s) if s <= DEFER_MAX_SIZE && can_hold_back(t) => {
                let held = t.deferred.get();
                let mut next = [0; crate::thread_state::DEFER_DEPTH];
                next[0] = release;
                next[1..].copy_from_slice(&held[..held.len() - 1]);
                t.deferred.set(next);
                held[held.len() - 1]
            }
            _ => release,
        }
    })
    .unwrap_or(release)
}

/// Runs `f`, a call into the next allocator that may call back into the
/// hooks (libstdc++'s `operator new` calls `malloc`), with this thread's
/// events passed through unrecorded and not counted as dropped: the caller
/// records the block itself, once. Nests; restores the thread's state
/// also when `f` unwinds (a C++ `new` throwing `std::bad_alloc`).
#[inline]
pub fn forwarding<R>(f: impl FnOnce() -> R) -> R {
    struct Restore<'a>(Option<&'a ThreadState>);
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            if let Some(t) = self.0 {
                t.internal.set(false);
                t.busy.set(false);
            }
        }
    }
    let mut f = Some(f);
    let r = crate::thread_state::with(|t| {
        let _restore = if t.busy.get() {
            // Already inside the agent or an outer forwarding call.
            Restore(None)
        } else {
            t.busy.set(true);
            t.internal.set(true);
            Restore(Some(t))
        };
        (f.take().expect("called once"))()
    });
    match r {
        Some(r) => r,
        // This thread's TLS is gone: the hooks pass through anyway.
        None => (f.take().expect("not called"))(),
    }
}

/// Tells the agent a thread was renamed (called by the preload library's
/// `pthread_setname_np` and `prctl(PR_SET_NAME)` after the rename): each
/// thread looks at its name again at its next event, so blocks allocated
/// after a rename carry the new name.
pub fn thread_renamed() {
    NAME_EPOCH.fetch_add(1, Ordering::Relaxed);
}

/// Set once the program installs a seccomp filter (see [`sandboxed`]).
static SANDBOXED: AtomicBool = AtomicBool::new(false);

/// To be called by a hook just *before* the program installs a seccomp
/// filter or enters seccomp's strict mode (`prctl(PR_SET_SECCOMP)`,
/// `syscall(SYS_seccomp, ...)`): recording stops for good in this process
/// and its later children. A filter decides every system call the agent
/// makes from then on (naming threads, their tables, a child's regions),
/// and one that kills on a call it does not expect would end the program
/// (a program that forbade `prctl` once it had sandboxed itself was
/// killed by the agent's look at a thread's name). What was recorded
/// stays readable; the header says when recording stopped, as after a
/// detach.
pub fn sandboxed() {
    if SANDBOXED.swap(true, Ordering::Relaxed) {
        return;
    }
    if STATE.load(Ordering::Acquire) == READY {
        mark_detached();
    }
    // Hooks now pass every call through (`writers` is `None`); a thread
    // already inside the agent finishes its event.
    STATE.store(DISABLED, Ordering::Release);
}

/// Snapshot of the agent's process-wide counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Bytes in live recorded blocks.
    pub live_bytes: u64,
    /// Live recorded blocks.
    pub live_blocks: u64,
    /// Highest `live_bytes` seen.
    pub peak_live_bytes: u64,
    /// Allocations recorded since start.
    pub total_allocs: u64,
    /// Bytes allocated since start.
    pub total_bytes: u64,
    /// Events not recorded (all reasons).
    pub dropped: u64,
    /// True when the agent is recording.
    pub enabled: bool,
}

/// The agent's counters (zero when it is disabled or not started yet).
pub fn stats() -> Stats {
    let Some(w) = writers() else {
        return Stats::default();
    };
    let c = w.allocations.stats();
    Stats {
        live_bytes: c.live_bytes,
        live_blocks: c.live_blocks,
        peak_live_bytes: c.peak_live_bytes,
        total_allocs: c.total_allocs,
        total_bytes: c.total_bytes,
        dropped: c.dropped_total(),
        enabled: true,
    }
}

/// Asks a watching dumper for a snapshot named `name`.
pub fn request_snapshot(name: &str) {
    let w = match writers() {
        Some(w) => Some(w),
        None => {
            if STATE.load(Ordering::Acquire) == DISABLED && preload_present() {
                // This copy of the agent stepped aside (or was never used as
                // an allocator) and the preload library records the process:
                // ask it.
                // SAFETY: the symbol is the preload library's
                // `heapdump_request_snapshot(const char *)`; the name is
                // copied into a NUL-terminated buffer.
                unsafe {
                    let f = libc::dlsym(libc::RTLD_DEFAULT, c"heapdump_request_snapshot".as_ptr());
                    let f: unsafe extern "C" fn(*const libc::c_char) = std::mem::transmute(f);
                    let mut buf = [0u8; 65];
                    let n = name.len().min(64);
                    buf[..n].copy_from_slice(&name.as_bytes()[..n]);
                    f(buf.as_ptr().cast());
                }
                return;
            }
            with_thread(|_| ready_writers(Role::GlobalAlloc)).flatten()
        }
    };
    if let Some(w) = w {
        w.counters
            .request_snapshot(name, heapdump_table::monotonic_ns());
    }
}

/// The async-signal-safe part of a signal request.
pub(crate) fn request_snapshot_from_signal() {
    if let Some(w) = writers() {
        w.counters
            .request_snapshot_signal_safe(heapdump_table::monotonic_ns());
    }
}

/// Sampled mode's running estimates for the memory curve
/// (`heapdump_table::timeline`): the live bytes, live blocks (x1024) and
/// bytes allocated that the sampled blocks stand for, each block weighted
/// by its size as a snapshot weighs it. Touched only at sampled events,
/// never on the unsampled fast path. Reset in a fork child.
static EST_LIVE_BYTES: AtomicU64 = AtomicU64::new(0);
static EST_LIVE_BLOCKS_X1024: AtomicU64 = AtomicU64::new(0);
static EST_ALLOC_BYTES: AtomicU64 = AtomicU64::new(0);

/// What a sampled block of `size` bytes stands for, weighed as a snapshot
/// weighs a live block of its size: (blocks x1024, bytes).
fn weighed(size: u64, rate: u64) -> (u64, u64) {
    let wt = heapdump_table::sampling::weight(size, rate);
    ((wt * 1024.0) as u64, (size as f64 * wt) as u64)
}

/// A sampled block of `size` bytes was recorded (`alloc`) or removed: moves
/// the estimates and offers the curve a point.
#[cold]
fn curve_sampled(size: u64, rate: u64, alloc: bool) {
    let (blocks, bytes) = weighed(size, rate);
    // Added as two's complement: a removal adds the negation.
    let sign = |v: u64| if alloc { v } else { v.wrapping_neg() };
    if alloc {
        EST_ALLOC_BYTES.fetch_add(bytes, Ordering::Relaxed);
    }
    let live = EST_LIVE_BYTES
        .fetch_add(sign(bytes), Ordering::Relaxed)
        .wrapping_add(sign(bytes));
    let n = EST_LIVE_BLOCKS_X1024
        .fetch_add(sign(blocks), Ordering::Relaxed)
        .wrapping_add(sign(blocks));
    // A racing free may briefly take a sum below zero: no point then.
    if live > i64::MAX as u64 || n > i64::MAX as u64 {
        return;
    }
    let Some(region) = allocations_region() else {
        return;
    };
    let view = region.view();
    let now = coarse_now_ns();
    if alloc && heapdump_table::peak::due(&view, live) {
        let base = region.header().clock_monotonic_ns;
        heapdump_table::peak::offer(&view, now.saturating_sub(base) / 1000, live, n / 1024);
    }
    if heapdump_table::timeline::due(&view, now, live) {
        heapdump_table::timeline::append(
            &view,
            heapdump_table::timeline::Point {
                time_ns: now,
                live_bytes: live,
                live_blocks: n / 1024,
                alloc_bytes: EST_ALLOC_BYTES.load(Ordering::Relaxed),
            },
        );
    }
}

/// Set once the agent was loaded into a running process by `heapdump
/// attach`: every pair of regions made from then on (the first, and a
/// forked child's) says recording started when it was made.
static ATTACHED_MODE: AtomicBool = AtomicBool::new(false);

/// The allocations region, if the agent is READY.
fn allocations_region() -> Option<&'static RegionWriter> {
    writers()?;
    // SAFETY: READY (checked with Acquire by `writers`) is published only
    // after the slot was written, and it is not rewritten while READY.
    Some(unsafe { (*ALLOCATIONS_REGION.0.get()).assume_init_ref() })
}

/// Starts the agent for `heapdump attach` (settings already given with
/// [`crate::config::set_overrides`]) and stamps the header: recording
/// started now, not when the process did. Returns false if the agent could
/// not start (disabled, or no regions).
pub fn start_attached() -> bool {
    ATTACHED_MODE.store(true, Ordering::Relaxed);
    start();
    let Some(r) = allocations_region() else {
        return false;
    };
    use heapdump_table::header::offsets;
    r.set_header_word(offsets::ATTACHED_AT, heapdump_table::monotonic_ns());
    r.set_header_word(offsets::DETACHED_AT, 0);
    true
}

/// Stamps a detach: recording stopped now (the regions stay readable).
pub fn mark_detached() {
    if let Some(r) = allocations_region() {
        use heapdump_table::header::offsets;
        r.set_header_word(offsets::DETACHED_AT, heapdump_table::monotonic_ns());
    }
}

/// Records the allocator's own whole-heap figure in the header (an
/// attached agent's housekeeping thread refreshes it).
pub fn set_allocator_heap(source: heapdump_table::header::HeapSource, bytes: u64) {
    if let Some(r) = allocations_region() {
        use heapdump_table::header::offsets;
        r.set_header_word(offsets::ALLOCATOR_HEAP, bytes);
        r.set_header_word(offsets::ALLOCATOR_HEAP_SOURCE, source.code());
        r.set_header_word(
            offsets::ALLOCATOR_HEAP_AT,
            heapdump_table::region::clock_ns(libc::CLOCK_MONOTONIC),
        );
    }
}

/// Forgets every recorded block, as if each had been freed: for a second
/// `heapdump attach` after a `detach`, when the frees made while detached
/// were not seen, so every record is stale. Call before any hook can run
/// again (the slots still point at the allocator). Returns how many
/// records were dropped.
pub fn forget_all_records() -> u64 {
    let Some(region) = allocations_region() else {
        return 0;
    };
    // Read our own table as a dumper would (the reader validates and
    // bounds everything), then remove each block through the free path so
    // that every counter moves as for a free.
    let records = forwarding(|| {
        let reader = region.open_reader().ok()?;
        let table = heapdump_table::AllocationsReader::new(&reader).ok()?;
        Some(table.snapshot().0)
    });
    let Some(records) = records else {
        return 0;
    };
    let mut n = 0;
    for r in &records {
        if on_free(r.address as usize).is_some() {
            n += 1;
        }
    }
    n
}

/// Starts the agent now instead of at the first allocation (the preload
/// library calls this from its constructor).
pub fn start() {
    with_thread(|_| {
        ready_writers(Role::Preload);
    });
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_thread_is_looked_at_first_then_at_the_16th_and_256th_events_then_every_4096th() {
        let mut looks = Vec::new();
        let mut next = 0;
        for n in 0..20_000u64 {
            if n == next {
                looks.push(n);
                next = super::next_look_after(n);
            }
        }
        assert_eq!(looks, [0, 16, 256, 4095, 8191, 12287, 16383]);
    }
}
