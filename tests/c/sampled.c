/* Known sites for heapdump's sampled-mode test: many small blocks, many
 * medium ones, a few huge ones, and churn that is all freed. Prints
 * "ready PID" and waits for a line on stdin. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

/* volatile: the compiler must not drop allocations nobody reads */
static void *volatile small[200000], *volatile medium[2000], *volatile huge[5];

__attribute__((noinline)) void site_small(void) {
    for (int i = 0; i < 200000; i++) small[i] = malloc(64);
}
__attribute__((noinline)) void site_medium(void) {
    for (int i = 0; i < 2000; i++) medium[i] = malloc(8192);
}
__attribute__((noinline)) void site_huge(void) {
    for (int i = 0; i < 5; i++) huge[i] = malloc(4 << 20);
}
__attribute__((noinline)) void site_churn(void) {
    for (int i = 0; i < 100000; i++) {
        void *volatile p = malloc(1000);
        free(p);
    }
}

int main(void) {
    site_small();
    site_churn();
    site_medium();
    site_huge();
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    if (read(0, line, sizeof line) < 0) {}
    return 0;
}
