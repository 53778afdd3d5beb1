/* libhmc: the C ABI of HMC, for schedulers written in C or C++.
 *
 * A client of one hmcd (the node daemon) over its gRPC contract (proto/hmc/v1): node info and
 * devices, ConnBuffers by name or id across nodes, path negotiation with the reasons, third-party
 * transfers (submit, poll, wait, cancel, migrate), events, metrics. No Python in the process.
 *
 *     hmc_client *c;
 *     if (hmc_connect("unix:/run/user/1000/hmc/hmcd.sock", NULL, NULL, 10.0, &c) != HMC_OK)
 *         fprintf(stderr, "%s\n", hmc_last_error());
 *     hmc_transfer_status st;
 *     hmc_migrate(c, "prefill-kv", "decode-kv", src, dst, len, n, 30.0, &st);
 *     hmc_client_close(c);
 *
 * Status codes. Every call returns an hmc_status. The codes are the wire's ErrorCode and the Python
 * exception tree (hmc.errors), one table below; on failure hmc_last_error() holds the message, on
 * the calling thread, until that thread's next failing call.
 *
 * Deadlines. Every call that talks to hmcd is bounded: by the client's timeout (hmc_connect), or
 * by the call's own timeout where it takes one. A timeout is seconds, finite, in (0, 1e6];
 * anything else (NaN, zero, negative, huge) is HMC_ERR_INVALID_ARGUMENT before anything is sent.
 *
 * Ownership. Objects a call returns through an out-pointer belong to the caller and are freed by
 * their *_free / *_close function (NULL is accepted and ignored). Strings returned by accessors
 * belong to their object and live as long as it does, unless the accessor says otherwise.
 *
 * Thread safety. An hmc_client may be used by several threads at once (calls on it are
 * independent); it must outlive every object made through it and must not be closed while
 * another thread uses it. Every other object (node info, buffer, buffer list, path, transfer,
 * event subscription) is for one thread at a time. hmc_last_error() is per thread.
 */
#ifndef HMC_HMC_H
#define HMC_HMC_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define HMC_API __attribute__((visibility("default")))
#else
#define HMC_API
#endif

/* Status codes: the value is the wire's hmc.v1.ErrorCode; the comment names the Python exception
 * (hmc.errors) of the same code. tests/test_libhmc.py checks that both sides agree. */
typedef enum hmc_status {
    HMC_OK = 0,
    HMC_ERR_INTERNAL = 1,          /* HMCError */
    HMC_ERR_INVALID_ARGUMENT = 2,  /* ArgumentError */
    HMC_ERR_OUT_OF_RANGE = 3,      /* OutOfRangeError */
    HMC_ERR_ACCESS_DENIED = 4,     /* AccessDeniedError */
    HMC_ERR_UNKNOWN_BUFFER = 5,    /* UnknownBufferError */
    HMC_ERR_BUFFER_WITHDRAWN = 6,  /* BufferWithdrawnError */
    HMC_ERR_AUTHENTICATION = 7,    /* AuthenticationError */
    HMC_ERR_PROTOCOL = 8,          /* ProtocolError */
    HMC_ERR_VERSION_MISMATCH = 9,  /* VersionMismatchError */
    HMC_ERR_TIMEOUT = 10,          /* TimeoutError */
    HMC_ERR_CANCELLED = 11,        /* CancelledError */
    HMC_ERR_PEER_LOST = 12,        /* BrokenResourceError */
    HMC_ERR_CLOSED = 13,           /* ClosedResourceError */
    HMC_ERR_BUSY = 14,             /* BusyResourceError */
    HMC_ERR_NO_PATH = 15,          /* NoPathError */
    HMC_ERR_UNSUPPORTED = 16,      /* UnsupportedError */
    HMC_ERR_DEVICE = 17,           /* DeviceError */
    HMC_ERR_UNAVAILABLE = 18,      /* UnavailableError */
    HMC_ERR_STALE_DESCRIPTOR = 19  /* StaleDescriptorError */
} hmc_status;

