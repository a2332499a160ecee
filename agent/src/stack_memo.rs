//! An earlier CFI walk of a thread, kept so that its later walks can take
//! the frames they share with it (the outer part of a stack: `main`, the event
//! loop, the request handler) without stepping through them again.
//!
//! Why: on code without frame pointers every CFI step waits for two
//! dependent loads (the frame's rule from the rule cache, then the return
//! address the rule locates), so a walk is a chain of loads as long as the
//! stack. Consecutive allocations of a thread mostly share the outer part
//! of their stacks. Once a walk reaches a frame in the same state as a
//! frame of the recorded walk (same program counter, same stack pointer
//! and, where the rest of the walk depends on it, the same `rbp`), the rest
//! of the walk is decided by the stack words the recorded walk read below
//! that frame: if each still holds the value read then, the walk would
//! find the same frames and end the same way. Those words' addresses are
//! known in advance, so they are checked with independent loads that the
//! processor overlaps instead of a chain of dependent ones. The memo need
//! not be the newest walk, only one of this thread's: it is refreshed when
//! a walk had to step through more than [`REFRESH_AFTER`] frames itself.
//! A thread keeps a few ([`StackMemos`]): the main one every walk steps
//! with, and others for further call paths, each found by its first frame.
//!
//! Invariants:
//! - Entries are stored bottom-up: `e[0]` is where the recorded walk ended,
//!   `e[len - 1]` its innermost frame. Stack pointers strictly fall as the
//!   index rises (each step of a walk raises the stack pointer).
//! - For `1 <= j < valid`, the step out of `e[j]` was a replayable one
//!   ([`Step::FramePointer`] or [`Step::Rsp`]): it read exactly the return
//!   address at `e[j - 1].sp - 8` (which became `e[j - 1].pc`) and, where
//!   it read one, the caller's `rbp` (which became `e[j - 1].rbp`; checked
//!   at `checks[j - 1].at` only where `e[j - 1].needs_rbp`); the new stack
//!   pointer and everything else followed from the rule of `e[j].pc` and
//!   the state of `e[j]`. Both words lie in
//!   `[e[j].sp, e[j - 1].sp)` and are aligned. So a walk in a state equal
//!   to `e[b]` (`b < valid`) reaches `e[b - 1]`, ..., `e[0]` exactly when
//!   those words still hold those values ([`StackMemo::follow`] checks
//!   them).
//! - `needs_rbp` of `e[j]`: whether the walk from `e[j]` on uses the `rbp`
//!   it has there before reloading it. When false, a state with another
//!   `rbp` walks the same frames, and the entries' `rbp` above the reload
//!   may be stale; nothing reads them.
//! - `complete`: the recorded walk ended at `e[0]` for a reason that
//!   depends only on `e[0]`'s state (its counter's rule, its stack pointer,
//!   its `rbp` where `needs_rbp`), so a replay ends there too. Otherwise
//!   (the walk was cut at the frame limit, or ended by a rule this memo
//!   does not replay) only a walk that reaches the frame limit before
//!   `e[0]` may take frames from the memo.
//! - `first_output` is 1 when `e[0]` is the state whose counter ended the
//!   walk (read as a return address, so checked like one, but not a frame
//!   of the trace), else 0.
//! - Every address an entry records lies in `[e[j + 1].sp, top]`, `top`
//!   being the highest readable stack word of the thread when it was
//!   recorded; a walk uses the memo only with the same `top` and from a
//!   frame whose stack pointer is at least its own, so every read of a
//!   replay lies in the part of the stack the walk may read. `extend`
//!   refuses to make a step replayable whose words break this, so a replay
//!   need only check the two ends of the range.
//! - `at_sp` maps a stack pointer's slot to an entry (+ 1) and is only a
//!   hint: [`StackMemo::candidate`] checks the entry it names (below the
//!   walk's bound, same stack pointer, counter and, where needed, `rbp`),
//!   so a slot shared by two entries or left stale by a new recording
//!   only makes a walk step further itself.
//! - Rules come from the thread's rule cache, which is emptied when a
//!   module may have been unloaded; the memo is emptied with it.
//! - `sum` of `e[j]` (`j >= first_output`, while `complete`): the trace
//!   hash's contribution of `e[first_output..=j]`, to be scaled by
//!   `P^(j - first_output + 1)` (see [`TraceHash`]), so a replayed walk's
//!   hash costs one multiply-add.

use crate::stack_capture::TraceHash;
use crate::trace_shortcut::ShortcutFill;
use heapdump_table::stack_compression::MAX_FRAMES;

/// Set in a program counter (a walk's [`Visited::pc`], a rule cache's key)
/// for a counter that a signal interrupted, whose rule is looked up at the
/// counter itself, not at the byte before it as for a return address. The
/// frames a memo keeps have it cleared. User-space counters are below
/// 2^56, so the bit never collides with an address.
pub(crate) const EXACT: u64 = 1 << 63;

/// Entries a memo holds: a walk's frames plus the state that ended it.
pub const MEMO_ENTRIES: usize = MAX_FRAMES + 1;
// Entry numbers + 1 fit `StackMemo::at_sp`'s bytes.
const _: () = assert!(MEMO_ENTRIES < 256);

/// Slots of [`StackMemo::at_sp`].
const SP_SLOTS: usize = 64;

/// A stack pointer's slot in [`StackMemo::at_sp`]: frames' stack pointers
/// are 16-byte aligned at call sites, so entries within 1 KiB of each
/// other never share one.
#[inline(always)]
fn sp_slot(sp: usize) -> usize {
    (sp >> 4) & (SP_SLOTS - 1)
}
// One bit of `StackMemo::rbp_checked` per check (`MEMO_ENTRIES - 1`).
const _: () = assert!(MEMO_ENTRIES - 1 <= 64);

/// A walk that met the memo after stepping through at most this many
/// frames itself leaves the memo as it is (recording costs more per frame
/// than stepping; see [`crate::cfi_unwind::walk`]).
pub const REFRESH_AFTER: usize = 3;

/// Of the walks that met the memo after more than [`REFRESH_AFTER`]
/// frames of their own, one in this many is recorded
/// ([`StackMemo::refresh_due`]).
pub const REFRESH_EVERY: u32 = 16;

