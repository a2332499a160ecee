/* A binary whose allocating function is static and, once stripped, has
 * no symbol: only exported_small (a few bytes, exported with -rdynamic)
 * comes before it. A symbolizer that names an address after the nearest
 * symbol before it calls hidden_site "exported_small"; heapdump must show
 * it as stripped_static+0xOFFSET. Prints "ready PID" and waits for a line
 * on stdin. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

void *volatile held[10];

__attribute__((noinline)) int exported_small(int x) { return x + 1; }

__attribute__((noinline)) static void hidden_site(void) {
    for (int i = 0; i < 10; i++) held[i] = malloc(4321);
}

int main(void) {
    hidden_site();
    printf("ready %d %d\n", (int)getpid(), exported_small(1));
    fflush(stdout);
    char line[64];
    if (read(0, line, sizeof line) < 0) {}
    return 0;
}
