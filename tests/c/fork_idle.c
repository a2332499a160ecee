/* A parent that forks a child which allocates nothing (a postgres
 * checkpointer waiting for work; one that allocates nothing at all since
 * the fork): the child prints "ready PID" and waits
 * for a line on stdin; the parent waits for the child and exits with its
 * status. The parent holds one 64-byte block at the fork; with argv[1] =
 * "thread" it runs a second thread (which sleeps) too. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void *sleeper(void *arg) {
    (void)arg;
    for (;;) pause();
    return NULL;
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "thread") == 0) {
        pthread_t t;
        if (pthread_create(&t, NULL, sleeper, NULL) != 0) return 2;
    }
    void *volatile p = malloc(64);
    fflush(stdout);
    pid_t c = fork();
    if (c == 0) {
        /* Not printf: its stdout buffer would be the child's first
         * allocation (the parent printed nothing). */
        char ready[32];
        int n = snprintf(ready, sizeof ready, "ready %d\n", (int)getpid());
        if (write(1, ready, (size_t)n) < 0) {}
        char line[64];
        if (read(0, line, sizeof line) < 0) {}
        _exit(0);
    }
    int status = 0;
    waitpid(c, &status, 0);
    free(p);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
