/* Built with split DWARF (-gsplit-dwarf) and packed into PROG.dwp by
 * dumper/tests/split_dwarf.rs: site_split's 40 blocks of 700-701 bytes
 * come through inlined_helper, an inlined function only the package's
 * debug information knows. Prints "ready PID", waits for a line. */
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
void *held[40];
static inline __attribute__((always_inline)) void *inlined_helper(int i) { return malloc(700 + (i & 1)); }
__attribute__((noinline)) void site_split(void) { for (int i = 0; i < 40; i++) held[i] = inlined_helper(i); }
int main(void) { site_split(); printf("ready %d\n", (int)getpid()); fflush(stdout); char l[8]; return read(0, l, 8) < 0; }
