/* Runs a program in a mount namespace of its own holding many mounts, as
 * any user can (an unprivileged user namespace): `mount_many N PROG ARGS`
 * enters a new user and mount namespace (the caller's ids mapped to 0
 * inside), mounts a tmpfs on /tmp/heapdump-mount-many-PID, N more on N
 * directories inside it, and executes PROG (stdin, stdout and the
 * environment, LD_PRELOAD included, passed on). Prints "mounts N" to
 * stderr (how many it made) first; exits 1 if it could not enter the
 * namespaces. */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY);
    if (fd < 0) return -1;
    ssize_t n = write(fd, text, strlen(text));
    close(fd);
    return n == (ssize_t)strlen(text) ? 0 : -1;
}

int main(int argc, char **argv) {
    if (argc < 3) return 2;
    long n = strtol(argv[1], NULL, 10);
    uid_t uid = getuid();
    gid_t gid = getgid();
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS)) {
        perror("unshare");
        return 1;
    }
    char map[64];
    write_file("/proc/self/setgroups", "deny");
    snprintf(map, sizeof map, "0 %d 1", (int)uid);
    if (write_file("/proc/self/uid_map", map)) return 1;
    snprintf(map, sizeof map, "0 %d 1", (int)gid);
    if (write_file("/proc/self/gid_map", map)) return 1;
    char top[64], dir[96];
    snprintf(top, sizeof top, "/tmp/heapdump-mount-many-%d", (int)getpid());
    mkdir(top, 0700);
    if (mount("none", top, "tmpfs", 0, NULL)) {
        perror("mount");
        return 1;
    }
    long made = 0;
    for (; made < n; made++) {
        snprintf(dir, sizeof dir, "%s/%ld", top, made);
        if (mkdir(dir, 0700) || mount("none", dir, "tmpfs", 0, NULL)) break;
    }
    fprintf(stderr, "mounts %ld\n", made);
    execv(argv[2], argv + 2);
    perror("execv");
    return 1;
}
