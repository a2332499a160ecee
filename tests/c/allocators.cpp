/* Every allocation entry point the preload agent exports, for heapdump's
 * tests of wrapping the program's own allocator.
 *
 * Each site_* function makes N blocks of a known size through one entry
 * point and keeps them; each freed_* function makes N blocks and frees them
 * through one release entry point (free, free_sized, every operator delete
 * variant, jemalloc's dallocx / sdallocx), so none of them may be live.
 * Built plain (glibc), with -DUSE_JEMALLOC -ljemalloc (adds jemalloc's
 * *allocx calls), with -DUSE_TCMALLOC -ltcmalloc, or run with mimalloc
 * preloaded after the agent. Then it checks that every kept block belongs
 * to that allocator (sallocx, MallocExtension_GetOwnership,
 * mi_is_in_heap_region, malloc_usable_size), prints "owner NAME ok COUNT"
 * and "ready", and waits for a line on stdin.
 */
#include <dlfcn.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <new>

#ifdef USE_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif
#ifdef USE_TCMALLOC
#include <gperftools/malloc_extension_c.h>
#endif

#define N 8
#define SITE extern "C" __attribute__((noinline))

/* Hides a block from the compiler, so no new/delete or malloc/free pair
 * is optimised away. */
__attribute__((noinline)) static void *opaque(void *p) {
    __asm__ volatile("" : : "r"(p) : "memory");
    return p;
}

static void *keep[512];
static size_t keep_size[512];
static int nkeep;
static void hold(void *p, size_t size) {
    if (!p) { fprintf(stderr, "allocation of %zu failed\n", size); exit(3); }
    keep[nkeep] = p;
    keep_size[nkeep++] = size;
}

SITE void site_malloc(void) { for (int i = 0; i < N; i++) hold(malloc(100), 100); }
SITE void site_calloc(void) { for (int i = 0; i < N; i++) hold(calloc(4, 25), 100); }
SITE void site_realloc(void) {
    for (int i = 0; i < N; i++) hold(realloc(malloc(10), 300), 300);
}
/* Blocks realloc'ed by the sites below, made elsewhere (outside every
 * site_ function): once resized, a block's stack must be the realloc's
 * (jemalloc resizes the first ones in place, and the agent keeps their
 * records; the last moves). */
static void *made[3][N];
__attribute__((noinline)) static void make_blocks_to_resize(void) {
    for (int i = 0; i < N; i++) {
        made[0][i] = opaque(malloc(100));
        made[1][i] = opaque(malloc(100));
        made[2][i] = opaque(malloc(3000));
    }
}
/* Within jemalloc's size class of 112 bytes, twice. */
SITE void site_realloc_same_class(void) {
    for (int i = 0; i < N; i++) {
        void *p = realloc(made[0][i], 104);
        hold(realloc(p, 110), 110);
    }
}
/* Past what a small block can grow in place. */
SITE void site_realloc_grown(void) {
    for (int i = 0; i < N; i++) hold(realloc(made[1][i], 5000), 5000);
}
/* Into a smaller size class: jemalloc moves the block. */
SITE void site_realloc_shrunk(void) {
    for (int i = 0; i < N; i++) hold(realloc(made[2][i], 40), 40);
}
/* jemalloc 5.3 has no reallocarray or pvalloc: in a program linked with
 * it these names resolve to glibc's, with or without the agent, and glibc
 * cannot resize or own jemalloc's blocks. Those sites are left out there. */
