//! The trace shortcut: a thread's recent walks, found by the state they
//! started in, each with every stack word that decided it. A walk that
//! starts in the same state while those words still hold the same values
//! would find the same frames, so its frame count and hash are answered at
//! once: one set lookup and one independent load per word, no step, no
//! rule lookup, no memo.
//!
//! Why: a thread's allocations mostly come from a few call sites, each
//! reached through the same frames again and again. Even when the
//! [`StackMemo`](crate::stack_memo::StackMemo) replays all but the first
//! frame, a walk still steps out of the hook's caller through its rule,
//! finds the memo entry, checks its bounds and the words, and keeps the
//! memo's books: ~300 instructions per allocation at 6 frames (callgrind
//! on bench/churn.c's young workload), for an answer the thread has
//! computed many times. Only the trace's hash is needed when the trace is
//! in the thread's stack cache (most allocations); a shortcut answer
//! carries no frames, and a caller that needs them walks again without the
//! shortcut.
//!
//! Invariants:
//! - The unwinder is a function of the start state (`pc`, `sp`, `rbp`),
//!   the rules of the module generation, the thread's `top` and the stack
//!   words it reads. An entry holds a walk's start state, frame count and
//!   hash, and the address and value of every word that decided it (the
//!   table holds the `top` and generation of all its entries: a fill with
//!   others empties it first): each step's return address, and the saved `rbp`
//!   a step reloaded where the walk above it used that `rbp` (the words a
//!   [`StackMemo`](crate::stack_memo::StackMemo) replay checks, for the same
//!   reasons, see there); `rbp` is part of the key only where the walk used
//!   it before reloading it (in code without frame pointers it is an
//!   ordinary register whose value changes from call to call).
//!   [`Shortcuts::find`] answers only when all of these are equal.
//! - Every word's address lies in `[sp, top]` and is 8-aligned
//!   ([`ShortcutFill::word`] refuses the entry otherwise), so a lookup from
//!   the same `sp` with the same `top` reads only the live part of the
//!   thread's own stack, which the walk may read.
//! - An entry is written only by its thread (the table is in its private
//!   [`ThreadTables`](crate::thread_tables::ThreadTables)); it is
//!   unreachable (its key's `sp` is 0) while it is being filled, and a
//!   fill that fails leaves it so.

use crate::stack_memo::Step;

/// Words an entry can hold (walks that depend on more are not kept: on
/// deep stacks a replay from the memo costs about what the check would).
pub const SHORTCUT_WORDS: usize = 48;
const _: () = assert!(SHORTCUT_WORDS.is_multiple_of(4));
/// Sets of the table (two ways each, each way indexed by its own hash).
pub const SHORTCUT_SETS: usize = 32;

/// Fills are paid for by answers: each fill adds [`FILL_COST`] to a debt
/// that each answer pays down by one; past [`MAX_DEBT`], only one walk in
/// [`FILL_EVERY`] of a run of unanswered ones fills. A thread whose walks
/// repeat (a service's request loop) soon answers nearly all of them and
/// keeps its entries up; one whose start states are too many for the
/// table (deep recursion at random depths) would otherwise pay for
/// writing entries that are evicted before they answer.
const FILL_COST: u32 = 8;
const MAX_DEBT: u32 = 128;
const FILL_EVERY: u32 = 32;

/// The table is asked while its answers pay for the asking: each walk it
/// does not answer adds one to a doubt that each answer takes three off
/// (so it keeps being asked while it answers at least a quarter of the
/// walks: an answer saves a few hundred instructions, a lookup that
/// finds nothing costs a few dozen and a line). Past [`DOUBT_LIMIT`] only
/// one walk in [`ASK_EVERY`] asks (and may fill), until answers bring the
/// doubt down again. A thread whose start states do not fit the table
/// (the churn: 16 sites at random depths 8-32) thus pays next to nothing.
const DOUBT_LIMIT: u32 = 64;
const ANSWER_CREDIT: u32 = 3;
const ASK_EVERY: u32 = 32;

