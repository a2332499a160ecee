/* A recursion of known depth for bench/walk-cost, compiled twice by
 * bench/build.rs: with frame pointers (CHAIN=chain_fp) and without
 * (CHAIN=chain_nofp, as distributions build). Each level calls the next
 * through a volatile pointer and adds to its result, so the compiler can
 * neither inline the recursion nor turn it into a loop or a tail call:
 * every level is one real frame on the stack. */
typedef void (*walk_cost_cb)(void *);

int CHAIN(int n, walk_cost_cb cb, void *arg);

static int (*volatile next_level)(int, walk_cost_cb, void *) = CHAIN;

__attribute__((noinline)) int CHAIN(int n, walk_cost_cb cb, void *arg) {
    if (n == 0) {
        cb(arg);
        return 1;
    }
    return next_level(n - 1, cb, arg) + 1;
}
