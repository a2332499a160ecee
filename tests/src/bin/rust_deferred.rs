//! The Rust twin of `tests/c/deferred.c`: with `Agent::system()`, blocks
//! whose release to glibc is held back must still reach glibc at thread
//! exit and in a forked child. Checked with glibc's own accounting
//! (`mallinfo2`, one arena). Prints one line per check and exits 0 when all
//! hold.

use heapdump_agent::Agent;

#[global_allocator]
static A: Agent = Agent::system();

const SIZE: usize = 2000;

fn in_use() -> usize {
    // SAFETY: mallinfo2 has no preconditions.
    unsafe { libc::mallinfo2() }.uordblks
}

fn chunk(v: &[u8]) -> usize {
    // SAFETY: the pointer is a live block of the system allocator.
    unsafe { libc::malloc_usable_size(v.as_ptr() as *mut libc::c_void) + 8 }
}

fn main() {
    // SAFETY: mallopt has no preconditions.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    drop(Vec::<u8>::with_capacity(16));
    let mut ok = true;

    let before = in_use();
    std::thread::spawn(|| {
        let blocks: Vec<Vec<u8>> = (0..100).map(|_| Vec::with_capacity(SIZE)).collect();
        drop(blocks);
    })
    .join()
    .unwrap();
    let after = in_use();
    println!("thread exit: in use before {before}, after {after}");
    // glibc and Rust's thread keep a little per finished thread; a block
    // held back would be a whole 2000-byte chunk.
    ok &= after < before + SIZE;

    let x: Vec<u8> = Vec::with_capacity(SIZE);
    let y: Vec<u8> = Vec::with_capacity(SIZE);
    let (cx, cy) = (chunk(&x), chunk(&y));
    let with_xy = in_use();
    drop(x);
    drop(y);
    let held = in_use();
    println!("held back: in use {held} after freeing {cx} + {cy} bytes (was {with_xy})");
    ok &= held == with_xy;

    use std::io::Write;
    std::io::stdout().flush().unwrap();
    // SAFETY: the child only measures, allocates once and exits.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let u0 = in_use();
        let z: Vec<u8> = Vec::with_capacity(SIZE);
        let cz = chunk(&z);
        let u1 = in_use();
        let good = u1 + cx + cy == u0 + cz;
        // SAFETY: leaving the child without running the parent's exit work.
        unsafe { libc::_exit(if good { 0 } else { 1 }) };
    }
    let mut status = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut status, 0) };
    let child_ok = libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0;
    println!(
        "child released them: {}",
        if child_ok { "yes" } else { "no" }
    );
    ok &= child_ok;
    println!("{}", if ok { "all held" } else { "FAILED" });
    std::process::exit(if ok { 0 } else { 1 });
}
