/* A plugin that attach_target dlopens after `heapdump attach`: its
 * allocations go through its own relocation slots, which the attached
 * agent redirects once it sees the library (within about a second).
 * plugin_alloc(n) keeps n blocks of 1234 bytes from site_plugin. */
#include <stdlib.h>

/* Not static: stores to it are never elided (nor the mallocs). */
void *plugin_kept[10000];
int plugin_used;

__attribute__((noinline)) void site_plugin(int n) {
    for (int i = 0; i < n && plugin_used < 10000; i++) plugin_kept[plugin_used++] = malloc(1234);
}

void plugin_alloc(int n) { site_plugin(n); }
