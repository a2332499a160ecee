/* A target that does what a hostile (or merely strange) process can do to
 * the root-run dumper reading it (dumper/tests/hostile_targets.rs). Runs
 * as any user. Prints "ready PID" first; then commands on stdin, one per
 * line, each answered by one line:
 *   "alloc"            -> 100 x malloc(300) at site_hostile; "allocated"
 *   "plugin PATH"      -> dlopen(PATH), calls its plugin_alloc(100); "loaded"
 *                         (or "dlopen failed: ...")
 *   "truncate PATH"    -> truncate(PATH, 0); "truncated"
 *   "setuid N"         -> all its user and group ids set to N, as a daemon
 *                         started as root drops to its own user; "setuid ok"
 *                         (or "setuid failed")
 *   "memfds N"         -> N memfds named as the agent's allocations region,
 *                         a page each, sealed against shrinking and growing,
 *                         mapped shared and writable (zeros: no region's
 *                         header); "made M" (how many it could)
 *   "fds N"            -> raises its descriptor limit to the hard limit and
 *                         opens /dev/null N times (as a server holding N
 *                         connections); "opened M" (how many it could)
 *   "mapmany N PATH"   -> maps the first page of PATH N times, readable
 *                         (the mappings never merge: each maps offset 0);
 *                         "mapped M" (how many it could)
 *   "request"          -> raise(SIGUSR2) (a snapshot request); "requested"
 *   "flood N"          -> N requests, one every 20 ms; "flooded"
 *   "name STRING"      -> a thread named STRING (escapes \e, \a and \xHH written
 *                         as such) allocates 10 x 555 at site_named and
 *                         stays, and the main thread takes the name too
 *                         (the process's name); "named"
 *   "jit"              -> code written at run time (an anonymous executable
 *                         mapping) calls malloc(4242) 10 times, named in
 *                         /tmp/perf-PID.map as a JIT runtime names it;
 *                         "jitted"
 *   "jitlink PATH"     -> more such code calls malloc(4343) 10 times; its
 *                         /tmp/perf-PID.map is replaced by a symbolic link
 *                         to PATH; "linked ADDR SIZE" (the code's place,
 *                         hex)
 *   "fusestack PATH"   -> maps PATH (its whole pages, private), switches
 *                         the stack to the middle of that mapping and, from
 *                         code written at run time (no CFI), reads one byte
 *                         of stdin there: the pages above the stack pointer,
 *                         which a walk of the stack would read, were never
 *                         touched; prints "stacked" first, "unstacked" once
 *                         the byte came (or "fusestack failed")
 *   "wrapped"          -> site_wrapped_a and site_wrapped_b each allocate 7
 *                         blocks through the program's own wrapper
 *                         xmalloc_checked (as redis's zmalloc); "wrapped"
 *   "exec"             -> executes itself again (/proc/self/exe: a new
 *                         program image, same pid, with the agent's regions
 *                         made anew), which prints "ready PID" again
 *   "crash"            -> a null dereference; the process must die of it
 *   "quit"             -> exit 0 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dlfcn.h>
#include <grp.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

void *kept[1000];
int used;

/* Code written at run time into an anonymous executable mapping: push rbp;
 * mov rbp, rsp; movabs rax, malloc; call rax; pop rbp; ret: a frame like a
 * JIT's, with a frame pointer. */
