/*
 * megacpp-jail: run one untrusted command in isolation and report how it ended.
 *
 * Built on first use by megacpp.eval.launcher with the system C compiler and driven only
 * by megacpp.eval.sandbox, which passes every setting on the command line.
 *
 * Isolation "namespaces" (the default):
 *   launcher  (non-root caller: enters a new user namespace first, uid 0 -> caller)
 *     unshares mount, network, pid, ipc and uts namespaces, then forks
 *     init     pid 1 of the new pid namespace. Builds a minimal root on a tmpfs (system
 *              directories read-only, binds, /dev basics, a fresh /proc, a size-limited
 *              /tmp), pivots into it, forks the program and waits for it. When init exits
 *              the kernel kills every process left in the namespace.
 *       program  drops to an unprivileged uid inside a fresh user namespace of its own
 *                (so RLIMIT_NPROC counts only this run's processes), caps the namespaces
 *                that user namespace may create at zero, sets rlimits and niceness,
 *                installs the seccomp filter and execs with the given environment only.
 * Isolation "rlimits" (fallback without namespaces): the launcher forks the program
 * directly; it still drops root, sets rlimits and niceness, installs the seccomp filter
 * and scrubs the environment.
 *
 * Both levels: with --cgroup DIR the launcher first moves itself into that (memory-limited)
 * cgroup, so every process of the run is charged to it, page cache and tmpfs included. The
 * program raises its own oom_score_adj to 1000, so the OOM killer ends it before the jail.
 *
 * The launcher writes to --status-fd exactly one of:
 *   "exit <wait-status> <maxrss-kb> <user-us> <sys-us>\n"  the program ran (any outcome)
 *   "error <what>: <strerror>\n"                          the jail could not be built
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <grp.h>
#include <limits.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#define JAIL_FAILED 125
#define MAX_BINDS 16
#define MAX_ENV 64
#define NEW_ROOT "/tmp" /* the tmpfs that becomes "/" is mounted here, in our mount ns */

struct bind {
    const char *source; /* host path */
    const char *target; /* absolute path inside the jail */
    int writable;
    int fd; /* O_PATH fd opened before any namespace or mount change */
};

struct config {
    int namespaces; /* 1: full isolation, 0: rlimits fallback */
    int seccomp;    /* 1: install the syscall filter before exec (--no-seccomp: 0) */
    const char *cgroup; /* the run's cgroup directory, joined first; NULL: none */
    int status_fd;
    struct bind binds[MAX_BINDS];
    int n_binds;
    const char *env[MAX_ENV + 1];
    int n_env;
    const char *cwd;
    int cwd_fd; /* rlimits mode: opened before dropping privileges */
    unsigned long long tmp_bytes, cpu_s, as_bytes, fsize_bytes, nproc, nofile;
    int nice;
    uid_t drop_uid; /* the unprivileged id used when started as root */
    gid_t drop_gid;
    uid_t caller_uid;
    gid_t caller_gid;
    char **argv;
};

static int status_fd = -1;

static void report(const char *fmt, ...) {
    if (status_fd < 0) return;
    va_list ap;
    va_start(ap, fmt);
    vdprintf(status_fd, fmt, ap);
    va_end(ap);
}

/* A setup step failed: tell the caller what and why, then stop. */
static void die(const char *what) {
    int saved = errno;
    report("error %s: %s\n", what, strerror(saved));
    if (status_fd < 0) fprintf(stderr, "megacpp-jail: %s: %s\n", what, strerror(saved));
    _exit(JAIL_FAILED);
}

static void die_msg(const char *what) {
    errno = EINVAL;
    die(what);
}

static unsigned long long parse_number(const char *text, const char *option) {
    char *end = NULL;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno || !end || *end || end == text) die_msg(option);
    return value;
}

static void add_bind(struct config *cfg, const char *spec, int writable) {
    if (cfg->n_binds >= MAX_BINDS) die_msg("too many --bind options");
    char *copy = strdup(spec);
    char *colon = copy ? strchr(copy, ':') : NULL;
    if (!colon || colon == copy || colon[1] != '/') die_msg("--bind expects HOST:/JAIL_PATH");
    *colon = '\0';
    struct bind *b = &cfg->binds[cfg->n_binds++];
    b->source = copy;
    b->target = colon + 1;
    b->writable = writable;
    b->fd = -1;
}

