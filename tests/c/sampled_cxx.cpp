/* C++ sites for heapdump's sampled-mode test: operator new forwards to
 * libstdc++'s, whose malloc passes through the agent's hook too, so the
 * sampling decision must still be taken once per block. Prints
 * "ready PID" and waits for a line on stdin. */
#include <cstdio>
#include <new>
#include <unistd.h>

static char *volatile kept[100000];

__attribute__((noinline)) void site_new(void) {
    for (int i = 0; i < 100000; i++) kept[i] = new char[512];
}
__attribute__((noinline)) void site_new_churn(void) {
    for (int i = 0; i < 100000; i++) {
        char *volatile p = new char[700];
        delete[] p;
    }
}

int main() {
    site_new();
    site_new_churn();
    std::printf("ready %d\n", (int)getpid());
    std::fflush(stdout);
    char line[64];
    if (read(0, line, sizeof line) < 0) {}
    return 0;
}
