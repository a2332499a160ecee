/* A heap that never settles: 300 000 blocks of 16 bytes kept (a snapshot
 * takes a while to walk them), then a buffer of 1 MiB allocated and freed
 * every 2 ms for as long as the program runs, so the memory curve gains a
 * point every 10 ms and its ring thins again and again, also while a
 * snapshot is being taken. Prints "ready PID" once 1 000 cycles have run
 * (2 s: the ring has thinned), then goes on until stdin closes. */
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define KEPT 300000

void *kept[KEPT]; /* not static: kept, not optimized away */

int main(void) {
    for (int i = 0; i < KEPT; i++)
        kept[i] = malloc(16);
    struct timespec nap = {0, 2 * 1000 * 1000};
    for (long cycle = 0;; cycle++) {
        char *volatile buffer = malloc(1 << 20);
        buffer[0] = 1;
        free(buffer);
        nanosleep(&nap, NULL);
        if (cycle == 1000) {
            printf("ready %d\n", getpid());
            fflush(stdout);
        }
        struct pollfd in = {0, POLLIN, 0};
        if (cycle > 1000 && poll(&in, 1, 0) > 0) {
            char line[16];
            if (read(0, line, sizeof line) <= 0)
                return 0;
        }
    }
}