SITE void site_reallocarray(void) {
    for (int i = 0; i < N; i++) hold(reallocarray(NULL, 3, 100), 300);
}
SITE void site_memalign(void) { for (int i = 0; i < N; i++) hold(memalign(64, 100), 100); }
SITE void site_posix_memalign(void) {
    for (int i = 0; i < N; i++) {
        void *p = NULL;
        if (posix_memalign(&p, 64, 100) != 0) p = NULL;
        hold(p, 100);
    }
}
SITE void site_aligned_alloc(void) {
    for (int i = 0; i < N; i++) hold(aligned_alloc(64, 128), 128);
}
SITE void site_valloc(void) { for (int i = 0; i < N; i++) hold(valloc(100), 100); }
/* Recorded as whole pages (what pvalloc gives). */
SITE void site_pvalloc(void) { for (int i = 0; i < N; i++) hold(pvalloc(100), 4096); }
SITE void site_new(void) { for (int i = 0; i < N; i++) hold(::operator new(100), 100); }
SITE void site_new_array(void) { for (int i = 0; i < N; i++) hold(::operator new[](100), 100); }
SITE void site_new_aligned(void) {
    for (int i = 0; i < N; i++) hold(::operator new(100, std::align_val_t(64)), 100);
}
SITE void site_new_array_aligned(void) {
    for (int i = 0; i < N; i++) hold(::operator new[](100, std::align_val_t(64)), 100);
}
SITE void site_new_nothrow(void) {
    for (int i = 0; i < N; i++) hold(::operator new(100, std::nothrow), 100);
}
SITE void site_new_array_nothrow(void) {
    for (int i = 0; i < N; i++) hold(::operator new[](100, std::nothrow), 100);
}
SITE void site_new_aligned_nothrow(void) {
    for (int i = 0; i < N; i++)
        hold(::operator new(100, std::align_val_t(64), std::nothrow), 100);
}
SITE void site_new_array_aligned_nothrow(void) {
    for (int i = 0; i < N; i++)
        hold(::operator new[](100, std::align_val_t(64), std::nothrow), 100);
}
#ifdef USE_JEMALLOC
SITE void site_mallocx(void) { for (int i = 0; i < N; i++) hold(mallocx(100, 0), 100); }
SITE void site_rallocx(void) {
    for (int i = 0; i < N; i++) hold(rallocx(mallocx(10, 0), 300, 0), 300);
}
SITE void site_xallocx(void) {
    for (int i = 0; i < N; i++) {
        void *p = mallocx(100, 0);
        if (xallocx(p, 100, 0, 0) < 100) p = NULL;
        hold(p, 100);
    }
}
#endif

/* C23's free_sized / free_aligned_sized: glibc 2.36 has neither, so they
 * are looked up (the agent exports both; without it, plain free). */
typedef void (*free_sized_fn)(void *, size_t);
typedef void (*free_aligned_sized_fn)(void *, size_t, size_t);

SITE void freed_free(void) { for (int i = 0; i < N; i++) free(opaque(malloc(200))); }
SITE void freed_free_sized(void) {
    free_sized_fn f = (free_sized_fn)dlsym(RTLD_DEFAULT, "free_sized");
    for (int i = 0; i < N; i++) {
        void *p = opaque(malloc(200));
        if (f) f(p, 200); else free(p);
    }
}
SITE void freed_free_aligned_sized(void) {
    free_aligned_sized_fn f =
        (free_aligned_sized_fn)dlsym(RTLD_DEFAULT, "free_aligned_sized");
    for (int i = 0; i < N; i++) {
        void *p = opaque(aligned_alloc(64, 192));
        if (f) f(p, 64, 192); else free(p);
    }
}
SITE void freed_delete(void) {
    for (int i = 0; i < N; i++) ::operator delete(opaque(::operator new(200)));
}
SITE void freed_delete_array(void) {
    for (int i = 0; i < N; i++) ::operator delete[](opaque(::operator new[](200)));
}
SITE void freed_delete_sized(void) {
    for (int i = 0; i < N; i++) ::operator delete(opaque(::operator new(200)), 200);
}
SITE void freed_delete_array_sized(void) {
    for (int i = 0; i < N; i++) ::operator delete[](opaque(::operator new[](200)), 200);
}
SITE void freed_delete_aligned(void) {
    std::align_val_t a = std::align_val_t(64);
    for (int i = 0; i < N; i++) ::operator delete(opaque(::operator new(200, a)), a);
}
SITE void freed_delete_array_aligned(void) {
    std::align_val_t a = std::align_val_t(64);
    for (int i = 0; i < N; i++) ::operator delete[](opaque(::operator new[](200, a)), a);
}
SITE void freed_delete_sized_aligned(void) {
    std::align_val_t a = std::align_val_t(64);
    for (int i = 0; i < N; i++) ::operator delete(opaque(::operator new(200, a)), 200, a);
}
SITE void freed_delete_array_sized_aligned(void) {
    std::align_val_t a = std::align_val_t(64);
    for (int i = 0; i < N; i++) ::operator delete[](opaque(::operator new[](200, a)), 200, a);
}
SITE void freed_delete_nothrow(void) {
    for (int i = 0; i < N; i++) ::operator delete(opaque(::operator new(200, std::nothrow)), std::nothrow);
}
SITE void freed_delete_array_nothrow(void) {
    for (int i = 0; i < N; i++)
        ::operator delete[](opaque(::operator new[](200, std::nothrow)), std::nothrow);
}
SITE void freed_delete_aligned_nothrow(void) {
    std::align_val_t a = std::align_val_t(64);
    for (int i = 0; i < N; i++)
        ::operator delete(opaque(::operator new(200, a, std::nothrow)), a, std::nothrow);
}
SITE void freed_delete_array_aligned_nothrow(void) {
    std::align_val_t a = std::align_val_t(64);
    for (int i = 0; i < N; i++)
        ::operator delete[](opaque(::operator new[](200, a, std::nothrow)), a, std::nothrow);
}
#ifdef USE_JEMALLOC
SITE void freed_dallocx(void) { for (int i = 0; i < N; i++) dallocx(opaque(mallocx(200, 0)), 0); }
SITE void freed_sdallocx(void) { for (int i = 0; i < N; i++) sdallocx(opaque(mallocx(200, 0)), 200, 0); }
#endif

