/* A FUSE file system whose server stalls root: what a user allowed to
 * mount with `allow_other` (user_allow_other in /etc/fuse.conf) can do to
 * a root-run heapdump that reads files of the user's process
 * (dumper/tests/hostile_targets.rs). Speaks the kernel's FUSE protocol on
 * /dev/fuse directly (no libfuse).
 *
 *   fuse_stall MOUNTPOINT FILE
 *
 * mounts a read-only directory at MOUNTPOINT holding one file, FILE's
 * base name with FILE's contents, and prints "mounted". Every request of
 * a process running as any user but root is answered; every request of
 * root's (uid 0) is read and never answered, so a root process that
 * touches the file (stat, open, read, a lookup in the directory) waits
 * for ever. Runs until killed; the mount is then gone with its server
 * (lazily unmounted by whoever cleans up). Needs root (mount(2)) and
 * /dev/fuse. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

struct in_header {
    uint32_t len, opcode;
    uint64_t unique, nodeid;
    uint32_t uid, gid, pid;
    uint16_t total_extlen, padding;
};
struct out_header {
    uint32_t len;
    int32_t error;
    uint64_t unique;
};
struct attr {
    uint64_t ino, size, blocks, atime, mtime, ctime;
    uint32_t atimensec, mtimensec, ctimensec, mode, nlink, uid, gid, rdev, blksize, flags;
};
struct entry_out {
    uint64_t nodeid, generation, entry_valid, attr_valid;
    uint32_t entry_valid_nsec, attr_valid_nsec;
    struct attr attr;
};
struct attr_out {
    uint64_t attr_valid;
    uint32_t attr_valid_nsec, dummy;
    struct attr attr;
};
struct open_out {
    uint64_t fh;
    uint32_t open_flags, padding;
};
struct read_in {
    uint64_t fh, offset;
    uint32_t size, read_flags;
    uint64_t lock_owner;
    uint32_t flags, padding;
};
struct init_out {
    uint32_t major, minor, max_readahead, flags;
    uint16_t max_background, congestion_threshold;
    uint32_t max_write, time_gran;
    uint16_t max_pages, map_alignment;
    uint32_t flags2, max_stack_depth, unused[6];
};

enum {
    LOOKUP = 1, FORGET = 2, GETATTR = 3, OPEN = 14, READ = 15, STATFS = 17, RELEASE = 18,
    FLUSH = 25, INIT = 26, OPENDIR = 27, READDIR = 28, RELEASEDIR = 29, INTERRUPT = 36,
    DESTROY = 38, BATCH_FORGET = 42
};

static int dev;
static char *data;
static size_t data_len;
static const char *name;

static void reply(uint64_t unique, int error, const void *body, size_t len) {
    char buf[sizeof(struct out_header) + 131072];
    struct out_header h = {sizeof h + len, -error, unique};
    memcpy(buf, &h, sizeof h);
    if (len) memcpy(buf + sizeof h, body, len);
    if (write(dev, buf, h.len) < 0 && errno != ENOENT) perror("fuse_stall: write");
}

static struct attr attr_of(uint64_t ino) {
    struct attr a = {0};
    a.ino = ino;
    a.nlink = 1;
    a.blksize = 4096;
    if (ino == 1) {
        a.mode = S_IFDIR | 0755;
        a.nlink = 2;
    } else {
        a.mode = S_IFREG | 0755;
        a.size = data_len;
        a.blocks = (data_len + 511) / 512;
    }
    return a;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: fuse_stall MOUNTPOINT FILE\n");
        return 2;
    }
    FILE *f = fopen(argv[2], "rb");
    if (!f) {
        perror(argv[2]);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    data_len = ftell(f);
    fseek(f, 0, SEEK_SET);
    data = malloc(data_len ? data_len : 1);
    if (fread(data, 1, data_len, f) != data_len) return 1;
    fclose(f);
    name = strrchr(argv[2], '/') ? strrchr(argv[2], '/') + 1 : argv[2];

    dev = open("/dev/fuse", O_RDWR | O_CLOEXEC);
    if (dev < 0) {
        perror("fuse_stall: /dev/fuse");
        return 1;
    }
    char opts[128];
    snprintf(opts, sizeof opts, "fd=%d,rootmode=40000,user_id=0,group_id=0,allow_other", dev);
    if (mount("fuse_stall", argv[1], "fuse.fuse_stall", MS_NOSUID | MS_NODEV, opts) != 0) {
        perror("fuse_stall: mount");
        return 1;
    }
    printf("mounted\n");
    fflush(stdout);

    static char buf[135168];
    for (;;) {
        ssize_t n = read(dev, buf, sizeof buf);
        if (n < 0) {
            if (errno == EINTR || errno == ENOENT || errno == EAGAIN) continue;
            return 0; /* unmounted */
        }
        struct in_header *in = (struct in_header *)buf;
        char *arg = buf + sizeof *in;
        if (in->opcode == FORGET || in->opcode == BATCH_FORGET || in->opcode == INTERRUPT)
            continue;
        if (in->opcode == INIT) {
            struct init_out o = {0};
            o.major = 7;
            o.minor = 31;
            o.max_readahead = 131072;
            o.max_background = 16;
            o.congestion_threshold = 12;
            o.max_write = 65536;
            o.time_gran = 1;
            reply(in->unique, 0, &o, sizeof o);
            continue;
        }
        if (in->uid == 0) continue; /* root waits for ever */
        switch (in->opcode) {
        case LOOKUP:
            if (in->nodeid == 1 && !strcmp(arg, name)) {
                struct entry_out e = {0};
                e.nodeid = 2;
                e.attr = attr_of(2);
                reply(in->unique, 0, &e, sizeof e);
            } else {
                reply(in->unique, ENOENT, NULL, 0);
            }
            break;
        case GETATTR: {
            struct attr_out a = {0};
            a.attr = attr_of(in->nodeid);
            reply(in->unique, 0, &a, sizeof a);
            break;
        }
        case OPEN:
        case OPENDIR: {
            struct open_out o = {0};
            reply(in->unique, 0, &o, sizeof o);
            break;
        }
        case READ: {
            struct read_in *r = (struct read_in *)arg;
            size_t off = r->offset < data_len ? r->offset : data_len;
            size_t len = data_len - off < r->size ? data_len - off : r->size;
            if (len > 131072) len = 131072;
            reply(in->unique, 0, data + off, len);
            break;
        }
        case READDIR:
        case RELEASE:
        case RELEASEDIR:
        case FLUSH:
            reply(in->unique, 0, NULL, 0);
            break;
        case DESTROY:
            reply(in->unique, 0, NULL, 0);
            return 0;
        default:
            reply(in->unique, ENOSYS, NULL, 0);
        }
    }
}
