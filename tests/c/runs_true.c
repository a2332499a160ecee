/* Runs /bin/true the way services run helpers (system(3): a shell, then
 * the program), so the helpers inherit LD_PRELOAD; prints "true exited N".
 * Built linked with jemalloc for the test of the jemalloc companion. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>

int main(void) {
    void *volatile p = malloc(100);
    fflush(stdout);
    int status = system("/bin/true");
    printf("true exited %d\n", WIFEXITED(status) ? WEXITSTATUS(status) : -1);
    free(p);
    return 0;
}
