/* The agent's half of `heapdump attach`, without ptrace: a program started
 * WITHOUT the agent allocates blocks, then loads libheapdump_preload.so
 * itself (argv[1]) with dlopen and calls heapdump_attach(NULL), as the
 * injector has the process do. Its later allocations must be recorded,
 * per site and thread; the blocks from before must not be, and their
 * frees and a realloc of one must work as without the agent.
 * Prints "attached N" (slots redirected), then "ready PID" and waits for a
 * line on stdin. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void *pre[1000];
void *after[50], *zeroed[20], *aligned[10], *from_thread[30];
void *volatile moved;

__attribute__((noinline)) void pre_attach(void) {
    for (int i = 0; i < 1000; i++) pre[i] = malloc(100 + i);
}
__attribute__((noinline)) void site_after_malloc(void) {
    for (int i = 0; i < 50; i++) after[i] = malloc(1000);
}
__attribute__((noinline)) void site_after_calloc(void) {
    for (int i = 0; i < 20; i++) zeroed[i] = calloc(1, 24);
}
__attribute__((noinline)) void site_after_aligned(void) {
    for (int i = 0; i < 10; i++)
        if (posix_memalign(&aligned[i], 64, 256) != 0) abort();
}
__attribute__((noinline)) void site_realloc_pre(void) { moved = realloc(pre[0], 5000); }
__attribute__((noinline)) void site_thread(void) {
    for (int i = 0; i < 30; i++) from_thread[i] = malloc(512);
}
static void *worker(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "attach-worker");
    site_thread();
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    pre_attach();
    void *h = dlopen(argv[1], RTLD_NOW);
    if (!h) {
        printf("dlopen failed: %s\n", dlerror());
        return 3;
    }
    int (*attach)(const char *) = (int (*)(const char *))dlsym(h, "heapdump_attach");
    int n = attach ? attach(NULL) : -2;
    printf("attached %d\n", n);
    fflush(stdout);
    site_after_malloc();
    site_after_calloc();
    site_after_aligned();
    site_realloc_pre();
    for (int i = 1; i < 1000; i++) free(pre[i]);
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    pthread_join(t, NULL);
    /* Pre-attach blocks' contents survive: the realloc copied the first. */
    memset((char *)moved + 100, 1, 4900);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    if (read(0, line, sizeof line) < 0) {}
    return 0;
}
