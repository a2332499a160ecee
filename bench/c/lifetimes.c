/* How long heap blocks live, counted in their thread's allocation events:
 * an LD_PRELOAD shim for bench/lifetimes (issue 30: how many blocks would a
 * per-thread batch of N events cancel before they reach a shared table?).
 *
 * malloc, calloc, realloc and free are forwarded to the next definitions
 * (dlsym(RTLD_NEXT), a static bump arena while binding). Each thread counts
 * its events (allocations and frees); a global table (one mutex: this is a
 * measurement, not an agent) keeps, per live block, the allocating thread
 * and its event count then. At each free the block's age is the allocating
 * thread's events since, when the freeing thread is that thread; frees by
 * another thread and frees of blocks the shim never saw are counted apart.
 * At exit the counts go to the file named by LIFETIMES_OUT, one
 * "name value" per line. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void *(*next_malloc)(size_t);
static void (*next_free)(void *);
static void *(*next_calloc)(size_t, size_t);
static void *(*next_realloc)(void *, size_t);

#include "bump_arena.h"

/* Live blocks: open addressing, linear probing, backward-shift deletion. */
#define SLOTS (1u << 22)
struct slot { uintptr_t addr; uint64_t thread; uint64_t event; };
static struct slot table[SLOTS];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* Age buckets (events of the allocating thread), then the other cases. */
static const uint64_t limits[] = {4, 16, 64, 256, 1024, 4096};
#define BUCKETS (sizeof limits / sizeof limits[0])
static uint64_t young[BUCKETS + 1]; /* the last: older than every limit */
static uint64_t cross_thread, unseen, allocations, full;

static __thread uint64_t my_events;
static __thread uint64_t my_id;
static uint64_t next_id = 1;
static __thread int inside;

static uint64_t thread_id(void) {
    if (my_id == 0) my_id = __atomic_fetch_add(&next_id, 1, __ATOMIC_RELAXED);
    return my_id;
}

static uint32_t place(uintptr_t a) { return (uint32_t)((a >> 4) * 0x9e3779b97f4a7c15ull >> 42) & (SLOTS - 1); }

static void remember(void *p) {
    if (p == NULL || in_arena(p)) return;
    uint64_t t = thread_id(), e = ++my_events;
    pthread_mutex_lock(&lock);
    allocations++;
    uint32_t i = place((uintptr_t)p), n = 0;
    while (table[i].addr != 0 && table[i].addr != (uintptr_t)p && n < SLOTS / 2) {
        i = (i + 1) & (SLOTS - 1);
        n++;
    }
    if (n >= SLOTS / 2) {
        full++;
    } else {
        table[i] = (struct slot){(uintptr_t)p, t, e};
    }
    pthread_mutex_unlock(&lock);
}

static void forget(void *p) {
    if (p == NULL || in_arena(p)) return;
    uint64_t t = thread_id(), now = ++my_events;
    pthread_mutex_lock(&lock);
    uint32_t i = place((uintptr_t)p), n = 0;
    while (table[i].addr != (uintptr_t)p) {
        if (table[i].addr == 0 || ++n >= SLOTS / 2) {
            unseen++;
            pthread_mutex_unlock(&lock);
            return;
        }
        i = (i + 1) & (SLOTS - 1);
    }
    if (table[i].thread != t) {
        cross_thread++;
    } else {
        uint64_t age = now - table[i].event;
        size_t b = 0;
        while (b < BUCKETS && age > limits[b]) b++;
        young[b]++;
    }
    /* Backward-shift deletion keeps every probe sequence unbroken. */
    for (uint32_t j = i;;) {
        j = (j + 1) & (SLOTS - 1);
        if (table[j].addr == 0) break;
        uint32_t k = place(table[j].addr);
        int movable = j > i ? (k <= i || k > j) : (k <= i && k > j);
        if (movable) {
            table[i] = table[j];
            i = j;
        }
    }
    table[i].addr = 0;
    pthread_mutex_unlock(&lock);
}

__attribute__((constructor)) static void bind(void) {
    inside = 1;
    next_malloc = dlsym(RTLD_NEXT, "malloc");
    next_free = dlsym(RTLD_NEXT, "free");
    next_calloc = dlsym(RTLD_NEXT, "calloc");
    next_realloc = dlsym(RTLD_NEXT, "realloc");
    inside = 0;
}

__attribute__((destructor)) static void report(void) {
    const char *path = getenv("LIFETIMES_OUT");
    if (path == NULL) return;
    inside = 1;
    FILE *f = fopen(path, "w");
    if (f == NULL) return;
    fprintf(f, "allocations %llu\n", (unsigned long long)allocations);
    for (size_t b = 0; b < BUCKETS; b++)
        fprintf(f, "freed_within_%llu %llu\n", (unsigned long long)limits[b],
                (unsigned long long)young[b]);
    fprintf(f, "freed_later %llu\n", (unsigned long long)young[BUCKETS]);
    fprintf(f, "freed_by_another_thread %llu\n", (unsigned long long)cross_thread);
    fprintf(f, "freed_unseen %llu\n", (unsigned long long)unseen);
    fprintf(f, "table_full %llu\n", (unsigned long long)full);
    fclose(f);
}

void *malloc(size_t n) {
    if (!next_malloc) return bump(n);
    void *p = next_malloc(n);
    if (!inside) remember(p);
    return p;
}

void free(void *p) {
    if (in_arena(p) || !next_free) return;
    if (!inside) forget(p);
    next_free(p);
}

void *calloc(size_t a, size_t b) {
    if (!next_calloc) return bump(a * b);
    void *p = next_calloc(a, b);
    if (!inside) remember(p);
    return p;
}

void *realloc(void *p, size_t n) {
    if (in_arena(p)) {
        void *q = malloc(n);
        size_t avail = (size_t)(arena + sizeof arena - (char *)p);
        if (q) memcpy(q, p, n < avail ? n : avail);
        return q;
    }
    void *q = next_realloc(p, n);
    if (!inside && q != p && (q != NULL || n == 0)) {
        /* Moved (or released by realloc(p, 0)): the old block ended. */
        if (p) forget(p);
        if (q) remember(q);
    }
    return q;
}
