/* The C tests' support: checks that say where they failed, the test node's state (cluster.py's state.env),
 * buffers mapped from the files the agents registered, random bytes, and a monotonic clock. */
#ifndef HMC_TESTS_HARNESS_H
#define HMC_TESTS_HARNESS_H

#define _GNU_SOURCE
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "hmc/hmc.h"

#define CHECK(cond)                                                                          \
    do {                                                                                     \
        if (!(cond)) {                                                                       \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__, __LINE__, \
                    #cond, hmc_last_error());                                                \
            exit(1);                                                                         \
        }                                                                                    \
    } while (0)

/* `call` returns `want`; else fail naming what it returned. */
#define EXPECT(want, call)                                                                                  \
    do {                                                                                                    \
        hmc_status got_ = (call);                                                                           \
        if (got_ != (want)) {                                                                               \
            fprintf(stderr, "%s:%d: %s returned %s, not %s (last error: %s)\n", __FILE__, __LINE__, #call, \
                    hmc_status_name(got_), hmc_status_name(want), hmc_last_error());                        \
            exit(1);                                                                                        \
        }                                                                                                   \
    } while (0)

/* The value of `key` in $HMC_CAPI_STATE/state.env (a static copy, NULL when absent). */
static inline const char *state(const char *key) {
    static char values[32][512];
    static int used = 0;
    const char *dir = getenv("HMC_CAPI_STATE");
    CHECK(dir != NULL);
    char path[512];
    snprintf(path, sizeof path, "%s/state.env", dir);
    FILE *file = fopen(path, "r");
    CHECK(file != NULL);
    char line[1024];
    const char *found = NULL;
    size_t n = strlen(key);
    while (fgets(line, sizeof line, file)) {
        if (strncmp(line, key, n) == 0 && line[n] == '=') {
            line[strcspn(line, "\n")] = '\0';
            CHECK(used < 32);
            snprintf(values[used], sizeof values[used], "%s", line + n + 1);
            found = values[used++];
            break;
        }
    }
    fclose(file);
    return found;
}

typedef struct mapped {
    uint8_t *bytes;
    size_t size;
} mapped;

/* The bytes of a buffer the test node's agents registered (its file, mapped shared: both sides see writes). */
static inline mapped map_buffer(const char *name) {
    char key[128];
    snprintf(key, sizeof key, "%s.file", name);
    const char *path = state(key);
    CHECK(path != NULL);
    int fd = open(path, O_RDWR);
    CHECK(fd >= 0);
    struct stat info;
    CHECK(fstat(fd, &info) == 0);
    mapped m = {mmap(NULL, (size_t)info.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), (size_t)info.st_size};
    close(fd);
    CHECK(m.bytes != MAP_FAILED);
    return m;
}

static inline void unmap_buffer(mapped m) { munmap(m.bytes, m.size); }

/* xorshift64*: random bytes (never zeros throughout) from `seed`. */
static inline void random_bytes(uint8_t *out, size_t n, uint64_t seed) {
    uint64_t x = seed * 2654435761u + 88172645463325252ull;
    for (size_t i = 0; i < n; i += 8) {
        x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
        uint64_t v = x * 2685821657736338717ull;
        memcpy(out + i, &v, n - i < 8 ? n - i : 8);
    }
}

static inline double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static inline hmc_client *connect_unix(void) {
    hmc_client *client = NULL;
    EXPECT(HMC_OK, hmc_connect(state("socket"), NULL, NULL, 10.0, &client));
    return client;
}

#endif
