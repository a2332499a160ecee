/* The other library of heapdump's dlopen/dlclose test (built -O2
 * -fomit-frame-pointer). */
#include <stdlib.h>
__attribute__((noinline)) void *alloc_from_b(size_t size) {
    void *p = malloc(size);
    __asm__ volatile("" ::: "memory");
    return p;
}
