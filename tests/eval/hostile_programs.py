"""C++ programs that try to break out of, or break, the sandbox (shared by the tests)."""

from __future__ import annotations

from pathlib import Path

FORK_BOMB = r"""
#include <unistd.h>
int main() { while (true) fork(); }
"""

# Tries to escape RLIMIT_NPROC accounting by forking from fresh nested user namespaces.
NESTED_USERNS_FORK_BOMB = r"""
#include <sched.h>
#include <unistd.h>
int main() {
    for (int level = 0; level < 3; level++) { unshare(CLONE_NEWUSER); fork(); }
    while (true) { if (fork() == 0) unshare(CLONE_NEWUSER); }
}
"""

BUSY_LOOP = r"""
int main() { volatile unsigned long x = 0; while (true) x++; }
"""

SLEEPER = r"""
#include <unistd.h>
int main() { sleep(1000); return 0; }
"""

ALLOCATE_64_GB = r"""
#include <cstdio>
int main() {
    char *block = new char[64ULL << 30];
    block[0] = 1;
    std::printf("allocated\n");
    return block[0] - 1;
}
"""

GROW_UNTIL_REFUSED = r"""
#include <cstring>
#include <vector>
int main() {
    std::vector<char *> blocks;
    while (true) {                      // touch every MiB so the memory is real
        char *block = new char[1 << 20];
        std::memset(block, 1, 1 << 20);
        blocks.push_back(block);
    }
}
"""

WRITE_10_GB_FILE = r"""
#include <cstdio>
#include <vector>
int main() {
    std::vector<char> chunk(1 << 20, 'x');
    FILE *out = std::fopen("big.bin", "wb");
    if (!out) return 2;
    for (int i = 0; i < 10240; i++) std::fwrite(chunk.data(), 1, chunk.size(), out);
    std::fclose(out);
    return 0;
}
"""

ENDLESS_STDOUT = r"""
#include <cstdio>
int main() { while (true) std::puts("yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy"); }
"""

ENDLESS_STDERR = r"""
#include <cstdio>
int main() { while (true) std::fputs("error error error error error\n", stderr); }
"""

# Tries to create each path; prints what happened; exits 0 (the host checks the files).
WRITE_OUTSIDE = r"""
#include <cerrno>
#include <cstdio>
#include <cstring>
int main() {
    const char *paths[] = {PATHS};
    for (const char *path : paths) {
        FILE *f = std::fopen(path, "w");
        std::printf("%s: %s\n", path, f ? "created" : std::strerror(errno));
        if (f) { std::fputs("escaped", f); std::fclose(f); }
    }
    return 0;
}
"""

# Exit 0 only if every outside file is unreadable and the program's own binary is readable.
READ_OUTSIDE = r"""
#include <cerrno>
#include <cstdio>
#include <cstring>
static bool readable(const char *path) {
    FILE *f = std::fopen(path, "rb");
    std::printf("%s: %s\n", path, f ? "READ" : std::strerror(errno));
    if (!f) return false;
    std::fclose(f);
    return true;
}
int main(int, char **argv) {
    const char *secrets[] = {PATHS};
    bool leaked = false;
    for (const char *path : secrets) leaked |= readable(path);
    bool own = readable(argv[0]);
    return leaked ? 3 : (own ? 0 : 4);
}
"""

# Exit 0 only if neither connection succeeds.
CONNECT = r"""
#include <arpa/inet.h>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <sys/socket.h>
#include <unistd.h>
static bool connects(const char *ip, int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) { std::printf("socket: %s\n", std::strerror(errno)); return false; }
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    inet_pton(AF_INET, ip, &addr.sin_addr);
    bool ok = connect(fd, (sockaddr *)&addr, sizeof addr) == 0;
    std::printf("%s:%d: %s\n", ip, port, ok ? "CONNECTED" : std::strerror(errno));
    close(fd);
    return ok;
}
int main() {
    bool local = connects("127.0.0.1", PORT);
    bool outside = connects("1.1.1.1", 80);
    return (local || outside) ? 3 : 0;
}
"""

