/* heapdump's no-frame-pointer test program (built -O2
 * -fomit-frame-pointer, like most distribution code), with known call
 * chains:
 *   main -> chain_a -> chain_b -> lib_enter -> lib_mid -> lib_leaf
 *        (100 blocks of 1000 bytes; the last three in chain_lib.so)
 *   main -> recurse x 41 (depth 40 .. 0) (10 blocks of 2000 bytes)
 *   main -> spin_nofp -> raise(SIGUSR1) -> on_signal (5 blocks of 777
 *        bytes, allocated in the signal handler, across the signal frame)
 *   main -> via_left -> shared_mid -> shared_leaf (60 blocks of 300 bytes)
 *   main -> via_right -> shared_mid -> shared_leaf (60 blocks of 301
 *        bytes), alternately with the one above: the same two frames at
 *        the same stack depth under two callers, so a walk that reuses the
 *        previous walk's outer frames must see the return address below
 *        shared_mid change
 * Prints "ready PID" and waits for a line on stdin. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void lib_enter(int n, size_t size);

static void *keep[256];
static int nkeep;
void hold_block(void *p) { if (p && nkeep < 256) keep[nkeep++] = p; }

__attribute__((noinline)) void chain_b(void) {
    lib_enter(100, 1000);
    __asm__ volatile("" ::: "memory");
}
__attribute__((noinline)) void chain_a(void) {
    chain_b();
    __asm__ volatile("" ::: "memory");
}
__attribute__((noinline)) void recurse(int depth) {
    if (depth == 0) {
        for (int i = 0; i < 10; i++) hold_block(malloc(2000));
    } else {
        recurse(depth - 1);
    }
    __asm__ volatile("" ::: "memory");
}
__attribute__((noinline)) void on_signal(int sig) {
    (void)sig;
    for (int i = 0; i < 5; i++) hold_block(malloc(777));
}
__attribute__((noinline)) void spin_nofp(void) {
    raise(SIGUSR1);
    __asm__ volatile("" ::: "memory");
}

__attribute__((noinline)) void shared_leaf(size_t size) {
    hold_block(malloc(size));
    __asm__ volatile("" ::: "memory");
}
__attribute__((noinline)) void shared_mid(size_t size) {
    shared_leaf(size);
    __asm__ volatile("" ::: "memory");
}
/* Different sizes, so the compiler cannot fold the two into one. */
__attribute__((noinline)) void via_left(void) {
    shared_mid(300);
    __asm__ volatile("" ::: "memory");
}
__attribute__((noinline)) void via_right(void) {
    shared_mid(301);
    __asm__ volatile("" ::: "memory");
}

int main(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGUSR1, &sa, NULL);
    chain_a();
    recurse(40);
    spin_nofp();
    for (int i = 0; i < 60; i++) {
        via_left();
        via_right();
    }
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    if (read(0, line, sizeof line) < 0) {}
    return 0;
}
