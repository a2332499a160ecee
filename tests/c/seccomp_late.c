/* A program that sandboxes itself after start, as a hardened daemon may
 * do: it allocates (the agent starts and records), installs a seccomp
 * filter that kills the process on prctl (which it does not need any
 * more) through prctl(PR_SET_SECCOMP), or with argv[1] = "syscall" through
 * syscall(SYS_seccomp, ...) as libseccomp does, then allocates a million
 * times
 * (the agent looks at a thread's name with prctl every so often) and
 * prints "done", then "ready PID", and waits for stdin to close. */
#define _GNU_SOURCE
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

void *volatile kept;

__attribute__((noinline)) void before_sandbox(void) { kept = malloc(1000); }

int main(int argc, char **argv) {
    int by_syscall = argc > 1 && strcmp(argv[1], "syscall") == 0;
    before_sandbox();
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_prctl, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof filter / sizeof filter[0], .filter = filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        (by_syscall ? syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &prog)
                    : prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) != 0) {
        perror("seccomp");
        return 1;
    }
    for (long i = 0; i < 1000000; i++) {
        void *volatile p = malloc(32 + i % 100);
        free(p);
    }
    printf("done\n");
    printf("ready %d\n", getpid());
    fflush(stdout);
    char line[16];
    while (fgets(line, sizeof line, stdin)) {
    }
    return 0;
}