static void parse_args(int argc, char **argv, struct config *cfg) {
    enum { O_ISOLATION = 1, O_STATUS, O_BIND, O_RWBIND, O_TMP, O_CWD, O_ENV, O_CPU, O_AS,
           O_FSIZE, O_NPROC, O_NOFILE, O_NICE, O_UID, O_GID, O_CGROUP, O_NO_SECCOMP };
    static const struct option options[] = {
        {"isolation", required_argument, 0, O_ISOLATION},
        {"status-fd", required_argument, 0, O_STATUS},
        {"bind", required_argument, 0, O_BIND},
        {"rw-bind", required_argument, 0, O_RWBIND},
        {"tmp-bytes", required_argument, 0, O_TMP},
        {"cwd", required_argument, 0, O_CWD},
        {"env", required_argument, 0, O_ENV},
        {"cpu", required_argument, 0, O_CPU},
        {"as", required_argument, 0, O_AS},
        {"fsize", required_argument, 0, O_FSIZE},
        {"nproc", required_argument, 0, O_NPROC},
        {"nofile", required_argument, 0, O_NOFILE},
        {"nice", required_argument, 0, O_NICE},
        {"uid", required_argument, 0, O_UID},
        {"gid", required_argument, 0, O_GID},
        {"cgroup", required_argument, 0, O_CGROUP},
        {"no-seccomp", no_argument, 0, O_NO_SECCOMP},
        {0, 0, 0, 0},
    };
    memset(cfg, 0, sizeof(*cfg));
    cfg->namespaces = 1;
    cfg->seccomp = 1;
    cfg->status_fd = -1;
    cfg->cwd_fd = -1;
    cfg->tmp_bytes = 64ULL << 20;
    cfg->drop_uid = 65534;
    cfg->drop_gid = 65534;
    int opt;
    while ((opt = getopt_long(argc, argv, "+", options, NULL)) != -1) {
        switch (opt) {
        case O_ISOLATION:
            if (strcmp(optarg, "namespaces") == 0) cfg->namespaces = 1;
            else if (strcmp(optarg, "rlimits") == 0) cfg->namespaces = 0;
            else die_msg("--isolation expects namespaces or rlimits");
            break;
        case O_STATUS: cfg->status_fd = (int)parse_number(optarg, "--status-fd"); break;
        case O_BIND: add_bind(cfg, optarg, 0); break;
        case O_RWBIND: add_bind(cfg, optarg, 1); break;
        case O_TMP: cfg->tmp_bytes = parse_number(optarg, "--tmp-bytes"); break;
        case O_CWD: cfg->cwd = optarg; break;
        case O_ENV:
            if (cfg->n_env >= MAX_ENV) die_msg("too many --env options");
            cfg->env[cfg->n_env++] = optarg;
            break;
        case O_CPU: cfg->cpu_s = parse_number(optarg, "--cpu"); break;
        case O_AS: cfg->as_bytes = parse_number(optarg, "--as"); break;
        case O_FSIZE: cfg->fsize_bytes = parse_number(optarg, "--fsize"); break;
        case O_NPROC: cfg->nproc = parse_number(optarg, "--nproc"); break;
        case O_NOFILE: cfg->nofile = parse_number(optarg, "--nofile"); break;
        case O_NICE: cfg->nice = (int)parse_number(optarg, "--nice"); break;
        case O_UID: cfg->drop_uid = (uid_t)parse_number(optarg, "--uid"); break;
        case O_GID: cfg->drop_gid = (gid_t)parse_number(optarg, "--gid"); break;
        case O_CGROUP: cfg->cgroup = optarg; break;
        case O_NO_SECCOMP: cfg->seccomp = 0; break;
        default: die_msg("unknown option");
        }
    }
    if (optind >= argc) die_msg("no program given after --");
    if (!cfg->cwd) die_msg("--cwd is required");
    cfg->argv = argv + optind;
    cfg->caller_uid = geteuid();
    cfg->caller_gid = getegid();
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) die(path);
    ssize_t len = (ssize_t)strlen(text);
    if (write(fd, text, len) != len) die(path);
    close(fd);
}

/* Map one id: inside the new user namespace `inner` is the caller's current `outer`. */
static void enter_user_namespace(uid_t inner_uid, uid_t outer_uid, gid_t inner_gid,
                                 gid_t outer_gid) {
    char map[64];
    if (unshare(CLONE_NEWUSER)) die("unshare user namespace");
    write_file("/proc/self/setgroups", "deny");
    snprintf(map, sizeof map, "%u %u 1\n", inner_uid, outer_uid);
    write_file("/proc/self/uid_map", map);
    snprintf(map, sizeof map, "%u %u 1\n", inner_gid, outer_gid);
    write_file("/proc/self/gid_map", map);
}

