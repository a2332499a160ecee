/* A process started WITHOUT the agent, for `heapdump attach`: it keeps
 * threads in every state an injector meets, and says whether any of them
 * saw an EINTR it should not have.
 *
 * - 4 threads malloc and free in tight loops (an attach must find a safe
 *   moment while the allocator is busy);
 * - one thread sleeps in nanosleep, another blocks in read(2) on stdin
 *   (the command thread), the main thread blocks in epoll_wait: a stop
 *   must not make any of them return EINTR;
 * - 1000 blocks allocated before anything attaches.
 *
 * Commands on stdin, one per line, each answered on stdout:
 *   alloc   -> 50 x malloc(1000) at site_after_malloc, realloc of a
 *              pre-attach block to 5000 at site_realloc_pre, frees the
 *              other 999 pre-attach blocks; "allocated"
 *   more    -> 40 x malloc(2000) at site_more; "more done"
 *   free    -> frees the 50 site_after_malloc blocks; "freed"
 *   fork    -> forks a child that runs site_more and prints "child PID",
 *              then waits until this process quits;
 *   jx      -> (built with -DWITH_JEMALLOC -ljemalloc) 10 x mallocx(3000)
 *              at site_mallocx, and frees the 50 site_after_malloc blocks
 *              with sdallocx; "jx done"
 *   stall   -> "stall US": the longest the sleeper thread overslept its
 *              20 ms (how long a stop held it), since the last "stall"
 *   rate    -> "rate N": malloc+free pairs per second of the churn
 *              threads over the next second (bench/attach);
 *   plugin  -> dlopens $ATTACH_PLUGIN (once) and calls its plugin_alloc(20):
 *              20 blocks of 1234 bytes at the plugin's site_plugin;
 *              "plugin done"
 *   quit    -> stops the threads, prints "eintr N" and exits 0.
 * Prints "ready PID" when all threads run. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>
#ifdef WITH_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

static void *pre[1000];
static void *after[50];
void *more[40]; /* not static: stores to it are never elided */
static void *volatile moved;
static atomic_int stop;
static atomic_long eintr;
static atomic_long overslept_us;
static atomic_long pairs;
static int wake[2];
static int hold[2] = {-1, -1};
static pid_t child;

__attribute__((noinline)) void pre_attach(void) {
    for (int i = 0; i < 1000; i++) pre[i] = malloc(100 + i);
}
__attribute__((noinline)) void site_after_malloc(void) {
    for (int i = 0; i < 50; i++) after[i] = malloc(1000);
}
__attribute__((noinline)) void site_realloc_pre(void) { moved = realloc(pre[0], 5000); }
#ifdef WITH_JEMALLOC
void *jx[10];
__attribute__((noinline)) void site_mallocx(void) {
    for (int i = 0; i < 10; i++) jx[i] = mallocx(3000, 0);
}
#endif
__attribute__((noinline)) void site_more(void) {
    for (int i = 0; i < 40; i++) more[i] = malloc(2000);
}

static void *churn(void *arg) {
    unsigned seed = (unsigned)(long)arg;
    pthread_setname_np(pthread_self(), "churn");
    while (!atomic_load_explicit(&stop, memory_order_relaxed)) {
        void *p[8];
        for (int i = 0; i < 8; i++) p[i] = malloc(16 + (rand_r(&seed) & 1023));
        for (int i = 0; i < 8; i++) free(p[i]);
        atomic_fetch_add_explicit(&pairs, 8, memory_order_relaxed);
    }
    return NULL;
}

static void *sleeper(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "sleeper");
    while (!atomic_load(&stop)) {
        struct timespec ts = {0, 20 * 1000 * 1000}, a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        if (nanosleep(&ts, NULL) != 0 && errno == EINTR) atomic_fetch_add(&eintr, 1);
        clock_gettime(CLOCK_MONOTONIC, &b);
        long us = (b.tv_sec - a.tv_sec) * 1000000L + (b.tv_nsec - a.tv_nsec) / 1000 - 20000;
        if (us > atomic_load(&overslept_us)) atomic_store(&overslept_us, us);
    }
    return NULL;
}

