/* Blocks that never coexisted, in the clock tick of the heap's peak: a
 * buffer of S bytes allocated (which moves the peak to S), freed, and
 * allocated and freed again within one tick of the coarse clock that
 * stamps records. The heap never held more than S (and the few bytes
 * live besides), however the tick is shared.
 *
 * Each attempt reads the coarse clock before and after; an attempt that
 * straddled a tick (preempted, or at a tick's end) is tried again with a
 * buffer 1/32 larger (so the peak moves again: it moves on a rise of
 * 1/64), up to 200 times. Prints "ready PID S" with the size of the
 * attempt that stayed within a tick (0 if none did), then waits for stdin
 * to close. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static long long coarse_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

__attribute__((noinline)) static void *site_buffer(size_t size) {
    char *volatile p = malloc(size);
    p[0] = 1;
    return p;
}

int main(void) {
    size_t size = 1 << 20, within = 0;
    for (int attempt = 0; attempt < 200 && within == 0; attempt++) {
        long long before = coarse_ns();
        free(site_buffer(size));
        free(site_buffer(size));
        if (coarse_ns() == before)
            within = size;
        else
            size += size / 32;
    }
    printf("ready %d %zu\n", getpid(), within);
    fflush(stdout);
    char line[16];
    while (fgets(line, sizeof line, stdin)) {
    }
    return 0;
}
