//! A Rust program *not* built with the agent, to be run under
//! `LD_PRELOAD=libheapdump_preload.so`. Rust's runtime calls
//! `pthread_getattr_np` (which allocates while holding a lock) on the main
//! thread and on each new thread: the agent must not deadlock there.
//! Prints `ready` with 3 x 40 blocks of 700 bytes from `plain_site` kept
//! by three named threads, then waits for stdin.

use std::hint::black_box;

#[inline(never)]
fn plain_site() -> Vec<Vec<u8>> {
    (0..40)
        .map(|_| black_box(Vec::with_capacity(700)))
        .collect()
}

fn main() {
    let kept: Vec<Vec<Vec<u8>>> = (0..3)
        .map(|i| {
            std::thread::Builder::new()
                .name(format!("plain-{i}"))
                .spawn(plain_site)
                .unwrap()
                .join()
                .unwrap()
        })
        .collect();
    println!("ready {}", std::process::id());
    let mut buf = [0u8; 8];
    // SAFETY: reading into a valid local buffer (read(2): no stdin buffer
    // is allocated while the test dumps us).
    unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
    black_box(kept);
}
