/* A thread that takes a new name twice while it allocates, as a JVM's or
 * a thread pool's threads do after they start: named "first-name", it
 * allocates 10 blocks of 1000 bytes; renamed "second-name"
 * (pthread_setname_np), 20 of 2000; renamed "third-name" (prctl), 5 of
 * 3000; all kept, then it ends. main prints "ready" and waits for stdin
 * to close. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>

void *kept[35]; /* not static: the compiler may not drop the blocks */

__attribute__((noinline)) static void site_named(int from, int n, size_t size) {
    for (int i = from; i < from + n; i++) kept[i] = malloc(size);
}

static void *worker(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "first-name");
    site_named(0, 10, 1000);
    pthread_setname_np(pthread_self(), "second-name");
    site_named(10, 20, 2000);
    prctl(PR_SET_NAME, "third-name");
    site_named(30, 5, 3000);
    return NULL;
}

int main(void) {
    pthread_t t;
    if (pthread_create(&t, NULL, worker, NULL) != 0) return 1;
    pthread_join(t, NULL);
    printf("ready\n");
    fflush(stdout);
    char line[16];
    while (fgets(line, sizeof line, stdin)) {
    }
    return 0;
}
