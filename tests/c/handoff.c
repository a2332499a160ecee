/* Blocks handed between threads while young: four threads allocate at
 * site_churn, free a third of their blocks themselves at once, hand a third
 * to the next thread (which frees them when it next looks, so some are
 * still in their allocator's young ring and some have been promoted to the
 * shared index), and free the rest a few allocations later. Each also keeps
 * 50 blocks of 777 bytes at site_kept, the last 8 allocated just before it
 * exits (so they are young in a ring whose thread is gone). After the
 * threads exit, main frees every second kept block. Expected live at the
 * snapshot: site_churn none, site_kept 4 * 25 blocks of 777 bytes.
 * Prints "ready PID", waits for a line on stdin, then frees the rest and
 * prints "done". */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define THREADS 4
#define EVENTS 30000
#define KEPT 50
#define KEPT_AT_EXIT 8

static void *queue[THREADS][EVENTS];
static int queued[THREADS];
static pthread_mutex_t mu[THREADS];
static pthread_barrier_t produced;
static void *kept[THREADS][KEPT];

__attribute__((noinline)) void *site_churn(size_t n) { return malloc(n); }
__attribute__((noinline)) void *site_kept(void) { return malloc(777); }

/* Frees what other threads handed to thread `t`. */
static void drain(int t) {
    void *batch[EVENTS];
    pthread_mutex_lock(&mu[t]);
    int n = queued[t];
    for (int i = 0; i < n; i++) batch[i] = queue[t][i];
    queued[t] = 0;
    pthread_mutex_unlock(&mu[t]);
    for (int i = 0; i < n; i++) free(batch[i]);
}

static void *worker(void *arg) {
    int t = (int)(long)arg;
    int next = (t + 1) % THREADS;
    void *later[4] = {0};
    int nkept = 0;
    for (int i = 0; i < EVENTS; i++) {
        void *p = site_churn(16 + (size_t)(i % 64) * 8);
        switch (i % 3) {
        case 0:
            free(p);
            break;
        case 1:
            pthread_mutex_lock(&mu[next]);
            queue[next][queued[next]++] = p;
            pthread_mutex_unlock(&mu[next]);
            break;
        default:
            free(later[i % 4]);
            later[i % 4] = p;
        }
        if (i % 7 == 0) drain(t);
        if (i % 600 == 5 && nkept < KEPT - KEPT_AT_EXIT) kept[t][nkept++] = site_kept();
    }
    for (int k = 0; k < 4; k++) free(later[k]);
    pthread_barrier_wait(&produced);
    drain(t);
    while (nkept < KEPT) kept[t][nkept++] = site_kept();
    return NULL;
}

int main(void) {
    pthread_t th[THREADS];
    pthread_barrier_init(&produced, NULL, THREADS);
    for (int t = 0; t < THREADS; t++) pthread_mutex_init(&mu[t], NULL);
    for (int t = 0; t < THREADS; t++) pthread_create(&th[t], NULL, worker, (void *)(long)t);
    for (int t = 0; t < THREADS; t++) pthread_join(th[t], NULL);
    for (int t = 0; t < THREADS; t++)
        for (int k = 1; k < KEPT; k += 2) free(kept[t][k]);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[8];
    if (read(0, line, sizeof line) < 0) {}
    for (int t = 0; t < THREADS; t++)
        for (int k = 0; k < KEPT; k += 2) free(kept[t][k]);
    printf("done\n");
    fflush(stdout);
    return 0;
}
