/* heapdump.h: the C interface of heapdump's preload agent
 * (libheapdump_preload.so), for C and C++ programs.
 *
 * Both functions are declared weak: a program built with this header also
 * runs without the preload library, and then they are NULL. Check before
 * calling:
 *
 *     #include "heapdump.h"
 *     if (heapdump_request_snapshot) heapdump_request_snapshot("after-warmup");
 *
 *     struct heapdump_stats s;
 *     if (heapdump_stats && heapdump_stats(&s, sizeof s) == 0)
 *         assert(s.live_bytes < 64 << 20);
 *
 * Both may be called from any thread; heapdump_stats() never allocates
 * (a test checks that reading the numbers does not move them). */
#ifndef HEAPDUMP_H
#define HEAPDUMP_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Process-wide heap numbers as the agent records them (the same counters a
 * snapshot reports). Fields are only ever added at the end; pass
 * sizeof(struct heapdump_stats) so that an older program gets the fields it
 * knows. */
struct heapdump_stats {
    uint64_t live_bytes;      /* bytes in live recorded blocks */
    uint64_t live_blocks;     /* live recorded blocks */
    uint64_t peak_live_bytes; /* highest live_bytes (within 64 KiB per thread) */
    uint64_t total_allocs;    /* allocations recorded since start */
    uint64_t total_bytes;     /* bytes allocated since start */
    uint64_t dropped;         /* events not recorded, all reasons */
    uint32_t enabled;         /* 1 while the agent records, else 0 */
    uint32_t reserved;        /* 0 */
};

/* Asks a watching `heapdump watch` for a snapshot named NAME (may be
 * NULL). */
void heapdump_request_snapshot(const char *name) __attribute__((weak));

/* Writes the first SIZE bytes of the current numbers to OUT. Returns 0
 * when the agent records, 1 when it does not (disabled, not started yet, or
 * its regions could not be made: every number is 0), -1 when OUT is NULL. */
int heapdump_stats(struct heapdump_stats *out, size_t size) __attribute__((weak));

#ifdef __cplusplus
}
#endif

#endif /* HEAPDUMP_H */
