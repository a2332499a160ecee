// C++ allocations through operator new / new[] / aligned new, with
// deletes: the trace must start at the function that called `new`.
#include <cstddef>
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
// A new-handler, then std::bad_alloc, on an allocation malloc refuses:
// the agent's `new` must still run libstdc++'s (the handler is called
// once, then the exception unwinds through the hook), and recording goes
// on afterwards (site_nothrow below is checked).
static int handler_calls;
static void handler() {
    handler_calls++;
    std::set_new_handler(nullptr);
}
__attribute__((noinline)) int site_new_handler() {
    std::set_new_handler(handler);
    volatile std::size_t huge = static_cast<std::size_t>(-1) / 2;
    int caught = 0;
    try {
        keep->push_back(::operator new(huge));
    } catch (const std::bad_alloc &) {
        caught++;
    }
    return caught;
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
    int caught = site_new_handler();
    site_nothrow();
    std::printf("ready %d handler=%d caught=%d\n", (int)getpid(), handler_calls, caught);
    std::fflush(stdout);
    char line[8];
    if (read(0, line, sizeof line) < 0) {}
    return 0;
}
