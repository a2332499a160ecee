/* peak_rss OUT PROGRAM [ARGS...]: runs PROGRAM (fork, then exec: a child
 * of this small process, whose largest resident set starts at this
 * process's, not at the test's) and writes its largest resident set, in
 * KiB, into the file OUT; exits with its status (128 + N when signal N
 * ended it).
 *
 * A program spawned by a test straight (vfork and exec) starts its largest
 * resident set at the test process's own (the kernel carries the mm's
 * high-water mark over the exec), and getrusage(RUSAGE_CHILDREN) takes the
 * largest of all the children a test process ever waited for: neither
 * measures one heapdump run alone. */
#include <stdio.h>
#include <sys/resource.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: peak_rss OUT PROGRAM [ARGS...]\n");
        return 2;
    }
    pid_t pid = fork();
    if (pid < 0) {
        perror("fork");
        return 2;
    }
    if (pid == 0) {
        execvp(argv[2], argv + 2);
        perror("exec");
        _exit(127);
    }
    int status = 0;
    struct rusage usage;
    if (wait4(pid, &status, 0, &usage) < 0) {
        perror("wait4");
        return 2;
    }
    FILE *out = fopen(argv[1], "w");
    if (!out) {
        perror("fopen");
        return 2;
    }
    fprintf(out, "%ld\n", usage.ru_maxrss);
    fclose(out);
    if (WIFSIGNALED(status))
        return 128 + WTERMSIG(status);
    return WEXITSTATUS(status);
}