/* "HMC_ERR_TIMEOUT" for HMC_ERR_TIMEOUT; "HMC_ERR_UNKNOWN" for a value outside the table. */
HMC_API const char *hmc_status_name(hmc_status status);

/* The message of this thread's last failed call ("" when none failed yet). Valid until this
 * thread's next libhmc call that fails. */
HMC_API const char *hmc_last_error(void);

/* The version of this library, e.g. "0.1.0". */
HMC_API const char *hmc_version(void);

/* -- the client -------------------------------------------------------------------------- */

typedef struct hmc_client hmc_client;

/* Connect to hmcd at `address`: "unix:/path/hmcd.sock" (the socket and its directory must belong
 * to this user or root and be closed to others, and the path hold no symlinked directory and no
 * "..": HMC_ERR_AUTHENTICATION otherwise; a token or a CA with it, or a '%', '?' or '#' in the path,
 * which gRPC would not take literally, is HMC_ERR_INVALID_ARGUMENT) or
 * "host:port" (TCP; `token`, when not NULL, printable ASCII, goes with every call; `tls_ca`, when not
 * NULL, is a PEM file of CA certificates: TLS, trusting that CA only). `timeout_s` bounds every later call that takes no timeout of its own.
 * Returns once hmcd answered (HMC_ERR_UNAVAILABLE naming the address when nothing serves there
 * within the timeout). */
HMC_API hmc_status hmc_connect(const char *address, const char *token, const char *tls_ca, double timeout_s, hmc_client **out);
HMC_API void hmc_client_close(hmc_client *client);

/* -- the node ---------------------------------------------------------------------------- */

/* 0 in any of the enums below: a value this library does not know (from a newer hmcd). */
typedef enum hmc_device_kind { HMC_DEVICE_UNKNOWN = 0, HMC_DEVICE_HOST = 1, HMC_DEVICE_CUDA = 2, HMC_DEVICE_HIP = 3 } hmc_device_kind;
typedef enum hmc_vendor { HMC_VENDOR_UNKNOWN = 0, HMC_VENDOR_HOST = 1, HMC_VENDOR_NVIDIA = 2, HMC_VENDOR_AMD = 3 } hmc_vendor;

typedef struct hmc_device {
    const char *name;      /* "cuda:0", "hip:1", "host" */
    hmc_device_kind kind;
    hmc_vendor vendor;     /* as declared (a device may be declared another vendor's) */
    int index;
    uint64_t total_memory; /* bytes; 0 when unknown */
    const char *model;
} hmc_device;

typedef struct hmc_node_info hmc_node_info;

HMC_API hmc_status hmc_node_info_get(hmc_client *client, hmc_node_info **out);
HMC_API const char *hmc_node_info_node(const hmc_node_info *info);
HMC_API const char *hmc_node_info_host_id(const hmc_node_info *info);
HMC_API const char *hmc_node_info_version(const hmc_node_info *info);
HMC_API int hmc_node_info_agents(const hmc_node_info *info);
HMC_API int hmc_node_info_buffers(const hmc_node_info *info);
HMC_API size_t hmc_node_info_device_count(const hmc_node_info *info);
/* Device `i` (< hmc_node_info_device_count); its strings live as long as `info`. */
HMC_API hmc_status hmc_node_info_device(const hmc_node_info *info, size_t i, hmc_device *out);
HMC_API void hmc_node_info_free(hmc_node_info *info);

/* Prometheus exposition text of the node; free it with hmc_string_free. */
HMC_API hmc_status hmc_metrics(hmc_client *client, char **text);
HMC_API void hmc_string_free(char *text);

/* -- buffers ----------------------------------------------------------------------------- */

/* A ConnBuffer's descriptor. A buffer is named by a `ref`: its name, or "id:<id>". */
typedef struct hmc_buffer hmc_buffer;
typedef struct hmc_buffer_list hmc_buffer_list;

