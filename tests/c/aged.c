/* Live blocks of known ages, for selecting blocks by allocation time.
 *
 * Prints "start" (stdout's buffer is allocated then, before any site; stdin
 * is unbuffered, so reading allocates nothing), then:
 * site_early keeps 40 blocks of 700 bytes; once the clocks have moved on by
 * a margin it prints "mid NS" (CLOCK_REALTIME in nanoseconds, a moment
 * after every early block), waits until the coarse monotonic clock the
 * agent stamps blocks with has passed that moment by the margin, and
 * site_late keeps 25 blocks of 1500 bytes; prints "late". On a line from
 * stdin it does the same again (the moment being when the line arrived):
 * site_later keeps 9 blocks of 333 bytes; prints "later". On the next line
 * (or EOF) it frees everything and exits. No sleeps: each wait is on a
 * clock, so the ordering holds however loaded the machine is. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define MARGIN_NS 20000000LL /* 20 ms: above a kernel tick at any HZ */

static long long ns_of(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Returns once `clock` reads at least `until`. */
static void wait_for(clockid_t clock, long long until) {
    while (ns_of(clock) < until) {
    }
}

static void *early[40], *late[25], *later[9];

__attribute__((noinline)) void site_early(void) {
    for (int i = 0; i < 40; i++) early[i] = malloc(700);
}

__attribute__((noinline)) void site_late(void) {
    for (int i = 0; i < 25; i++) late[i] = malloc(1500);
}

__attribute__((noinline)) void site_later(void) {
    for (int i = 0; i < 9; i++) later[i] = malloc(333);
}

int main(void) {
    char line[64];
    /* Unbuffered stdin: no buffer is allocated at the first read. */
    setvbuf(stdin, NULL, _IONBF, 0);
    printf("start\n");
    fflush(stdout);
    site_early();
    /* Every early block was stamped at or before now (the coarse clock
     * lags, never leads). */
    wait_for(CLOCK_MONOTONIC, ns_of(CLOCK_MONOTONIC) + MARGIN_NS);
    long long mid_mono = ns_of(CLOCK_MONOTONIC);
    printf("mid %lld\n", ns_of(CLOCK_REALTIME));
    fflush(stdout);
    wait_for(CLOCK_MONOTONIC_COARSE, mid_mono + MARGIN_NS);
    site_late();
    printf("late\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 1;
    wait_for(CLOCK_MONOTONIC_COARSE, ns_of(CLOCK_MONOTONIC) + MARGIN_NS);
    site_later();
    printf("later\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) { /* EOF also ends it */ }
    for (int i = 0; i < 40; i++) free(early[i]);
    for (int i = 0; i < 25; i++) free(late[i]);
    for (int i = 0; i < 9; i++) free(later[i]);
    return 0;
}