/// A kept walk's start state (see the module doc). Kept apart from the
/// rest of its entry, two to a cache line (a set's two ways), so that a
/// walk the table does not hold costs at most two lines of a small array
/// (its place in each way, in two sets: see [`Shortcuts`]).
#[derive(Clone, Copy)]
#[repr(C)]
struct Key {
    pc: u64,
    /// 0: empty (a start state's stack pointer is never 0).
    sp: usize,
    rbp: usize,
    /// `usize::MAX` where the walk used the start state's `rbp`, else 0.
    rbp_mask: usize,
}

impl Key {
    const EMPTY: Key = Key {
        pc: 0,
        sp: 0,
        rbp: 0,
        rbp_mask: 0,
    };

    /// Whether this is the walk from this start state.
    #[inline(always)]
    fn starts(&self, pc: u64, sp: usize, rbp: usize) -> bool {
        ((self.pc ^ pc) | (self.sp ^ sp) as u64 | ((self.rbp ^ rbp) & self.rbp_mask) as u64) == 0
    }
}

/// A stack word a kept walk read: its address and the value it held.
#[derive(Clone, Copy)]
#[repr(C)]
struct Word {
    at: usize,
    val: u64,
}

/// A kept walk's answer and words.
#[repr(C)]
struct Entry {
    hash: u64,
    frames: u32,
    len: u16,
    /// The caller's hint for this walk ([`Answer::hint`]), [`NO_HINT`]
    /// until it gives one.
    hint: u16,
    words: [Word; SHORTCUT_WORDS],
}

impl Entry {
    const EMPTY: Entry = Entry {
        hash: 0,
        frames: 0,
        len: 0,
        hint: NO_HINT,
        words: [Word { at: 0, val: 0 }; SHORTCUT_WORDS],
    };
}

impl Entry {
    /// Whether every word the entry holds has its value still.
    ///
    /// # Safety
    /// Every word's address must be readable: they lie in `[sp, top]` of
    /// the walk the entry was filled from (see [`ShortcutFill::word`]),
    /// readable when the caller's start state has the same `sp` and `top`.
    #[inline(always)]
    unsafe fn unchanged(&self) -> bool {
        let mut diff = 0;
        // Whole groups of four: `finish` pads an entry's words to a
        // multiple of four (the loop then has no remainder to run).
        for g in self.words.chunks_exact(4).take(usize::from(self.len) / 4) {
            // SAFETY: each `at` is 8-aligned and lies in `[sp, top]`
            // (see `ShortcutFill::word`): readable by the caller's
            // guarantee. Volatile: nothing may be assumed of the words.
            let read = |w: &Word| unsafe { std::ptr::read_volatile(w.at as *const u64) } ^ w.val;
            diff |= read(&g[0]) | read(&g[1]) | read(&g[2]) | read(&g[3]);
        }
        diff == 0
    }
}

/// [`Answer::hint`] of an entry whose caller gave none yet.
pub const NO_HINT: u16 = u16::MAX;

/// The table's answer for a walk: its frame count and hash, and the hint
/// the caller left with the entry (the recorder keeps where in the
/// thread's stack cache it found the trace last, so that a set's later
/// way costs one probe, not four; `Shortcuts::hint`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Answer {
    /// Frames of the walk.
    pub frames: usize,
    /// The walk's trace hash.
    pub hash: u64,
    /// What the caller left with the entry, [`NO_HINT`] if nothing.
    pub hint: u16,
    /// The entry that answered (`set * 2 + way`).
    entry: u16,
}

