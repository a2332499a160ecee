/* A daemon's habits (varnishd's manager, any program that daemonizes):
 * it holds blocks, closes every inherited descriptor with close_range (the
 * agent's memfds among them), opens a socket, which takes the lowest free
 * number (the agent's old one), forks, and the child uses the socket.
 *
 * Prints "child socket ok" when the child's getsockopt works on the
 * socket, then "ready PID" and waits for a line on stdin (so a test can
 * snapshot it with its descriptors closed). Exit status 0 when the child
 * saw its socket intact. */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

/* Not static: the compiler must not drop the mallocs. */
void *kept[100];

__attribute__((noinline)) static void keep_blocks(void) {
    for (int i = 0; i < 100; i++) kept[i] = malloc(10000);
}

__attribute__((noinline)) static void *after_close(void) { return malloc(777); }

int main(void) {
    keep_blocks();
    /* stdout is a pipe to the test: keep 0-2, close everything above. */
    if (syscall(SYS_close_range, 3U, ~0U, 0U) != 0) {
        perror("close_range");
        return 1;
    }
    int s = socket(AF_INET, SOCK_STREAM, 0);
    if (s < 0) {
        perror("socket");
        return 1;
    }
    void *volatile late = after_close();
    fflush(stdout);
    pid_t c = fork();
    if (c == 0) {
        int type = 0;
        socklen_t len = sizeof type;
        int r = getsockopt(s, SOL_SOCKET, SO_TYPE, &type, &len);
        void *volatile p = malloc(100);
        free(p);
        if (r != 0 || type != SOCK_STREAM) {
            printf("child socket broken: %s\n", r != 0 ? strerror(errno) : "not a stream socket");
            fflush(stdout);
            _exit(3);
        }
        _exit(0);
    }
    int status = 0;
    if (waitpid(c, &status, 0) != c) {
        perror("waitpid");
        return 1;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) return 2;
    printf("child socket ok\n");
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    if (read(0, line, sizeof line) < 0) {}
    free(late);
    return 0;
}
