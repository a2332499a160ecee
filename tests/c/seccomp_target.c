/* A process under a seccomp filter, for `heapdump attach`: the filter
 * denies memfd_create, with EPERM (argv[1] = "eperm") or by killing the
 * process (argv[1] = "kill"), as a hardened service's may (systemd's
 * SystemCallFilter= kills by default). A thread mallocs and frees in a
 * loop; the main thread answers commands on stdin:
 *   alive -> "alive"
 *   quit  -> exits 0.
 * Prints "ready PID" once the filter is in place. */
#define _GNU_SOURCE
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

static void *churn(void *arg) {
    (void)arg;
    for (unsigned long i = 0;; i++) {
        void *volatile p = malloc(100 + i % 50);
        free(p);
        if (i % 100000 == 0)
            usleep(1000);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int kill = argc > 1 && strcmp(argv[1], "kill") == 0;
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_memfd_create, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, kill ? SECCOMP_RET_KILL_PROCESS : (SECCOMP_RET_ERRNO | 1)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof filter / sizeof filter[0], .filter = filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        perror("seccomp");
        return 1;
    }
    pthread_t t;
    pthread_create(&t, NULL, churn, NULL);
    printf("ready %d\n", getpid());
    fflush(stdout);
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        if (strncmp(line, "alive", 5) == 0) {
            printf("alive\n");
            fflush(stdout);
        } else if (strncmp(line, "quit", 4) == 0) {
            return 0;
        }
    }
    return 0;
}