/// A thread's shortcut table (see the module doc): two ways, each indexed
/// by its own hash of the start state (a skewed two-way table: states that
/// share a set in one way rarely share it in the other, so three states
/// seldom fight over two places, which in plain two-way sets happened to
/// 16 call sites often enough to move the benchmarks with the code's
/// layout), the place last answered or filled kept.
#[repr(C)]
pub struct Shortcuts {
    /// The `top` and rule generation of every entry (a fill with others
    /// empties the table first).
    top: usize,
    generation: u64,
    /// Walks in a row that the table did not answer.
    misses: u32,
    /// Fills not yet paid for by answers, see [`FILL_COST`].
    debt: u32,
    /// See [`DOUBT_LIMIT`].
    doubt: u32,
    /// Walks that did not ask while in doubt.
    unasked: u32,
    /// Per set, bit `w`: the set's place in way `w` is the one to fill
    /// next for a state whose other place answered or was filled last.
    victim: [u8; SHORTCUT_SETS],
    keys: [[Key; 2]; SHORTCUT_SETS],
    /// Last (see [`Shortcuts::UNZEROED`]).
    entries: [[Entry; 2]; SHORTCUT_SETS],
}
const _: () = assert!(
    std::mem::offset_of!(Shortcuts, entries) + Shortcuts::UNZEROED
        == std::mem::size_of::<Shortcuts>()
);

impl Default for Shortcuts {
    fn default() -> Self {
        Self::new()
    }
}

