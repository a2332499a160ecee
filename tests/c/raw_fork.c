/* A child made without the atfork handlers (the raw clone system call
 * with SIGCHLD, a fork: as container runtimes, some spawners and glibc's
 * _Fork make them) must
 * never write into its parent's regions (agent/src/fork_guard.rs), and is
 * recorded in its own. The parent churns young blocks at site_churn and
 * keeps KEPT blocks of 40 bytes at site_parent; the child, made by the
 * raw clone system call, frees every one of the parent's blocks (it
 * inherited them; never recorded in the child), keeps CHILD blocks of 24
 * bytes at site_child, churns too, prints "child PID" and waits for a
 * line on stdin, then exits. Expected: the child's snapshot holds its
 * CHILD blocks and nothing at site_parent; the parent's, printed "ready
 * PID" once the child has exited, its KEPT blocks and nothing at
 * site_child. The parent then waits for a line, frees its blocks and
 * prints "done". */
#define _GNU_SOURCE
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define KEPT 3000
#define CHILD 5000
#define CHURN 20000

static void *kept[KEPT];
static void *child_blocks[CHILD];

__attribute__((noinline)) void *site_parent(void) { return malloc(40); }
__attribute__((noinline)) void *site_child(void) { return malloc(24); }
__attribute__((noinline)) void *site_churn(int i) { return malloc(16 + i % 200); }

static void wait_line(void) {
    char line[8];
    if (read(0, line, sizeof line) < 0) {}
}

int main(void) {
    /* The parent's young ring and caches hold entries when it forks. */
    for (int i = 0; i < CHURN; i++) free(site_churn(i));
    for (int i = 0; i < KEPT; i++) kept[i] = site_parent();
    pid_t pid = (pid_t)syscall(SYS_clone, SIGCHLD, 0, 0, 0, 0);
    if (pid < 0) return 1;
    if (pid == 0) {
        for (int i = 0; i < KEPT; i++) free(kept[i]);
        for (int i = 0; i < CHILD; i++) child_blocks[i] = site_child();
        for (int i = 0; i < CHURN; i++) free(site_churn(i));
        printf("child %d\n", (int)getpid());
        fflush(stdout);
        wait_line();
        _exit(0);
    }
    int st = 0;
    if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) return 2;
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    wait_line();
    for (int i = 0; i < KEPT; i++) free(kept[i]);
    printf("done\n");
    fflush(stdout);
    return 0;
}