/* The ConnBuffer `ref`, here or at a node the directory knows (HMC_ERR_UNKNOWN_BUFFER if none). */
HMC_API hmc_status hmc_lookup(hmc_client *client, const char *ref, hmc_buffer **out);
/* The ConnBuffers of this node, and of the other nodes its directory knows unless `local_only`. */
HMC_API hmc_status hmc_list_buffers(hmc_client *client, int local_only, hmc_buffer_list **out);
HMC_API size_t hmc_buffer_list_count(const hmc_buffer_list *list);
/* Entry `i` (< count), owned by the list; NULL past the end. */
HMC_API const hmc_buffer *hmc_buffer_list_at(const hmc_buffer_list *list, size_t i);
HMC_API void hmc_buffer_list_free(hmc_buffer_list *list);

HMC_API const char *hmc_buffer_id(const hmc_buffer *buffer);
HMC_API const char *hmc_buffer_name(const hmc_buffer *buffer);
HMC_API const char *hmc_buffer_node(const hmc_buffer *buffer);     /* the owner agent's node */
HMC_API const char *hmc_buffer_device(const hmc_buffer *buffer);   /* "host", "cuda:0", ... */
HMC_API uint64_t hmc_buffer_size(const hmc_buffer *buffer);
HMC_API void hmc_buffer_free(hmc_buffer *buffer);

/* -- paths ------------------------------------------------------------------------------- */

typedef struct hmc_path hmc_path;

/* The path hmcd would choose from `src` to `dst` ("ipc", "staged", ...), why, and why every better
 * path was refused. */
HMC_API hmc_status hmc_negotiate(hmc_client *client, const char *src, const char *dst, hmc_path **out);
HMC_API const char *hmc_path_name(const hmc_path *path);
HMC_API const char *hmc_path_reason(const hmc_path *path);
HMC_API size_t hmc_path_rejected_count(const hmc_path *path);
/* Rejected path `i`'s name and reason; NULL past the end. */
HMC_API const char *hmc_path_rejected_name(const hmc_path *path, size_t i);
HMC_API const char *hmc_path_rejected_reason(const hmc_path *path, size_t i);
HMC_API void hmc_path_free(hmc_path *path);

/* -- third-party transfers ---------------------------------------------------------------- */

typedef enum hmc_transfer_state {
    HMC_TRANSFER_UNKNOWN = 0,
    HMC_TRANSFER_PENDING = 1,
    HMC_TRANSFER_RUNNING = 2,
    HMC_TRANSFER_DONE = 3,
    HMC_TRANSFER_FAILED = 4,
    HMC_TRANSFER_CANCELLED = 5
} hmc_transfer_state;

typedef struct hmc_transfer_status {
    hmc_transfer_state state;
    hmc_status error;      /* why it FAILED (or was CANCELLED); HMC_OK otherwise */
    uint64_t bytes_total;
    uint64_t bytes_done;
    const char *path;      /* the path it took ("" until known); valid until the next call on its transfer */
} hmc_transfer_status;     /* a call that fills one sets every field, to zeros and "" when it knows nothing */

typedef struct hmc_transfer hmc_transfer;

/* Ask hmcd to move `count` ranges of `src` into `dst` (src_offsets[i], dst_offsets[i], lengths[i];
 * each below 2^63); the agent owning `src` moves them. Returns once hmcd accepted it (PENDING).
 * `timeout_s` bounds the transfer itself. Ranges outside a buffer are HMC_ERR_OUT_OF_RANGE and
 * nothing is moved. */
HMC_API hmc_status hmc_submit(hmc_client *client, const char *src, const char *dst, const uint64_t *src_offsets, const uint64_t *dst_offsets,
                              const uint64_t *lengths, size_t count, double timeout_s, hmc_transfer **out);