static void say(const char *s) {
    printf("%s\n", s);
    fflush(stdout);
}

static void *commands(void *arg) {
    (void)arg;
    pthread_setname_np(pthread_self(), "commands");
    char line[256];
    size_t have = 0;
    for (;;) {
        ssize_t n = read(0, line + have, sizeof line - 1 - have);
        if (n < 0 && errno == EINTR) {
            atomic_fetch_add(&eintr, 1);
            continue;
        }
        if (n <= 0) break;
        have += (size_t)n;
        line[have] = 0;
        char *nl;
        while ((nl = strchr(line, '\n'))) {
            *nl = 0;
            if (!strcmp(line, "alloc")) {
                site_after_malloc();
                site_realloc_pre();
                for (int i = 1; i < 1000; i++) free(pre[i]);
                memset((char *)moved + 100, 1, 4900);
                say("allocated");
            } else if (!strcmp(line, "more")) {
                site_more();
                say("more done");
            } else if (!strcmp(line, "free")) {
                for (int i = 0; i < 50; i++) free(after[i]);
                say("freed");
#ifdef WITH_JEMALLOC
            } else if (!strcmp(line, "jx")) {
                site_mallocx();
                for (int i = 0; i < 50; i++) sdallocx(after[i], 1000, 0);
                say("jx done");
#endif
            } else if (!strcmp(line, "plugin")) {
                static void (*plugin_alloc)(int);
                if (!plugin_alloc) {
                    void *h = dlopen(getenv("ATTACH_PLUGIN"), RTLD_NOW);
                    if (h) plugin_alloc = (void (*)(int))dlsym(h, "plugin_alloc");
                }
                if (plugin_alloc) plugin_alloc(20);
                say(plugin_alloc ? "plugin done" : "plugin missing");
            } else if (!strcmp(line, "stall")) {
                printf("stall %ld\n", atomic_exchange(&overslept_us, 0));
                fflush(stdout);
            } else if (!strcmp(line, "rate")) {
                long before = atomic_load(&pairs);
                struct timespec one = {1, 0};
                nanosleep(&one, NULL);
                printf("rate %ld\n", atomic_load(&pairs) - before);
                fflush(stdout);
            } else if (!strcmp(line, "fork")) {
                if (pipe(hold) != 0) abort();
                child = fork();
                if (child == 0) {
                    close(hold[1]);
                    site_more();
                    printf("child %d\n", (int)getpid());
                    fflush(stdout);
                    char c;
                    while (read(hold[0], &c, 1) < 0 && errno == EINTR) {}
                    _exit(0);
                }
                close(hold[0]);
            } else if (!strcmp(line, "quit")) {
                atomic_store(&stop, 1);
                if (write(wake[1], "q", 1) != 1) abort();
                return NULL;
            }
            size_t rest = have - (size_t)(nl + 1 - line);
            memmove(line, nl + 1, rest + 1);
            have = rest;
        }
    }
    atomic_store(&stop, 1);
    if (write(wake[1], "q", 1) != 1) abort();
    return NULL;
}

int main(void) {
    pre_attach();
    if (pipe(wake) != 0) return 2;
    int ep = epoll_create1(0);
    struct epoll_event ev = {.events = EPOLLIN, .data.fd = wake[0]};
    epoll_ctl(ep, EPOLL_CTL_ADD, wake[0], &ev);
    pthread_t t[7];
    for (long i = 0; i < 4; i++) pthread_create(&t[i], NULL, churn, (void *)(i + 1));
    pthread_create(&t[4], NULL, sleeper, NULL);
    pthread_create(&t[5], NULL, commands, NULL);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    for (;;) {
        struct epoll_event got;
        int n = epoll_wait(ep, &got, 1, -1);
        if (n < 0 && errno == EINTR) {
            atomic_fetch_add(&eintr, 1);
            continue;
        }
        if (n > 0) break;
    }
    for (int i = 0; i < 6; i++) pthread_join(t[i], NULL);
    if (child > 0) {
        close(hold[1]);
        int st;
        waitpid(child, &st, 0);
    }
    printf("eintr %ld\n", atomic_load(&eintr));
    fflush(stdout);
    return 0;
}
