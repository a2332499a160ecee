/* A single-threaded daemon asleep in poll(2) with a timeout, as varnish's
 * manager is: the kernel resumes such a sleep through the thread's restart
 * block, and it is the only thread `heapdump attach` can choose.
 * Commands on stdin: "alloc" -> 10 x malloc(777) at site_poll, "allocated";
 * "spike" -> 64 x malloc(16384) at site_spike, all freed again, "spiked";
 * "quit" -> "eintr N" (polls that returned EINTR), exit 0.
 * With the argument "usr2" it handles SIGUSR2 itself (as postgres does).
 * Prints "ready PID" first. */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void *kept[10];

__attribute__((noinline)) void site_poll(void) {
    for (int i = 0; i < 10; i++) kept[i] = malloc(777);
}

__attribute__((noinline)) void site_spike(void) {
    void *b[64];
    for (int i = 0; i < 64; i++) b[i] = malloc(16384);
    for (int i = 0; i < 64; i++) free(b[i]);
}

static void on_usr2(int sig) { (void)sig; }

int main(int argc, char **argv) {
    long eintr = 0;
    if (argc > 1 && !strcmp(argv[1], "usr2")) signal(SIGUSR2, on_usr2);
    char line[128];
    size_t have = 0;
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    for (;;) {
        struct pollfd p = {.fd = 0, .events = POLLIN};
        int n = poll(&p, 1, 200);
        if (n < 0) {
            if (errno == EINTR) eintr++;
            continue;
        }
        if (n == 0) continue;
        ssize_t r = read(0, line + have, sizeof line - 1 - have);
        if (r <= 0) break;
        have += (size_t)r;
        line[have] = 0;
        char *nl;
        while ((nl = strchr(line, '\n'))) {
            *nl = 0;
            if (!strcmp(line, "alloc")) {
                site_poll();
                printf("allocated\n");
                fflush(stdout);
            } else if (!strcmp(line, "spike")) {
                site_spike();
                printf("spiked\n");
                fflush(stdout);
            } else if (!strcmp(line, "quit")) {
                printf("eintr %ld\n", eintr);
                fflush(stdout);
                return 0;
            }
            size_t rest = have - (size_t)(nl + 1 - line);
            memmove(line, nl + 1, rest + 1);
            have = rest;
        }
    }
    return 0;
}