SIGNAL_HOST = r"""
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
int main() {
    int rc = kill(HOST_PID, SIGKILL);
    std::printf("kill(%d): %s\n", HOST_PID, rc == 0 ? "DELIVERED" : std::strerror(errno));
    return rc == 0 ? 3 : 0;
}
"""

TEMPLATE_BOMB = r"""
template <int... Is> struct List {};
template <class A, class B> struct Concat;
template <int... A, int... B> struct Concat<List<A...>, List<B...>> { using type = List<A..., B...>; };
template <int N> struct Bomb {
    using half = typename Bomb<N - 1>::type;
    using type = typename Concat<half, half>::type;     // 2^N template arguments
};
template <> struct Bomb<0> { using type = List<1>; };
int main() { typename Bomb<40>::type boom; (void)boom; }
"""

INCLUDE_DEV_ZERO = "#include </dev/zero>\nint main() { return 0; }\n"

# The memory escape found by a hostile review: a new user and mount namespace, its own uid
# map, a fresh tmpfs over /tmp (sized by the kernel at half of host RAM, not by the jail),
# then 1.9 GB written into it in files under the file-size limit. It exits 0 on success.
MOUNT_TMPFS_ESCAPE = r"""
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <unistd.h>
#include <vector>
static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY);
    if (fd >= 0) { write(fd, text, std::strlen(text)); close(fd); }
}
int main() {
    unsigned uid = getuid(), gid = getgid();
    if (unshare(CLONE_NEWUSER | CLONE_NEWNS)) { std::perror("unshare"); return 1; }
    char map[64];
    write_file("/proc/self/setgroups", "deny");
    std::snprintf(map, sizeof map, "0 %u 1", uid);
    write_file("/proc/self/uid_map", map);
    std::snprintf(map, sizeof map, "0 %u 1", gid);
    write_file("/proc/self/gid_map", map);
    if (mount("tmpfs", "/tmp", "tmpfs", 0, nullptr)) { std::perror("mount"); return 1; }
    std::vector<char> chunk(1 << 20, 'x');
    long written_mb = 0;
    for (int file = 0; written_mb < 1900; file++) {      // 4 MiB files: under RLIMIT_FSIZE
        char name[64];
        std::snprintf(name, sizeof name, "/tmp/fill%d", file);
        FILE *out = std::fopen(name, "wb");
        if (!out) break;
        for (int i = 0; i < 4; i++, written_mb++) std::fwrite(chunk.data(), 1, chunk.size(), out);
        std::fclose(out);
    }
    std::printf("wrote %ld MiB into a tmpfs of its own\n", written_mb);
    return 0;
}
"""

# Other ways to a namespace or a mount of one's own, or to memory outside every cap. Each
# body returns a syscall's result; the program prints "refused: <errno text>" and exits 0
# when it fails, "ESCAPED" and exits 3 when it succeeds.
ESCAPE_ATTEMPT = r"""
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <sched.h>
#include <sys/ipc.h>
#include <sys/mman.h>
#include <sys/mount.h>
#include <sys/shm.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
struct clone3_args { uint64_t flags, pidfd, child_tid, parent_tid, exit_signal, stack,
                     stack_size, tls; };
static long child_or_wait(long pid) {      // a clone that worked: the child leaves at once
    if (pid == 0) _exit(3);
    if (pid > 0) waitpid((pid_t)pid, nullptr, 0);
    return pid;
}
static long attempt() { ATTEMPT }
int main() {
    long rc = attempt();
    if (rc < 0) { std::printf("refused: %s\n", std::strerror(errno)); return 0; }
    std::printf("ESCAPED (%ld)\n", rc);
    return 3;
}
"""

EPERM, ENOSYS = "Operation not permitted", "Function not implemented"

