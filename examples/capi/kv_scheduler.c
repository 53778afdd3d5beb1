/* A scheduler in C: it watches hmcd's events and, when told to on stdin, migrates a request's KV blocks from
 * one agent's ConnBuffer to another's, through hmcd (libhmc; no Python in this process).
 *
 *     kv_scheduler ADDRESS SRC DST [TOKEN]
 *
 * stdin, one instruction a line:
 *     migrate REQUEST BLOCK_BYTES SRC_BLOCK:DST_BLOCK ...   move those blocks of REQUEST
 *     quit
 * It prints the buffer and agent events as they come, and for each request what moved, over which path.
 */
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hmc/hmc.h"

#define MAX_BLOCKS 65536

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static const char *event_name(hmc_event_kind kind) {
    switch (kind) {
        case HMC_EVENT_BUFFER_ADDED: return "buffer added";
        case HMC_EVENT_BUFFER_WITHDRAWN: return "buffer withdrawn";
        case HMC_EVENT_PEER_UP: return "peer up";
        case HMC_EVENT_PEER_DOWN: return "peer down";
        case HMC_EVENT_AGENT_UP: return "agent up";
        case HMC_EVENT_AGENT_DOWN: return "agent down";
        case HMC_EVENT_UNKNOWN: break;
    }
    return "event";
}

/* "migrate REQUEST BLOCK_BYTES a:b a:b ...": move the blocks; 0 when done, 1 when refused. */
static int migrate(hmc_client *client, const char *src, const char *dst, char *line) {
    static uint64_t so[MAX_BLOCKS], dof[MAX_BLOCKS], len[MAX_BLOCKS];
    char *save = NULL;
    strtok_r(line, " \t\n", &save);  /* "migrate" */
    const char *request = strtok_r(NULL, " \t\n", &save);
    const char *block_text = strtok_r(NULL, " \t\n", &save);
    if (request == NULL || block_text == NULL) {
        fprintf(stderr, "usage: migrate REQUEST BLOCK_BYTES SRC_BLOCK:DST_BLOCK ...\n");
        return 1;
    }
    uint64_t block = strtoull(block_text, NULL, 10);
    size_t count = 0;
    for (char *pair = strtok_r(NULL, " \t\n", &save); pair != NULL; pair = strtok_r(NULL, " \t\n", &save)) {
        unsigned long long from, to;
        if (count == MAX_BLOCKS || sscanf(pair, "%llu:%llu", &from, &to) != 2) {
            fprintf(stderr, "request %s: bad block pair %s\n", request, pair);
            return 1;
        }
        so[count] = from * block, dof[count] = to * block, len[count] = block;
        ++count;
    }
    hmc_path *path = NULL;
    if (hmc_negotiate(client, src, dst, &path) != HMC_OK) {
        fprintf(stderr, "request %s: no path %s -> %s: %s\n", request, src, dst, hmc_last_error());
        return 1;
    }
    double started = now_s();
    hmc_transfer_status status;
    hmc_status result = hmc_migrate(client, src, dst, so, dof, len, count, 60.0, &status);
    double ms = (now_s() - started) * 1e3;
    if (result != HMC_OK) {
        fprintf(stderr, "request %s: %s: %s\n", request, hmc_status_name(result), hmc_last_error());
        hmc_path_free(path);
        return 1;
    }
    printf("request %s: moved %zu blocks (%llu bytes) %s -> %s over %s in %.1f ms (%s)\n", request, count, (unsigned long long)status.bytes_done, src, dst,
           status.path, ms, hmc_path_reason(path));
    fflush(stdout);
    hmc_path_free(path);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s ADDRESS SRC DST [TOKEN]\n", argv[0]);
        return 2;
    }
    hmc_client *client = NULL;
    if (hmc_connect(argv[1], argc > 4 ? argv[4] : NULL, NULL, 10.0, &client) != HMC_OK) {
        fprintf(stderr, "connect %s: %s\n", argv[1], hmc_last_error());
        return 1;
    }
    hmc_events *events = NULL;
    if (hmc_events_subscribe(client, 1, &events) != HMC_OK) {
        fprintf(stderr, "subscribe: %s\n", hmc_last_error());
        hmc_client_close(client);
        return 1;
    }
    printf("watching hmcd at %s; migrating %s -> %s when told to\n", argv[1], argv[2], argv[3]);
    fflush(stdout);
    int failures = 0, open = 1;
    static char line[1 << 20];
    while (open) {
        struct pollfd ready[2] = {{.fd = 0, .events = POLLIN}, {.fd = hmc_events_fd(events), .events = POLLIN}};
        if (poll(ready, 2, -1) < 0) break;
        if (ready[1].revents) {
            hmc_event event;
            hmc_status got;
            while ((got = hmc_events_next(events, 0.0, &event)) == HMC_OK) {
                printf("event %llu: %s %s on %s\n", (unsigned long long)event.sequence, event_name(event.kind),
                       event.buffer_name[0] ? event.buffer_name : event.agent_id, event.node);
            }
            if (got != HMC_ERR_TIMEOUT) {
                fprintf(stderr, "events ended: %s: %s\n", hmc_status_name(got), hmc_last_error());
                failures++, open = 0;
            }
            fflush(stdout);
        }
        if (ready[0].revents) {
            if (fgets(line, sizeof line, stdin) == NULL || strncmp(line, "quit", 4) == 0) break;
            if (strncmp(line, "migrate", 7) == 0) failures += migrate(client, argv[2], argv[3], line);
        }
    }
    hmc_events_close(events);
    hmc_client_close(client);
    return failures ? 1 : 0;
}
