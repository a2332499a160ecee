/* A process whose only thread lives on a 16 KiB alternate signal stack
 * (a coroutine-like stack, far below the 128 KiB the injector needs for
 * its calls): every round of heapdump attach refuses it, so the attach
 * gives up after its 40 rounds, having changed nothing. The thread waits
 * in read(2) inside the handler; each line "ping" is answered "pong",
 * "quit" ends it. Prints "ready PID" first. */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char alt[16384];

static void on_usr1(int sig) {
    (void)sig;
    char line[64];
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    for (;;) {
        ssize_t n = read(0, line, sizeof line - 1);
        if (n <= 0 || !strncmp(line, "quit", 4)) _exit(0);
        if (!strncmp(line, "ping", 4)) {
            write(1, "pong\n", 5);
        }
    }
}

int main(void) {
    stack_t ss = {.ss_sp = alt, .ss_size = sizeof alt, .ss_flags = 0};
    if (sigaltstack(&ss, NULL) != 0) return 1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_usr1;
    sa.sa_flags = SA_ONSTACK;
    sigaction(SIGUSR1, &sa, NULL);
    raise(SIGUSR1);
    return 1;
}