/// How a frame was stepped out of, as far as a replay is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// Through the frame pointer: the new stack pointer is `rbp + 16`, the
    /// return address at `rbp + 8`, the caller's `rbp` at `rbp`.
    FramePointer,
    /// CFA = rsp + k: the return address just below the CFA (the new stack
    /// pointer); the caller's `rbp` at `CFA + rbp_off`, or (0) unchanged.
    Rsp {
        /// Offset of the saved `rbp` from the CFA; 0: `rbp` is not saved.
        rbp_off: i64,
    },
    /// The walk ends in this frame whatever its `rbp` and the stack hold
    /// (the outermost frame, or no CFI and no frame-pointer fallback).
    End,
    /// Any other rule (general CFI, a signal frame): not replayed.
    Other,
}

/// One frame as the walk visited it, innermost first, with the raw rule
/// the walk used to step out of it (classified by [`Step`] later, off the
/// walk's loop).
#[derive(Clone, Copy, Debug, Default)]
pub struct Visited {
    /// Program counter, tagged as the walk tags it.
    pub pc: u64,
    /// Stack pointer.
    pub sp: usize,
    /// `rbp` (0 = unknown).
    pub rbp: usize,
    /// The walker's rule for `pc`, opaque here.
    pub rule: u64,
}

/// How a walk ended, for [`StackMemo::record`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum End {
    /// `out` was full.
    Limit,
    /// The last visited state's counter is not a code address: it is not a
    /// frame of the trace.
    BadCounter,
    /// Stepping out of the last visited frame failed.
    Stepped,
}

/// `P^k` for every `k` a memo needs ([`TraceHash::P`]).
const POW: [u64; MEMO_ENTRIES + 1] = {
    let mut t = [1u64; MEMO_ENTRIES + 1];
    let mut k = 1;
    while k <= MEMO_ENTRIES {
        t[k] = t[k - 1].wrapping_mul(TraceHash::P);
        k += 1;
    }
    t
};

/// The two words the step into an entry read, and their values: the
/// return address, and the caller's `rbp` or (where the step read none)
/// the return address again, so that a replay checks two words per entry
/// without a branch (frames that save `rbp` and frames that do not
/// alternate unpredictably). Where no entry of a replay checks an `rbp`
/// (code without frame pointers, see [`StackMemo::rbp_checked`]) it
/// checks the return addresses alone.
#[derive(Clone, Copy, Debug)]
struct Check {
    ra_at: usize,
    ra: u64,
    at: usize,
    val: u64,
}

/// An earlier walk of a thread (see the module doc), one array per use so
/// that a replay's loads are dense.
pub struct StackMemo {
    /// The entries' counters, tagged as the walk tags them.
    pc: [u64; MEMO_ENTRIES],
    /// The entries' stack pointers.
    sp: [usize; MEMO_ENTRIES],
    /// The entries' `rbp` (0 = unknown; stale where not `needs_rbp`).
    rbp: [usize; MEMO_ENTRIES],
    /// The words the step into each entry read (see [`Check`]).
    checks: [Check; MEMO_ENTRIES],
    /// The entries' counters untagged, in reverse (`e[j]`'s at
    /// `MEMO_ENTRIES - 1 - j`): a replay's frames are one copy.
    frames_rev: [u64; MEMO_ENTRIES],
    /// The trace hash's contribution of `e[first_output..=j]`.
    sum: [u64; MEMO_ENTRIES],
    needs_rbp: [bool; MEMO_ENTRIES],
    /// Entry + 1 by [`sp_slot`] of its stack pointer (0: none): a hint
    /// that lets [`StackMemo::candidate`] find the entry a frame may join
    /// in one load instead of stepping down the entries one by one (on the
    /// churn, whose walks start at any depth of a deep memo, that search
    /// stepped over ~16 entries per walk). Written as entries are;
    /// entries sharing a slot leave the newest; a stale value is harmless
    /// (a candidate is checked against the entry itself).
    at_sp: [u8; SP_SLOTS],
    /// Bit `i` set: `checks[i]` checks a saved `rbp` (its second word is
    /// not the return address again). Bits at and above `len - 1` are
    /// stale; a replay reads only bits below its entry.
    rbp_checked: u64,
    len: usize,
    valid: usize,
    complete: bool,
    first_output: usize,
    top: usize,
    generation: u64,
    /// Walks in a row that took nothing from the memo.
    misses: u32,
    /// Walks that met the memo only after stepping through more than
    /// [`REFRESH_AFTER`] frames themselves (see [`StackMemo::refresh_due`]).
    deep_meets: u32,
}

impl Default for StackMemo {
    fn default() -> Self {
        Self::new()
    }
}

impl StackMemo {
    /// An empty memo (usable in a `const` thread-local initialiser).
    pub const fn new() -> Self {
        StackMemo {
            pc: [0; MEMO_ENTRIES],
            sp: [0; MEMO_ENTRIES],
            rbp: [0; MEMO_ENTRIES],
            checks: [Check {
                ra_at: 0,
                ra: 0,
                at: 0,
                val: 0,
            }; MEMO_ENTRIES],
            frames_rev: [0; MEMO_ENTRIES],
            sum: [0; MEMO_ENTRIES],
            needs_rbp: [false; MEMO_ENTRIES],
            at_sp: [0; SP_SLOTS],
            rbp_checked: 0,
            len: 0,
            valid: 0,
            complete: false,
            first_output: 0,
            top: 0,
            generation: 0,
            misses: 0,
            deep_meets: 0,
        }
    }

    /// Notes that a walk took frames from the memo.
    #[inline(always)]
    pub fn met(&mut self) {
        self.misses = 0;
    }

    /// Notes that a walk took nothing from the memo; says whether to
    /// record it. A thread whose walks keep missing (stacks that share no
    /// replayable frame with each other, say a bottom frame whose rule the
    /// memo does not replay) records only every 16th walk after the
    /// second miss, so the memo costs it little.
    #[inline(always)]
    pub fn missed(&mut self) -> bool {
        self.misses = self.misses.wrapping_add(1);
        self.misses <= 2 || self.misses.is_multiple_of(16)
    }

    /// Notes a walk that met the memo after stepping through more than
    /// [`REFRESH_AFTER`] frames itself; says whether to record it (on the
    /// first such walk, then every [`REFRESH_EVERY`]th). A thread whose
    /// consecutive allocations come from a few call paths in turn (a
    /// server's request loop: parse, execute, reply) would otherwise
    /// re-record at nearly every walk, each path evicting the other, and
    /// recording costs several times what stepping does; this way the memo
    /// keeps one path for a while, whose walks then cost almost nothing,
    /// and still follows a lasting change of path within a few walks.
    #[inline(always)]
    pub fn refresh_due(&mut self) -> bool {
        let due = self.refresh_pending();
        self.deep_meets = self.deep_meets.wrapping_add(1);
        due
    }

