//! A fake instrumented process for tests (`heapdump __fake-target`): it
//! writes a known live set straight into real heapdump regions with the
//! table crate's writers, so tests have exact ground truth without the
//! agent. Not part of the user interface.
//!
//! Stacks are made of the entry addresses (+1, as if return addresses) of
//! real functions of this binary, so symbolization has something real to
//! resolve: `[site_*, fake_thread_*, fake_root]`, leaf first.
//!
//! Protocol: prints `ready` on stdout once its table is written, then reads
//! commands from stdin, answering each with `ok`: `request NAME` (API-style
//! snapshot request), `signal` (signal-style request, no name), `alloc`
//! (one more live block at `site_alpha` on the main thread), `exit`; and
//! `fork`, answered with `forked PID`: a child that keeps the parent's
//! region descriptors and never creates its own. It exits at end of input.

use std::io::{BufRead, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use heapdump_table::header::offsets;
use heapdump_table::stack_compression;
use heapdump_table::{
    monotonic_ns, AllocationRecord, AllocationsConfig, AllocationsWriter, RegionWriter,
    ResourceKey, ResourcesWriter,
};

/// One planned allocation site of the fake target.
#[derive(Clone, Copy, Debug)]
pub struct PlannedSite {
    /// Leaf function (in this module).
    pub function: &'static str,
    /// Thread function it is called from.
    pub caller: &'static str,
    /// Name of the allocating thread.
    pub thread: &'static str,
    /// Size of each block.
    pub size: u64,
    /// Blocks left live.
    pub live: u64,
    /// Blocks allocated then freed.
    pub freed: u64,
}

/// The live set the fake target writes (before any `alloc` command).
pub const PLAN: [PlannedSite; 4] = [
    PlannedSite {
        function: "site_alpha",
        caller: "fake_thread_main",
        thread: "fake-main",
        size: 100,
        live: 10,
        freed: 4,
    },
    PlannedSite {
        function: "site_beta",
        caller: "fake_thread_worker",
        thread: "fake-worker-1",
        size: 1000,
        live: 5,
        freed: 2,
    },
    PlannedSite {
        function: "site_gamma",
        caller: "fake_thread_worker",
        thread: "fake-worker-2",
        size: 64,
        live: 3,
        freed: 0,
    },
    PlannedSite {
        function: "site_delta",
        caller: "fake_thread_worker",
        thread: "fake-worker-1",
        size: 4096,
        live: 2,
        freed: 1,
    },
];

/// Sizes used by the churn threads (`--churn`): site `churn_a` always
/// allocates 48 bytes and `churn_b` 272, so a torn record would show up as
/// a site whose bytes are not a multiple of its block size.
pub const CHURN_SIZES: [u64; 2] = [48, 272];

/// How the fake target damages its regions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Corruption {
    /// Overwrite the allocations region's magic.
    Magic,
    /// Set the allocations region's major version to 99.
    Version,
    /// Leave one live node mid-update (odd sequence) and point another at
    /// a stack key that does not exist.
    Nodes,
}

/// Options of the fake target.
#[derive(Clone, Copy, Debug, Default)]
pub struct FakeOptions {
    /// Damage the regions after writing them.
    pub corrupt: Option<Corruption>,
    /// Publish only an unsealed memfd named like an allocations region.
    pub unsealed: bool,
    /// Keep two threads allocating and freeing until exit.
    pub churn: bool,
    /// Extra live blocks (for benchmarks), spread over a hundred stacks.
    pub blocks: u64,
}

macro_rules! site_fn {
    ($name:ident, $v:expr) => {
        /// A fake allocation site (its address is used as a frame).
        #[inline(never)]
        pub fn $name() -> u64 {
            std::hint::black_box($v).wrapping_mul(std::hint::black_box(3))
        }
    };
}
site_fn!(site_alpha, 0xa1u64);
site_fn!(site_beta, 0xb2u64);
site_fn!(site_gamma, 0xc3u64);
site_fn!(site_delta, 0xd4u64);
site_fn!(churn_a, 0xe5u64);
site_fn!(churn_b, 0xf6u64);

/// Thread function of the main thread's stacks.
#[inline(never)]
pub fn fake_thread_main() -> u64 {
    std::hint::black_box(0x11u64).rotate_left(std::hint::black_box(3))
}

/// Thread function of the workers' stacks.
#[inline(never)]
pub fn fake_thread_worker() -> u64 {
    std::hint::black_box(0x22u64).rotate_right(std::hint::black_box(5))
}

/// Root frame of every stack.
#[inline(never)]
pub fn fake_root() -> u64 {
    std::hint::black_box(0x33u64) ^ std::hint::black_box(0x44)
}

fn fn_addr(name: &str) -> u64 {
    let f: fn() -> u64 = match name {
        "site_alpha" => site_alpha,
        "site_beta" => site_beta,
        "site_gamma" => site_gamma,
        "site_delta" => site_delta,
        "churn_a" => churn_a,
        "churn_b" => churn_b,
        "fake_thread_main" => fake_thread_main,
        "fake_thread_worker" => fake_thread_worker,
        _ => fake_root,
    };
    f as usize as u64
}

