/* A forked child of a process whose owner tables hold blocks
 * (table/src/allocations_table/owner_table.rs): the child must not see
 * them. A thread of the parent keeps FIFO_LIVE blocks of a FIFO pattern at
 * site_parent (in its owner table) and exits (its table keeps them); main
 * forks. The child runs the FIFO pattern itself at site_child, taking a
 * table up (the parent's thread's, the first free), then frees every
 * second of the parent's blocks (not recorded in the child: a table still
 * holding the parent's entries would match them, and free one of the
 * child's records in their place). Expected live in the child: site_child FIFO_LIVE blocks of 48 bytes,
 * nothing at site_parent. The child prints "ready PID", waits for a line on
 * stdin, frees the rest and prints "done"; the parent waits for it.
 * With argv[1] = "thread", the parent keeps a second thread (sleeping)
 * at the fork: the agent then copies none of its records into the child
 * (agent/src/fork_inheritance.rs); without, it copies them, and the
 * child's table holds the FIFO_LIVE / 2 site_parent blocks it keeps. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define FIFO_LIVE 2000
#define FIFO_EVENTS 30000

static void *parent_blocks[FIFO_LIVE];
static void *child_blocks[FIFO_LIVE];

__attribute__((noinline)) void *site_parent(void) { return malloc(32); }
__attribute__((noinline)) void *site_child(void) { return malloc(48); }

static void fifo(void **ring, void *(*site)(void)) {
    for (int i = 0; i < FIFO_LIVE; i++) ring[i] = site();
    for (int i = 0; i < FIFO_EVENTS; i++) {
        int slot = i % FIFO_LIVE;
        free(ring[slot]);
        ring[slot] = site();
    }
}

static void *parent_thread(void *arg) {
    (void)arg;
    fifo(parent_blocks, site_parent);
    return NULL;
}

static void *sleeper(void *arg) {
    (void)arg;
    for (;;) pause();
    return NULL;
}

int main(int argc, char **argv) {
    pthread_t th;
    pthread_create(&th, NULL, parent_thread, NULL);
    pthread_join(th, NULL);
    if (argc > 1 && strcmp(argv[1], "thread") == 0) {
        pthread_t s;
        if (pthread_create(&s, NULL, sleeper, NULL) != 0) return 1;
    }
    pid_t pid = fork();
    if (pid < 0) return 1;
    if (pid > 0) {
        int st = 0;
        waitpid(pid, &st, 0);
        return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
    }
    fifo(child_blocks, site_child);
    for (int i = 0; i < FIFO_LIVE; i += 2) {
        free(parent_blocks[i]);
        parent_blocks[i] = NULL;
    }
    printf("ready %d\n", (int)getpid());
    fflush(stdout);
    char line[8];
    if (read(0, line, sizeof line) < 0) {}
    for (int i = 0; i < FIFO_LIVE; i++) free(child_blocks[i]);
    for (int i = 0; i < FIFO_LIVE; i++) free(parent_blocks[i]);
    printf("done\n");
    fflush(stdout);
    return 0;
}
