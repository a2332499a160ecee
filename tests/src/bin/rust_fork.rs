//! Forks (and optionally execs) while other threads allocate, to check
//! that a child never writes into its parent's regions and gets its own.
//! Protocol: prints `ready PARENT CHILD` once both have their pattern in
//! place; both wait for stdin to close.

use std::hint::black_box;

#[global_allocator]
static A: heapdump_agent::Agent = heapdump_agent::Agent::system();

// Each site keeps its frame while it allocates: `black_box` after the
// call stops a release build from making `collect` a tail call, which
// would leave no frame of the site on the stack (and the blocks would be
// `main`'s, as any profiler would see them).
#[inline(never)]
fn parent_site() -> Vec<Vec<u8>> {
    black_box((0..40).map(|_| Vec::with_capacity(111)).collect())
}

#[inline(never)]
fn child_site() -> Vec<Vec<u8>> {
    black_box((0..25).map(|_| Vec::with_capacity(222)).collect())
}

fn main() {
    let keep = black_box(parent_site());
    // Threads allocating while we fork.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let hs: Vec<_> = (0..2)
        .map(|_| {
            let stop = stop.clone();
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    black_box(Vec::<u8>::with_capacity(64));
                }
            })
        })
        .collect();
    let mut fds = [0i32; 2];
    // SAFETY: pipe with a valid 2-element array.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: fork; the child only uses the agent, the pipe and stdio.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        let mine = black_box(child_site());
        let msg = format!("{}\n", std::process::id());
        // SAFETY: writing a valid buffer to the pipe.
        unsafe { libc::write(fds[1], msg.as_ptr().cast(), msg.len()) };
        let mut rest = Vec::new();
        let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut rest);
        black_box(mine);
        // SAFETY: leave without running the parent's atexit handlers.
        unsafe { libc::_exit(0) };
    }
    let mut buf = [0u8; 32];
    // SAFETY: reading into a valid buffer.
    let n = unsafe { libc::read(fds[0], buf.as_mut_ptr().cast(), buf.len()) };
    let child: u32 = std::str::from_utf8(&buf[..n as usize])
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    for h in hs {
        h.join().unwrap();
    }
    println!("ready {} {}", std::process::id(), child);
    let mut rest = Vec::new();
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut rest);
    // SAFETY: waiting for our child.
    unsafe { libc::waitpid(pid as i32, std::ptr::null_mut(), 0) };
    black_box(keep);
}
