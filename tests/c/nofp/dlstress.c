/* heapdump's dlopen/dlclose test (built -O2 -fomit-frame-pointer): two
 * threads allocate through library A (argv[1]) and free it all; A is
 * closed while two churn threads keep allocating and freeing; library B
 * (argv[2], often mapped where A was) is opened and two threads allocate
 * 50 blocks of 4321 bytes each through it and keep them. Prints "ready
 * SAME|MOVED" (whether B took A's address) and waits for a line on stdin. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

typedef void *(*alloc_fn)(size_t);
static alloc_fn fn;
static atomic_int stop;
static void *kept[2][50];

static void *churn(void *arg) {
    (void)arg;
    void *ring[64] = {0};
    unsigned i = 0;
    while (!atomic_load(&stop)) {
        free(ring[i % 64]);
        ring[i % 64] = malloc(16 + i % 512);
        i++;
    }
    for (int k = 0; k < 64; k++) free(ring[k]);
    return NULL;
}

__attribute__((noinline)) static void *use_a(void *arg) {
    (void)arg;
    for (int round = 0; round < 200; round++) {
        void *tmp[20];
        for (int k = 0; k < 20; k++) tmp[k] = fn(100 + k);
        for (int k = 0; k < 20; k++) free(tmp[k]);
    }
    return NULL;
}

__attribute__((noinline)) static void *use_b(void *arg) {
    long t = (long)arg;
    for (int k = 0; k < 50; k++) kept[t][k] = fn(4321);
    __asm__ volatile("" ::: "memory");
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    pthread_t c[2], w[2];
    for (int k = 0; k < 2; k++) pthread_create(&c[k], NULL, churn, NULL);
    void *a = dlopen(argv[1], RTLD_NOW);
    if (!a) { fprintf(stderr, "%s\n", dlerror()); return 3; }
    fn = (alloc_fn)dlsym(a, "alloc_from_a");
    Dl_info info;
    dladdr((void *)fn, &info);
    void *base_a = info.dli_fbase;
    for (long k = 0; k < 2; k++) pthread_create(&w[k], NULL, use_a, (void *)k);
    for (int k = 0; k < 2; k++) pthread_join(w[k], NULL);
    dlclose(a); /* the churn threads keep allocating meanwhile */
    void *b = dlopen(argv[2], RTLD_NOW);
    if (!b) { fprintf(stderr, "%s\n", dlerror()); return 3; }
    fn = (alloc_fn)dlsym(b, "alloc_from_b");
    dladdr((void *)fn, &info);
    for (long k = 0; k < 2; k++) pthread_create(&w[k], NULL, use_b, (void *)k);
    for (int k = 0; k < 2; k++) pthread_join(w[k], NULL);
    atomic_store(&stop, 1);
    for (int k = 0; k < 2; k++) pthread_join(c[k], NULL);
    printf("ready %s\n", info.dli_fbase == base_a ? "SAME" : "MOVED");
    fflush(stdout);
    char line[64];
    if (read(0, line, sizeof line) < 0) {}
    return 0;
}