/// The sets of a start state in way 0 and in way 1: call sites differ in
/// `pc`, the depths of one site in `sp` (16-byte aligned at a call); the
/// two ways take different bits of the product.
#[inline(always)]
fn sets_of(pc: u64, sp: usize) -> [usize; 2] {
    let h = (pc ^ (sp as u64 >> 4)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    [(h >> 59) as usize, (h >> 54) as usize % SHORTCUT_SETS]
}
const _: () = assert!(SHORTCUT_SETS == 32);

impl Shortcuts {
    /// Marks the place of `way` (at `sets[way]`) as just used: the state's
    /// other place is the one to fill next.
    #[inline(always)]
    fn used(&mut self, sets: [usize; 2], way: usize) {
        self.victim[sets[way]] &= !(1 << way);
        self.victim[sets[way ^ 1]] |= 1 << (way ^ 1);
    }
}

impl Shortcuts {
    /// Bytes at the end of the table that an empty table need not have
    /// zeroed: the entries, reached only through their keys (whose zero
    /// `sp` says empty), so a reused table zeroes the first part only.
    pub const UNZEROED: usize = std::mem::size_of::<[[Entry; 2]; SHORTCUT_SETS]>();

    /// Whether no key leads to an entry.
    pub fn is_empty(&self) -> bool {
        self.keys.iter().flatten().all(|k| k.sp == 0)
    }

    /// An empty table (all zero bytes, as the thread's tables start).
    pub const fn new() -> Self {
        Shortcuts {
            top: 0,
            generation: 0,
            misses: 0,
            debt: 0,
            doubt: 0,
            unasked: 0,
            victim: [0; SHORTCUT_SETS],
            keys: [[Key::EMPTY; 2]; SHORTCUT_SETS],
            entries: [const { [Entry::EMPTY, Entry::EMPTY] }; SHORTCUT_SETS],
        }
    }

    /// [`Self::answer`]'s frame count and hash (the tests' form).
    ///
    /// # Safety
    /// As for [`Self::answer`].
    #[cfg(test)]
    unsafe fn find(
        &mut self,
        pc: u64,
        sp: usize,
        rbp: usize,
        top: usize,
        generation: u64,
    ) -> Option<(usize, u64)> {
        // SAFETY: the caller's guarantee, passed on.
        unsafe { self.answer(pc, sp, rbp, top, generation) }.map(|a| (a.frames, a.hash))
    }

    /// Leaves `hint` with the entry that gave `answer` (its next answers
    /// carry it), unless the entry was refilled since.
    #[inline(always)]
    pub fn hint(&mut self, answer: &Answer, hint: u16) {
        let (set, way) = (
            answer.entry as usize / 2 % SHORTCUT_SETS,
            answer.entry as usize % 2,
        );
        let e = &mut self.entries[set][way];
        if e.hash == answer.hash {
            e.hint = hint;
        }
    }

    /// The answer for the walk from state (`pc`, `sp`, `rbp`) with `top`
    /// and rules of `generation`, if an entry holds that walk and every
    /// word it depends on is unchanged.
    ///
    /// # Safety
    /// `[sp, top + 8)` must be readable (the live part of the calling
    /// thread's stack, as for a walk from `sp`).
    #[inline(always)]
    pub unsafe fn answer(
        &mut self,
        pc: u64,
        sp: usize,
        rbp: usize,
        top: usize,
        generation: u64,
    ) -> Option<Answer> {
        let sets = sets_of(pc, sp);
        let way = if ((self.top ^ top) as u64 | (self.generation ^ generation)) != 0 {
            usize::MAX
        } else if self.keys[sets[0]][0].starts(pc, sp, rbp) {
            0
        } else if self.keys[sets[1]][1].starts(pc, sp, rbp) {
            1
        } else {
            usize::MAX
        };
        if way > 1 {
            self.missed();
            return None;
        };
        let e = &self.entries[sets[way]][way];
        // SAFETY: the caller's guarantee, with `top` the table's.
        if !unsafe { e.unchanged() } {
            self.missed();
            return None;
        }
        let answer = Answer {
            frames: e.frames as usize,
            hash: e.hash,
            hint: e.hint,
            entry: (sets[way] * 2 + way) as u16,
        };
        // A thread whose walks repeat has nothing to pay back: one test.
        if (self.misses | self.debt | self.doubt) != 0 {
            self.misses = 0;
            self.debt = self.debt.saturating_sub(1);
            self.doubt = self.doubt.saturating_sub(ANSWER_CREDIT);
        }
        // Not due any more (a fill marks the other place due; a hit only
        // keeps its own: one byte written, as before the skew).
        self.victim[sets[way]] &= !(1 << way);
        Some(answer)
    }

    /// Whether to ask the table about this walk (see [`DOUBT_LIMIT`]); a
    /// walk that does not ask keeps nothing either.
    #[inline(always)]
    pub fn worth_asking(&mut self) -> bool {
        if self.doubt < DOUBT_LIMIT {
            return true;
        }
        self.unasked = self.unasked.wrapping_add(1);
        self.unasked.is_multiple_of(ASK_EVERY)
    }

    /// Notes a walk the table did not answer.
    #[inline(always)]
    fn missed(&mut self) {
        self.misses = self.misses.wrapping_add(1);
        // Capped just past the limit: one answer restores asking.
        self.doubt = (self.doubt + 1).min(DOUBT_LIMIT + ANSWER_CREDIT - 1);
    }

    /// Whether [`Shortcuts::fill`] would keep a walk now (a thread whose
    /// fills have not paid off mostly skips the work of one).
    #[inline(always)]
    pub fn fill_due(&self) -> bool {
        self.debt <= MAX_DEBT - FILL_COST || self.misses.is_multiple_of(FILL_EVERY)
    }

    /// Starts keeping the walk that just missed from (`pc`, `sp`, `rbp`),
    /// if the thread's answers have paid for it (see [`FILL_COST`]). The
    /// entry is the set's victim way; it is unreachable until
    /// [`ShortcutFill::finish`].
    #[inline]
    pub fn fill(
        &mut self,
        pc: u64,
        sp: usize,
        top: usize,
        generation: u64,
    ) -> Option<ShortcutFill<'_>> {
        if !self.fill_due() {
            return None;
        }
        if self.debt <= MAX_DEBT - FILL_COST {
            self.debt += FILL_COST;
        }
        if self.top != top || self.generation != generation {
            for set in &mut self.keys {
                for k in set {
                    k.sp = 0;
                }
            }
            self.top = top;
            self.generation = generation;
        }
        let sets = sets_of(pc, sp);
        // An empty place first (way 0's, then way 1's), else the one due
        // (way 0's if both or neither are).
        let free = [self.keys[sets[0]][0].sp == 0, self.keys[sets[1]][1].sp == 0];
        let due = [self.victim[sets[0]] & 1 != 0, self.victim[sets[1]] & 2 != 0];
        let way = usize::from(!free[0] && (free[1] || (due[1] && !due[0])));
        self.used(sets, way);
        let s = sets[way];
        let key = &mut self.keys[s][way];
        *key = Key {
            pc,
            sp: 0,
            rbp: 0,
            rbp_mask: 0,
        };
        let e = &mut self.entries[s][way];
        e.len = 0;
        e.hint = NO_HINT;
        Some(ShortcutFill {
            key,
            e,
            sp,
            top,
            ok: sp != 0 && sp <= top,
        })
    }
}

