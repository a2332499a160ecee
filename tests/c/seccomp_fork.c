/* A program that sandboxes itself after start, then forks a worker, as
 * a hardened daemon may: it allocates (the agent starts and makes its
 * regions), installs a seccomp filter that kills the process on
 * memfd_create (the first call with which the agent would make a fork
 * child's regions), forks a child that allocates and exits 0, and prints
 * how the child ended ("child exited 0", or "child killed by signal N"),
 * then "ready PID" and waits for stdin to close. */
#define _GNU_SOURCE
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

void *volatile kept;

int main(void) {
    kept = malloc(1000);
    struct sock_filter filter[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, SYS_memfd_create, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof filter / sizeof filter[0], .filter = filter};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
        prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) != 0) {
        perror("seccomp");
        return 1;
    }
    pid_t c = fork();
    if (c == 0) {
        void *volatile p = malloc(2000);
        free(p);
        _exit(0);
    }
    int st = 0;
    waitpid(c, &st, 0);
    if (WIFSIGNALED(st))
        printf("child killed by signal %d\n", WTERMSIG(st));
    else
        printf("child exited %d\n", WEXITSTATUS(st));
    printf("ready %d\n", getpid());
    fflush(stdout);
    char line[16];
    while (fgets(line, sizeof line, stdin)) {
    }
    return 0;
}
