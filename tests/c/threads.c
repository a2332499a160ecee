/* Thread exit storm: waves of threads allocate, free, keep blocks and exit
 * while other threads keep allocating; TLS destructors allocate and free
 * during thread exit; a constructor allocates before main; an atexit
 * handler allocates after main returns. Prints "ready" with everything in
 * place, waits for a line on stdin. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define WAVES 10
#define PER_WAVE 20
void *kept[WAVES * PER_WAVE * 3 + 16];
static int nkept;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_key_t key;
static void *before_main;

static void keep(void *p) {
    pthread_mutex_lock(&mu);
    kept[nkept++] = p;
    pthread_mutex_unlock(&mu);
}

__attribute__((noinline)) void site_ctor(void) { before_main = malloc(4321); }
__attribute__((constructor)) static void ctor(void) { site_ctor(); }

__attribute__((noinline)) void site_tls_dtor(void *v) {
    free(v);                 /* frees the thread's TLS block */
    keep(malloc(48));        /* and allocates during thread exit */
}
static void dtor(void *v) { site_tls_dtor(v); }

__attribute__((noinline)) void site_worker(void) {
    for (int i = 0; i < 50; i++) {
        void *volatile p = malloc(100 + i);
        free(p);
    }
    keep(malloc(640));
    pthread_setspecific(key, malloc(99));
}

static void *worker(void *arg) {
    (void)arg;
    site_worker();
    return NULL;
}

__attribute__((noinline)) void site_atexit(void) {
    void *volatile p = malloc(55);
    free(p);
    p = malloc(66); /* still live at exit: must not crash anything */
}
static void at_exit(void) { site_atexit(); }

int main(void) {
    pthread_key_create(&key, dtor);
    atexit(at_exit);
    for (int w = 0; w < WAVES; w++) {
        pthread_t t[PER_WAVE];
        for (int i = 0; i < PER_WAVE; i++) pthread_create(&t[i], NULL, worker, NULL);
        /* the main thread allocates while the wave exits */
        for (int i = 0; i < 100; i++) {
            void *volatile p = malloc(10);
            free(p);
        }
        for (int i = 0; i < PER_WAVE; i++) pthread_join(t[i], NULL);
    }
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[8];
    if (read(0, line, sizeof line) < 0) {}
    return before_main ? 0 : 1;
}
