/* A dynamically linked program that links no library at all (no libc, so
 * no dlopen in the process): heapdump attach must refuse it before any
 * ptrace call. Writes "ready PID\n" and waits in read(2) for a line. */
#include <sys/syscall.h>
static long sys3(long n, long a, long b, long c) {
    long r;
    __asm__ volatile("syscall" : "=a"(r) : "a"(n), "D"(a), "S"(b), "d"(c) : "rcx", "r11", "memory");
    return r;
}
static int fmt(char *p, long v) { char t[24]; int n = 0, k = 0; do { t[n++] = '0' + v % 10; v /= 10; } while (v); while (n) p[k++] = t[--n]; return k; }
void _start(void) {
    char buf[64] = "ready ";
    int n = 6 + fmt(buf + 6, sys3(SYS_getpid, 0, 0, 0));
    buf[n++] = '\n';
    sys3(SYS_write, 1, (long)buf, n);
    char in[8];
    sys3(SYS_read, 0, (long)in, sizeof in);
    sys3(SYS_write, 1, (long)"bye\n", 4);
    sys3(SYS_exit, 0, 0, 0);
}
