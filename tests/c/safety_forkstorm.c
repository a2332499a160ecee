/* Fork storm under the preload agent while two threads allocate: 200
 * children in waves of 50 (the parent does not wait between forks); each
 * child allocates and frees, then a quarter exec /bin/true (still under
 * LD_PRELOAD), a quarter exit() (atexit handlers run), the rest _exit().
 * A child that deadlocks in malloc (a lock held by a parent thread at fork
 * time) hangs the parent's waitpid: the test's hang guard catches that.
 * The parent keeps 100 blocks of 333 bytes from site_keep, then prints
 * "ready PID failed=N" and waits for stdin. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static atomic_int stop;

static void *churn(void *arg) {
    unsigned i = (unsigned)(size_t)arg;
    void *ring[64] = {0};
    while (!atomic_load(&stop)) {
        unsigned s = i % 64;
        free(ring[s]);
        ring[s] = malloc(16 + (i * 37) % 2000);
        i++;
    }
    for (int s = 0; s < 64; s++) free(ring[s]);
    return NULL;
}

__attribute__((noinline)) static void *site_keep(size_t n) { return malloc(n); }

__attribute__((noinline)) static void child_work(int i) {
    void *p[50];
    for (int k = 0; k < 50; k++) p[k] = malloc(32 + k * 8);
    for (int k = 0; k < 50; k += 2) free(p[k]);
    char *s = strdup("child");
    free(s);
    switch (i % 4) {
    case 0:
        execl("/bin/true", "true", (char *)NULL);
        _exit(127);
    case 1:
        exit(0);
    default:
        _exit(0);
    }
}

int main(void) {
    pthread_t t[2];
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, churn, (void *)(size_t)(i * 1000));
    void *keep[100];
    for (int i = 0; i < 100; i++) keep[i] = site_keep(333);
    int failed = 0;
    for (int wave = 0; wave < 4; wave++) {
        pid_t kids[50];
        for (int j = 0; j < 50; j++) {
            kids[j] = fork();
            if (kids[j] == 0) child_work(wave * 50 + j);
            if (kids[j] < 0) failed++;
        }
        for (int j = 0; j < 50; j++) {
            int st;
            if (kids[j] <= 0) continue;
            if (waitpid(kids[j], &st, 0) < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) failed++;
        }
    }
    atomic_store(&stop, 1);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    printf("ready %d failed=%d\n", (int)getpid(), failed);
    fflush(stdout);
    char line[64];
    (void)!read(0, line, sizeof line);
    for (int i = 0; i < 100; i++) free(keep[i]);
    return 0;
}
