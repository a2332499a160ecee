/* Threads that come and go one after another, as a thread-per-request
 * server's do: 100 threads, each started after the previous one ended,
 * each allocating 1000 bytes that stay live (kept in `kept`). Prints
 * "ready PID" and waits for stdin to close. With the argument "shrink",
 * main first allocates and frees two blocks of 1 MiB (the heap then
 * shrank: it held more than was left). */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define THREADS 100

void *kept[THREADS];

static void *work(void *arg) {
    kept[(long)arg] = malloc(1000);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "shrink") == 0) {
        for (int i = 0; i < 2; i++) {
            char *volatile big = malloc(1 << 20);
            big[0] = 1;
            free(big);
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