    /// What the next [`StackMemo::refresh_due`] will answer.
    #[inline(always)]
    fn refresh_pending(&self) -> bool {
        self.deep_meets.is_multiple_of(REFRESH_EVERY)
    }

    /// Whether this memo, recorded with `top` and `generation`, has (`pc`,
    /// `sp`, `rbp`) as its innermost candidate entry: a walk from that
    /// frame may replay it whole.
    #[inline(always)]
    fn starts_at(&self, pc: u64, sp: usize, rbp: usize, top: usize, generation: u64) -> bool {
        let i = self.valid.wrapping_sub(1);
        // (`valid <= MEMO_ENTRIES`: the bound only spares a panic path.)
        i < MEMO_ENTRIES
            && self.sp[i] == sp
            && self.pc[i] == pc
            && self.top == top
            && self.generation == generation
            && (!self.needs_rbp[i] || self.rbp[i] == rbp)
    }

    /// Records a walk that replayed `other`'s entry `b` after visiting
    /// `visited` itself, arriving at `b` with `rbp`: `other`'s entries up
    /// to `b`, then the walk's own (as [`StackMemo::record_above`] would
    /// in `other`, which stays as it is).
    pub fn record_from(
        &mut self,
        other: &StackMemo,
        b: usize,
        rbp: usize,
        visited: &[Visited],
        classify: impl Fn(u64) -> Step,
    ) {
        let n = b + 1;
        self.pc[..n].copy_from_slice(&other.pc[..n]);
        self.sp[..n].copy_from_slice(&other.sp[..n]);
        self.rbp[..n].copy_from_slice(&other.rbp[..n]);
        self.checks[..n].copy_from_slice(&other.checks[..n]);
        self.frames_rev[MEMO_ENTRIES - n..].copy_from_slice(&other.frames_rev[MEMO_ENTRIES - n..]);
        self.sum[..n].copy_from_slice(&other.sum[..n]);
        self.needs_rbp[..n].copy_from_slice(&other.needs_rbp[..n]);
        for (j, &sp) in self.sp[..n].iter().enumerate() {
            self.at_sp[sp_slot(sp)] = (j + 1) as u8;
        }
        // Bits at and above `b` are stale (`extend` rewrites them).
        self.rbp_checked = other.rbp_checked;
        self.len = n;
        self.valid = other.valid;
        self.complete = other.complete;
        self.first_output = other.first_output;
        self.top = other.top;
        self.generation = other.generation;
        self.record_above(b, rbp, visited, classify);
    }

    /// Forgets the recorded walk.
    pub fn clear(&mut self) {
        self.len = 0;
        self.valid = 0;
    }

    /// Prepares a walk whose highest readable word is `top`, with rules of
    /// module generation `generation`: a memo recorded with other ones is
    /// forgotten. Returns the candidate bound for [`StackMemo::candidate`].
    #[inline(always)]
    pub fn start(&mut self, top: usize, generation: u64) -> usize {
        if self.top != top || self.generation != generation {
            self.clear();
            self.top = top;
            self.generation = generation;
        }
        self.valid
    }

    /// The entry a walk now in state (`pc`, `sp`, `rbp`) may continue
    /// from, given the bound `p` (entries below `p` are the candidates:
    /// [`StackMemo::start`]'s `valid`, or 0 once a replay failed). The
    /// entry with that stack pointer, if any, is unique (stack pointers
    /// strictly fall as the index rises) and found through `at_sp`.
    #[inline(always)]
    pub fn candidate(&self, p: &mut usize, pc: u64, sp: usize, rbp: usize) -> Option<usize> {
        let b = usize::from(self.at_sp[sp_slot(sp)]).wrapping_sub(1);
        // (`*p <= valid <= MEMO_ENTRIES`; saying so spares the bounds
        // checks below.)
        (b < (*p).min(MEMO_ENTRIES)
            && self.sp[b] == sp
            && self.pc[b] == pc
            && (!self.needs_rbp[b] || self.rbp[b] == rbp))
            .then_some(b)
    }

    /// Replays the walk from entry `b` (found by [`StackMemo::candidate`]),
    /// whose frames go to `out[n..]` after the `n` the walk found itself
    /// (hashed into `h` so far). Checks every stack word the replayed
    /// steps read; returns the finished `(frames, hash, filled)`, or `None`
    /// (and `out[n..]` is garbage) when a word changed or the memo cannot
    /// tell the rest of this walk. `lo..=top` is what the walk may read.
    ///
    /// `filled` false: the memo's frames are not in `out[n..frames]` yet
    /// (most walks only need the hash: their trace is in the thread's
    /// stack cache); [`StackMemo::fill`] with the same `n` and `b` puts
    /// them there, as long as the memo is not recorded over in between.
    #[inline(always)]
    pub fn follow(
        &self,
        b: usize,
        out: &mut [u64],
        n: usize,
        h: TraceHash,
        lo: usize,
        top: usize,
    ) -> Option<(usize, u64, bool)> {
        match self.follow_whole(b, out.len().saturating_sub(n), h, lo, top) {
            (0, _) => self.follow_general(b, out, n, h, lo, top),
            (usize::MAX, _) => None,
            (frames, then) => {
                let (k, h) = then.finish(n + frames);
                Some((k, h, false))
            }
        }
    }

    /// The common case of [`StackMemo::follow`], out of line with a small
    /// signature (its arguments and answer in registers): the whole rest
    /// of the walk fits in `room` free places, the memo is complete, and
    /// no step below `b` checks a saved `rbp` (bits `0..b` of
    /// `rbp_checked`), so the checked range is `[sp[b], sp[0] - 8]` and
    /// each check is its return address alone. Answers the frames taken
    /// and the hash before [`TraceHash::finish`]; `(0, _)` when the case
    /// does not apply (ask [`StackMemo::follow_general`]), `(usize::MAX,
    /// _)` when it does and a word changed or lies outside `[lo, top]`.
    /// (The general path's arithmetic and its three-word answer through
    /// memory cost ~35 instructions per walk; callgrind on bench/churn.c.)
    #[inline(never)]
    fn follow_whole(
        &self,
        b: usize,
        room: usize,
        h: TraceHash,
        lo: usize,
        top: usize,
    ) -> (usize, TraceHash) {
        let fo = self.first_output;
        if b >= MEMO_ENTRIES || b < fo || !self.complete || b + 1 - fo > room {
            return (0, h);
        }
        if self.rbp_checked & u64::MAX.checked_shr(64 - b as u32).unwrap_or(0) != 0 {
            return (0, h);
        }
        let end = self.sp[0];
        if self.sp[b] < lo || end < 8 || end - 8 > top {
            return (usize::MAX, h);
        }
        // The range `[sp[b], sp[0] - 8]` lies in `[lo, top]`, as
        // `check_return_addresses` requires.
        if self.check_return_addresses(0, b) != 0 {
            return (usize::MAX, h);
        }
        let frames = b + 1 - fo;
        (frames, h.then(POW[frames], self.sum[b]))
    }

