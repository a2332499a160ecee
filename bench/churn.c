/* Churn workload: the benchmark of heapdump's agent and of the profilers it
 * is compared with. Each event frees the oldest block of a ring and
 * allocates a new one (a malloc+free pair) from one of 16 call sites,
 * reached through a recursion of depth 8..32, with sizes 16..4096.
 *
 *   churn [THREADS] [EVENTS] [RING] [DEPTH]   (defaults: 1, 2000000, 100000, 0)
 *
 * DEPTH > 0 reaches every call site through exactly DEPTH levels of
 * recursion instead of 8..32 (a stack of DEPTH + 5 frames with the leaf,
 * the thread's entry and libc's two).
 *
 * Events and ring are split between threads. Prints one line:
 *   churn threads=T events=E ring=R depth=D ns_per_pair=X
 * The time covers only the churn loop (not set-up or exit). Before it, one
 * line says whether heapdump's agent recorded the run, in its own words
 * (heapdump_stats of libheapdump_preload.so, looked up at run time):
 *   agent: recording allocs=N     or     agent: absent
 * so a benchmark can refuse a run that it attributes to the agent but
 * that ran bare (a preload the loader did not find is only a warning).
 *
 * Built with -DCHURN_CXX -lstdc++, the blocks are C++ new[] / delete[]
 * (see BLOCK_ALLOC below) instead of malloc / free.
 *
 * CHURN_MAX_SIZE=N in the environment (17..1048576) makes the sizes 16..N
 * instead of 16..4096 (16..528: glibc's thread cache serves every block).
 *
 * With CHURN_PAUSE=1 in the environment, after the loop (the ring still
 * live) it prints that line and `ready`, and waits for a line (or EOF) on
 * stdin before freeing the ring and exiting: time for a profiler's snapshot
 * of the live heap (bench/compare). The timed loop is the same either way. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifdef CHURN_CXX
/* Built with -DCHURN_CXX (and -lstdc++), the ring's blocks come from C++'s
 * operator new[] and go back through delete[] (their Itanium ABI names, so
 * that one C file serves both): what a C++ program's allocations cost. */
void *_Znam(size_t);
void _ZdaPv(void *);
#define BLOCK_ALLOC(s) _Znam(s)
#define BLOCK_FREE(p) _ZdaPv(p)
#else
#define BLOCK_ALLOC(s) malloc(s)
#define BLOCK_FREE(p) free(p)
#endif

typedef void *(*leaf_fn)(size_t);
#define LEAF(n) __attribute__((noinline)) void *leaf##n(size_t s) { void *p = BLOCK_ALLOC(s); __asm__ volatile("" ::"r"(p) : "memory"); return p; }
LEAF(0) LEAF(1) LEAF(2) LEAF(3) LEAF(4) LEAF(5) LEAF(6) LEAF(7)
LEAF(8) LEAF(9) LEAF(10) LEAF(11) LEAF(12) LEAF(13) LEAF(14) LEAF(15)
static leaf_fn leaves[16] = {leaf0, leaf1, leaf2, leaf3, leaf4, leaf5, leaf6, leaf7,
                             leaf8, leaf9, leaf10, leaf11, leaf12, leaf13, leaf14, leaf15};

__attribute__((noinline)) void *descend(int depth, unsigned site, size_t size) {
    void *p;
    if (depth <= 0)
        p = leaves[site % 16](size);
    else
        p = descend(depth - 1, site, size);
    __asm__ volatile("" ::"r"(p) : "memory"); /* no tail call: keep the frames */
    return p;
}

struct job { long events; long ring; unsigned seed; };

static int fixed_depth; /* 0: 8..32 */
static unsigned size_span = 4081; /* sizes 16 .. 16 + size_span - 1 */

static int depth_of(unsigned x) { return fixed_depth ? fixed_depth : 8 + (x >> 8) % 25; }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + ts.tv_nsec;
}

static pthread_barrier_t start;
static uint64_t t0, t1;
static int pause_after;

static void *run(void *arg) {
    struct job *j = arg;
    void **ring = calloc(j->ring, sizeof(void *));
    unsigned x = j->seed;
    /* fill the ring first (not timed) */
    for (long i = 0; i < j->ring; i++) {
        x = x * 1103515245u + 12345u;
        ring[i] = descend(depth_of(x), x >> 16, 16 + (x >> 4) % size_span);
    }
    pthread_barrier_wait(&start);
    for (long i = 0; i < j->events; i++) {
        x = x * 1103515245u + 12345u;
        long slot = i % j->ring;
        BLOCK_FREE(ring[slot]);
        ring[slot] = descend(depth_of(x), x >> 16, 16 + (x >> 4) % size_span);
    }
    pthread_barrier_wait(&start);
    if (pause_after) pthread_barrier_wait(&start); /* released after `ready` */
    for (long i = 0; i < j->ring; i++) BLOCK_FREE(ring[i]);
    free(ring);
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    long events = argc > 2 ? atol(argv[2]) : 2000000;
    long ring = argc > 3 ? atol(argv[3]) : 100000;
    fixed_depth = argc > 4 ? atoi(argv[4]) : 0;
    if (threads < 1 || threads > 64 || fixed_depth < 0 || fixed_depth > 200) return 2;
    const char *ms = getenv("CHURN_MAX_SIZE");
    if (ms && *ms) {
        long m = atol(ms);
        if (m < 17 || m > 1048576) return 2;
        size_span = (unsigned)(m - 15);
    }
    const char *pe = getenv("CHURN_PAUSE");
    pause_after = pe && *pe && *pe != '0';
    pthread_barrier_init(&start, NULL, threads + 1);
    pthread_t t[64];
    struct job jobs[64];
    for (int i = 0; i < threads; i++) {
        jobs[i] = (struct job){events / threads, ring / threads, 12345u + 777u * i};
        pthread_create(&t[i], NULL, run, &jobs[i]);
    }
    pthread_barrier_wait(&start);
    t0 = now_ns();
    pthread_barrier_wait(&start);
    t1 = now_ns();
    /* The agent's own word on whether it recorded this run. */
    struct { uint64_t live_bytes, live_blocks, peak, total_allocs, total_bytes, dropped;
             uint32_t enabled, reserved; } st = {0};
    int (*stats)(void *, size_t) = (int (*)(void *, size_t))dlsym(RTLD_DEFAULT, "heapdump_stats");
    if (stats && stats(&st, sizeof st) == 0)
        printf("agent: recording allocs=%llu\n", (unsigned long long)st.total_allocs);
    else
        printf("agent: absent\n");
    /* per pair, in wall time of the whole process (threads run together) */
    printf("churn threads=%d events=%ld ring=%ld depth=%d ns_per_pair=%.1f\n", threads, events,
           ring, fixed_depth, (double)(t1 - t0) / (double)events * threads);
    if (pause_after) {
        printf("ready\n");
        fflush(stdout);
        char line[64];
        if (!fgets(line, sizeof line, stdin)) { /* EOF also releases */ }
        pthread_barrier_wait(&start);
    }
    for (int i = 0; i < threads; i++) pthread_join(t[i], NULL);
    return 0;
}
