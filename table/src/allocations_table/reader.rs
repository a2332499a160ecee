//! The reader: one linear walk over the node array, accepting a node only
//! between two equal even sequence readings.
//!
//! Invariants:
//! - Readers never write and never take a lock: the walk reads nodes and
//!   the shards' counters only.
//! - The walk is bounded by the node capacity of the validated layout and
//!   by the high-water mark, and reads only the pages of the node array
//!   that hold data (`lseek(SEEK_DATA)` on the region's memfd): the
//!   high-water mark is a word the target writes, and a forged one must not
//!   make the reader fault in gigabytes of never-written shared memory
//!   (each read fault of a memfd hole allocates a page, charged to the
//!   reader). A page that was never written holds only free nodes, and a
//!   swapped-out page still counts as data, so nothing live is skipped; a
//!   block live for the whole walk was written, so its page is data, before
//!   the walk looked. A node that keeps changing is retried within
//!   a budget and a deadline ([`WALK_RETRY_BUDGET`], [`WALK_RETRY_TIME`]),
//!   then the walk is reported partial: a target killed inside an update
//!   leaves `seq` odd forever.

use super::*;

/// Most nodes a walk puts aside for a patient second look.
pub const WALK_MAX_DEFERRED: usize = 1024;
/// Total retries a walk spends on nodes that were changing.
pub const WALK_RETRY_BUDGET: u32 = 200_000;
/// Longest a walk spends re-reading nodes that were changing.
pub const WALK_RETRY_TIME: std::time::Duration = std::time::Duration::from_millis(500);

/// The outcome of a walk over the live table.
#[derive(Clone, Debug, Default)]
pub struct WalkStats {
    /// Nodes examined (the high-water mark at the start of the walk).
    pub nodes: u64,
    /// Live records reported.
    pub reported: u64,
    /// Nodes that never read consistently (writer mid-update the whole
    /// time, or killed mid-update).
    pub unstable: u64,
}

impl WalkStats {
    /// Why the walk is incomplete, if it is.
    pub fn partial_reason(&self) -> Option<String> {
        (self.unstable > 0).then(|| {
            format!(
                "{} record(s) were being modified throughout the walk (target killed mid-update, or hostile)",
                self.unstable
            )
        })
    }
}

/// Read-only access to an allocations region (the dumper's side).
#[derive(Clone, Copy, Debug)]
pub struct AllocationsReader<'a> {
    pub(super) view: SharedView,
    pub(super) layout: Layout,
    /// The region's memfd, to skip its holes (`None`: read every node).
    pub(super) fd: Option<std::os::fd::RawFd>,
    pub(super) _region: std::marker::PhantomData<&'a ()>,
}

pub(super) enum NodeRead {
    Free,
    Live(AllocationRecord),
    Changing,
}

impl<'a> AllocationsReader<'a> {
    /// Validates the layout of a mapped allocations region.
    pub fn new(region: &'a RegionReader) -> Result<Self, TableError> {
        let h = region.header();
        if region.kind() != RegionKind::Allocations {
            return Err(TableError::WrongKind {
                found: h.kind,
                expected: RegionKind::Allocations as u32,
            });
        }
        let layout = Layout::from_header(&h.layout, h.region_size)?;
        Ok(AllocationsReader {
            view: region.view(),
            layout,
            fd: Some(region.raw_fd()),
            _region: std::marker::PhantomData,
        })
    }

    /// Reads any bytes as an allocations region (fuzzing, tests).
    ///
    /// # Safety
    /// `view` must stay mapped for `'a`.
    pub unsafe fn from_view(view: SharedView) -> Result<Self, TableError> {
        let h = parse_header(&view, RegionKind::Allocations)?;
        let layout = Layout::from_header(&h.layout, h.region_size)?;
        Ok(AllocationsReader {
            view,
            layout,
            fd: None,
            _region: std::marker::PhantomData,
        })
    }