    /// [`StackMemo::follow`] in every case (the memo incomplete, a saved
    /// `rbp` checked, or only part of the rest fitting).
    #[inline(never)]
    fn follow_general(
        &self,
        b: usize,
        out: &mut [u64],
        n: usize,
        h: TraceHash,
        lo: usize,
        top: usize,
    ) -> Option<(usize, u64, bool)> {
        let fo = self.first_output;
        // At least one free place (the walk asks only then): `checked` below
        // is then at most `b`.
        let room = out.len().checked_sub(n).filter(|&r| r > 0)?;
        let frames = b + 1 - fo;
        // The lowest entry output, and the lowest whose step is checked.
        let (last, checked) = if frames <= room {
            if !self.complete {
                return None;
            }
            (fo, 0)
        } else {
            (b + 1 - room, b + 1 - room)
        };
        // Every word checked lies in `[sp[b], sp[checked] - 8]` (see
        // `extend`): within what the walk may read if those two ends are.
        if self.sp[b] < lo || self.sp[checked] < 8 || self.sp[checked] - 8 > top {
            return None;
        }
        // Bits `checked..b` (b <= 64: `b < valid <= MEMO_ENTRIES`).
        let range = ((1u128 << b) - (1u128 << checked)) as u64;
        let diff = if self.rbp_checked & range == 0 {
            // No saved `rbp` among these steps: each check's second word is
            // its return address again.
            self.check_return_addresses(checked, b)
        } else {
            self.check_both(checked, b)
        };
        if diff != 0 {
            return None;
        }
        let k = n + (b + 1 - last);
        if frames <= room {
            // The whole rest of the walk: its hash from the sums, its
            // frames left to `fill`.
            let (k, h) = h.then(POW[frames], self.sum[b]).finish(k);
            Some((k, h, false))
        } else {
            out[n..k].copy_from_slice(&self.frames_rev[MEMO_ENTRIES - 1 - b..MEMO_ENTRIES - last]);
            let mut h = h;
            for &pc in &out[n..k] {
                h.add(pc);
            }
            let (k, h) = h.finish(k);
            Some((k, h, true))
        }
    }

    /// Writes the frames of a replay from entry `b` that [`StackMemo::follow`]
    /// left out (`filled` false) into `out[n..]`; returns the walk's frame
    /// count (as `follow` did).
    #[inline]
    pub fn fill(&self, out: &mut [u64], n: usize, b: usize) -> usize {
        let last = self.first_output;
        let k = n + (b + 1 - last);
        out[n..k].copy_from_slice(&self.frames_rev[MEMO_ENTRIES - 1 - b..MEMO_ENTRIES - last]);
        k
    }

    /// How many words [`StackMemo::replay_words`] adds for entry `b`.
    pub fn replay_word_count(&self, b: usize) -> usize {
        let b = b.min(MEMO_ENTRIES - 1);
        let below = u64::MAX.checked_shr(64 - b as u32).unwrap_or(0);
        b + (self.rbp_checked & below).count_ones() as usize
    }

    /// Adds to `fill` every stack word a whole replay from entry `b`
    /// checks (see [`StackMemo::follow`]: each step's return address, and
    /// its saved `rbp` where checked); returns `e[b]`'s stack pointer and
    /// whether the walk from `e[b]` uses its `rbp`. For the trace shortcut
    /// (`crate::trace_shortcut`), after such a replay succeeded.
    pub fn replay_words(&self, b: usize, fill: &mut ShortcutFill<'_>) -> (usize, bool) {
        let b = b.min(MEMO_ENTRIES - 1);
        for (j, c) in self.checks[..b].iter().enumerate() {
            fill.word(c.ra_at);
            if self.rbp_checked >> j & 1 != 0 {
                fill.word(c.at);
            }
        }
        (self.sp[b], self.needs_rbp[b])
    }

    /// The return addresses of `checks[checked..b]`, XORed with their
    /// values and ORed together (0: all unchanged). The caller checked that
    /// every word lies in `[sp[b], sp[checked] - 8]`, inside the readable
    /// stack (as for [`Self::check_both`]).
    #[inline(always)]
    fn check_return_addresses(&self, checked: usize, b: usize) -> u64 {
        // SAFETY: each `ra_at` of these checks lies in `[sp[b],
        // sp[checked] - 8]` and is aligned (`extend` makes a step
        // replayable only then), inside `[lo, top]`, the live part of this
        // thread's stack that the walk may read (the caller checked it).
        // Volatile: nothing may be assumed of the words.
        let changed = |c: &Check| unsafe { std::ptr::read_volatile(c.ra_at as *const u64) } ^ c.ra;
        // Four at a time: the loop's own count and branch once per four
        // frames (the loads are independent either way).
        let mut quads = self.checks[checked..b].chunks_exact(4);
        let mut diff = 0;
        for q in &mut quads {
            diff |= changed(&q[0]) | changed(&q[1]) | changed(&q[2]) | changed(&q[3]);
        }
        for c in quads.remainder() {
            diff |= changed(c);
        }
        diff
    }

    /// Both words of `checks[checked..b]`, XORed with their values and
    /// ORed together (0: all unchanged). The caller checked that every word
    /// lies in `[sp[b], sp[checked] - 8]`, inside the readable stack.
    #[inline(always)]
    fn check_both(&self, checked: usize, b: usize) -> u64 {
        let mut diff = 0;
        for c in &self.checks[checked..b] {
            // SAFETY: both words lie in `[sp[b], sp[checked] - 8]`, inside
            // `[lo, top]`, the live part of this thread's stack that the
            // walk may read (`follow`'s caller's guarantee, checked by
            // `follow`), and are aligned (checked by `extend`). Volatile:
            // nothing may be assumed of them.
            let (ra, word) = unsafe {
                (
                    std::ptr::read_volatile(c.ra_at as *const u64),
                    std::ptr::read_volatile(c.at as *const u64),
                )
            };
            diff |= (ra ^ c.ra) | (word ^ c.val);
        }
        diff
    }

