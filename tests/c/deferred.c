/* Blocks whose release the agent holds back (freed by the program, out of
 * the table at once, handed to glibc after the thread's next two frees)
 * must still reach glibc: at thread exit, and in a forked child. Checked
 * with glibc's own accounting (mallinfo2: bytes in use in the main arena;
 * M_ARENA_MAX=1 puts every thread there). Blocks of 2000 bytes are past
 * the tcache, so a real free lowers the count at once.
 *
 * Prints one line per check and exits 0 when all hold (under the preload
 * library: without the agent nothing is held back and the second check
 * fails). */
#define _GNU_SOURCE
#include <malloc.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#define SIZE 2000

static size_t in_use(void) { return mallinfo2().uordblks; }

static void *worker(void *arg) {
    (void)arg;
    void *b[100];
    for (int i = 0; i < 100; i++) b[i] = malloc(SIZE);
    for (int i = 0; i < 100; i++) free(b[i]);
    return NULL;
}

int main(void) {
    mallopt(M_ARENA_MAX, 1);
    free(malloc(16));
    printf("start\n");
    fflush(stdout);
    int ok = 1;

    /* Thread exit releases what the thread held back. */
    size_t before = in_use();
    pthread_t t;
    pthread_create(&t, NULL, worker, NULL);
    pthread_join(t, NULL);
    size_t after = in_use();
    printf("thread exit: in use before %zu, after %zu\n", before, after);
    /* glibc keeps a few hundred bytes per finished thread itself; a block
     * held back would be a whole 2000-byte chunk. */
    ok &= after < before + SIZE;

    /* The main thread holds its last two frees back... */
    void *x = malloc(SIZE), *y = malloc(SIZE);
    size_t cx = malloc_usable_size(x) + 8, cy = malloc_usable_size(y) + 8;
    size_t with_xy = in_use();
    free(x);
    free(y);
    size_t held = in_use();
    printf("held back: in use %zu after freeing %zu + %zu bytes (was %zu)\n", held, cx, cy,
           with_xy);
    ok &= held == with_xy;

    /* ...and a forked child releases them, by its first allocation at the
     * latest (the agent's fork handler does now): after it, the child's
     * heap is the parent's at the fork less the two, plus the new block. */
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        size_t u0 = in_use();
        void *z = malloc(SIZE);
        size_t cz = malloc_usable_size(z) + 8;
        size_t u1 = in_use();
        printf("child: in use %zu, after its first malloc %zu\n", u0, u1);
        fflush(stdout);
        _exit(u1 + cx + cy == held + cz ? 0 : 1);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    ok &= WIFEXITED(status) && WEXITSTATUS(status) == 0;
    printf("child released them: %s\n", WIFEXITED(status) && WEXITSTATUS(status) == 0 ? "yes" : "no");
    printf(ok ? "all held\n" : "FAILED\n");
    return ok ? 0 : 1;
}