/* Open bind sources inside the new mount namespace (a bind's source must belong to it),
 * before /tmp is covered: the host paths may lie there. */
static void open_bind_sources(struct config *cfg) {
    for (int i = 0; i < cfg->n_binds; i++) {
        cfg->binds[i].fd = open(cfg->binds[i].source, O_PATH | O_CLOEXEC);
        if (cfg->binds[i].fd < 0) die(cfg->binds[i].source);
    }
}

/* mkdir -p under the new root; `path` is absolute inside the jail. */
static void make_dirs(const char *path) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s%s", NEW_ROOT, path) >= (int)sizeof buf) die_msg(path);
    for (char *p = buf + strlen(NEW_ROOT) + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(buf, 0755) && errno != EEXIST) die(buf);
        *p = '/';
    }
    if (mkdir(buf, 0755) && errno != EEXIST) die(buf);
}

static void make_file(const char *jail_path) {
    char buf[PATH_MAX];
    snprintf(buf, sizeof buf, "%s%s", NEW_ROOT, jail_path);
    int fd = open(buf, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) die(buf);
    close(fd);
}

/* Re-mount a bind read-only, keeping the flags a user namespace may not clear. */
static void remount_readonly(const char *target) {
    struct statvfs st;
    if (statvfs(target, &st)) die(target);
    unsigned long flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV;
    if (st.f_flag & ST_NOEXEC) flags |= MS_NOEXEC;
    if (st.f_flag & ST_NOATIME) flags |= MS_NOATIME;
    if (st.f_flag & ST_NODIRATIME) flags |= MS_NODIRATIME;
    if (st.f_flag & ST_RELATIME) flags |= MS_RELATIME;
    if (mount(NULL, target, NULL, flags, NULL)) die(target);
}

static void bind_into_root(const char *source, const char *jail_path, int writable, int is_dir) {
    char target[PATH_MAX];
    snprintf(target, sizeof target, "%s%s", NEW_ROOT, jail_path);
    if (is_dir) make_dirs(jail_path);
    else make_file(jail_path);
    if (mount(source, target, NULL, MS_BIND | MS_REC, NULL)) die(target);
    if (!writable) remount_readonly(target);
    else if (mount(NULL, target, NULL, MS_REMOUNT | MS_BIND | MS_NOSUID | MS_NODEV, NULL))
        die(target);
}

/* /usr, /etc, ... read-only; a host symlink (merged /usr) is recreated as a symlink. */
static void add_system_dirs(void) {
    static const char *dirs[] = {"/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64",
                                 "/libx32", "/etc"};
    for (size_t i = 0; i < sizeof dirs / sizeof dirs[0]; i++) {
        struct stat st;
        if (lstat(dirs[i], &st)) continue;
        if (S_ISLNK(st.st_mode)) {
            char link[PATH_MAX], target[PATH_MAX];
            ssize_t n = readlink(dirs[i], link, sizeof link - 1);
            if (n < 0) die(dirs[i]);
            link[n] = '\0';
            snprintf(target, sizeof target, "%s%s", NEW_ROOT, dirs[i]);
            if (symlink(link, target)) die(target);
        } else if (S_ISDIR(st.st_mode)) {
            bind_into_root(dirs[i], dirs[i], 0, 1);
        }
    }
}

static void add_devices(void) {
    static const char *nodes[] = {"/dev/null", "/dev/zero", "/dev/full", "/dev/random",
                                  "/dev/urandom"};
    static const char *links[][2] = {{"/proc/self/fd", "/dev/fd"},
                                     {"/proc/self/fd/0", "/dev/stdin"},
                                     {"/proc/self/fd/1", "/dev/stdout"},
                                     {"/proc/self/fd/2", "/dev/stderr"}};
    make_dirs("/dev");
    for (size_t i = 0; i < sizeof nodes / sizeof nodes[0]; i++) {
        char target[PATH_MAX];
        snprintf(target, sizeof target, "%s%s", NEW_ROOT, nodes[i]);
        make_file(nodes[i]);
        if (mount(nodes[i], target, NULL, MS_BIND, NULL)) die(target);
    }
    for (size_t i = 0; i < sizeof links / sizeof links[0]; i++) {
        char target[PATH_MAX];
        snprintf(target, sizeof target, "%s%s", NEW_ROOT, links[i][1]);
        if (symlink(links[i][0], target)) die(target);
    }
}

