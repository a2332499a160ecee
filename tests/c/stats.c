/* The C interface of the preload agent (agent/preload/include/heapdump.h):
 * heap numbers around 10 blocks of 1000 bytes allocated then freed, printed
 * as differences; without the preload library the weak symbols are NULL
 * and it prints "no agent". */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "heapdump.h"

int main(void) {
    /* stdout's buffer is allocated by this first line, before any reading. */
    printf("start\n");
    fflush(stdout);
    if (!heapdump_stats || !heapdump_request_snapshot) {
        printf("no agent\n");
        return 0;
    }
    struct heapdump_stats a, b, c;
    int ra = heapdump_stats(&a, sizeof a);
    void *p[10];
    for (int i = 0; i < 10; i++) p[i] = malloc(1000);
    heapdump_stats(&b, sizeof b);
    for (int i = 0; i < 10; i++) free(p[i]);
    heapdump_stats(&c, sizeof c);
    printf("returned %d enabled %u dropped %llu\n", ra, b.enabled,
           (unsigned long long)b.dropped);
    printf("grew %llu bytes %llu blocks\n", (unsigned long long)(b.live_bytes - a.live_bytes),
           (unsigned long long)(b.live_blocks - a.live_blocks));
    printf("shrank %llu bytes %llu blocks\n", (unsigned long long)(b.live_bytes - c.live_bytes),
           (unsigned long long)(b.live_blocks - c.live_blocks));
    printf("allocated %llu bytes %llu blocks\n",
           (unsigned long long)(c.total_bytes - a.total_bytes),
           (unsigned long long)(c.total_allocs - a.total_allocs));
    printf("peak covers live %d\n", b.peak_live_bytes >= b.live_bytes);
    /* An older caller's shorter struct: only its part is written. */
    unsigned long long two[2];
    memset(two, 0xff, sizeof two);
    heapdump_stats((struct heapdump_stats *)two, 8);
    printf("short %d\n", two[0] == c.live_bytes && two[1] == ~0ull);
    printf("null %d\n", heapdump_stats(NULL, sizeof a));
    return 0;
}
