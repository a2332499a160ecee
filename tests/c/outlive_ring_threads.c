/* Threads whose blocks outlive their young rings (the agent then puts
 * them straight into the index, agent/src/young_policy.rs) and that exit
 * while doing so, their rings still holding the last blocks they took
 * before the bypass began. Each of THREADS threads allocates LONG blocks
 * of 200 bytes at site_long, all kept, with a young block at site_young
 * freed at once after every fourth (4 inserts in 5 promote a block); after they exit, main frees every second
 * kept block of every thread (blocks in the index, and in the rings of
 * threads that are gone). Then THREADS new threads each allocate and free
 * YOUNG_PAIRS young blocks (taking up the rings the first ones gave back).
 *
 * Expected live: site_long THREADS * LONG/2 blocks of 200 bytes, nothing at
 * site_young. Prints "ready PID", waits for a line on stdin, then frees the
 * rest and prints "done". */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define THREADS 4
#define LONG 4000
#define YOUNG_PAIRS 20000

static void *kept[THREADS][LONG];

__attribute__((noinline)) void *site_long(void) { return malloc(200); }
__attribute__((noinline)) void *site_young(void) { return malloc(40); }

static void *keeper(void *arg) {
    long t = (long)arg;
    for (int i = 0; i < LONG; i++) {
        kept[t][i] = site_long();
        if (i % 4 == 3) {
            void *volatile p = site_young();
            free(p);
        }
    }
    return NULL;
}

static void *young(void *arg) {
    (void)arg;
    for (int i = 0; i < YOUNG_PAIRS; i++) {
        void *volatile p = site_young();
        free(p);
    }
    return NULL;
}

static void run(void *(*f)(void *)) {
    pthread_t th[THREADS];
    for (long t = 0; t < THREADS; t++) pthread_create(&th[t], NULL, f, (void *)t);
    for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
}

int main(void) {
    run(keeper);
    for (int t = 0; t < THREADS; t++)
        for (int i = LONG - 1; i >= 0; i -= 2) {
            free(kept[t][i]);
            kept[t][i] = NULL;
        }
    run(young);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[8];
    if (read(0, line, sizeof line) < 0) {}
    for (int t = 0; t < THREADS; t++)
        for (int i = 0; i < LONG; i++) free(kept[t][i]);
    printf("done\n");
    fflush(stdout);
    return 0;
}