static void add_user_binds(struct config *cfg) {
    for (int i = 0; i < cfg->n_binds; i++) {
        struct bind *b = &cfg->binds[i];
        struct stat st;
        char source[64];
        if (fstat(b->fd, &st)) die(b->source);
        snprintf(source, sizeof source, "/proc/self/fd/%d", b->fd);
        bind_into_root(source, b->target, b->writable, S_ISDIR(st.st_mode));
        close(b->fd);
        b->fd = -1;
    }
}

/* In init (pid 1): build the jail's root filesystem and pivot into it. */
static void build_root(struct config *cfg) {
    char opts[64];
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL)) die("make mounts private");
    open_bind_sources(cfg);
    if (mount("tmpfs", NEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m"))
        die("mount root tmpfs");
    add_system_dirs();
    add_devices();
    add_user_binds(cfg);
    make_dirs("/proc");
    if (mount("proc", NEW_ROOT "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL))
        die("mount /proc");
    make_dirs("/tmp");
    /* nr_inodes: empty files use no blocks, so size= alone would not bound their inodes. */
    snprintf(opts, sizeof opts, "mode=1777,size=%llu,nr_inodes=16384", cfg->tmp_bytes);
    if (mount("tmpfs", NEW_ROOT "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, opts))
        die("mount /tmp tmpfs");
    if (chdir(NEW_ROOT)) die("chdir new root");
    if (syscall(SYS_pivot_root, ".", ".")) die("pivot_root");
    if (umount2(".", MNT_DETACH)) die("detach old root");
    if (chdir("/")) die("chdir /");
    if (mount(NULL, "/", NULL, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV, NULL))
        die("remount root read-only");
    if (sethostname("megacpp-sandbox", 15)) die("sethostname");
}

static void set_limit(int resource, unsigned long long soft, unsigned long long hard,
                      const char *what) {
    struct rlimit rl = {.rlim_cur = soft, .rlim_max = hard};
    if (setrlimit(resource, &rl)) die(what);
}

static void apply_limits(const struct config *cfg) {
    if (cfg->cpu_s) set_limit(RLIMIT_CPU, cfg->cpu_s, cfg->cpu_s + 1, "RLIMIT_CPU");
    if (cfg->as_bytes) set_limit(RLIMIT_AS, cfg->as_bytes, cfg->as_bytes, "RLIMIT_AS");
    if (cfg->fsize_bytes)
        set_limit(RLIMIT_FSIZE, cfg->fsize_bytes, cfg->fsize_bytes, "RLIMIT_FSIZE");
    if (cfg->nproc) set_limit(RLIMIT_NPROC, cfg->nproc, cfg->nproc, "RLIMIT_NPROC");
    if (cfg->nofile) set_limit(RLIMIT_NOFILE, cfg->nofile, cfg->nofile, "RLIMIT_NOFILE");
    set_limit(RLIMIT_CORE, 0, 0, "RLIMIT_CORE");
    if (setpriority(PRIO_PROCESS, 0, cfg->nice)) die("setpriority");
}

static void drop_root(const struct config *cfg) {
    if (setgroups(0, NULL)) die("setgroups");
    if (setresgid(cfg->drop_gid, cfg->drop_gid, cfg->drop_gid)) die("setresgid");
    if (setresuid(cfg->drop_uid, cfg->drop_uid, cfg->drop_uid)) die("setresuid");
}

/* Move this process (and so everything it starts) into the run's cgroup. */
static void join_cgroup(const char *dir) {
    char path[PATH_MAX], pid[32];
    if (snprintf(path, sizeof path, "%s/cgroup.procs", dir) >= (int)sizeof path) die_msg(dir);
    snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    write_file(path, pid);
}

/* Under memory pressure the OOM killer should pick the program, never the jail's init or
 * launcher (which report the outcome). Raising one's own score needs no privilege. */
static void prefer_for_oom_kill(void) {
    write_file("/proc/self/oom_score_adj", "1000\n");
}

/* In the program's own user namespace, where it still holds CAP_SYS_RESOURCE until exec:
 * allow zero child namespaces of any kind. A second wall behind the seccomp filter against
 * unshare(CLONE_NEWUSER | CLONE_NEWNS) + mount, with which a program could mount a tmpfs
 * outside the /tmp size cap and every rlimit. A kernel without a given sysctl skips it. */
static void forbid_nested_namespaces(void) {
    static const char *kinds[] = {"user", "mnt", "pid", "net", "ipc", "uts", "cgroup", "time"};
    for (size_t i = 0; i < sizeof kinds / sizeof kinds[0]; i++) {
        char path[64];
        snprintf(path, sizeof path, "/proc/sys/user/max_%s_namespaces", kinds[i]);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT) continue;
        if (fd < 0 || write(fd, "0\n", 2) != 2) die(path);
        close(fd);
    }
}

/* --- the seccomp filter ------------------------------------------------------------------- */

#if defined(__x86_64__)
#define JAIL_AUDIT_ARCH AUDIT_ARCH_X86_64
#elif defined(__aarch64__)
#define JAIL_AUDIT_ARCH AUDIT_ARCH_AARCH64
#else
#error "megacpp-jail's seccomp filter is written for x86_64 and aarch64"
#endif
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "megacpp-jail's seccomp filter reads the low half of a 64-bit argument (little-endian)"
#endif

/* Numbers of the newer mount calls, identical on every architecture; older headers lack them. */
#ifndef __NR_open_tree
#define __NR_open_tree 428
#endif
#ifndef __NR_move_mount
#define __NR_move_mount 429
#endif
#ifndef __NR_fsopen
#define __NR_fsopen 430
#endif
#ifndef __NR_fsconfig
#define __NR_fsconfig 431
#endif
#ifndef __NR_fsmount
#define __NR_fsmount 432
#endif
#ifndef __NR_fspick
#define __NR_fspick 433
#endif
#ifndef __NR_clone3
#define __NR_clone3 435
#endif
#ifndef __NR_mount_setattr
#define __NR_mount_setattr 442
#endif
#ifndef __NR_memfd_secret
#define __NR_memfd_secret 447
#endif
#ifndef __NR_open_tree_attr
#define __NR_open_tree_attr 467
#endif
#ifndef CLONE_NEWTIME
#define CLONE_NEWTIME 0x00000080
#endif

/* Any of these in clone()/unshare() flags creates a namespace. (In clone() the low byte is
 * the exit signal; a valid signal never sets 0x80, so CLONE_NEWTIME only meets bad calls.) */
#define NAMESPACE_FLAGS (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | \
                         CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWTIME)

#define DENY(nr, err)                                             \
    BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, (nr), 0, 1),              \
    BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ((err) & SECCOMP_RET_DATA))

/* Deny the program every way to a new namespace or a new mount, and the memory holders
 * that would escape RLIMIT_AS and the /tmp cap where no memory cgroup counts them. Inside a
 * new user namespace a program holds CAP_SYS_ADMIN over a new mount namespace and can mount
 * a tmpfs with no size limit: a way around every memory limit but a cgroup. */
static void install_seccomp(void) {
    struct sock_filter filter[] = {
        /* Another ABI's syscall numbers (int 0x80 on x86_64) would bypass the table. */
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, JAIL_AUDIT_ARCH, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_KILL_PROCESS),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
#if defined(__x86_64__)
        /* x32 ABI numbers (bit 30) reach the same kernel functions under other numbers. */
        BPF_JUMP(BPF_JMP | BPF_JGE | BPF_K, 0x40000000, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | ENOSYS),
#endif
        /* clone3 passes its flags in memory, which a filter cannot read: refuse the call as
         * unknown, and glibc (threads, posix_spawn) falls back to clone, checked below. */
        DENY(__NR_clone3, ENOSYS),
        /* Joining an existing namespace. */
        DENY(__NR_setns, EPERM),
        /* Mounting, unmounting, changing root: the classic and the file-descriptor API. */
        DENY(__NR_mount, EPERM),
        DENY(__NR_umount2, EPERM),
        DENY(__NR_pivot_root, EPERM),
        DENY(__NR_open_tree, EPERM),
        DENY(__NR_open_tree_attr, EPERM),
        DENY(__NR_move_mount, EPERM),
        DENY(__NR_fsopen, EPERM),
        DENY(__NR_fsconfig, EPERM),
        DENY(__NR_fsmount, EPERM),
        DENY(__NR_fspick, EPERM),
        DENY(__NR_mount_setattr, EPERM),
        /* Anonymous shared memory outside any address space and any tmpfs size cap: memfds
         * (up to RLIMIT_FSIZE each, per open file) and SysV segments (kept after exit). */
        DENY(__NR_memfd_create, EPERM),
        DENY(__NR_memfd_secret, EPERM),
        DENY(__NR_shmget, EPERM),
        DENY(__NR_msgget, EPERM),
        /* clone() and unshare(): allowed (threads, fork) unless a namespace flag is set. */
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_clone, 1, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_unshare, 0, 3),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, args[0])),
        BPF_JUMP(BPF_JMP | BPF_JSET | BPF_K, NAMESPACE_FLAGS, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog program = {
        .len = (unsigned short)(sizeof filter / sizeof filter[0]),
        .filter = filter,
    };
    /* Needs no_new_privs (set by the caller), so an unprivileged process may install it. */
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &program)) die("seccomp filter");
}

