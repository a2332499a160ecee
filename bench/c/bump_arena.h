/* The static bump arena the benchmark shims (forwarder.c, lifetimes.c)
 * serve allocations from while dlsym(RTLD_NEXT) binds the next allocator:
 * never reused, so its blocks are zeroed; free() of one is a no-op. */
#ifndef HEAPDUMP_BENCH_BUMP_ARENA_H
#define HEAPDUMP_BENCH_BUMP_ARENA_H
#include <stddef.h>

static char arena[1 << 16];
static size_t used;

static void *bump(size_t n) {
    if (used + n > sizeof arena) return NULL;
    void *p = arena + used;
    used += (n + 15) & ~(size_t)15;
    return p; /* zeroed: the arena is never reused */
}

static int in_arena(void *p) { return (char *)p >= arena && (char *)p < arena + sizeof arena; }
#endif
