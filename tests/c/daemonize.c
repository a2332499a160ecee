/* A daemon's start: what it builds before it forks, the child holds for
 * its whole life. The parent allocates 40 x 1000 bytes at site_config and
 * 10 x 300 at site_dropped, and forks; the child frees the 10, allocates
 * 5 x 200 at site_child, prints "ready PID" (its own pid) and waits for a
 * line on stdin; the parent prints "parent PID" first, waits for the
 * child and exits with its status. With argv[1] = "thread", the parent
 * starts a thread (which sleeps) before forking. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

void *config[40], *dropped[10], *child_blocks[5];

__attribute__((noinline)) void site_config(void) {
    for (int i = 0; i < 40; i++) config[i] = malloc(1000);
}
__attribute__((noinline)) void site_dropped(void) {
    for (int i = 0; i < 10; i++) dropped[i] = malloc(300);
}
__attribute__((noinline)) void site_child(void) {
    for (int i = 0; i < 5; i++) child_blocks[i] = malloc(200);
}

static void *sleeper(void *arg) {
    (void)arg;
    for (;;) pause();
    return NULL;
}

/* A line without stdio (its buffer would be an allocation). */
static void say(const char *what, int pid) {
    char line[48];
    int n = snprintf(line, sizeof line, "%s %d\n", what, pid);
    if (write(1, line, (size_t)n) < 0) {}
}

int main(int argc, char **argv) {
    if (argc > 1 && strcmp(argv[1], "thread") == 0) {
        pthread_t t;
        if (pthread_create(&t, NULL, sleeper, NULL) != 0) return 2;
    }
    site_config();
    site_dropped();
    say("parent", (int)getpid());
    pid_t c = fork();
    if (c < 0) return 3;
    if (c == 0) {
        for (int i = 0; i < 10; i++) free(dropped[i]);
        site_child();
        say("ready", (int)getpid());
        char line[64];
        if (read(0, line, sizeof line) < 0) {}
        _exit(0);
    }
    int status = 0;
    waitpid(c, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