# name -> (the attempt, the errno text the sandbox answers with)
ESCAPE_VARIANTS: dict[str, tuple[str, str]] = {
    "nested_unshare": ((
        "for (int level = 0; level < 3; level++) if (unshare(CLONE_NEWUSER)) return -1;"
        " return unshare(CLONE_NEWNS);"), EPERM),
    "unshare_mount_namespace": ("return unshare(CLONE_NEWNS);", EPERM),
    "clone_namespaces": ((
        "return child_or_wait(syscall(SYS_clone, CLONE_NEWUSER | CLONE_NEWNS | SIGCHLD,"
        " 0, 0, 0, 0));"), EPERM),
    "clone3_namespaces": ((
        "clone3_args args{}; args.flags = CLONE_NEWUSER | CLONE_NEWNS;"
        " args.exit_signal = SIGCHLD;"
        " return child_or_wait(syscall(SYS_clone3, &args, sizeof args));"), ENOSYS),
    "mount_tmpfs": ('return mount("tmpfs", "/tmp", "tmpfs", 0, "size=2g");', EPERM),
    "mount_proc": ((
        'mkdir("/tmp/proc", 0755);'
        ' return mount("proc", "/tmp/proc", "proc", 0, nullptr);'), EPERM),
    "umount": ('return umount2("/tmp", MNT_DETACH);', EPERM),
    "pivot_root": ((
        'mkdir("/tmp/old", 0755);'
        ' return syscall(SYS_pivot_root, "/tmp", "/tmp/old");'), EPERM),
    "setns": ((
        'int fd = open("/proc/self/ns/mnt", O_RDONLY); if (fd < 0) return -1;'
        " return setns(fd, CLONE_NEWNS);"), EPERM),
    "fsopen": ('return syscall(SYS_fsopen, "tmpfs", 0);', EPERM),
    "open_tree": ('return syscall(SYS_open_tree, AT_FDCWD, "/tmp", 1 /* OPEN_TREE_CLONE */);',
                  EPERM),
    "memfd": ('return memfd_create("hoard", 0);', EPERM),
    "sysv_shm": ("return shmget(IPC_PRIVATE, 64 << 20, IPC_CREAT | 0600);", EPERM),
}

# What the seccomp filter must leave alone: threads (clone3, then clone with CLONE_THREAD),
# fork, posix_spawn via popen, unshare of non-namespace state, anonymous shared mappings.
ORDINARY_PROCESSES = r"""
#include <cstdio>
#include <cstring>
#include <future>
#include <sched.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>
#include <vector>
int main() {
    std::vector<std::thread> threads;
    int sums[4] = {};
    for (int t = 0; t < 4; t++) threads.emplace_back([&sums, t] { for (int i = 0; i <= 100; i++) sums[t] += i; });
    for (auto &thread : threads) thread.join();
    auto later = std::async(std::launch::async, [] { return 42; });
    pid_t child = fork();
    if (child == 0) _exit(7);
    int status = 0;
    waitpid(child, &status, 0);
    FILE *echo = popen("echo spawned", "r");
    char line[32] = {};
    if (!echo || !std::fgets(line, sizeof line, echo)) return 10;
    pclose(echo);
    if (unshare(CLONE_FILES | CLONE_FS)) return 11;
    void *shared = mmap(nullptr, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) return 12;
    std::printf("%d %d %d %s", sums[0] + sums[3], later.get(), WEXITSTATUS(status), line);
    return 0;
}
"""

# Fills /tmp with SIZE_MB MiB in 4 MiB files (under RLIMIT_FSIZE); exits 1 when /tmp is full.
FILL_TMP = r"""
#include <cstdio>
#include <vector>
int main() {
    std::vector<char> chunk(1 << 20, 'x');
    for (int mb = 0, file = 0; mb < SIZE_MB; file++) {
        char name[64];
        std::snprintf(name, sizeof name, "/tmp/fill%d", file);
        FILE *out = std::fopen(name, "wb");
        if (!out) { std::perror("fopen"); return 1; }
        for (int i = 0; i < 4; i++, mb++) {
            if (std::fwrite(chunk.data(), 1, chunk.size(), out) != chunk.size()) {
                std::perror("fwrite");
                return 1;
            }
        }
        if (std::fclose(out)) { std::perror("fclose"); return 1; }
    }
    std::printf("wrote SIZE_MB MiB\n");
    return 0;
}
"""



def c_strings(paths: list[Path | str]) -> str:
    """Paths as a C initializer list of string literals."""
    return ", ".join(f'"{path}"' for path in paths)
