/* A heap that goes up and down for a while (issue 22: the curve's ring
 * fills and thins many times): keeps 1 MiB, then argv[1] cycles of 4 MiB
 * allocated, 13 ms, freed, 13 ms (more than the
 * curve's 10 ms between points, on a coarse clock); at a third of the way one 64 MiB spike.
 * Prints "done PID", then waits for a line on stdin (or EOF). */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

void *base;
void *volatile cur;

static void nap(void) {
    struct timespec ts = {0, 13 * 1000 * 1000};
    nanosleep(&ts, NULL);
}

int main(int argc, char **argv) {
    int cycles = argc > 1 ? atoi(argv[1]) : 300;
    base = malloc(1 << 20);
    for (int i = 0; i < cycles; i++) {
        cur = malloc(i == cycles / 3 ? 64 << 20 : 4 << 20);
        nap();
        free(cur);
        nap();
    }
    printf("done %d\n", (int)getpid());
    fflush(stdout);
    char line[16];
    if (read(0, line, sizeof line) < 0) return 1;
    return 0;
}
