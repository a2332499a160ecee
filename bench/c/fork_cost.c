/* What a fork costs a process that holds N live blocks, and its child:
 * argv[1] = N blocks (32..95 bytes), argv[2] = rounds. Each round forks
 * once; the parent times fork() until it returns, the child from the
 * same start until fork() returned in it (the atfork handlers included:
 * where heapdump's agent copies the parent's records into the child's
 * table) and exits at once. One line per round:
 *   fork parent_us=P child_us=C child_live=L
 * where L is the child's live blocks as heapdump's agent counts them
 * (heapdump_stats, looked up at run time; -1 without the agent), and a
 * first line "agent: recording" or "agent: absent" in the parent. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct stats { uint64_t live_bytes, live_blocks, peak, total_allocs, total_bytes, dropped;
               uint32_t enabled, reserved; };

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec * 1e6 + (double)t.tv_nsec / 1e3;
}

static long long live_blocks(void) {
    int (*stats)(void *, size_t) = (int (*)(void *, size_t))dlsym(RTLD_DEFAULT, "heapdump_stats");
    struct stats st = {0};
    if (!stats || stats(&st, sizeof st) != 0) return -1;
    return (long long)st.live_blocks;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000;
    int rounds = argc > 2 ? atoi(argv[2]) : 5;
    void **blocks = malloc(sizeof(void *) * (size_t)n);
    for (long i = 0; i < n; i++) blocks[i] = malloc(32 + (size_t)(i & 63));
    printf("agent: %s\n", live_blocks() >= 0 ? "recording" : "absent");
    fflush(stdout);
    for (int r = 0; r < rounds; r++) {
        int fds[2];
        if (pipe(fds) != 0) return 2;
        double t0 = now_us();
        pid_t c = fork();
        if (c < 0) return 3;
        if (c == 0) {
            double t1 = now_us();
            char line[96];
            int len = snprintf(line, sizeof line, "%.1f %lld", t1 - t0, live_blocks());
            if (write(fds[1], line, (size_t)len) < 0) {}
            _exit(0);
        }
        double t1 = now_us();
        close(fds[1]);
        char line[96] = {0};
        if (read(fds[0], line, sizeof line - 1) < 0) return 4;
        close(fds[0]);
        waitpid(c, NULL, 0);
        double child_us = 0;
        long long child_live = 0;
        if (sscanf(line, "%lf %lld", &child_us, &child_live) != 2) return 5;
        printf("fork parent_us=%.1f child_us=%.1f child_live=%lld\n", t1 - t0, child_us,
               child_live);
    }
    free(blocks);
    return 0;
}
