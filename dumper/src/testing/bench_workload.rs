//! `heapdump __bench-workload N STACKS` (hidden): the snapshot benchmark's
//! target, run under the preload agent (`dumper/scripts/bench-snapshot.sh`).
//!
//! Allocates `N` live blocks (16 to 79 bytes) from `STACKS` distinct call
//! stacks: stack `i` is a recursion through four non-inlined functions
//! chosen by the base-4 digits of `i`, over a varying depth (3 to 12
//! frames), so every stack is distinct and symbolization has real work.
//! Prints `ready PID` when every block is live, then holds them until
//! stdin closes.

use std::hint::black_box;
use std::io::{Read, Write};

/// Blocks kept live, and the next size to allocate.
struct State {
    keep: Vec<Vec<u8>>,
    per_stack: usize,
    serial: usize,
}

#[inline(never)]
fn leaf(s: &mut State) {
    for _ in 0..s.per_stack {
        let size = 16 + s.serial % 64;
        s.serial += 1;
        s.keep.push(black_box(Vec::with_capacity(size)));
    }
}

macro_rules! level {
    ($name:ident) => {
        #[inline(never)]
        fn $name(s: &mut State, id: usize, depth: usize) {
            descend(s, id, depth);
            black_box(());
        }
    };
}
level!(level_a);
level!(level_b);
level!(level_c);
level!(level_d);

/// One more frame chosen by the next base-4 digit of `id`, or the leaf.
#[inline(always)]
fn descend(s: &mut State, id: usize, depth: usize) {
    if depth == 0 {
        return leaf(s);
    }
    match id % 4 {
        0 => level_a(s, id / 4, depth - 1),
        1 => level_b(s, id / 4, depth - 1),
        2 => level_c(s, id / 4, depth - 1),
        _ => level_d(s, id / 4, depth - 1),
    }
}

/// Depth of stack `id`: enough base-4 digits to tell `stacks` ids apart,
/// plus a varying extra (the extra digits are zeros, so ids stay
/// distinct: two ids differ in a low digit or in depth).
fn depth_of(id: usize, stacks: usize) -> usize {
    let mut digits = 1;
    while 4usize.pow(digits as u32) < stacks {
        digits += 1;
    }
    digits + (id % 7).min(12usize.saturating_sub(digits))
}

/// Runs the workload (never returns before stdin closes).
pub fn run(blocks: usize, stacks: usize) {
    let stacks = stacks.clamp(1, blocks.max(1));
    let mut s = State {
        keep: Vec::with_capacity(blocks),
        per_stack: blocks / stacks,
        serial: 0,
    };
    for id in 0..stacks {
        if id == stacks - 1 {
            // The remainder goes to the last stack.
            s.per_stack = blocks - s.keep.len();
        }
        descend(&mut s, id, depth_of(id, stacks));
    }
    println!(
        "ready {} ({} live blocks)",
        std::process::id(),
        s.keep.len()
    );
    let _ = std::io::stdout().flush();
    let mut sink = [0u8; 64];
    while std::io::stdin().read(&mut sink).unwrap_or(0) > 0 {}
    black_box(&s.keep);
}