/// An entry being filled (see [`Shortcuts::fill`]): the words, then
/// [`ShortcutFill::finish`].
pub struct ShortcutFill<'t> {
    key: &'t mut Key,
    e: &'t mut Entry,
    sp: usize,
    top: usize,
    ok: bool,
}

impl ShortcutFill<'_> {
    /// Adds the stack word at `at` with its current value. Refuses the
    /// entry when the word is outside `[sp, top]`, unaligned, or one too
    /// many.
    #[inline]
    pub fn word(&mut self, at: usize) {
        let n = self.e.len as usize;
        if !self.ok || n >= SHORTCUT_WORDS || at < self.sp || at > self.top || !at.is_multiple_of(8)
        {
            self.ok = false;
            return;
        }
        // SAFETY: `at` is 8-aligned and lies in `[sp, top]`, the readable
        // part of the thread's stack from the walk's start (the walk read
        // this very word moments ago; `fill`'s caller's guarantee).
        let val = unsafe { std::ptr::read_volatile(at as *const u64) };
        self.e.words[n] = Word { at, val };
        self.e.len = n as u16 + 1;
    }

    /// Adds the words of the steps out of the frames `visited` (innermost
    /// first, each with its rule classified by `classify`) that a walk
    /// stepped through before it reached a state whose own walk depends
    /// on `needs_rbp_below` and on the words already added, at stack
    /// pointer `below_sp`. Returns whether the walk from the first of
    /// `visited` uses its `rbp`. Mirrors `StackMemo::extend`: a step out of
    /// a frame through its frame pointer reads the return address at the
    /// new stack pointer - 8 and the saved `rbp` just below; a step by an
    /// `rsp` rule the return address there and, where it has one, the
    /// saved `rbp` at its offset from the new stack pointer. Any other
    /// rule refuses the entry.
    pub fn steps<V>(
        &mut self,
        visited: &[V],
        mut below_sp: usize,
        needs_rbp_below: bool,
        state: impl Fn(&V) -> (usize, Step),
    ) -> bool {
        let mut needs = needs_rbp_below;
        for v in visited.iter().rev() {
            let (sp, step) = state(v);
            let (fp, rbp_off) = match step {
                Step::FramePointer => (true, 0),
                Step::Rsp { rbp_off } => (false, rbp_off),
                Step::End | Step::Other => {
                    self.ok = false;
                    return true;
                }
            };
            let ra_at = below_sp.wrapping_sub(8);
            let rbp_at = if fp {
                below_sp.wrapping_sub(16)
            } else {
                below_sp.wrapping_add_signed(rbp_off as isize)
            };
            let reads_rbp = fp || rbp_off != 0;
            if !(sp <= ra_at && ra_at < below_sp) {
                self.ok = false;
            }
            self.word(ra_at);
            if reads_rbp && needs {
                if !(sp <= rbp_at && rbp_at < below_sp) {
                    self.ok = false;
                }
                self.word(rbp_at);
            }
            needs = fp || (!reads_rbp && needs);
            below_sp = sp;
        }
        needs
    }

    /// Makes the entry answer for start state `sp` (given to
    /// [`Shortcuts::fill`]) and `rbp` (compared only when `uses_rbp`):
    /// `frames` frames hashed to `hash`. Does nothing if a word was
    /// refused.
    pub fn finish(self, rbp: usize, uses_rbp: bool, frames: usize, hash: u64) {
        if !self.ok || frames > u32::MAX as usize {
            return;
        }
        // Padded to a multiple of four with the last word again (read
        // twice, it decides the same): [`Shortcuts::find`] checks whole
        // groups of four. `SHORTCUT_WORDS` is a multiple of four, so the
        // padding fits.
        let mut n = self.e.len as usize;
        while !n.is_multiple_of(4) {
            self.e.words[n] = self.e.words[n - 1];
            n += 1;
        }
        self.e.len = n as u16;
        self.e.frames = frames as u32;
        self.e.hash = hash;
        self.key.rbp = rbp;
        self.key.rbp_mask = if uses_rbp { usize::MAX } else { 0 };
        self.key.sp = self.sp;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake stack: 64 words, the "start" at word 8, the top at word 63.
    fn stack() -> Box<[u64; 64]> {
        let mut s = Box::new([0u64; 64]);
        for (i, w) in s.iter_mut().enumerate() {
            *w = 0x1000 + i as u64;
        }
        s
    }

    fn at(s: &[u64; 64], i: usize) -> usize {
        &s[i] as *const u64 as usize
    }

    #[test]
    fn an_entry_answers_only_while_its_start_state_and_every_word_are_unchanged() {
        let mut s = stack();
        let (sp, top) = (at(&s, 8), at(&s, 63));
        let mut t = Box::new(Shortcuts::new());
        // SAFETY (all `find`s): `[sp, top + 8)` lies inside `s`.
        assert_eq!(unsafe { t.find(0x5000, sp, 7, top, 1) }, None);
        let mut f = t.fill(0x5000, sp, top, 1).unwrap();
        f.word(at(&s, 10));
        f.word(at(&s, 20));
        f.finish(7, false, 5, 0xabc);
        assert_eq!(unsafe { t.find(0x5000, sp, 7, top, 1) }, Some((5, 0xabc)));
        // rbp unused: another rbp walks the same frames.
        assert_eq!(unsafe { t.find(0x5000, sp, 9, top, 1) }, Some((5, 0xabc)));
        // Any other start, top or generation: no answer.
        assert_eq!(unsafe { t.find(0x5001, sp, 7, top, 1) }, None);
        assert_eq!(unsafe { t.find(0x5000, sp + 16, 7, top, 1) }, None);
        assert_eq!(unsafe { t.find(0x5000, sp, 7, top - 8, 1) }, None);
        assert_eq!(unsafe { t.find(0x5000, sp, 7, top, 2) }, None);
        // A word changed: no answer until it holds its value again.
        s[20] = 1;
        assert_eq!(unsafe { t.find(0x5000, sp, 7, top, 1) }, None);
        s[20] = 0x1000 + 20;
        assert_eq!(unsafe { t.find(0x5000, sp, 7, top, 1) }, Some((5, 0xabc)));
        // A word the entry does not hold changes nothing.
        s[30] = 1;
        assert_eq!(unsafe { t.find(0x5000, sp, 7, top, 1) }, Some((5, 0xabc)));
    }

    #[test]
    fn an_entry_carries_the_hint_its_caller_left_until_it_is_refilled() {
        let s = stack();
        let (sp, top) = (at(&s, 8), at(&s, 63));
        let mut t = Box::new(Shortcuts::new());
        t.fill(0x5000, sp, top, 1)
            .unwrap()
            .finish(0, false, 5, 0xabc);
        // SAFETY (all `answer`s): `[sp, top + 8)` lies inside `s`.
        let a = unsafe { t.answer(0x5000, sp, 0, top, 1) }.unwrap();
        assert_eq!((a.frames, a.hash, a.hint), (5, 0xabc, NO_HINT));
        t.hint(&a, 37);
        let b = unsafe { t.answer(0x5000, sp, 0, top, 1) }.unwrap();
        assert_eq!(b.hint, 37);
        // Two more fills from the same start: the first takes the other
        // place, the second this one (due again): no hint, and the old
        // answer's hint is not left with the new walk.
        t.fill(0x5000, sp, top, 1)
            .unwrap()
            .finish(0, false, 6, 0xdef);
        t.fill(0x5000, sp, top, 1)
            .unwrap()
            .finish(0, false, 7, 0x123);
        t.hint(&a, 99);
        let c = unsafe { t.answer(0x5000, sp, 0, top, 1) }.unwrap();
        assert_eq!((c.frames, c.hash, c.hint), (7, 0x123, NO_HINT));
    }

    #[test]
    fn an_entry_is_padded_to_groups_of_four_and_every_word_still_decides() {
        let mut s = stack();
        let (sp, top) = (at(&s, 8), at(&s, 63));
        let mut t = Box::new(Shortcuts::new());
        let mut f = t.fill(0x5000, sp, top, 1).unwrap();
        for i in [10, 11, 12, 13, 14] {
            f.word(at(&s, i));
        }
        f.finish(0, false, 5, 0xabc);
        let e = &t
            .entries
            .iter()
            .flatten()
            .find(|e| e.hash == 0xabc)
            .unwrap();
        assert_eq!(e.len, 8, "five words padded to eight");
        // SAFETY (all `find`s): `[sp, top + 8)` lies inside `s`.
        assert_eq!(unsafe { t.find(0x5000, sp, 0, top, 1) }, Some((5, 0xabc)));
        for i in [10, 14] {
            s[i] = 1;
            assert_eq!(unsafe { t.find(0x5000, sp, 0, top, 1) }, None, "word {i}");
            s[i] = 0x1000 + i as u64;
        }
        assert_eq!(unsafe { t.find(0x5000, sp, 0, top, 1) }, Some((5, 0xabc)));
    }

    #[test]
    fn rbp_is_compared_only_where_the_walk_used_it() {
        let s = stack();
        let (sp, top) = (at(&s, 8), at(&s, 63));
        let mut t = Box::new(Shortcuts::new());
        let f = t.fill(0x5000, sp, top, 1).unwrap();
        f.finish(7, true, 3, 0x77);
        assert_eq!(unsafe { t.find(0x5000, sp, 7, top, 1) }, Some((3, 0x77)));
        assert_eq!(unsafe { t.find(0x5000, sp, 9, top, 1) }, None);
    }

    #[test]
    fn a_word_outside_the_stack_from_the_start_or_unaligned_refuses_the_entry() {
        let s = stack();
        let (sp, top) = (at(&s, 8), at(&s, 62));
        for bad in [at(&s, 7), at(&s, 63), at(&s, 10) + 4] {
            let mut t = Box::new(Shortcuts::new());
            let mut f = t.fill(0x5000, sp, top, 1).unwrap();
            f.word(at(&s, 10));
            f.word(bad);
            f.finish(0, false, 1, 1);
            assert_eq!(unsafe { t.find(0x5000, sp, 0, top, 1) }, None, "{bad:x}");
        }
        // Too many words.
        let mut t = Box::new(Shortcuts::new());
        let mut f = t.fill(0x5000, sp, top, 1).unwrap();
        for i in 0..=SHORTCUT_WORDS {
            f.word(at(&s, 9 + i));
        }
        f.finish(0, false, 1, 1);
        assert_eq!(unsafe { t.find(0x5000, sp, 0, top, 1) }, None);
    }

    #[test]
    fn steps_add_the_words_a_walk_read_and_say_whether_it_used_the_start_rbp() {
        let s = stack();
        let (top, w) = (at(&s, 63), |i| at(&s, i));
        let mut t = Box::new(Shortcuts::new());
        // Innermost first: a frame-pointer step from sp = word 8 to word
        // 12, then an rsp step (rbp saved 3 words below the new sp) to
        // word 20, then the walk met a state that uses its rbp.
        let visited = [
            (w(8), Step::FramePointer),
            (w(12), Step::Rsp { rbp_off: -24 }),
        ];
        let mut f = t.fill(0x5000, w(8), top, 1).unwrap();
        let uses = f.steps(&visited, w(20), true, |v| *v);
        // The rsp step: return address at word 19, saved rbp at 17
        // (the state below uses it); the frame-pointer step: return address
        // at 11 only (the rbp it saved at 10 is reloaded by the rsp step
        // before anything uses it).
        let words: Vec<usize> = f.e.words[..f.e.len as usize].iter().map(|x| x.at).collect();
        assert_eq!(words, [w(19), w(17), w(11)]);
        assert!(uses, "a frame-pointer step uses the state's rbp");
        f.finish(5, uses, 3, 0x33);
        assert_eq!(unsafe { t.find(0x5000, w(8), 5, top, 1) }, Some((3, 0x33)));
        assert_eq!(unsafe { t.find(0x5000, w(8), 6, top, 1) }, None);

        // An rsp step that does not save rbp passes the need on; one that
        // reloads it ends it; the saved rbp is read only where needed.
        let mut f = t.fill(0x6000, w(8), top, 1).unwrap();
        let only_ra = [(w(8), Step::Rsp { rbp_off: -16 })];
        assert!(!f.steps(&only_ra, w(12), false, |v| *v));
        assert_eq!(f.e.len, 1, "the saved rbp is not needed below");
        let mut f = t.fill(0x6000, w(8), top, 1).unwrap();
        let pass = [(w(8), Step::Rsp { rbp_off: 0 })];
        assert!(f.steps(&pass, w(12), true, |v| *v));
        // Another rule refuses the entry.
        let mut f = t.fill(0x6000, w(8), top, 1).unwrap();
        f.steps(&[(w(8), Step::Other)], w(12), false, |v| *v);
        f.finish(0, false, 1, 1);
        assert_eq!(unsafe { t.find(0x6000, w(8), 0, top, 1) }, None);
    }

    #[test]
    fn a_table_that_answers_under_a_quarter_of_walks_is_asked_one_walk_in_32() {
        let s = stack();
        let (sp, top) = (at(&s, 8), at(&s, 63));
        let mut t = Box::new(Shortcuts::new());
        t.fill(0x5000, sp, top, 1).unwrap().finish(0, false, 1, 7);
        // One answer in five walks: the doubt grows by 4 - 3 per five.
        let mut asked = 0;
        for i in 0..2000u64 {
            if t.worth_asking() {
                asked += 1;
                let pc = if i % 5 == 0 { 0x5000 } else { 0x6000 + i };
                // SAFETY: `[sp, top + 8)` lies inside `s`.
                let _ = unsafe { t.find(pc, sp, 0, top, 1) };
            }
        }
        assert!(asked < 600, "{asked} of 2000 walks asked");
        // Answers at every walk bring it back.
        let mut asked = 0;
        for _ in 0..200 {
            if t.worth_asking() {
                asked += 1;
                // SAFETY: as above.
                assert!(unsafe { t.find(0x5000, sp, 0, top, 1) }.is_some());
            }
        }
        assert!(asked > 150, "{asked} of 200 walks asked");
    }

    #[test]
    fn fills_are_paid_for_by_answers() {
        let s = stack();
        let (sp, top) = (at(&s, 8), at(&s, 63));
        let mut t = Box::new(Shortcuts::new());
        let mut filled = 0;
        let fill = |t: &mut Shortcuts, pc| {
            // SAFETY: `[sp, top + 8)` lies inside `s`.
            assert_eq!(unsafe { t.find(pc, sp, 0, top, 1) }, None);
            t.fill(pc, sp, top, 1)
                .map(|f| f.finish(0, false, 1, 7))
                .is_some()
        };
        for i in 0..64u64 {
            filled += usize::from(fill(&mut t, 0x9000 + i));
        }
        // 16 on credit, then one per 32 misses in a row (the 32nd, 64th).
        assert_eq!(filled, 16 + 2);
        // Eight answers pay for one more fill.
        for _ in 0..8 {
            // SAFETY: as above.
            assert!(unsafe { t.find(0x9000 + 63, sp, 0, top, 1) }.is_some());
        }
        assert!(fill(&mut t, 0x8000));
        assert!(!fill(&mut t, 0x8001));
    }
}