/// The return addresses of a planned stack, leaf first.
pub fn stack_of(function: &str, caller: &str) -> Vec<u64> {
    vec![
        fn_addr(function) + 1,
        fn_addr(caller) + 1,
        fn_addr("fake_root") + 1,
    ]
}

struct Fake<'a> {
    res: ResourcesWriter<'a>,
    allocs: AllocationsWriter<'a>,
    clock_base_ns: u64,
    next_addr: &'a AtomicU64,
}

impl Fake<'_> {
    fn stack(&self, function: &str, caller: &str) -> ResourceKey {
        let mut bytes = Vec::new();
        stack_compression::encode(&stack_of(function, caller), &mut bytes);
        self.res.intern_stack_trace(&bytes).expect("intern stack").0
    }

    fn alloc(&self, stack: ResourceKey, thread: ResourceKey, size: u64) -> u64 {
        let address = self.next_addr.fetch_add(0x1000, Ordering::Relaxed);
        let rec = AllocationRecord {
            address,
            size,
            stack,
            thread,
            timestamp_us: monotonic_ns().saturating_sub(self.clock_base_ns) / 1000,
        };
        self.allocs.insert(&rec).expect("insert");
        self.res.record_allocation(stack, size);
        address
    }

    fn free(&self, address: u64) {
        self.allocs.remove(address).expect("remove");
    }

    fn thread(&self, name: &str) -> ResourceKey {
        // SAFETY: gettid has no preconditions (the system call: glibc's
        // wrapper is from 2.30, heapdump runs on 2.17).
        let tid = unsafe { libc::syscall(libc::SYS_gettid) } as u64;
        self.res
            .insert_thread_info(tid, name.as_bytes())
            .expect("thread info")
    }

    fn run_plan_for(&self, thread_name: &str) {
        let thread = self.thread(thread_name);
        self.run_plan(thread_name, thread);
    }

    /// Allocates the planned blocks of `thread_name`: `freed` blocks that
    /// are then freed, and `live` blocks that stay.
    fn run_plan(&self, thread_name: &str, thread: ResourceKey) {
        for p in PLAN.iter().filter(|p| p.thread == thread_name) {
            let stack = self.stack(p.function, p.caller);
            let freed: Vec<u64> = (0..p.freed)
                .map(|_| self.alloc(stack, thread, p.size))
                .collect();
            for _ in 0..p.live {
                self.alloc(stack, thread, p.size);
            }
            for a in freed {
                self.free(a);
            }
        }
    }

    /// `n` live blocks over 96 stacks whose leaf addresses differ (inside
    /// the site functions), sizes 16..4096.
    fn bulk(&self, n: u64, thread: ResourceKey) {
        let sites = [
            "site_alpha",
            "site_beta",
            "site_gamma",
            "site_delta",
            "churn_a",
            "churn_b",
        ];
        let mut keys = Vec::new();
        for (i, site) in sites.iter().enumerate() {
            for k in 0..16u64 {
                let frames = [
                    fn_addr(site) + 1 + k,
                    fn_addr(if i % 2 == 0 {
                        "fake_thread_main"
                    } else {
                        "fake_thread_worker"
                    }) + 1,
                    fn_addr("fake_root") + 1,
                ];
                let mut bytes = Vec::new();
                stack_compression::encode(&frames, &mut bytes);
                keys.push(self.res.intern_stack_trace(&bytes).expect("intern").0);
            }
        }
        for i in 0..n {
            let size = 16 + (i * 7919) % 4080;
            self.alloc(keys[(i % keys.len() as u64) as usize], thread, size);
        }
    }

    fn churn(&self, idx: usize, stop: &AtomicBool) {
        let thread = self.thread(&format!("fake-churn-{idx}"));
        let name = ["churn_a", "churn_b"][idx % 2];
        let size = CHURN_SIZES[idx % 2];
        let stack = self.stack(name, "fake_thread_worker");
        let mut ring = std::collections::VecDeque::new();
        while !stop.load(Ordering::Relaxed) {
            ring.push_back(self.alloc(stack, thread, size));
            if ring.len() > 2000 {
                let a = ring.pop_front().expect("non-empty");
                self.free(a);
            }
        }
    }
}

fn corrupt(region: &RegionWriter, how: Corruption) {
    let view = region.view();
    match how {
        Corruption::Magic => view
            .atomic_u64(0)
            .expect("magic")
            .store(0, Ordering::Relaxed),
        Corruption::Version => {
            let w = view.atomic_u64(8).expect("version word");
            let old = w.load(Ordering::Relaxed);
            w.store((old & !0xffff) | 99, Ordering::Relaxed);
        }
        Corruption::Nodes => {
            let nodes_off = region.header().layout[4];
            let hw = view.load_u64(offsets::KIND_WORDS).unwrap_or(0);
            let mut live_seen = 0;
            for i in 0..hw {
                let base = nodes_off + i * 32;
                if view.load_u64(base + 8).unwrap_or(0) == 0 {
                    continue;
                }
                let w0 = view.atomic_u64(base).expect("node");
                match live_seen {
                    0 => {
                        w0.fetch_or(1, Ordering::Relaxed);
                    }
                    1 => {
                        let w3 = view.atomic_u64(base + 24).expect("node");
                        let old = w3.load(Ordering::Relaxed);
                        w3.store((old & !0xffff_ffff) | 0x0fff_fff0, Ordering::Relaxed);
                    }
                    _ => break,
                }
                live_seen += 1;
            }
        }
    }
}