static unsigned char *jit_code(size_t *len) {
    unsigned char t[] = {0x55, 0x48, 0x89, 0xe5, 0x48, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0,
                         0xff, 0xd0, 0x5d, 0xc3};
    void *(*m)(size_t) = malloc;
    memcpy(t + 6, &m, 8);
    unsigned char *code = mmap(NULL, 4096, PROT_READ | PROT_WRITE | PROT_EXEC,
                               MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    memcpy(code, t, sizeof t);
    *len = sizeof t;
    return code;
}

__attribute__((noinline)) void site_hostile(void) {
    for (int i = 0; i < 100 && used < 1000; i++) kept[used++] = malloc(300);
}

__attribute__((noinline)) void *xmalloc_checked(size_t n) {
    void *p = malloc(n);
    if (!p) abort();
    return p;
}

__attribute__((noinline)) void site_wrapped_a(void) {
    for (int i = 0; i < 7 && used < 1000; i++) kept[used++] = xmalloc_checked(700);
}

__attribute__((noinline)) void site_wrapped_b(void) {
    for (int i = 0; i < 7 && used < 1000; i++) kept[used++] = xmalloc_checked(800);
}

static char thread_name[64];
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static int named_done;

__attribute__((noinline)) void site_named(void) {
    for (int i = 0; i < 10 && used < 1000; i++) kept[used++] = malloc(555);
}

static void *named_thread(void *arg) {
    (void)arg;
    prctl(PR_SET_NAME, thread_name, 0, 0, 0);
    site_named();
    pthread_mutex_lock(&mu);
    named_done = 1;
    pthread_cond_signal(&cv);
    pthread_mutex_unlock(&mu);
    for (;;) pause();
    return NULL;
}

/* "\e" -> ESC, "\a" -> BEL, other bytes as they are. */
static void unescape(const char *in, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; in[i] && o + 1 < cap; i++) {
        if (in[i] == '\\' && in[i + 1] == 'e') { out[o++] = 27; i++; }
        else if (in[i] == '\\' && in[i + 1] == 'a') { out[o++] = 7; i++; }
        else if (in[i] == '\\' && in[i + 1] == 'x' && isxdigit((unsigned char)in[i + 2])
                 && isxdigit((unsigned char)in[i + 3])) {
            char hex[3] = {in[i + 2], in[i + 3], 0};
            out[o++] = (char)strtol(hex, NULL, 16);
            i += 3;
        }
        else out[o++] = in[i];
    }
    out[o] = 0;
}

