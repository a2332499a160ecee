/* A thread renamed after it allocated. A worker named "before-name"
 * allocates 20 blocks of 300 bytes and keeps them; main prints "ready" and
 * waits for a line, renames the worker "after-name" (no allocation on the
 * worker afterwards, so the agent's record keeps the old name), prints
 * "renamed", waits for a line (or EOF), then lets the worker end. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static void *kept[20];
static int go_on[2];
static pthread_barrier_t allocated;

__attribute__((noinline)) void site_renamed(void) {
    for (int i = 0; i < 20; i++) kept[i] = malloc(300);
}

static void *worker(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "before-name");
    site_renamed();
    pthread_barrier_wait(&allocated);
    char c;
    while (read(go_on[0], &c, 1) < 0) {} /* held until main says so */
    return NULL;
}

int main(void) {
    char line[64];
    if (pipe(go_on) != 0) return 1;
    pthread_barrier_init(&allocated, NULL, 2);
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    pthread_barrier_wait(&allocated);
    printf("ready\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) return 1;
    pthread_setname_np(t, "after-name");
    printf("renamed\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin)) { /* EOF also ends it */ }
    if (write(go_on[1], "x", 1) != 1) return 1;
    pthread_join(t, NULL);
    for (int i = 0; i < 20; i++) free(kept[i]);
    return 0;
}