    /// Records a walk that replayed entry `b` after visiting `visited`
    /// (innermost first) itself, arriving at `b` with `rbp`.
    #[inline(never)]
    pub fn record_above(
        &mut self,
        b: usize,
        rbp: usize,
        visited: &[Visited],
        classify: impl Fn(u64) -> Step,
    ) {
        let mut b = b;
        let m = visited.len();
        if b + 1 + m > MEMO_ENTRIES {
            // Too deep to keep all: drop the outermost entries. The memo
            // no longer reaches the walk's end (and its sums, counted from
            // there, are no longer used).
            let drop = b + 1 + m - MEMO_ENTRIES;
            self.pc.copy_within(drop..=b, 0);
            self.sp.copy_within(drop..=b, 0);
            self.rbp.copy_within(drop..=b, 0);
            self.checks.copy_within(drop..=b, 0);
            self.rbp_checked = self.rbp_checked.checked_shr(drop as u32).unwrap_or(0);
            self.frames_rev.copy_within(
                MEMO_ENTRIES - 1 - b..MEMO_ENTRIES - drop,
                MEMO_ENTRIES - 1 - b + drop,
            );
            self.needs_rbp.copy_within(drop..=b, 0);
            b -= drop;
            for (j, &sp) in self.sp[..=b].iter().enumerate() {
                self.at_sp[sp_slot(sp)] = (j + 1) as u8;
            }
            self.valid = self.valid.saturating_sub(drop).max(1);
            self.complete = false;
            self.first_output = 0;
        }
        self.rbp[b] = rbp;
        self.valid = self.valid.min(b + 1);
        self.len = b + 1;
        self.extend(visited, classify);
    }

    /// Records a walk that took nothing from the memo: `visited` are its
    /// states, innermost first (with the one that ended it when `end` is
    /// [`End::BadCounter`]).
    #[inline(never)]
    pub fn record(&mut self, visited: &[Visited], end: End, classify: impl Fn(u64) -> Step) {
        self.clear();
        let Some((last, above)) = visited.split_last() else {
            return;
        };
        let (step, complete) = match end {
            End::Limit => (Step::Other, false),
            End::BadCounter => (Step::End, true),
            End::Stepped => {
                let s = classify(last.rule);
                (s, s != Step::Other)
            }
        };
        self.complete = complete;
        self.first_output = usize::from(end == End::BadCounter);
        self.pc[0] = last.pc;
        self.frames_rev[MEMO_ENTRIES - 1] = last.pc & !EXACT;
        self.sp[0] = last.sp;
        self.at_sp[sp_slot(last.sp)] = 1;
        self.rbp[0] = last.rbp;
        // Only a frame-pointer step's bounds depend on rbp.
        self.needs_rbp[0] = step == Step::FramePointer;
        self.sum[0] = if self.first_output == 0 {
            TraceHash::mix(last.pc & !EXACT)
        } else {
            0
        };
        self.len = 1;
        self.valid = 1;
        self.extend(above, classify);
    }

    /// Appends the frames `visited` (innermost first) above the current
    /// innermost entry, each stepped out of by `classify(rule)` into the
    /// one below it. Keeps the invariant [`StackMemo::follow`] relies on: a
    /// step is replayable only if the words it read, the return address at
    /// `below.sp - 8` and the one at `checks[below].at`, are aligned and lie in
    /// `[v.sp, below.sp)`; so the words checked below an entry `e[b]` all
    /// lie in `[e[b].sp, e[checked].sp - 8]`.
    ///
    /// The running values (the entry below, its hash sum and `needs_rbp`)
    /// stay in locals: through memory, each entry would wait for the last
    /// one's stores.
    #[inline(always)]
    fn extend(&mut self, visited: &[Visited], classify: impl Fn(u64) -> Step) {
        let Some(mut j) = self.len.checked_sub(1) else {
            return;
        };
        let mut below_sp = self.sp[j];
        let mut below_pc = self.pc[j];
        let mut below_rbp = self.rbp[j];
        let mut needs = self.needs_rbp[j];
        let mut sum = self.sum[j];
        let mut valid = self.valid;
        let fo = self.first_output;
        for v in visited.iter().rev() {
            j += 1;
            if j >= MEMO_ENTRIES {
                break;
            }
            // Branch-light: the kinds of neighbouring frames vary.
            let (fp, rbp_off, stepped) = match classify(v.rule) {
                Step::FramePointer => (true, 0, true),
                Step::Rsp { rbp_off } => (false, rbp_off, true),
                Step::End | Step::Other => (false, 0, false),
            };
            let ra_at = below_sp.wrapping_sub(8);
            let rbp_at = if fp {
                below_sp.wrapping_sub(16)
            } else {
                below_sp.wrapping_add_signed(rbp_off as isize)
            };
            let reads_rbp = fp | (rbp_off != 0);
            // The saved rbp is checked only where the walk below uses it:
            // in code without frame pointers rbp is an ordinary register,
            // and the values frames save of it change from call to call.
            let check_rbp = reads_rbp & needs;
            let at = if check_rbp { rbp_at } else { ra_at };
            let replayable = stepped
                & (v.sp <= at)
                & (at < below_sp)
                & (v.sp <= ra_at)
                & (ra_at < below_sp)
                & (below_sp | at | v.sp).is_multiple_of(8);
            let bit = 1u64 << (j - 1);
            self.rbp_checked = if check_rbp {
                self.rbp_checked | bit
            } else {
                self.rbp_checked & !bit
            };
            self.checks[j - 1] = Check {
                ra_at,
                ra: below_pc,
                at,
                val: if check_rbp {
                    below_rbp as u64
                } else {
                    below_pc
                },
            };
            self.pc[j] = v.pc;
            self.frames_rev[MEMO_ENTRIES - 1 - j] = v.pc & !EXACT;
            self.sp[j] = v.sp;
            self.at_sp[sp_slot(v.sp)] = (j + 1) as u8;
            self.rbp[j] = v.rbp;
            // Whether the walk from here uses this frame's rbp: a
            // frame-pointer step does; a step that reloads rbp does not;
            // one that passes it on does if the frame below does.
            needs = !replayable | fp | (!reads_rbp & needs);
            self.needs_rbp[j] = needs;
            let pc = v.pc & !EXACT;
            sum = sum.wrapping_add(TraceHash::mix(pc).wrapping_mul(POW[j - fo]));
            self.sum[j] = sum;
            if replayable & (valid == j) {
                valid = j + 1;
            }
            (below_sp, below_pc, below_rbp) = (v.sp, v.pc, v.rbp);
            self.len = j + 1;
        }
        self.valid = valid;
    }
}

/// Memos one thread keeps ([`StackMemos`]): the main one and the others.
pub const PATHS: usize = 4;
const _: () = assert!(PATHS >= 2 && PATHS <= 256);

