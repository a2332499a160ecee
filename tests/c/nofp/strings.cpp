// heapdump's C++ no-frame-pointer test (built -O2 -fomit-frame-pointer):
// build_things grows a std::vector and builds a std::string whose buffers
// are allocated inside libstdc++ (no frame pointers either). Prints
// "ready PID" and waits for a line on stdin.
#include <cstdio>
#include <string>
#include <unistd.h>
#include <vector>

std::vector<long> *numbers;
std::string *text;

__attribute__((noinline)) void build_things() {
    numbers = new std::vector<long>();
    for (long i = 0; i < 5000; i++) numbers->push_back(i);
    text = new std::string(3000, 'x');
    text->append(std::string(5000, 'y'));
    __asm__ volatile("" ::: "memory");
}

int main() {
    build_things();
    std::printf("ready %d\n", (int)getpid());
    std::fflush(stdout);
    char line[64];
    if (read(0, line, sizeof line) < 0) {}
    return 0;
}
