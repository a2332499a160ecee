/* The shared library half of heapdump's no-frame-pointer chain test
 * (built -O2 -fomit-frame-pointer): lib_enter -> lib_mid -> lib_leaf,
 * which allocates. */
#include <stdlib.h>

void hold_block(void *p);

__attribute__((noinline)) void lib_leaf(int n, size_t size) {
    for (int i = 0; i < n; i++) hold_block(malloc(size));
}
__attribute__((noinline)) void lib_mid(int n, size_t size) {
    lib_leaf(n, size);
    __asm__ volatile("" ::: "memory");
}
__attribute__((noinline)) void lib_enter(int n, size_t size) {
    lib_mid(n, size);
    __asm__ volatile("" ::: "memory");
}