/// A walk that met the main memo after stepping through at least this
/// many frames itself (and no more than [`REFRESH_AFTER`], which refresh
/// the main memo instead) may be recorded into another memo.
pub const OTHER_PATH_AFTER: usize = 2;

/// Of the walks that may be recorded into another memo, one in this many
/// is, while the other memos earn their keep (see [`StackMemos`]).
pub const OTHER_PATH_EVERY: u32 = 64;

/// ... and one in this many when they do not.
pub const OTHER_PATH_IDLE_EVERY: u32 = 4096;

/// Walks that look for another memo starting at their first frame after
/// one was recorded or served a walk: past that many in a row that found
/// none, walks stop looking (the thread's paths do not repeat exactly)
/// until the next recording.
pub const PROBES: u32 = 1024;

/// Most credit the other memos can hold (see [`StackMemos`]).
const MAX_CREDIT: u32 = 64;

/// Slots of [`StackMemos`]' route table.
const ROUTE_SLOTS: usize = 64;

/// The route slot of a first frame (`pc`, `sp`).
#[inline(always)]
fn route_slot(pc: u64, sp: usize) -> usize {
    ((pc ^ (sp as u64 >> 3)).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58) as usize % ROUTE_SLOTS
}

/// A thread's memos: the main one, which every walk steps with as with a
/// single memo, and a few others, one per further call path the thread
/// allocates from often. A server alternates between a few paths (parse a
/// request, execute it, write the reply) that join only a few frames up,
/// and a walk from a path other than the main memo's steps through its own
/// frames until they join (on redis 27 % of walks stepped 2 or 3 frames,
/// ~45 instructions each). Such a walk is recorded now and then into
/// another memo (in turn), and a route table keyed by its first frame
/// finds that memo again: a later walk whose first frame is that memo's
/// innermost entry replays the whole trace from it before stepping at
/// all. Walks that step through more frames refresh the main memo, as
/// before (a deeper walk of the same path makes it serve both).
///
/// The other memos are recorded only while they earn their keep: each
/// recording spends a credit, each walk they serve earns one, and with
/// no credit left only one walk in [`OTHER_PATH_IDLE_EVERY`] is recorded
/// (a thread whose paths never repeat exactly, like `bench/churn`'s
/// random recursion depths, then pays almost nothing for them: its walks
/// stop looking for other memos [`PROBES`] walks after a recording).
///
/// Invariants: each memo keeps [`StackMemo`]'s (a replay from any of them
/// checks every word it relies on, so a stale route or memo can only cost
/// a failed check, never change a trace); memo 0 is the main one; route
/// entries are 0 (none) or a memo number in `1..PATHS`; `next` is in
/// `1..PATHS` (0 reads as 1); all-zero bytes are the empty set.
pub struct StackMemos {
    memos: [StackMemo; PATHS],
    /// Which other memo's innermost entry is a walk's first frame, by
    /// [`route_slot`] of that frame (a hint, see the invariants).
    route: [u8; ROUTE_SLOTS],
    /// The other memo the next recording goes to (0 reads as 1).
    next: usize,
    /// Walks that may be recorded into another memo so far.
    other_paths: u32,
    /// See the type's doc.
    credit: u32,
    /// Walks that may still look for another memo starting at their first
    /// frame before one serves a walk or is recorded (see [`PROBES`]).
    probes: u32,
}

impl Default for StackMemos {
    fn default() -> Self {
        Self::new()
    }
}

impl StackMemos {
    /// An empty set.
    pub const fn new() -> Self {
        StackMemos {
            memos: [const { StackMemo::new() }; PATHS],
            route: [0; ROUTE_SLOTS],
            next: 0,
            other_paths: 0,
            credit: 0,
            probes: 0,
        }
    }

    /// Forgets every recorded walk.
    pub fn clear(&mut self) {
        for m in &mut self.memos {
            m.clear();
        }
        self.route = [0; ROUTE_SLOTS];
    }

    /// Memo `k` (0: the main one).
    #[inline(always)]
    pub fn memo(&self, k: usize) -> &StackMemo {
        &self.memos[k % PATHS]
    }

    /// The main memo, which every walk steps with.
    #[inline(always)]
    pub fn main(&mut self) -> &mut StackMemo {
        &mut self.memos[0]
    }

    /// Another memo whose innermost entry is the walk's first frame
    /// (`pc`, `sp`, `rbp`), recorded with the same `top` and rule
    /// generation: its number and that entry, to [`StackMemo::follow`]
    /// from before stepping. One table load and one entry check, and
    /// none at all once [`PROBES`] walks in a row found nothing there.
    #[inline(always)]
    pub fn other_start(
        &mut self,
        pc: u64,
        sp: usize,
        rbp: usize,
        top: usize,
        generation: u64,
    ) -> Option<(usize, usize)> {
        if self.probes == 0 {
            // No other memo recorded lately has served a walk.
            return None;
        }
        self.probes -= 1;
        let k = usize::from(self.route[route_slot(pc, sp)]) % PATHS;
        let m = &self.memos[k];
        (k != 0 && m.starts_at(pc, sp, rbp, top, generation)).then(|| (k, m.valid - 1))
    }

    /// Notes that other memo `k` served a walk.
    #[inline(always)]
    pub fn other_served(&mut self, k: usize) {
        self.memos[k % PATHS].met();
        self.credit = (self.credit + 1).min(MAX_CREDIT);
        self.probes = PROBES;
    }

    /// Whether [`StackMemos::after_replay`] will write the main memo after
    /// a walk that visited `visited` frames itself (ask just before it:
    /// frames a walk left there must be filled first).
    #[inline(always)]
    pub fn refresh_due(&self, visited: usize) -> bool {
        visited > REFRESH_AFTER && self.memos[0].refresh_pending()
    }

    /// After a walk that took the rest from the main memo's entry `b` (met
    /// with `rbp`) after visiting `visited` itself: notes the use and,
    /// where due, records the walk (see the type's doc).
    #[inline(always)]
    pub fn after_replay(
        &mut self,
        b: usize,
        rbp: usize,
        visited: &[Visited],
        classify: impl Fn(u64) -> Step,
    ) {
        let m = &mut self.memos[0];
        m.met();
        if visited.len() > REFRESH_AFTER {
            if m.refresh_due() {
                m.record_above(b, rbp, visited, classify);
            }
        } else if visited.len() >= OTHER_PATH_AFTER {
            let n = self.other_paths;
            self.other_paths = n.wrapping_add(1);
            let every = if self.credit > 0 {
                OTHER_PATH_EVERY
            } else {
                OTHER_PATH_IDLE_EVERY
            };
            if n.is_multiple_of(every) {
                self.record_other(b, rbp, visited, classify);
            }
        }
    }

