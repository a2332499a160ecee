/* A known allocation pattern, for heapdump's end-to-end tests.
 *
 * Each site_* function allocates blocks of a known size from its own call
 * site; some are freed, some reallocated; two named threads allocate too.
 * When the pattern is in place the program prints "ready" and waits for a
 * line on stdin, so the test can dump it while it is quiescent. With
 * argument "hold" the threads stay alive until then as well.
 */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define KEEP 4096
static void *keep[KEEP];
static int nkeep;
static void hold(void *p) { if (p && nkeep < KEEP) keep[nkeep++] = p; }

__attribute__((noinline)) void site_malloc(void) {
    for (int i = 0; i < 100; i++) hold(malloc(1000));
}
__attribute__((noinline)) void site_calloc(void) {
    for (int i = 0; i < 50; i++) hold(calloc(3, 8));
}
__attribute__((noinline)) void site_realloc(void) {
    for (int i = 0; i < 10; i++) {
        void *p = malloc(64);
        p = realloc(p, 4096);          /* moves: recorded at this site, 4096 */
        hold(p);
    }
}
__attribute__((noinline)) void site_free_half(void) {
    void *tmp[200];
    for (int i = 0; i < 200; i++) tmp[i] = malloc(32);
    for (int i = 0; i < 200; i += 2) free(tmp[i]);
    for (int i = 1; i < 200; i += 2) hold(tmp[i]);
}
__attribute__((noinline)) void site_aligned(void) {
    void *p;
    for (int i = 0; i < 5; i++) {
        if (posix_memalign(&p, 64, 200) == 0) hold(p);
        hold(aligned_alloc(128, 256));
        hold(memalign(256, 300));
        hold(valloc(100));
    }
}
__attribute__((noinline)) void site_reallocarray(void) {
    for (int i = 0; i < 7; i++) hold(reallocarray(NULL, 10, 12));
}
__attribute__((noinline)) void site_freed_all(void) {
    for (int i = 0; i < 300; i++) {
        void *volatile p = malloc(777); /* volatile: not elided */
        free(p);
    }
}

static pthread_barrier_t done;
static int hold_threads;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;

__attribute__((noinline)) void site_thread1(void) {
    for (int i = 0; i < 30; i++) {
        void *p = malloc(512);
        pthread_mutex_lock(&mu); hold(p); pthread_mutex_unlock(&mu);
    }
}
__attribute__((noinline)) void site_thread2(void) {
    for (int i = 0; i < 20; i++) {
        void *p = malloc(2048);
        pthread_mutex_lock(&mu); hold(p); pthread_mutex_unlock(&mu);
    }
}
static void *worker1(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "worker-1");
    site_thread1();
    pthread_barrier_wait(&done);
    if (hold_threads) pthread_barrier_wait(&done);
    return NULL;
}
static void *worker2(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "worker-2");
    site_thread2();
    pthread_barrier_wait(&done);
    if (hold_threads) pthread_barrier_wait(&done);
    return NULL;
}

int main(int argc, char **argv) {
    hold_threads = argc > 1 && strcmp(argv[1], "hold") == 0;
    pthread_setname_np(pthread_self(), "pattern-main");
    pthread_barrier_init(&done, NULL, 3);
    pthread_t t1, t2;
    pthread_create(&t1, NULL, worker1, NULL);
    pthread_create(&t2, NULL, worker2, NULL);
    site_malloc();
    site_calloc();
    site_realloc();
    site_free_half();
    site_aligned();
    site_reallocarray();
    site_freed_all();
    pthread_barrier_wait(&done);
    if (!hold_threads) {
        pthread_join(t1, NULL);
        pthread_join(t2, NULL);
    }
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    /* read(2), not stdio: no stdin buffer is allocated while being dumped */
    if (read(0, line, sizeof line) < 0) {}
    if (hold_threads) {
        pthread_barrier_wait(&done);
        pthread_join(t1, NULL);
        pthread_join(t2, NULL);
    }
    return 0;
}
