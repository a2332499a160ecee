/* A do-nothing LD_PRELOAD forwarder: malloc, free, calloc, realloc and
 * malloc_usable_size, each forwarded to the next definition
 * (dlsym(RTLD_NEXT)), with a static bump arena while binding. The floor
 * of any forwarding agent's cost, for bench/redis-instructions. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>

static void *(*next_malloc)(size_t);
static void (*next_free)(void *);
static void *(*next_calloc)(size_t, size_t);
static void *(*next_realloc)(void *, size_t);
static size_t (*next_usable)(void *);

#include "bump_arena.h"

__attribute__((constructor)) static void bind(void) {
    next_malloc = dlsym(RTLD_NEXT, "malloc");
    next_free = dlsym(RTLD_NEXT, "free");
    next_calloc = dlsym(RTLD_NEXT, "calloc");
    next_realloc = dlsym(RTLD_NEXT, "realloc");
    next_usable = dlsym(RTLD_NEXT, "malloc_usable_size");
}

void *malloc(size_t n) { return next_malloc ? next_malloc(n) : bump(n); }
void free(void *p) { if (!in_arena(p) && next_free) next_free(p); }
void *calloc(size_t a, size_t b) { return next_calloc ? next_calloc(a, b) : bump(a * b); }
void *realloc(void *p, size_t n) { return next_realloc(p, n); }
size_t malloc_usable_size(void *p) { return next_usable(p); }
