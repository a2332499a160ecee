/* A service that leaks steadily (issue 22's report): every 10 ms for
 * argv[1] rounds (0: until a line arrives on stdin) it leaks one
 * 1000-byte block at site_leak and allocates and frees 64 KiB at
 * site_temp; 5 blocks of 4 KiB at site_steady are kept from the start.
 * Prints "done PID", then waits for a line on stdin (or EOF). */
#define _GNU_SOURCE
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

void *steady[5];
void **leaked;
void *volatile temp;

__attribute__((noinline)) void site_steady(void) {
    for (int i = 0; i < 5; i++) steady[i] = malloc(4096);
}
__attribute__((noinline)) void *site_leak(void) { return malloc(1000); }
__attribute__((noinline)) void site_temp(void) {
    temp = malloc(64 << 10);
    free(temp);
}

int main(int argc, char **argv) {
    int rounds = argc > 1 ? atoi(argv[1]) : 100;
    int cap = rounds > 0 ? rounds : 100000;
    leaked = calloc((size_t)cap, sizeof *leaked);
    site_steady();
    for (int i = 0; i < cap; i++) {
        if (rounds == 0) {
            struct pollfd p = {.fd = 0, .events = POLLIN};
            if (poll(&p, 1, 0) > 0) {
                char stop[16];
                if (read(0, stop, sizeof stop) < 0) return 1;
                break;
            }
        }
        leaked[i] = site_leak();
        site_temp();
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    printf("done %d\n", (int)getpid());
    fflush(stdout);
    char line[16];
    if (read(0, line, sizeof line) < 0) return 1;
    return 0;
}