int main(void) {
    char line[4096];
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        line[strcspn(line, "\n")] = 0;
        if (!strcmp(line, "alloc")) {
            site_hostile();
            printf("allocated\n");
        } else if (!strncmp(line, "plugin ", 7)) {
            void *h = dlopen(line + 7, RTLD_NOW);
            if (!h) {
                printf("dlopen failed: %s\n", dlerror());
            } else {
                void (*f)(int) = (void (*)(int))dlsym(h, "plugin_alloc");
                if (f) f(100);
                printf("loaded\n");
            }
        } else if (!strncmp(line, "mapmany ", 8)) {
            char *path = NULL;
            long n = strtol(line + 8, &path, 10), made = 0;
            int fd = open(path + 1, O_RDONLY);
            for (long i = 0; fd >= 0 && i < n; i++, made++)
                if (mmap(NULL, 4096, PROT_READ, MAP_PRIVATE, fd, 0) == MAP_FAILED) break;
            if (fd >= 0) close(fd);
            printf("mapped %ld\n", made);
        } else if (!strncmp(line, "fds ", 4)) {
            long n = strtol(line + 4, NULL, 10), made = 0;
            struct rlimit r;
            if (getrlimit(RLIMIT_NOFILE, &r) == 0) {
                r.rlim_cur = r.rlim_max;
                setrlimit(RLIMIT_NOFILE, &r);
            }
            for (; made < n; made++)
                if (open("/dev/null", O_RDONLY) < 0) break;
            printf("opened %ld\n", made);
        } else if (!strncmp(line, "memfds ", 7)) {
            long n = strtol(line + 7, NULL, 10), made = 0;
            for (; made < n; made++) {
                int fd = (int)syscall(SYS_memfd_create, "heapdump.allocations", 2 /* MFD_ALLOW_SEALING */);
                if (fd < 0 || ftruncate(fd, 4096)) break;
                if (fcntl(fd, 1033 /* F_ADD_SEALS */, 0x2 | 0x4 /* SHRINK | GROW */)) break;
                if (mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) == MAP_FAILED) break;
                close(fd);
            }
            printf("made %ld\n", made);
        } else if (!strncmp(line, "setuid ", 7)) {
            long id = strtol(line + 7, NULL, 10);
            int ok = setgroups(0, NULL) == 0 && setresgid((gid_t)id, (gid_t)id, (gid_t)id) == 0 &&
                     setresuid((uid_t)id, (uid_t)id, (uid_t)id) == 0;
            printf(ok ? "setuid ok\n" : "setuid failed\n");
        } else if (!strncmp(line, "truncate ", 9)) {
            printf(truncate(line + 9, 0) == 0 ? "truncated\n" : "truncate failed\n");
        } else if (!strcmp(line, "request")) {
            raise(SIGUSR2);
            printf("requested\n");
        } else if (!strncmp(line, "flood ", 6)) {
            int n = atoi(line + 6);
            struct timespec ts = {0, 20 * 1000 * 1000};
            for (int i = 0; i < n; i++) {
                raise(SIGUSR2);
                nanosleep(&ts, NULL);
            }
            printf("flooded\n");
        } else if (!strncmp(line, "name ", 5)) {
            unescape(line + 5, thread_name, 16);
            pthread_t t;
            pthread_create(&t, NULL, named_thread, NULL);
            pthread_mutex_lock(&mu);
            while (!named_done) pthread_cond_wait(&cv, &mu);
            pthread_mutex_unlock(&mu);
            prctl(PR_SET_NAME, thread_name, 0, 0, 0);
            printf("named\n");
        } else if (!strcmp(line, "jit")) {
            size_t len;
            unsigned char *code = jit_code(&len);
            char path[64];
            snprintf(path, sizeof path, "/tmp/perf-%d.map", (int)getpid());
            FILE *f = fopen(path, "w");
            if (f) {
                fprintf(f, "%lx %zx LazyCompile:*jsAllocate app.js:12\n", (unsigned long)code,
                        len);
                fclose(f);
            }
            void *(*jitted)(size_t) = (void *(*)(size_t))code;
            for (int i = 0; i < 10 && used < 1000; i++) kept[used++] = jitted(4242);
            printf("jitted\n");
        } else if (!strncmp(line, "jitlink ", 8)) {
            size_t len;
            unsigned char *code = jit_code(&len);
            void *(*jitted)(size_t) = (void *(*)(size_t))code;
            for (int i = 0; i < 10 && used < 1000; i++) kept[used++] = jitted(4343);
            char path[64];
            snprintf(path, sizeof path, "/tmp/perf-%d.map", (int)getpid());
            unlink(path);
            if (symlink(line + 8, path) == 0)
                printf("linked %lx %zx\n", (unsigned long)code, len);
            else
                printf("symlink failed\n");
        } else if (!strncmp(line, "fusestack ", 10)) {
            int fd = open(line + 10, O_RDONLY);
            struct stat st;
            size_t len = fd >= 0 && fstat(fd, &st) == 0 ? (size_t)st.st_size & ~4095UL : 0;
            char *m = len >= (512 << 10) ? mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE,
                                                fd, 0)
                                         : MAP_FAILED;
            /* syscall; ret */
            static const unsigned char t[] = {0x0f, 0x05, 0xc3};
            unsigned char *code = mmap(NULL, 4096, PROT_READ | PROT_WRITE | PROT_EXEC,
                                       MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
            if (m == MAP_FAILED || code == MAP_FAILED) {
                printf("fusestack failed\n");
            } else {
                memcpy(code, t, sizeof t);
                printf("stacked\n");
                fflush(stdout);
                char byte;
                char *sp = m + len / 2;
                long r;
                __asm__ volatile("mov %%rsp, %%r12\n\t"
                                 "mov %[sp], %%rsp\n\t"
                                 "call *%[code]\n\t"
                                 "mov %%r12, %%rsp"
                                 : "=a"(r)
                                 : [sp] "r"(sp), [code] "r"(code), "a"(0L), "D"(0L),
                                   "S"(&byte), "d"(1L)
                                 : "rcx", "r11", "r12", "memory");
                printf("unstacked %ld\n", r);
            }
            if (fd >= 0) close(fd);
        } else if (!strcmp(line, "wrapped")) {
            site_wrapped_a();
            site_wrapped_b();
            printf("wrapped\n");
        } else if (!strcmp(line, "exec")) {
            char *args[] = {"hostile", NULL};
            fflush(stdout);
            execv("/proc/self/exe", args);
            printf("exec failed\n");
        } else if (!strcmp(line, "crash")) {
            fflush(stdout);
            volatile int *p = NULL;
            *p = 1;
            printf("survived\n");
        } else if (!strcmp(line, "quit")) {
            return 0;
        } else {
            printf("unknown %s\n", line);
        }
        fflush(stdout);
    }
    return 0;
}