/* Every kept block must belong to the allocator this build names. */
static const char *check_owner(void) {
    typedef bool (*mi_owned_fn)(const void *);
    mi_owned_fn mi_owned = (mi_owned_fn)dlsym(RTLD_DEFAULT, "mi_is_in_heap_region");
    const char *name = "glibc";
#if defined(USE_JEMALLOC)
    name = "jemalloc";
#elif defined(USE_TCMALLOC)
    name = "tcmalloc";
#else
    if (mi_owned) name = "mimalloc";
#endif
    for (int i = 0; i < nkeep; i++) {
        void *p = keep[i];
        int ok = malloc_usable_size(p) >= keep_size[i];
#if defined(USE_JEMALLOC)
        ok = ok && sallocx(p, 0) >= keep_size[i];
#elif defined(USE_TCMALLOC)
        ok = ok && MallocExtension_GetOwnership(p) == MallocExtension_kOwned;
#else
        if (mi_owned) ok = ok && mi_owned(p);
#endif
        if (!ok) {
            fprintf(stderr, "block %d (%p, %zu bytes) is not %s's\n", i, p, keep_size[i], name);
            exit(5);
        }
    }
    return name;
}

int main(void) {
    site_malloc();
    site_calloc();
    site_realloc();
    make_blocks_to_resize();
    site_realloc_same_class();
    site_realloc_grown();
    site_realloc_shrunk();
#ifndef USE_JEMALLOC
    site_reallocarray();
#endif
    site_memalign();
    site_posix_memalign();
    site_aligned_alloc();
    site_valloc();
#ifndef USE_JEMALLOC
    site_pvalloc();
#endif
    site_new();
    site_new_array();
    site_new_aligned();
    site_new_array_aligned();
    site_new_nothrow();
    site_new_array_nothrow();
    site_new_aligned_nothrow();
    site_new_array_aligned_nothrow();
#ifdef USE_JEMALLOC
    site_mallocx();
    site_rallocx();
    site_xallocx();
    freed_dallocx();
    freed_sdallocx();
#endif
    freed_free();
    freed_free_sized();
    freed_free_aligned_sized();
    freed_delete();
    freed_delete_array();
    freed_delete_sized();
    freed_delete_array_sized();
    freed_delete_aligned();
    freed_delete_array_aligned();
    freed_delete_sized_aligned();
    freed_delete_array_sized_aligned();
    freed_delete_nothrow();
    freed_delete_array_nothrow();
    freed_delete_aligned_nothrow();
    freed_delete_array_aligned_nothrow();
    const char *owner = check_owner();
    printf("owner %s ok %d\n", owner, nkeep);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[64];
    if (read(0, line, sizeof line) < 0) {}
    return 0;
}
