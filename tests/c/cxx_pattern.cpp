// C++ allocations through operator new / new[] / aligned new, with
// deletes: the trace must start at the function that called `new`.
#include <cstdio>
#include <new>
#include <string>
#include <unistd.h>
#include <vector>

struct alignas(64) Wide { char b[128]; };
static std::vector<void *> *keep;

__attribute__((noinline)) void site_new() {
    for (int i = 0; i < 40; i++) keep->push_back(new char[300]);
}
__attribute__((noinline)) void site_new_object() {
    for (int i = 0; i < 30; i++) keep->push_back(new long(i));
}
__attribute__((noinline)) void site_new_aligned() {
    for (int i = 0; i < 12; i++) keep->push_back(new Wide());
}
__attribute__((noinline)) void site_deleted() {
    for (int i = 0; i < 100; i++) {
        std::string *volatile s = new std::string(100, 'x');
        delete s;
    }
}
__attribute__((noinline)) void site_nothrow() {
    for (int i = 0; i < 5; i++) keep->push_back(new (std::nothrow) char[70]);
}

int main() {
    keep = new std::vector<void *>();
    keep->reserve(1000);
    site_new();
    site_new_object();
    site_new_aligned();
    site_deleted();
    site_nothrow();
    std::printf("ready %d\n", (int)getpid());
    std::fflush(stdout);
    char line[8];
    if (read(0, line, sizeof line) < 0) {}
    return 0;
}