fn serve_commands(fake: &Fake<'_>, main_thread: ResourceKey) {
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    for line in stdin.lock().lines() {
        let Ok(line) = line else { break };
        let line = line.trim();
        let counters = fake.allocs.counters();
        match line.split_once(' ').map_or((line, ""), |(a, b)| (a, b)) {
            ("request", name) => counters.request_snapshot(name, monotonic_ns()),
            ("signal", _) => counters.request_snapshot_signal_safe(monotonic_ns()),
            ("alloc", _) => {
                let stack = fake.stack("site_alpha", "fake_thread_main");
                fake.alloc(stack, main_thread, PLAN[0].size);
            }
            ("exit", _) => break,
            ("fork", _) => {
                // SAFETY: the child only makes async-signal-safe system
                // calls (prctl, pause) and never returns into Rust code
                // that could touch locks held by other threads at fork.
                let pid = unsafe { libc::fork() };
                if pid == 0 {
                    // SAFETY: as above; the child dies with its parent.
                    unsafe {
                        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                        loop {
                            libc::pause();
                        }
                    }
                }
                let _ = writeln!(out, "forked {pid}");
                let _ = out.flush();
                continue;
            }
            _ => {
                let _ = writeln!(out, "unknown command");
                continue;
            }
        }
        let _ = writeln!(out, "ok");
        let _ = out.flush();
    }
}

/// Runs the fake target until its stdin ends or says `exit`.
pub fn run(opts: FakeOptions) -> Result<(), Box<dyn std::error::Error>> {
    if opts.unsealed {
        let fd = heapdump_table::region::memfd_create(c"heapdump.allocations", libc::MFD_CLOEXEC)?;
        nix::unistd::ftruncate(&fd, 1 << 20)?;
        // Mapped writable and shared, as a (foreign) writer maps its region:
        // that is what makes a process an instrumented one to the dumper.
        let file = std::fs::File::from(fd);
        // SAFETY: a fresh memfd only this process knows; nothing truncates
        // it while the mapping lives (it lives until this function returns).
        let map = unsafe { memmap2::MmapMut::map_mut(&file)? };
        println!("ready");
        std::io::stdout().flush()?;
        let mut s = String::new();
        while std::io::stdin().read_line(&mut s)? > 0 {
            s.clear();
        }
        drop(map);
        drop(file);
        return Ok(());
    }
    let res_region = ResourcesWriter::create_region(16 << 20, 1024)?;
    let alloc_region = AllocationsWriter::create_region(AllocationsConfig {
        capacity: (opts.blocks + (opts.blocks / 4)).max(1 << 16),
        shards: if opts.blocks > 100_000 { 256 } else { 16 },
    })?;
    let next_addr = AtomicU64::new(0x7e00_0000_0000);
    let fake = Fake {
        res: ResourcesWriter::new(&res_region)?,
        allocs: AllocationsWriter::new(&alloc_region)?,
        clock_base_ns: alloc_region.header().clock_monotonic_ns,
        next_addr: &next_addr,
    };
    // The dumper shows live threads under their current OS names: give the
    // main thread the name it is recorded under (this also becomes the
    // process name).
    // SAFETY: PR_SET_NAME reads a NUL-terminated string of up to 16 bytes.
    unsafe { libc::prctl(libc::PR_SET_NAME, c"fake-main".as_ptr()) };
    let main_thread = fake.thread("fake-main");
    // Main thread's sites, then each worker on its own named thread.
    fake.run_plan("fake-main", main_thread);
    std::thread::scope(|s| {
        for name in ["fake-worker-1", "fake-worker-2"] {
            let fake = &fake;
            std::thread::Builder::new()
                .name(name.to_string())
                .spawn_scoped(s, move || fake.run_plan_for(name))
                .expect("spawn worker");
        }
    });
    if opts.blocks > 0 {
        fake.bulk(opts.blocks, main_thread);
    }
    if let Some(how) = opts.corrupt {
        corrupt(&alloc_region, how);
    }
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        if opts.churn {
            for i in 0..2 {
                let (fake, stop) = (&fake, &stop);
                std::thread::Builder::new()
                    .name(format!("fake-churn-{i}"))
                    .spawn_scoped(s, move || fake.churn(i, stop))
                    .expect("spawn churn");
            }
        }
        println!("ready");
        let _ = std::io::stdout().flush();
        serve_commands(&fake, main_thread);
        stop.store(true, Ordering::Relaxed);
    });
    Ok(())
}
