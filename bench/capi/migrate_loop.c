/* bench/capi_client.py's C side: `count` third-party migrations of `bytes` (one range) through hmcd with libhmc,
 * after `warmup` untimed ones; prints each one's seconds, one a line.
 *
 *     migrate_loop ADDRESS SRC DST BYTES WARMUP COUNT
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "hmc/hmc.h"

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s ADDRESS SRC DST BYTES WARMUP COUNT\n", argv[0]);
        return 2;
    }
    hmc_client *client = NULL;
    if (hmc_connect(argv[1], NULL, NULL, 30.0, &client) != HMC_OK) {
        fprintf(stderr, "connect: %s\n", hmc_last_error());
        return 1;
    }
    uint64_t zero = 0, bytes = strtoull(argv[4], NULL, 10);
    int warmup = atoi(argv[5]), count = atoi(argv[6]);
    for (int i = 0; i < warmup + count; ++i) {
        double started = now_s();
        hmc_transfer_status status;
        if (hmc_migrate(client, argv[2], argv[3], &zero, &zero, &bytes, 1, 30.0, &status) != HMC_OK) {
            fprintf(stderr, "migrate: %s\n", hmc_last_error());
            return 1;
        }
        if (i >= warmup) printf("%.9f\n", now_s() - started);
    }
    hmc_client_close(client);
    return 0;
}
