/* Snapshot requests from C: by the configured signal and through the API
 * (heapdump_request_snapshot, declared weak so the program also runs
 * without the agent). With argument "own", the program installs its own
 * handler for SIGUSR1 (the test sets HEAPDUMP_SIGNAL=SIGUSR1): the agent's
 * handler must not be what runs, and the program must survive. Protocol:
 * prints "ready", then for each stdin line: "raise" -> raise(sig) and print
 * "raised N" (N = own handler hits), "api NAME" -> request and print
 * "requested". */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

extern void heapdump_request_snapshot(const char *name) __attribute__((weak));

static volatile sig_atomic_t own_hits;
static void own_handler(int sig) { (void)sig; own_hits++; }

int main(int argc, char **argv) {
    int own = argc > 1 && strcmp(argv[1], "own") == 0;
    int sig = own ? SIGUSR1 : SIGUSR2;
    if (own) signal(SIGUSR1, own_handler);
    void *volatile keep = malloc(10);
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[128];
    for (;;) {
        ssize_t n = read(0, line, sizeof line - 1);
        if (n <= 0) break;
        line[n] = 0;
        line[strcspn(line, "\n")] = 0;
        if (strcmp(line, "raise") == 0) {
            raise(sig);
            printf("raised %d\n", (int)own_hits);
        } else if (strncmp(line, "api ", 4) == 0) {
            if (heapdump_request_snapshot) heapdump_request_snapshot(line + 4);
            printf("requested\n");
        }
        fflush(stdout);
    }
    free(keep);
    return 0;
}
