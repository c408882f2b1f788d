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



def c_strings(paths: list[Path | str]) -> str:
    """Paths as a C initializer list of string literals."""
    return ", ".join(f'"{path}"' for path in paths)
