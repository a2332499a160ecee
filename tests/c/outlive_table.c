/* Threads whose blocks outlive their young rings, and their owner tables
 * (table/src/allocations_table/owner_table.rs; the agent's policy is
 * agent/src/young_policy.rs): blocks freed by the allocating thread and by
 * others, tables given back at thread exit and taken up by the next thread
 * with the blocks they still hold, a table that overflows and is drained.
 *
 *   1. Thread A keeps FIFO blocks at site_fifo (32 bytes): each of
 *      FIFO_EVENTS allocations frees the block allocated FIFO_LIVE earlier
 *      (its blocks live in its owner table and die there); it exits with
 *      its last FIFO_LIVE blocks live, in the table it gives back.
 *   2. Main frees every second of them (in a table whose owner is gone).
 *   3. Thread B runs the FIFO pattern at site_fifo_b (200 bytes, so that
 *      the allocator never hands it an address of A's: a block of A's left
 *      recorded by mistake stays visible), taking up the first table free,
 *      A's, with the blocks it still holds; it frees every other one of
 *      those as it goes (in its own table now), and exits with its own last
 *      FIFO_LIVE blocks live.
 *   4. Thread C keeps HUGE blocks at site_huge (64 bytes), more than a
 *      table takes: it takes the same table up, evicts the blocks it holds
 *      into the index, and drains it there when it is full.
 *   5. Main frees every second huge block.
 *
 * Expected live: site_huge HUGE/2 of 64 bytes, site_fifo FIFO_LIVE/4 of 32
 * (A's), site_fifo_b FIFO_LIVE of 200 (B's). Prints "ready PID", waits for a
 * line on stdin, then frees the rest and prints "done". */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define FIFO_LIVE 2000
#define FIFO_EVENTS 30000
#define HUGE 20000

static void *huge[HUGE];
static void *a_fifo[FIFO_LIVE];
static void *b_fifo[FIFO_LIVE];

__attribute__((noinline)) void *site_fifo(void) { return malloc(32); }
__attribute__((noinline)) void *site_fifo_b(void) { return malloc(200); }
__attribute__((noinline)) void *site_huge(void) { return malloc(64); }

/* FIFO_EVENTS allocations, each freeing the one FIFO_LIVE before; leaves
 * the last FIFO_LIVE in ring. */
static void fifo(void **ring) {
    for (int i = 0; i < FIFO_LIVE; i++) ring[i] = site_fifo();
    for (int i = 0; i < FIFO_EVENTS; i++) {
        int slot = i % FIFO_LIVE;
        free(ring[slot]);
        ring[slot] = site_fifo();
    }
}

static void *thread_a(void *arg) {
    (void)arg;
    fifo(a_fifo);
    return NULL;
}

static void *thread_c(void *arg) {
    (void)arg;
    for (int i = 0; i < HUGE; i++) huge[i] = site_huge();
    return NULL;
}

static void *thread_b(void *arg) {
    (void)arg;
    for (int i = 0; i < FIFO_LIVE; i++) b_fifo[i] = site_fifo_b();
    for (int i = 0; i < FIFO_EVENTS; i++) {
        int slot = i % FIFO_LIVE;
        free(b_fifo[slot]);
        b_fifo[slot] = site_fifo_b();
        /* A's remaining blocks (odd slots): every other, 1, 5, 9, ... */
        if (i % 8 == 2 && i < 2 * FIFO_LIVE) {
            free(a_fifo[i / 2]);
            a_fifo[i / 2] = NULL;
        }
    }
    return NULL;
}

static void run(void *(*f)(void *)) {
    pthread_t th;
    pthread_create(&th, NULL, f, NULL);
    pthread_join(th, NULL);
}

int main(void) {
    run(thread_a);
    for (int i = 0; i < FIFO_LIVE; i += 2) {
        free(a_fifo[i]);
        a_fifo[i] = NULL;
    }
    run(thread_b);
    run(thread_c);
    for (int i = 0; i < HUGE; i += 2) {
        free(huge[i]);
        huge[i] = NULL;
    }
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[8];
    if (read(0, line, sizeof line) < 0) {}
    for (int i = 0; i < HUGE; i++) free(huge[i]);
    for (int i = 0; i < FIFO_LIVE; i++) free(a_fifo[i]);
    for (int i = 0; i < FIFO_LIVE; i++) free(b_fifo[i]);
    printf("done\n");
    fflush(stdout);
    return 0;
}
