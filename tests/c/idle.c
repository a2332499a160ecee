/* A program that allocates one block, prints "ready PID" and waits for a
 * line on stdin: for heapdump's tests of what the agent can and cannot
 * see (built static, or run with an allocator preloaded before the
 * agent). */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(void) {
    void *volatile p = malloc(4096);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    if (read(0, line, sizeof line) < 0) {}
    free(p);
    return 0;
}
