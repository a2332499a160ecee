/* The heap at its peak when the blocks freed since the peak come from
 * many distinct stacks (a thread counts them per stack in peak blocks of
 * about a thousand stacks each, at most 8). argv[1] = N stacks (at most
 * 16384): one 4 KiB block from each of N distinct call stacks (a
 * recursion through site_zero/site_one chosen by the bits of the stack's
 * number, 14 levels), all live at once (the peak: N x 4 KiB), all freed,
 * then 4 x 1 KiB at site_after; with "keep" after N, none is freed.
 * Prints "ready PID", waits for a line. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

void *blocks[16384], *after[4];

__attribute__((noinline)) void *site_leaf(void) { return malloc(4 << 10); }
__attribute__((noinline)) void *site_zero(unsigned id, int level);
__attribute__((noinline)) void *site_one(unsigned id, int level);

static void *descend(unsigned id, int level) {
    if (level == 0) return site_leaf();
    return (id & 1) ? site_one(id >> 1, level - 1) : site_zero(id >> 1, level - 1);
}
__attribute__((noinline)) void *site_zero(unsigned id, int level) {
    void *p = descend(id, level);
    __asm__ volatile("" ::: "memory");
    return p;
}
__attribute__((noinline)) void *site_one(unsigned id, int level) {
    void *p = descend(id, level);
    __asm__ volatile("" ::: "memory");
    return p;
}
__attribute__((noinline)) void site_after(void) {
    for (int i = 0; i < 4; i++) after[i] = malloc(1024);
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 100;
    if (n < 1 || n > 16384) return 2;
    for (int i = 0; i < n; i++) blocks[i] = descend((unsigned)i, 14);
    /* "keep" (argv[2]): the blocks stay live (a heap of N stacks). */
    if (argc < 3 || strcmp(argv[2], "keep") != 0)
        for (int i = 0; i < n; i++) free(blocks[i]);
    site_after();
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[16];
    if (read(0, line, sizeof line) < 0) return 1;
    return 0;
}