    /// The process-wide counters in this region's header.
    pub fn counters(&self) -> Counters {
        read_counters(&self.view)
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> u64 {
        self.layout.capacity
    }

    #[inline]
    pub(super) fn read_node(&self, i: u64) -> NodeRead {
        let base = self.layout.nodes_off + i * NODE_SIZE;
        // All four words lie inside the validated node area.
        let ld = |w: u64| self.view.load_u64(base + w * 8).unwrap_or(0);
        let a = ld(0);
        fence(Ordering::Acquire);
        if a & 1 == 1 {
            return NodeRead::Changing;
        }
        let w1 = ld(1);
        let w2 = ld(2);
        let w3 = ld(3);
        // Acquire fence: the data loads above complete before the second
        // seq reading, so equal even readings mean no writer intervened.
        fence(Ordering::Acquire);
        if ld(0) != a {
            return NodeRead::Changing;
        }
        match super::record::decode_node(a, w1, w2, w3) {
            Some(rec) => NodeRead::Live(rec),
            None => NodeRead::Free,
        }
    }

    /// Reads node `i` up to `tries` times; spins for the first
    /// `spin_tries`, then yields the CPU between tries (a writer preempted
    /// mid-update needs it). Returns the outcome and the tries used.
    ///
    /// Yielding stops at `deadline`: on a loaded machine one `yield_now`
    /// can cost a whole scheduler slice, so a try count alone would not
    /// bound the time spent on a node that never settles.
    pub(super) fn read_node_retrying(
        &self,
        i: u64,
        tries: u32,
        spin_tries: u32,
        deadline: Option<std::time::Instant>,
    ) -> (NodeRead, u32) {
        for attempt in 0..tries {
            match self.read_node(i) {
                NodeRead::Changing => {
                    if attempt < spin_tries {
                        std::hint::spin_loop();
                    } else if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                        return (NodeRead::Changing, attempt + 1);
                    } else {
                        std::thread::yield_now();
                    }
                }
                r => return (r, attempt + 1),
            }
        }
        (NodeRead::Changing, tries)
    }

    /// Calls `f` for every live record, each read consistently. Never
    /// blocks the writers; bounded by the node capacity. Nodes that keep
    /// changing are retried once more at the end (giving a descheduled
    /// writer time to finish) and otherwise counted as `unstable`.
    ///
    /// Every retry is bounded: a first pass spins briefly on a changing
    /// node; at most [`WALK_MAX_DEFERRED`] nodes are put aside for a
    /// patient second look, which has a total budget of
    /// [`WALK_RETRY_BUDGET`] tries and [`WALK_RETRY_TIME`] of wall time.
    /// So a region whose nodes all look mid-update (a target killed at the
    /// wrong moment, or hostile bytes) costs one quick pass, not a hang.
    pub fn walk(&self, mut f: impl FnMut(&AllocationRecord)) -> WalkStats {
        let hw = self.view.load_u64(W_NODE_HW).unwrap_or(0);
        fence(Ordering::Acquire);
        let n = hw.min(self.layout.capacity);
        let mut stats = WalkStats {
            nodes: n,
            ..Default::default()
        };
        let mut later = Vec::new();
        for i in self.written_nodes(n).into_iter().flatten() {
            match self.read_node_retrying(i, 16, u32::MAX, None).0 {
                NodeRead::Free => {}
                NodeRead::Live(r) => {
                    stats.reported += 1;
                    f(&r);
                }
                NodeRead::Changing if later.len() < WALK_MAX_DEFERRED => later.push(i),
                NodeRead::Changing => stats.unstable += 1,
            }
        }
        if later.is_empty() {
            return stats;
        }
        let started = std::time::Instant::now();
        let mut budget = WALK_RETRY_BUDGET;
        for i in later {
            let tries = if budget == 0 || started.elapsed() > WALK_RETRY_TIME {
                1
            } else {
                budget.min(20_000)
            };
            let (r, used) = self.read_node_retrying(i, tries, 32, Some(started + WALK_RETRY_TIME));
            budget = budget.saturating_sub(used);
            match r {
                NodeRead::Free => {}
                NodeRead::Live(r) => {
                    stats.reported += 1;
                    f(&r);
                }
                NodeRead::Changing => stats.unstable += 1,
            }
        }
        stats
    }

    /// The ranges of node numbers below `n` whose pages hold data (every
    /// node when the region's file cannot say).
    pub(super) fn written_nodes(&self, n: u64) -> Vec<std::ops::Range<u64>> {
        let Some(fd) = self.fd else {
            return std::iter::once(0..n).collect();
        };
        let start = self.layout.nodes_off;
        let end = start + n * NODE_SIZE;
        let mut out = Vec::new();
        let mut at = start;
        while at < end {
            // SAFETY: lseek on a descriptor the region keeps open for 'a;
            // it moves only the file offset, which nothing else uses (the
            // region is read through its mapping).
            let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
            if data < 0 {
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                    break; // No data past `at`.
                }
                return std::iter::once(0..n).collect(); // The file cannot tell: read it all.
            }
            let data = data as u64;
            if data >= end {
                break;
            }
            // SAFETY: as above.
            let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
            let hole = if hole < 0 {
                end
            } else {
                (hole as u64).min(end)
            };
            if hole <= data {
                return std::iter::once(0..n).collect();
            }
            out.push((data.max(start) - start) / NODE_SIZE..(hole - start).div_ceil(NODE_SIZE));
            at = hole;
        }
        out
    }

    /// Collects every live record (see [`Self::walk`]).
    pub fn snapshot(&self) -> (Vec<AllocationRecord>, WalkStats) {
        let mut v = Vec::new();
        let stats = self.walk(|r| v.push(*r));
        (v, stats)
    }
}
