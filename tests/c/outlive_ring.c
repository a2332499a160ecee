/* A thread whose blocks first die young, then outlive its young ring, then
 * die young again: the agent's young-ring policy (agent/src/young_policy.rs)
 * keeps the ring, then puts blocks straight into the shared index (while
 * the ring still holds the last blocks it took), then takes the ring up
 * again. Frees happen in every phase, of blocks in the ring, in the index,
 * and of blocks left in the ring while the thread bypasses it.
 *
 *   1. 5 000 blocks at site_young, each freed at once;
 *   2. LONG blocks of 100 bytes at site_long, all kept (every window of
 *      allocations promotes them: the thread bypasses its ring);
 *   3. every second site_long block freed, newest first (the newest were
 *      in the ring when the bypass began);
 *   4. 20 000 blocks at site_young again, each freed at once (the bypass
 *      ends meanwhile);
 *   5. 3 000 blocks at site_mixed of 48 bytes, every fourth kept.
 *
 * Expected live: site_long LONG/2 blocks of 100 bytes, site_mixed 750 of
 * 48, nothing at site_young. Prints "ready PID", waits for a line on stdin,
 * then frees the rest and prints "done". */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define LONG 3000
#define MIXED 3000

static void *kept[LONG];
static void *mixed[MIXED];

__attribute__((noinline)) void *site_young(void) { return malloc(24); }
__attribute__((noinline)) void *site_long(void) { return malloc(100); }
__attribute__((noinline)) void *site_mixed(void) { return malloc(48); }

static void young(int n) {
    for (int i = 0; i < n; i++) {
        void *volatile p = site_young();
        free(p);
    }
}

int main(void) {
    young(5000);
    for (int i = 0; i < LONG; i++) kept[i] = site_long();
    for (int i = LONG - 1; i >= 0; i -= 2) {
        free(kept[i]);
        kept[i] = NULL;
    }
    young(20000);
    for (int i = 0; i < MIXED; i++) {
        mixed[i] = site_mixed();
        if (i % 4 != 0) {
            free(mixed[i]);
            mixed[i] = NULL;
        }
    }
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[8];
    if (read(0, line, sizeof line) < 0) {}
    for (int i = 0; i < LONG; i++) free(kept[i]);
    for (int i = 0; i < MIXED; i++) free(mixed[i]);
    printf("done\n");
    fflush(stdout);
    return 0;
}
