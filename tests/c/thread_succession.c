/* Threads that come and go one after another, as a thread-per-request
 * server's do: 100 threads, each started after the previous one ended,
 * each allocating 1000 bytes that stay live (kept in `kept`). Prints
 * "ready PID" and waits for stdin to close. With the argument "shrink",
 * main first allocates and frees a block of 1 MiB ten times (the heap
 * then shrank: it held more than was left, and much more was allocated
 * than it ever held), waiting after each for the coarse clock that
 * stamps records to tick: the recorded peak counts a block freed after
 * it that was allocated in its own tick as live at the peak, so blocks
 * that never coexisted but share a tick would add up there. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define THREADS 100

void *kept[THREADS];

static long long coarse_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Returns once the coarse clock has moved on from its reading now (the
 * kernel advances it every tick: a bounded wait). */
static void next_coarse_tick(void) {
    long long now = coarse_ns();
    while (coarse_ns() == now) {
    }
}

static void *work(void *arg) {
    kept[(long)arg] = malloc(1000);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "shrink") == 0) {
        for (int i = 0; i < 10; i++) {
            char *volatile big = malloc(1 << 20);
            big[0] = 1;
            free(big);
            next_coarse_tick();
        }
    }
    for (long i = 0; i < THREADS; i++) {
        pthread_t t;
        if (pthread_create(&t, NULL, work, (void *)i) != 0)
            return 1;
        pthread_join(t, NULL);
    }
    printf("ready %d\n", getpid());
    fflush(stdout);
    char line[16];
    while (fgets(line, sizeof line, stdin)) {
    }
    return 0;
}
