/* A thread created with a small stack, as node does (32 KiB): glibc takes
 * the static TLS of every library loaded at start out of each thread's
 * stack and refuses (EINVAL) a stack that leaves too little, so under the
 * agent pthread_create must still succeed, and the thread's allocations
 * be recorded. Prints "ready" with the thread's 25 blocks held, waits for
 * a line on stdin. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* Not static: a static array nobody reads would let the compiler drop
 * the mallocs. */
void *held[25];

__attribute__((noinline)) void *site_small_stack(void *arg) {
    (void)arg;
    for (int i = 0; i < 25; i++) held[i] = malloc(200);
    return NULL;
}

int main(void) {
    pthread_attr_t a;
    pthread_attr_init(&a);
    int r = pthread_attr_setstacksize(&a, 32768);
    if (r == 0) {
        pthread_t t;
        r = pthread_create(&t, &a, site_small_stack, NULL);
        if (r == 0) pthread_join(t, NULL);
    }
    if (r != 0) {
        printf("failed: %s\n", strerror(r));
        return 1;
    }
    printf("ready %d\n", getpid());
    fflush(stdout);
    char line[64];
    (void)!fgets(line, sizeof line, stdin);
    return 0;
}
