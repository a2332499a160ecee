/* One of two libraries heapdump's dlopen/dlclose test loads in turn (built
 * -O2 -fomit-frame-pointer). */
#include <stdlib.h>
__attribute__((noinline)) void *alloc_from_a(size_t size) {
    void *p = malloc(size);
    __asm__ volatile("" ::: "memory");
    return p;
}
