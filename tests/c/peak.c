/* The heap at its peak (issue 22): 70 x 1 MiB kept at site_keep, then 250
 * x 1 MiB at site_spike (the peak: ~320 MiB), all freed, then 10 x 100 KiB
 * at site_after (after the peak, at once: most likely in the coarse clock
 * tick the peak was recorded in, which the agent tells apart from before
 * it). Settles at ~71 MiB.
 * Prints "ready PID", then waits for a line on stdin (or EOF) and exits. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void *keep[70], *spike[250], *after[10];

__attribute__((noinline)) void site_keep(void) {
    for (int i = 0; i < 70; i++) keep[i] = malloc(1 << 20);
}
__attribute__((noinline)) void site_spike(void) {
    for (int i = 0; i < 250; i++) spike[i] = malloc(1 << 20);
}
__attribute__((noinline)) void site_after(void) {
    for (int i = 0; i < 10; i++) after[i] = malloc(100 << 10);
}

int main(void) {
    site_keep();
    site_spike();
    for (int i = 0; i < 250; i++) free(spike[i]);
    site_after();
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[16];
    if (read(0, line, sizeof line) < 0) return 1;
    return 0;
}