    /// Records into the next other memo a walk that replayed the main
    /// memo's entry `b` (see [`StackMemo::record_from`]).
    #[inline(never)]
    fn record_other(
        &mut self,
        b: usize,
        rbp: usize,
        visited: &[Visited],
        classify: impl Fn(u64) -> Step,
    ) {
        let v = self.next.clamp(1, PATHS - 1);
        self.next = if v + 1 < PATHS { v + 1 } else { 1 };
        self.credit = self.credit.saturating_sub(1);
        self.probes = PROBES;
        let (main, others) = self.memos.split_at_mut(1);
        let to = &mut others[v - 1];
        to.record_from(&main[0], b, rbp, visited, classify);
        let i = to.valid.wrapping_sub(1);
        if i < MEMO_ENTRIES {
            self.route[route_slot(to.pc[i], to.sp[i])] = v as u8;
        }
    }

    /// After a walk that took nothing from the main memo: records it there,
    /// as [`StackMemo::missed`] says.
    #[inline(always)]
    pub fn after_miss(&mut self, visited: &[Visited], end: End, classify: impl Fn(u64) -> Step) {
        let m = &mut self.memos[0];
        if m.missed() {
            m.record(visited, end, classify);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames of the fake walk: enough for a replay to check its return
    /// addresses four at a time and then one at a time.
    const FRAMES: usize = 7;
    /// The frames' counters, innermost first.
    const ALL: [u64; FRAMES] = [0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 0x6000, 0x7000];

    /// A memo of a walk over a fake stack (innermost first: frame `i` at
    /// word index `4 i`, counter `ALL[i]`), stepped out of the second
    /// frame by `second` (1: CFA = rsp + k, no `rbp`; 2: frame pointer),
    /// out of the others below the outermost by rule 1, and ended by the
    /// outermost's rule `end_rule` (2: frame pointer; 3: the walk ends).
    fn memo_over(stack: &[u64; 32], second: u64, end_rule: u64) -> StackMemo {
        let base = stack.as_ptr() as usize;
        let visited: Vec<Visited> = (0..FRAMES)
            .map(|i| Visited {
                pc: ALL[i],
                sp: base + 0x20 * i,
                rbp: 0xab0 + i,
                rule: match i {
                    1 => second,
                    i if i == FRAMES - 1 => end_rule,
                    _ => 1,
                },
            })
            .collect();
        let mut memo = StackMemo::new();
        memo.start(base + 31 * 8, 1);
        memo.record(&visited, End::Stepped, classify);
        memo
    }

    fn classify(rule: u64) -> Step {
        match rule {
            1 => Step::Rsp { rbp_off: 0 },
            2 => Step::FramePointer,
            3 => Step::End,
            _ => Step::Other,
        }
    }

    /// The words the walk read: each caller's return address just below
    /// its stack pointer (word `4 i - 1`), and the saved `rbp` of the
    /// second frame's caller (0xab2, word 6) where a frame-pointer step
    /// reads it.
    fn fake_stack() -> Box<[u64; 32]> {
        let mut s = Box::new([0u64; 32]);
        for i in 1..FRAMES {
            s[4 * i - 1] = ALL[i];
        }
        s[6] = 0xab2;
        s
    }

    fn replay(memo: &StackMemo, stack: &[u64; 32]) -> Option<Vec<u64>> {
        let base = stack.as_ptr() as usize;
        let mut out = [0u64; 16];
        let (n, _, filled) = memo.follow(
            FRAMES - 1,
            &mut out,
            0,
            TraceHash::new(),
            base,
            base + 31 * 8,
        )?;
        if !filled {
            assert_eq!(memo.fill(&mut out, 0, FRAMES - 1), n);
        }
        Some(out[..n].to_vec())
    }

    /// `replay` with word `i` of `stack` changed for the time of it.
    fn replay_with(memo: &StackMemo, stack: &mut [u64; 32], i: usize) -> Option<Vec<u64>> {
        let kept = stack[i];
        stack[i] ^= 0x10;
        let r = replay(memo, stack);
        stack[i] = kept;
        r
    }

    /// The replay gives the walk's frames, and none when any return
    /// address it relies on changed.
    fn assert_every_return_address_checked(memo: &StackMemo, stack: &mut [u64; 32]) {
        assert_eq!(replay(memo, stack), Some(ALL.to_vec()));
        for i in 1..FRAMES {
            let at = 4 * i - 1;
            assert_eq!(
                replay_with(memo, stack, at),
                None,
                "return address at word {at}"
            );
        }
        assert_eq!(replay(memo, stack), Some(ALL.to_vec()));
    }

    /// A walk from another path (its two inner frames differ from the main
    /// memo's, the rest is shared) that met the main memo after two steps
    /// goes to another memo; a later walk starting at that path's first
    /// frame replays all of it from there, and only while every return
    /// address it relies on still holds. The main memo stays as it was.
    #[test]
    fn another_path_is_recorded_into_another_memo_and_found_by_its_first_frame() {
        let mut stack = fake_stack();
        let base = stack.as_ptr() as usize;
        let top = base + 31 * 8;
        let main_walk: Vec<Visited> = (0..FRAMES)
            .map(|i| Visited {
                pc: ALL[i],
                sp: base + 0x20 * i,
                rbp: 0xab0 + i,
                rule: if i == FRAMES - 1 { 3 } else { 1 },
            })
            .collect();
        let mut memos = Box::new(StackMemos::new());
        memos.main().start(top, 1);
        memos.after_miss(&main_walk, End::Stepped, classify);
        assert_eq!(memos.other_start(ALL[0], base, 0xab0, top, 1), None);
        // The other path: inner counters 0x1100 and 0x2100 (its second
        // frame's return address at word 3), then the main memo's frames
        // from the third on (entry FRAMES - 3, bottom-up).
        let other = [0x1100, 0x2100];
        let other_walk: Vec<Visited> = (0..2)
            .map(|i| Visited {
                pc: other[i],
                sp: base + 0x20 * i,
                rbp: 0xab0 + i,
                rule: 1,
            })
            .collect();
        let b = FRAMES - 3;
        memos.after_replay(b, 0xab2, &other_walk, classify);
        let (k, e) = memos
            .other_start(0x1100, base, 0xab0, top, 1)
            .expect("the other path's first frame routes to its memo");
        assert_ne!(k, 0);
        assert_eq!(e, FRAMES - 1);
        // The main memo is untouched.
        assert_eq!(replay(memos.memo(0), &stack), Some(ALL.to_vec()));
        let mut expect = other.to_vec();
        expect.extend_from_slice(&ALL[2..]);
        let follow = |memos: &StackMemos, stack: &[u64; 32]| {
            // (The memo's addresses are the stack's: read them anew.)
            let base = stack.as_ptr() as usize;
            let mut out = [0u64; 16];
            let (n, h, filled) =
                memos
                    .memo(k)
                    .follow(e, &mut out, 0, TraceHash::new(), base, top)?;
            if !filled {
                assert_eq!(memos.memo(k).fill(&mut out, 0, e), n);
            }
            let mut by_frame = TraceHash::new();
            for &pc in &out[..n] {
                by_frame.add(pc);
            }
            assert_eq!(by_frame.finish(n).1, h, "the replay's hash is the frames'");
            Some(out[..n].to_vec())
        };
        stack[3] = 0x2100;
        assert_eq!(follow(&memos, &stack), Some(expect.clone()));
        // Any return address of the other path changed: no replay.
        for at in [3, 7, 11, 15, 19, 23] {
            let kept = stack[at];
            stack[at] ^= 0x10;
            assert_eq!(follow(&memos, &stack), None, "word {at}");
            stack[at] = kept;
        }
        assert_eq!(follow(&memos, &stack), Some(expect));
        // Another rule generation or stack top: no route.
        assert_eq!(memos.other_start(0x1100, base, 0xab0, top, 2), None);
        assert_eq!(memos.other_start(0x1100, base, 0xab0, top - 8, 1), None);
    }

    /// With no walk served by the other memos, their recordings slow down
    /// to one in [`OTHER_PATH_IDLE_EVERY`]; walks they serve bring the
    /// faster pace back.
    #[test]
    fn other_memos_are_recorded_rarely_while_they_serve_no_walk() {
        let stack = fake_stack();
        let base = stack.as_ptr() as usize;
        let top = base + 31 * 8;
        let main_walk: Vec<Visited> = (0..FRAMES)
            .map(|i| Visited {
                pc: ALL[i],
                sp: base + 0x20 * i,
                rbp: 0,
                rule: if i == FRAMES - 1 { 3 } else { 1 },
            })
            .collect();
        let mut memos = Box::new(StackMemos::new());
        memos.main().start(top, 1);
        memos.after_miss(&main_walk, End::Stepped, classify);
        // Distinct first frames, so that each recording has its own route.
        let walk = |i: u64| -> Vec<Visited> {
            (0..2)
                .map(|j| Visited {
                    pc: 0x10_0000 + 0x100 * i + j,
                    sp: base + 0x20 * j as usize,
                    rbp: 0,
                    rule: 1,
                })
                .collect()
        };
        let recorded = |memos: &mut StackMemos, from: u64, walks: u64| {
            (from..from + walks)
                .filter(|&i| {
                    memos.after_replay(FRAMES - 3, 0, &walk(i), classify);
                    memos
                        .other_start(0x10_0000 + 0x100 * i, base, 0, top, 1)
                        .is_some()
                })
                .count()
        };
        let idle = u64::from(OTHER_PATH_IDLE_EVERY);
        assert_eq!(recorded(&mut memos, 0, idle), 1, "the first, then none");
        memos.other_served(1);
        let busy = u64::from(OTHER_PATH_EVERY);
        // (The count of eligible walks continues from `idle`, a multiple
        // of both paces.)
        assert_eq!(
            recorded(&mut memos, idle, 2 * busy),
            1,
            "one credit: one recording"
        );
        for _ in 0..4 {
            memos.other_served(1);
        }
        assert_eq!(recorded(&mut memos, idle + 2 * busy, 2 * busy), 2);
    }

    #[test]
    fn deep_meetings_refresh_the_memo_on_the_first_then_every_nth() {
        let mut memo = StackMemo::new();
        let due: Vec<bool> = (0..2 * REFRESH_EVERY + 1)
            .map(|_| memo.refresh_due())
            .collect();
        let expect: Vec<bool> = (0..2 * REFRESH_EVERY + 1)
            .map(|k| k % REFRESH_EVERY == 0)
            .collect();
        assert_eq!(due, expect);
        assert!(due[0], "a new path is recorded at once");
    }

    #[test]
    fn a_frame_joins_the_entry_with_its_stack_pointer_and_counter_and_no_other() {
        let stack = fake_stack();
        let base = stack.as_ptr() as usize;
        let memo = memo_over(&stack, 1, 3);
        assert_eq!(memo.valid, FRAMES);
        for (i, &pc) in ALL.iter().enumerate() {
            // Entries are bottom-up: frame `i` of the walk is entry
            // `FRAMES - 1 - i`.
            let (sp, rbp) = (base + 0x20 * i, 0xab0 + i);
            let mut p = memo.valid;
            assert_eq!(memo.candidate(&mut p, pc, sp, rbp), Some(FRAMES - 1 - i));
            assert_eq!(
                memo.candidate(&mut p, pc + 1, sp, rbp),
                None,
                "another counter"
            );
            // A stack pointer sharing the entry's slot is not the entry's.
            let other = sp + SP_SLOTS * 16;
            assert_eq!(sp_slot(other), sp_slot(sp));
            assert_eq!(memo.candidate(&mut p, pc, other, rbp), None, "another sp");
            // Below a bound of 0 (after a failed replay): none.
            let mut none = 0;
            assert_eq!(memo.candidate(&mut none, pc, sp, rbp), None);
        }
        // A fresh memo has no candidate at all.
        let mut p = MEMO_ENTRIES;
        assert_eq!(StackMemo::new().candidate(&mut p, ALL[0], base, 0), None);
    }

    #[test]
    fn a_replay_without_saved_rbp_checks_every_return_address_and_nothing_else() {
        let mut stack = fake_stack();
        let memo = memo_over(&stack, 1, 3);
        assert_eq!(memo.rbp_checked, 0);
        // A word no step read changes nothing.
        assert_eq!(replay_with(&memo, &mut stack, 6), Some(ALL.to_vec()));
        assert_every_return_address_checked(&memo, &mut stack);
    }

    #[test]
    fn a_replay_through_a_frame_pointer_step_checks_the_saved_rbp_too() {
        // The outermost frame is left through its frame pointer, so the
        // walk from the frames below it depends on their `rbp`, which the
        // second frame's frame-pointer step read at word 6.
        let mut stack = fake_stack();
        let memo = memo_over(&stack, 2, 2);
        assert_ne!(memo.rbp_checked, 0);
        assert_eq!(replay_with(&memo, &mut stack, 6), None, "saved rbp");
        assert_every_return_address_checked(&memo, &mut stack);
    }
}