/* In the program's process: lose every privilege, apply limits, exec. Never returns. */
static void enter_program(const struct config *cfg) {
    prefer_for_oom_kill();
    if (cfg->namespaces) {
        if (cfg->caller_uid == 0) {
            drop_root(cfg);
            /* setresuid made us non-dumpable, which would hide /proc/self/uid_map. */
            if (prctl(PR_SET_DUMPABLE, 1)) die("PR_SET_DUMPABLE");
            enter_user_namespace(cfg->drop_uid, cfg->drop_uid, cfg->drop_gid, cfg->drop_gid);
        } else {
            /* We are uid 0 of the caller's namespace: become the caller's id again. The
             * capabilities the new namespace grants are dropped by execve (uid != 0). */
            enter_user_namespace(cfg->caller_uid, 0, cfg->caller_gid, 0);
        }
        forbid_nested_namespaces();
        if (chdir(cfg->cwd)) die(cfg->cwd);
    } else {
        if (cfg->caller_uid == 0) drop_root(cfg);
        if (fchdir(cfg->cwd_fd)) die(cfg->cwd);
    }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)) die("PR_SET_NO_NEW_PRIVS");
    /* After the user namespace, on purpose: RLIMIT_NPROC then counts the processes of this
     * namespace (this run) only, not every process of the uid on the host; namespaces the
     * program nests inside are capped by the same limit, which it cannot raise. */
    apply_limits(cfg);
    /* Every inherited fd above stderr closes at exec, the status fd included. */
    syscall(SYS_close_range, 3U, ~0U, 4U /* CLOSE_RANGE_CLOEXEC */);
    if (cfg->seccomp) install_seccomp();
    execve(cfg->argv[0], cfg->argv, (char **)cfg->env);
    die(cfg->argv[0]);
}

