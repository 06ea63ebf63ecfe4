/* A turn command for bench_gate.py that costs almost nothing to start.
 *
 *   stamp LOG HOLD_MS      or      stamp LOG -
 *
 * Its first action appends "S <turn> <mind> <ns>" to LOG, CLOCK_MONOTONIC in ns; it
 * then sleeps HOLD_MS (with "-": the number that is the first delivery's message, read
 * from the turn's stdin after the start stamp) and, as its last action, appends "E <turn> <mind> <ns>" and
 * exits. Each line is one write() to an O_APPEND file, so concurrent turns never
 * interleave. The turn id and mind come from VOLUTE_TURN_ID / VOLUTE_MIND.
 * Built static at bench time: exec of a static binary skips the dynamic loader.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static void stamp(int fd, char kind) {
    struct timespec ts;
    char line[256];
    clock_gettime(CLOCK_MONOTONIC, &ts);
    const char *turn = getenv("VOLUTE_TURN_ID");
    const char *mind = getenv("VOLUTE_MIND");
    int n = snprintf(line, sizeof line, "%c %s %s %lld\n", kind, turn ? turn : "-",
                     mind ? mind : "-", (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    if (write(fd, line, (size_t)n) != n) _exit(111);
}

int main(int argc, char **argv) {
    if (argc != 3) return 64;
    int fd = open(argv[1], O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) return 73;
    stamp(fd, 'S');
    long ms = 0;
    if (strcmp(argv[2], "-") == 0) {
        static char buf[65536];
        ssize_t got = read(0, buf, sizeof buf - 1);
        buf[got > 0 ? got : 0] = 0;
        const char *key = strstr(buf, "\"message\": \"");
        if (key) ms = strtol(key + 12, NULL, 10);
    } else {
        ms = strtol(argv[2], NULL, 10);
    }
    struct timespec hold = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&hold, &hold) != 0) {
    }
    stamp(fd, 'E');
    return 0;
}