HMC_API const char *hmc_transfer_id(const hmc_transfer *transfer);
/* The transfer's status now, without waiting (the last known one when hmcd does not answer). */
HMC_API hmc_status hmc_poll(hmc_client *client, hmc_transfer *transfer, hmc_transfer_status *out);
/* Wait up to `timeout_s` for the transfer to end: HMC_OK once DONE; its error once FAILED;
 * HMC_ERR_CANCELLED once cancelled; HMC_ERR_TIMEOUT if it is still running then. `out` (may be
 * NULL) gets its last known status either way. Against an hmcd that stopped answering it returns
 * at most 1 s after `timeout_s`. */
HMC_API hmc_status hmc_wait(hmc_client *client, hmc_transfer *transfer, double timeout_s, hmc_transfer_status *out);
/* Cancel the transfer (best effort: ranges already moved stay moved; nothing lands after it ends). */
HMC_API hmc_status hmc_cancel(hmc_client *client, hmc_transfer *transfer);
HMC_API void hmc_transfer_free(hmc_transfer *transfer);

/* hmc_submit then hmc_wait (KV-cache blocks from one agent's buffer to another's): HMC_OK once
 * every byte landed. hmcd fails a migration at `timeout_s`; its verdict is waited for 5 s longer.
 * A migration that has not ended then (or whose wait fails) is cancelled before the call returns
 * its error (best effort, within 1 s; the agent executing it stops at its own deadline in any
 * case). Against an hmcd that stopped answering after the submit the call returns within
 * `timeout_s` + 7 s. `out` (may be NULL) gets the last
 * known status; its `path` is valid until the next hmc_migrate on this thread. */
HMC_API hmc_status hmc_migrate(hmc_client *client, const char *src, const char *dst, const uint64_t *src_offsets, const uint64_t *dst_offsets,
                               const uint64_t *lengths, size_t count, double timeout_s, hmc_transfer_status *out);

/* -- events ------------------------------------------------------------------------------ */

typedef enum hmc_event_kind {
    HMC_EVENT_UNKNOWN = 0,
    HMC_EVENT_BUFFER_ADDED = 1,
    HMC_EVENT_BUFFER_WITHDRAWN = 2,
    HMC_EVENT_PEER_UP = 3,
    HMC_EVENT_PEER_DOWN = 4,
    HMC_EVENT_AGENT_UP = 5,
    HMC_EVENT_AGENT_DOWN = 6
} hmc_event_kind;

typedef struct hmc_event {
    hmc_event_kind kind;
    uint64_t sequence;
    double time;           /* seconds since the epoch, hmcd's clock */
    const char *node;
    const char *buffer_id; /* "" unless a buffer event */
    const char *buffer_name;
    const char *agent_id;
    const char *peer;
} hmc_event;               /* strings valid until the next hmc_events_next on its subscription */

typedef struct hmc_events hmc_events;

/* Subscribe to hmcd's events (also its peers' with `include_peers`); returns once subscribed (hmcd's
 * refusal as its error). The subscription keeps its own connection: it may outlive its client. Up to
 * 65536 events wait to be taken; a subscriber that falls further behind has its subscription ended
 * with HMC_ERR_BUSY. */
HMC_API hmc_status hmc_events_subscribe(hmc_client *client, int include_peers, hmc_events **out);
/* A file descriptor that is readable while events wait to be taken (or the subscription ended):
 * for poll/epoll in a scheduler's event loop. Owned by the subscription. */
HMC_API int hmc_events_fd(const hmc_events *events);
/* The next event, waiting up to `timeout_s` (0: do not wait): HMC_ERR_TIMEOUT when none came;
 * the subscription's end as its error (HMC_ERR_UNAVAILABLE when hmcd went away, or stopped answering
 * keepalive pings: within about 15 s). */
HMC_API hmc_status hmc_events_next(hmc_events *events, double timeout_s, hmc_event *out);
HMC_API void hmc_events_close(hmc_events *events);

#ifdef __cplusplus
}
#endif

#endif /* HMC_HMC_H */