/* Fork the program, wait for it, report its wait status and resource use. */
static void supervise(const struct config *cfg) {
    pid_t child = fork();
    if (child < 0) die("fork program");
    if (child == 0) enter_program(cfg);
    int wstatus = 0;
    struct rusage ru;
    while (wait4(child, &wstatus, 0, &ru) < 0) {
        if (errno != EINTR) die("wait for program");
    }
    long long user_us = ru.ru_utime.tv_sec * 1000000LL + ru.ru_utime.tv_usec;
    long long sys_us = ru.ru_stime.tv_sec * 1000000LL + ru.ru_stime.tv_usec;
    report("exit %d %ld %lld %lld\n", wstatus, ru.ru_maxrss, user_us, sys_us);
    _exit(0);
}

int main(int argc, char **argv) {
    struct config cfg;
    parse_args(argc, argv, &cfg);
    status_fd = cfg.status_fd;
    if (status_fd >= 0 && fcntl(status_fd, F_SETFD, FD_CLOEXEC)) die("status fd");
    /* First, before any namespace or privilege change: every process of the run is then
     * charged to the run's cgroup, and the caller's permission on it is what counts. */
    if (cfg.cgroup) join_cgroup(cfg.cgroup);
    if (!cfg.namespaces) {
        /* Opened while still privileged: the dropped uid may not traverse its parents. */
        cfg.cwd_fd = open(cfg.cwd, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (cfg.cwd_fd < 0) die(cfg.cwd);
        supervise(&cfg);
    }

    if (cfg.caller_uid != 0) enter_user_namespace(0, cfg.caller_uid, 0, cfg.caller_gid);
    if (unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS))
        die("unshare mount/net/pid/ipc/uts namespaces");
    pid_t init = fork();
    if (init < 0) die("fork init");
    if (init == 0) {
        if (prctl(PR_SET_PDEATHSIG, SIGKILL)) die("PR_SET_PDEATHSIG");
        build_root(&cfg);
        supervise(&cfg);
    }
    int wstatus = 0;
    while (waitpid(init, &wstatus, 0) < 0) {
        if (errno != EINTR) die("wait for init");
    }
    return WIFEXITED(wstatus) ? WEXITSTATUS(wstatus) : JAIL_FAILED;
}
