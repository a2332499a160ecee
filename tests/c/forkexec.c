/* fork and fork+exec: the child must never write into its parent's regions,
 * gets regions of its own, and an exec'd image inherits none of them.
 * Output: "child-fds ..." (the fd list of an exec'd program started without
 * LD_PRELOAD), then "ready PARENT CHILD"; waits for stdin EOF. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

void *keep[100]; /* external: the stores (and mallocs) cannot be elided */

__attribute__((noinline)) void site_parent(void) {
    for (int i = 0; i < 40; i++) keep[i] = malloc(111);
}
__attribute__((noinline)) void site_child(void) {
    for (int i = 40; i < 65; i++) keep[i] = malloc(222);
}
__attribute__((noinline)) void site_parent_after(void) {
    for (int i = 65; i < 75; i++) keep[i] = malloc(333);
}

static void wait_eof(void) {
    char buf[64];
    while (read(0, buf, sizeof buf) > 0) {}
}

int main(void) {
    site_parent();
    /* fork + exec of a program without the agent: it must see no region. */
    int out[2];
    if (pipe(out) != 0) return 2;
    pid_t e = fork();
    if (e == 0) {
        dup2(out[1], 1);
        char *envp[] = {"PATH=/usr/bin:/bin", NULL};
        execle("/bin/sh", "sh", "-c", "ls -l /proc/self/fd/ | tr '\\n' ' '", (char *)NULL, envp);
        _exit(127);
    }
    close(out[1]);
    char fds[4096];
    ssize_t n = 0, r;
    while ((r = read(out[0], fds + n, sizeof fds - 1 - n)) > 0) n += r;
    fds[n > 0 ? n : 0] = 0;
    waitpid(e, NULL, 0);
    printf("child-fds %s\n", fds);
    fflush(stdout);

    int p[2];
    if (pipe(p) != 0) return 2;
    pid_t c = fork();
    if (c == 0) {
        site_child();
        char msg[32];
        int len = snprintf(msg, sizeof msg, "%d\n", (int)getpid());
        if (write(p[1], msg, len) < 0) {}
        wait_eof();
        _exit(0);
    }
    char buf[32] = {0};
    if (read(p[0], buf, sizeof buf - 1) < 0) return 2;
    site_parent_after();
    printf("ready %d %d\n", (int)getpid(), atoi(buf));
    fflush(stdout);
    wait_eof();
    waitpid(c, NULL, 0);
    return 0;
}
