/* libhmc's C test suite, against the real hmcd and agents of cluster.py ($HMC_CAPI_STATE): every call, and
 * bad input (NULL handles, out-of-range ranges, unknown buffers, wrong token, deadline expiry, cancel,
 * hmcd gone mid-call) returning its status with the destination's poisoned bytes unchanged.
 *
 *     capi_tests NAME    runs one test (ctest runs each as its own test)
 */
#include <errno.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>

#include "harness.h"

#define POISON 0xA5
#define MIB (1u << 20)

/* Every byte of `dst` outside [at, at + n) is still POISON. */
static int poisoned_outside(const mapped *dst, size_t at, size_t n) {
    for (size_t i = 0; i < dst->size; ++i) {
        if ((i < at || i >= at + n) && dst->bytes[i] != POISON) return 0;
    }
    return 1;
}

static int all_poison(const mapped *m) { return poisoned_outside(m, 0, 0); }

/* capi-src filled with random bytes from `seed`, capi-dst poisoned, both mapped. */
static void fresh_pair(uint64_t seed, mapped *src, mapped *dst) {
    *src = map_buffer("capi-src"), *dst = map_buffer("capi-dst");
    random_bytes(src->bytes, src->size, seed);
    memset(dst->bytes, POISON, dst->size);
}

/* `argv` (a program and its arguments) started in the background: an agent or a fake hmcd of cluster.py. */
static pid_t start_process(char *const argv[]) {
    pid_t parent = getpid();
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);  /* a test that fails (exits) takes it along */
        if (getppid() != parent) _exit(127);
        execv(argv[0], argv);
        _exit(127);
    }
    return child;
}

static void await_file(const char *path, double seconds) {
    double deadline = now_s() + seconds;
    while (access(path, F_OK) != 0) {
        CHECK(now_s() < deadline);
        usleep(50000);
    }
}

static void test_status_table(void) {
    CHECK(strcmp(hmc_status_name(HMC_OK), "HMC_OK") == 0);
    CHECK(strcmp(hmc_status_name(HMC_ERR_TIMEOUT), "HMC_ERR_TIMEOUT") == 0);
    CHECK(strcmp(hmc_status_name(HMC_ERR_STALE_DESCRIPTOR), "HMC_ERR_STALE_DESCRIPTOR") == 0);
    CHECK(strcmp(hmc_status_name((hmc_status)20), "HMC_ERR_UNKNOWN") == 0);
    CHECK(strcmp(hmc_status_name((hmc_status)-1), "HMC_ERR_UNKNOWN") == 0);
    CHECK(strcmp(hmc_last_error(), "") == 0);
    CHECK(strlen(hmc_version()) > 0);
    static const char *const names[] = {"HMC_OK", "HMC_ERR_INTERNAL", "HMC_ERR_INVALID_ARGUMENT", "HMC_ERR_OUT_OF_RANGE", "HMC_ERR_ACCESS_DENIED",
                                        "HMC_ERR_UNKNOWN_BUFFER", "HMC_ERR_BUFFER_WITHDRAWN", "HMC_ERR_AUTHENTICATION", "HMC_ERR_PROTOCOL",
                                        "HMC_ERR_VERSION_MISMATCH", "HMC_ERR_TIMEOUT", "HMC_ERR_CANCELLED", "HMC_ERR_PEER_LOST", "HMC_ERR_CLOSED",
                                        "HMC_ERR_BUSY", "HMC_ERR_NO_PATH", "HMC_ERR_UNSUPPORTED", "HMC_ERR_DEVICE", "HMC_ERR_UNAVAILABLE",
                                        "HMC_ERR_STALE_DESCRIPTOR"};
    for (int code = 0; code < 20; ++code) CHECK(strcmp(hmc_status_name((hmc_status)code), names[code]) == 0);
}

static void test_connect_bad_input(void) {
    hmc_client *client = (hmc_client *)0x1;
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_connect(state("socket"), NULL, NULL, 10.0, NULL));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_connect(NULL, NULL, NULL, 10.0, &client));
    CHECK(client == NULL);
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_connect("", NULL, NULL, 10.0, &client));
    const double bad[] = {NAN, INFINITY, 0.0, -1.0, 1e7};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; ++i) EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_connect(state("socket"), NULL, NULL, bad[i], &client));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_connect("unix:", NULL, NULL, 10.0, &client));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_connect(state("socket"), "a-token", NULL, 10.0, &client));  /* tokens are for TCP */
    CHECK(strstr(hmc_last_error(), "TCP") != NULL);
    /* nothing serves there: UNAVAILABLE within the deadline, naming the address */
    char missing[600];
    snprintf(missing, sizeof missing, "unix:%s/nobody.sock", state("dir"));
    double started = now_s();
    EXPECT(HMC_ERR_UNAVAILABLE, hmc_connect(missing, NULL, NULL, 0.5, &client));
    CHECK(now_s() - started < 5.0);
    CHECK(strstr(hmc_last_error(), "nobody.sock") != NULL);
    CHECK(client == NULL);
}

static void test_connect_refuses_an_untrusted_socket(void) {
    /* a socket in a directory others may write to: refused before anything is sent */
    char dir[600], path[700];
    snprintf(dir, sizeof dir, "%s/open-dir", state("dir"));
    mkdir(dir, 0777);
    CHECK(chmod(dir, 0777) == 0);
    snprintf(path, sizeof path, "%s/hmcd.sock", dir);
    unlink(path);
    int fd = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un address = {.sun_family = AF_UNIX};
    CHECK(strlen(path) < sizeof address.sun_path);
    memcpy(address.sun_path, path, strlen(path) + 1);
    CHECK(bind(fd, (struct sockaddr *)&address, sizeof address) == 0);
    CHECK(listen(fd, 1) == 0);
    char target[720];
    snprintf(target, sizeof target, "unix:%s", path);
    hmc_client *client = NULL;
    EXPECT(HMC_ERR_AUTHENTICATION, hmc_connect(target, NULL, NULL, 2.0, &client));
    CHECK(strstr(hmc_last_error(), "open to others") != NULL);
    /* the real socket, reached through a symlinked directory, however the path is spelled: refused too */
    char link[600], through[700];
    snprintf(link, sizeof link, "%s/linked-dir", state("dir"));
    unlink(link);
    CHECK(symlink(state("dir"), link) == 0);
    const char *spellings[] = {"%s/node.sock", "%s//node.sock", "%s/./node.sock", "%s/.//./node.sock"};
    for (size_t i = 0; i < sizeof spellings / sizeof spellings[0]; ++i) {
        char path_through[650];
        snprintf(path_through, sizeof path_through, spellings[i], link);
        snprintf(through, sizeof through, "unix:%s", path_through);
        EXPECT(HMC_ERR_AUTHENTICATION, hmc_connect(through, NULL, NULL, 2.0, &client));
        CHECK(strstr(hmc_last_error(), "symlink") != NULL);
    }
    snprintf(through, sizeof through, "unix:%s/../%s/node.sock", link, strrchr(state("dir"), '/') + 1);
    EXPECT(HMC_ERR_AUTHENTICATION, hmc_connect(through, NULL, NULL, 2.0, &client));
    /* the real socket linked into the open directory: gRPC percent-decodes the path and ends it at '?' or '#', so
     * these reach it while the path checked is another (or none): refused as written */
    char linked[650];
    snprintf(linked, sizeof linked, "%s/node.sock", dir);
    unlink(linked);
    CHECK(linkat(AT_FDCWD, state("socket") + strlen("unix:"), AT_FDCWD, linked, 0) == 0);  /* link(): shadowed here */
    const char *encoded[] = {"unix:%s/open%%2ddir/node.sock", "unix:%s/open-dir/node.sock?/x", "unix:%s/open-dir/node.sock#/x",
                             "unix:%s/linked-dir/%%2e%%2e/open-dir/node.sock", "unix://%s/open%%2Ddir/node.sock"};
    for (size_t i = 0; i < sizeof encoded / sizeof encoded[0]; ++i) {
        snprintf(through, sizeof through, encoded[i], state("dir"));
        double started = now_s();
        EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_connect(through, NULL, NULL, 2.0, &client));
        CHECK(strstr(hmc_last_error(), "'%'") != NULL && now_s() - started < 1.0 && client == NULL);
    }
    snprintf(through, sizeof through, "unix:%s", linked);
    EXPECT(HMC_ERR_AUTHENTICATION, hmc_connect(through, NULL, NULL, 2.0, &client));
    unlink(linked);
    unlink(link);
    /* the real socket, spelled with "//" and "/./" but no link: accepted */
    snprintf(through, sizeof through, "unix:%s//./node.sock", state("dir"));
    EXPECT(HMC_OK, hmc_connect(through, NULL, NULL, 10.0, &client));
    hmc_client_close(client);
    close(fd);
}

static void test_tcp_token_and_tls(void) {
    hmc_client *client = NULL;
    EXPECT(HMC_OK, hmc_connect(state("tcp"), state("token"), state("ca"), 10.0, &client));
    hmc_node_info *info = NULL;
    EXPECT(HMC_OK, hmc_node_info_get(client, &info));
    CHECK(strcmp(hmc_node_info_node(info), "node") == 0);
    hmc_node_info_free(info);
    hmc_client_close(client);
    client = NULL;
    EXPECT(HMC_ERR_AUTHENTICATION, hmc_connect(state("tcp"), "wrong-token", state("ca"), 10.0, &client));
    CHECK(client == NULL);
    EXPECT(HMC_ERR_AUTHENTICATION, hmc_connect(state("tcp"), NULL, state("ca"), 10.0, &client));
    /* a token with a control character (a newline read along with it) or past ASCII: refused here, at once */
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_connect(state("tcp"), "capi-test-token\n", state("ca"), 10.0, &client));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_connect(state("tcp"), "tok\xc3\xa9n", state("ca"), 10.0, &client));
    /* a CA file that holds no certificate: refused at once, not after the timeout */
    char bogus[600];
    snprintf(bogus, sizeof bogus, "%s/ext.cnf", state("dir"));
    double started = now_s();
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_connect(state("tcp"), state("token"), bogus, 10.0, &client));
    CHECK(now_s() - started < 2.0);
    char missing[600];
    snprintf(missing, sizeof missing, "%s/no-such-ca.pem", state("dir"));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_connect(state("tcp"), state("token"), missing, 10.0, &client));
    /* plaintext against a TLS listener never gets an answer: UNAVAILABLE at the deadline */
    EXPECT(HMC_ERR_UNAVAILABLE, hmc_connect(state("tcp"), state("token"), NULL, 1.0, &client));
}

static void test_node_devices_and_metrics(void) {
    hmc_client *client = connect_unix();
    hmc_node_info *info = NULL;
    EXPECT(HMC_OK, hmc_node_info_get(client, &info));
    CHECK(strcmp(hmc_node_info_node(info), "node") == 0);
    CHECK(strlen(hmc_node_info_host_id(info)) > 0 && strlen(hmc_node_info_version(info)) > 0);
    CHECK(hmc_node_info_agents(info) == 2 && hmc_node_info_buffers(info) == 4);  /* this node's: not the far one's */
    size_t count = hmc_node_info_device_count(info);
    CHECK(count >= 1);
    int host = 0;
    for (size_t i = 0; i < count; ++i) {
        hmc_device device;
        EXPECT(HMC_OK, hmc_node_info_device(info, i, &device));
        host |= device.kind == HMC_DEVICE_HOST && strcmp(device.name, "host") == 0;
    }
    CHECK(host);
    hmc_device device;
    EXPECT(HMC_ERR_OUT_OF_RANGE, hmc_node_info_device(info, count, &device));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_node_info_device(info, 0, NULL));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_node_info_device(NULL, 0, &device));
    hmc_node_info_free(info);
    char *text = NULL;
    EXPECT(HMC_OK, hmc_metrics(client, &text));
    CHECK(strstr(text, "hmc_") != NULL);
    hmc_string_free(text);
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_metrics(client, NULL));
    hmc_client_close(client);
}

static void test_null_handles(void) {
    hmc_node_info *info = (hmc_node_info *)0x1;
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_node_info_get(NULL, &info));
    CHECK(info == NULL);
    hmc_buffer *buffer = NULL;
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_lookup(NULL, "capi-src", &buffer));
    hmc_buffer_list *list = NULL;
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_list_buffers(NULL, 0, &list));
    hmc_path *path = NULL;
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_negotiate(NULL, "capi-src", "capi-dst", &path));
    uint64_t zero = 0, one = 1;
    hmc_transfer *transfer = NULL;
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_submit(NULL, "capi-src", "capi-dst", &zero, &zero, &one, 1, 10.0, &transfer));
    hmc_transfer_status status;
    memset(&status, 0x5a, sizeof status);
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_wait(NULL, NULL, 1.0, &status));
    CHECK(status.state == HMC_TRANSFER_UNKNOWN && status.error == HMC_OK && status.bytes_done == 0 && strcmp(status.path, "") == 0);
    memset(&status, 0x5a, sizeof status);
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_poll(NULL, NULL, &status));
    CHECK(status.state == HMC_TRANSFER_UNKNOWN && status.error == HMC_OK && status.bytes_done == 0 && strcmp(status.path, "") == 0);
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_wait(NULL, NULL, 1.0, &status));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_cancel(NULL, NULL));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_migrate(NULL, "capi-src", "capi-dst", &zero, &zero, &one, 1, 10.0, &status));
    hmc_events *events = NULL;
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_events_subscribe(NULL, 0, &events));
    hmc_event event;
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_events_next(NULL, 0.0, &event));
    char *text = NULL;
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_metrics(NULL, &text));
    /* accessors of NULL objects answer empty, and every free takes NULL */
    CHECK(strcmp(hmc_buffer_id(NULL), "") == 0 && hmc_buffer_size(NULL) == 0 && hmc_buffer_list_count(NULL) == 0);
    CHECK(hmc_buffer_list_at(NULL, 0) == NULL && strcmp(hmc_path_name(NULL), "") == 0 && hmc_path_rejected_name(NULL, 0) == NULL);
    CHECK(strcmp(hmc_transfer_id(NULL), "") == 0 && hmc_events_fd(NULL) == -1 && strcmp(hmc_node_info_node(NULL), "") == 0);
    hmc_client_close(NULL), hmc_node_info_free(NULL), hmc_buffer_free(NULL), hmc_buffer_list_free(NULL), hmc_path_free(NULL);
    hmc_transfer_free(NULL), hmc_events_close(NULL), hmc_string_free(NULL);
}

/* Names as long as hmcd takes (64 KiB): its error repeating an unknown name of 9000 bytes arrives as that error (not
 * BUSY from gRPC's default 8 KiB metadata limit), a listing past gRPC's default 4 MiB arrives whole (hmcd sends up to
 * 64 MiB), and a reference one byte longer, or not UTF-8, is refused here before anything is sent. */
static void long_names(void) {
    hmc_client *client = connect_unix();
    enum { UNKNOWN = 9000, LONG = 64 * 1024, COUNT = 72 };  /* 72 names of 64 KiB: a listing of 4.5 MiB */
    char *name = malloc(LONG + 2);
    CHECK(name != NULL);
    memset(name, 'n', LONG + 1);
    name[UNKNOWN] = '\0';
    hmc_buffer *buffer = NULL;
    EXPECT(HMC_ERR_UNKNOWN_BUFFER, hmc_lookup(client, name, &buffer));
    CHECK(strstr(hmc_last_error(), "nnnnnnnn") != NULL);
    name[UNKNOWN] = 'n', name[LONG + 1] = '\0';
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_lookup(client, name, &buffer));  /* 64 KiB + 1 */
    CHECK(buffer == NULL && strstr(hmc_last_error(), "65536") != NULL);
    static const char *const not_utf8[] = {"kv\xff", "kv\xc3", "\xc0\xafkv", "kv\xed\xa0\x80", "id:\xf5\x80\x80\x80", "kv\xf4\x90\x80\x80"};
    for (size_t i = 0; i < sizeof not_utf8 / sizeof not_utf8[0]; ++i) {
        EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_lookup(client, not_utf8[i], &buffer));
        hmc_path *path = NULL;
        EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_negotiate(client, "capi-src", not_utf8[i], &path));
    }
    EXPECT(HMC_ERR_UNKNOWN_BUFFER, hmc_lookup(client, "kv-\xc3\xa9-\xf0\x9f\x98\x80", &buffer));  /* valid UTF-8 passes */
    name[LONG] = '\0';
    /* an agent with COUNT buffers named 64 KiB each (cluster.py's "@FILE" spec: the name is that file's text) */
    char dir[512], ready[600];
    static char files[COUNT][600], specs[COUNT][640];
    snprintf(dir, sizeof dir, "%s", state("dir"));
    snprintf(ready, sizeof ready, "%s/agent-long.ready", dir);
    unlink(ready);
    for (int i = 0; i < COUNT; ++i) {
        snprintf(files[i], sizeof files[i], "%s/long-name-%d", dir, i);
        snprintf(specs[i], sizeof specs[i], "@%s:4096", files[i]);
        snprintf(name, 16, "%08d", i), name[8] = 'n';  /* distinct names */
        FILE *file = fopen(files[i], "w");
        CHECK(file != NULL && fwrite(name, 1, LONG, file) == LONG && fclose(file) == 0);
    }
    char *argv[COUNT + 7] = {(char *)state("python"), (char *)state("cluster"), "agent", "long", dir, "node"};
    for (int i = 0; i < COUNT; ++i) argv[6 + i] = specs[i];
    argv[6 + COUNT] = NULL;
    pid_t agent = start_process(argv);
    await_file(ready, 60.0);
    hmc_buffer_list *list = NULL;
    EXPECT(HMC_OK, hmc_list_buffers(client, 1, &list));
    CHECK(hmc_buffer_list_count(list) == 4 + COUNT);
    int found = 0;
    for (size_t i = 0; i < hmc_buffer_list_count(list); ++i) found += strcmp(hmc_buffer_name(hmc_buffer_list_at(list, i)), name) == 0;
    CHECK(found == 1);
    hmc_buffer_list_free(list);
    EXPECT(HMC_OK, hmc_lookup(client, name, &buffer));
    CHECK(hmc_buffer_size(buffer) == 4096 && strcmp(hmc_buffer_name(buffer), name) == 0);
    hmc_buffer_free(buffer);
    kill(agent, SIGKILL);
    waitpid(agent, NULL, 0);
    for (double deadline = now_s() + 60.0;; usleep(50000)) {  /* withdrawn: the next tests see the node as it was */
        CHECK(now_s() < deadline);
        EXPECT(HMC_OK, hmc_list_buffers(client, 1, &list));
        size_t count = hmc_buffer_list_count(list);
        hmc_buffer_list_free(list);
        if (count == 4) break;
    }
    for (int i = 0; i < COUNT; ++i) {
        char memory[620];
        snprintf(memory, sizeof memory, "%s.mem", files[i]);
        unlink(files[i]), unlink(memory);
    }
    unlink(ready);
    free(name);
    hmc_client_close(client);
}

static void test_buffers_and_paths(void) {
    hmc_client *client = connect_unix();
    hmc_buffer *src = NULL, *again = NULL;
    EXPECT(HMC_OK, hmc_lookup(client, "capi-src", &src));
    CHECK(strcmp(hmc_buffer_name(src), "capi-src") == 0 && hmc_buffer_size(src) == 64 * MIB);
    CHECK(strcmp(hmc_buffer_node(src), "node") == 0 && strcmp(hmc_buffer_device(src), "host") == 0);
    char by_id[200];
    snprintf(by_id, sizeof by_id, "id:%s", hmc_buffer_id(src));
    EXPECT(HMC_OK, hmc_lookup(client, by_id, &again));
    CHECK(strcmp(hmc_buffer_name(again), "capi-src") == 0);
    hmc_buffer_free(again);
    hmc_buffer *none = NULL;
    EXPECT(HMC_ERR_UNKNOWN_BUFFER, hmc_lookup(client, "no-such-buffer", &none));
    CHECK(none == NULL);
    EXPECT(HMC_ERR_UNKNOWN_BUFFER, hmc_lookup(client, "id:0000000000000000", &none));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_lookup(client, "", &none));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_lookup(client, "id:", &none));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_lookup(client, NULL, &none));
    hmc_buffer_list *list = NULL;
    EXPECT(HMC_OK, hmc_list_buffers(client, 1, &list));
    CHECK(hmc_buffer_list_count(list) == 4 && hmc_buffer_list_at(list, 4) == NULL);
    int seen = 0;
    for (size_t i = 0; i < hmc_buffer_list_count(list); ++i) {
        const hmc_buffer *b = hmc_buffer_list_at(list, i);
        seen += strcmp(hmc_buffer_id(b), hmc_buffer_id(src)) == 0;
    }
    CHECK(seen == 1);
    hmc_buffer_list_free(list);
    hmc_buffer_free(src);
    hmc_path *path = NULL;
    EXPECT(HMC_OK, hmc_negotiate(client, "capi-src", "capi-dst", &path));
    CHECK(strcmp(hmc_path_name(path), "ipc") == 0 && strlen(hmc_path_reason(path)) > 0);
    for (size_t i = 0; i < hmc_path_rejected_count(path); ++i) CHECK(strlen(hmc_path_rejected_reason(path, i)) > 0);
    CHECK(hmc_path_rejected_name(path, hmc_path_rejected_count(path)) == NULL);
    hmc_path_free(path);
    EXPECT(HMC_ERR_UNKNOWN_BUFFER, hmc_negotiate(client, "capi-src", "no-such-buffer", &path));
    hmc_client_close(client);
    long_names();
}

/* A buffer of another node (another hmcd, another host to negotiation): found by name and by listing through
 * this node's hmcd, a path between hosts negotiated, and a migration into it verified byte by byte. */
static void test_across_nodes(void) {
    hmc_client *client = connect_unix();
    hmc_buffer *far = NULL;
    EXPECT(HMC_OK, hmc_lookup(client, "capi-far", &far));
    CHECK(strcmp(hmc_buffer_node(far), "far") == 0 && hmc_buffer_size(far) == MIB);
    char by_id[200];
    snprintf(by_id, sizeof by_id, "id:%s", hmc_buffer_id(far));
    hmc_buffer_free(far);
    hmc_buffer_list *list = NULL;
    int everywhere = 0, here = 0;
    EXPECT(HMC_OK, hmc_list_buffers(client, 0, &list));
    for (size_t i = 0; i < hmc_buffer_list_count(list); ++i) everywhere += strcmp(hmc_buffer_name(hmc_buffer_list_at(list, i)), "capi-far") == 0;
    hmc_buffer_list_free(list);
    EXPECT(HMC_OK, hmc_list_buffers(client, 1, &list));
    for (size_t i = 0; i < hmc_buffer_list_count(list); ++i) here += strcmp(hmc_buffer_name(hmc_buffer_list_at(list, i)), "capi-far") == 0;
    hmc_buffer_list_free(list);
    CHECK(everywhere == 1 && here == 0);
    hmc_path *path = NULL;
    EXPECT(HMC_OK, hmc_negotiate(client, "capi-src", by_id, &path));
    CHECK(strcmp(hmc_path_name(path), "ipc") != 0);  /* another host: never the same-host path */
    hmc_path_free(path);
    mapped src = map_buffer("capi-src"), dst = map_buffer("capi-far");
    random_bytes(src.bytes, MIB, 21);
    memset(dst.bytes, POISON, dst.size);
    uint64_t so[2] = {4096, 0}, dof[2] = {0, MIB / 2}, len[2] = {MIB / 2, MIB / 2 - 1};
    hmc_transfer_status status;
    EXPECT(HMC_OK, hmc_migrate(client, "capi-src", by_id, so, dof, len, 2, 30.0, &status));
    CHECK(status.bytes_done == MIB - 1 && strcmp(status.path, "ipc") != 0);
    CHECK(memcmp(dst.bytes, src.bytes + 4096, MIB / 2) == 0 && memcmp(dst.bytes + MIB / 2, src.bytes, MIB / 2 - 1) == 0);
    CHECK(dst.bytes[MIB - 1] == POISON);
    unmap_buffer(src), unmap_buffer(dst);
    hmc_client_close(client);
}

/* Scattered ranges, random bytes, every byte of the destination compared. */
static void test_transfer_every_byte(void) {
    hmc_client *client = connect_unix();
    mapped src, dst;
    fresh_pair(11, &src, &dst);
    enum { N = 64 };
    uint64_t so[N], dof[N], len[N];
    for (int i = 0; i < N; ++i) {  /* odd sizes, unaligned offsets, the last byte of the destination */
        len[i] = 1 + (uint64_t)(i * 7919) % 65521;
        so[i] = (uint64_t)i * 1000003u % (src.size - len[i]);
        dof[i] = (uint64_t)i * (dst.size / N) + (uint64_t)i % 13;
    }
    len[N - 1] = 1, dof[N - 1] = dst.size - 1;
    hmc_transfer *transfer = NULL;
    EXPECT(HMC_OK, hmc_submit(client, "capi-src", "capi-dst", so, dof, len, N, 30.0, &transfer));
    CHECK(strlen(hmc_transfer_id(transfer)) > 0);
    hmc_transfer_status status;
    EXPECT(HMC_OK, hmc_wait(client, transfer, 30.0, &status));
    CHECK(status.state == HMC_TRANSFER_DONE && status.error == HMC_OK && strlen(status.path) > 0);
    uint64_t total = 0;
    for (int i = 0; i < N; ++i) total += len[i];
    CHECK(status.bytes_total == total && status.bytes_done == total);
    EXPECT(HMC_OK, hmc_poll(client, transfer, &status));
    CHECK(status.state == HMC_TRANSFER_DONE);
    hmc_transfer_free(transfer);
    uint8_t *expected = malloc(dst.size);
    memset(expected, POISON, dst.size);
    for (int i = 0; i < N; ++i) memcpy(expected + dof[i], src.bytes + so[i], len[i]);
    CHECK(memcmp(expected, dst.bytes, dst.size) == 0);
    free(expected);
    unmap_buffer(src), unmap_buffer(dst);
    hmc_client_close(client);
}

static void test_bad_ranges_write_nothing(void) {
    hmc_client *client = connect_unix();
    mapped dst = map_buffer("capi-dst"), small = map_buffer("capi-small"), ro = map_buffer("capi-ro");
    memset(dst.bytes, POISON, dst.size);
    memset(small.bytes, POISON, small.size);
    uint64_t so[2] = {0, 4096}, dof[2] = {0, 65536 - 10}, len[2] = {4096, 4096};
    hmc_transfer *transfer = NULL;
    hmc_transfer_status status;
    /* past the end of the destination: refused, nothing written (not even the first, valid range) */
    hmc_status got = hmc_submit(client, "capi-src", "capi-small", so, dof, len, 2, 10.0, &transfer);
    if (got == HMC_OK) got = hmc_wait(client, transfer, 10.0, &status);
    CHECK(got == HMC_ERR_OUT_OF_RANGE);
    hmc_transfer_free(transfer);
    CHECK(all_poison(&small));
    /* an offset near 2^63, a length of 2^63, NULL arrays, no ranges: refused here, before anything is sent */
    uint64_t huge = UINT64_C(1) << 63, big = (UINT64_C(1) << 63) - 1;
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_submit(client, "capi-src", "capi-dst", so, &huge, len, 1, 10.0, &transfer));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_submit(client, "capi-src", "capi-dst", &huge, dof, len, 1, 10.0, &transfer));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_submit(client, "capi-src", "capi-dst", so, dof, &huge, 1, 10.0, &transfer));
    got = hmc_submit(client, "capi-src", "capi-dst", so, &big, len, 1, 10.0, &transfer);
    if (got == HMC_OK) got = hmc_wait(client, transfer, 10.0, &status);
    CHECK(got == HMC_ERR_OUT_OF_RANGE);
    hmc_transfer_free(transfer);
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_submit(client, "capi-src", "capi-dst", NULL, dof, len, 1, 10.0, &transfer));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_submit(client, "capi-src", "capi-dst", so, dof, len, 0, 10.0, &transfer));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_submit(client, "capi-src", "capi-dst", so, dof, len, 1, NAN, &transfer));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_submit(client, "capi-src", "capi-dst", so, dof, len, 1, -1.0, &transfer));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_submit(client, "capi-src", "capi-dst", so, dof, len, 1, 10.0, NULL));
    /* more ranges than hmcd's 64 MiB message holds: refused here, not BUSY (which a caller would retry for ever) */
    enum { MANY = (64 << 20) / 24 + 1 };
    uint64_t *many = calloc(MANY, sizeof *many);
    CHECK(many != NULL);
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_submit(client, "capi-src", "capi-dst", many, many, many, MANY, 10.0, &transfer));
    CHECK(transfer == NULL && strstr(hmc_last_error(), "fewer") != NULL);
    free(many);
    /* unknown buffers and read-only memory */
    EXPECT(HMC_ERR_UNKNOWN_BUFFER, hmc_submit(client, "capi-src", "no-such-buffer", so, dof, len, 1, 10.0, &transfer));
    EXPECT(HMC_ERR_UNKNOWN_BUFFER, hmc_submit(client, "no-such-buffer", "capi-dst", so, dof, len, 1, 10.0, &transfer));
    uint8_t before[64];
    memcpy(before, ro.bytes, sizeof before);
    got = hmc_submit(client, "capi-src", "capi-ro", so, so, len, 1, 10.0, &transfer);
    if (got == HMC_OK) got = hmc_wait(client, transfer, 10.0, &status);
    CHECK(got == HMC_ERR_ACCESS_DENIED);
    hmc_transfer_free(transfer);
    CHECK(memcmp(before, ro.bytes, sizeof before) == 0);
    EXPECT(HMC_ERR_OUT_OF_RANGE, hmc_migrate(client, "capi-src", "capi-small", so, dof, len, 2, 10.0, &status));
    CHECK(all_poison(&small) && all_poison(&dst));
    unmap_buffer(dst), unmap_buffer(small), unmap_buffer(ro);
    hmc_client_close(client);
}

/* A wait shorter than the transfer: TIMEOUT, the status says it still runs; the transfer then ends by itself. */
static void test_deadline_and_cancel(void) {
    hmc_client *client = connect_unix();
    mapped src, dst;
    fresh_pair(12, &src, &dst);
    enum { N = 4096 };
    static uint64_t so[N], dof[N], len[N];
    for (int i = 0; i < N; ++i) so[i] = (uint64_t)((i * 2477) % N) * 16384, dof[i] = (uint64_t)i * 16384, len[i] = 16384;
    hmc_transfer *transfer = NULL;
    hmc_transfer_status status;
    EXPECT(HMC_OK, hmc_submit(client, "capi-src", "capi-dst", so, dof, len, N, 30.0, &transfer));
    hmc_status got = hmc_wait(client, transfer, 1e-6, &status);
    CHECK(got == HMC_ERR_TIMEOUT || got == HMC_OK);
    if (got == HMC_ERR_TIMEOUT) CHECK(status.state == HMC_TRANSFER_PENDING || status.state == HMC_TRANSFER_RUNNING);
    memset(&status, 0x5a, sizeof status);
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_wait(client, transfer, 0.0, &status));
    /* refused before asking hmcd: the last known status (not what was in memory) */
    CHECK((status.state == HMC_TRANSFER_PENDING || status.state == HMC_TRANSFER_RUNNING) && status.error == HMC_OK && strlen(status.path) < 64);
    memset(&status, 0x5a, sizeof status);
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_poll(NULL, transfer, &status));  /* cleared, as hmc_wait's */
    CHECK(status.state == HMC_TRANSFER_UNKNOWN && status.error == HMC_OK && status.bytes_total == 0 && strcmp(status.path, "") == 0);
    EXPECT(HMC_OK, hmc_wait(client, transfer, 30.0, &status));
    for (int i = 0; i < N; ++i) CHECK(memcmp(dst.bytes + dof[i], src.bytes + so[i], len[i]) == 0);
    hmc_transfer_free(transfer);
    /* cancelled at once: CANCELLED (or DONE when it won the race); either way nothing lands after it ended */
    memset(dst.bytes, POISON, dst.size);
    EXPECT(HMC_OK, hmc_submit(client, "capi-src", "capi-dst", so, dof, len, N, 30.0, &transfer));
    EXPECT(HMC_OK, hmc_cancel(client, transfer));
    got = hmc_wait(client, transfer, 30.0, &status);
    printf("cancelled at once: %s, %llu of %llu bytes moved\n", hmc_status_name(got), (unsigned long long)status.bytes_done, (unsigned long long)status.bytes_total);
    CHECK((got == HMC_ERR_CANCELLED && status.state == HMC_TRANSFER_CANCELLED) || (got == HMC_OK && status.state == HMC_TRANSFER_DONE));
    uint8_t *ended = malloc(dst.size);
    memcpy(ended, dst.bytes, dst.size);
    /* a full round trip through the same agents afterwards: a late write of the cancelled one would show */
    uint64_t one_so = 0, one_do = 0, one_len = 4096;
    EXPECT(HMC_OK, hmc_migrate(client, "capi-src", "capi-small", &one_so, &one_do, &one_len, 1, 30.0, &status));
    CHECK(memcmp(ended, dst.bytes, dst.size) == 0);
    free(ended);
    hmc_transfer_free(transfer);
    unmap_buffer(src), unmap_buffer(dst);
    hmc_client_close(client);
}

typedef struct worker {
    hmc_client *client;
    int index;
    hmc_status result;
} worker;

static void *migrate_slice(void *arg) {
    worker *w = arg;
    uint64_t so = (uint64_t)w->index * 8 * MIB, dof = so, len = 8 * MIB;
    hmc_transfer_status status;
    w->result = hmc_migrate(w->client, "capi-src", "capi-dst", &so, &dof, &len, 1, 30.0, &status);
    return NULL;
}

/* One client, eight threads migrating disjoint slices at once. */
static void test_threads_share_a_client(void) {
    hmc_client *client = connect_unix();
    mapped src, dst;
    fresh_pair(13, &src, &dst);
    pthread_t threads[8];
    worker workers[8];
    for (int i = 0; i < 8; ++i) {
        workers[i] = (worker){client, i, HMC_ERR_INTERNAL};
        CHECK(pthread_create(&threads[i], NULL, migrate_slice, &workers[i]) == 0);
    }
    for (int i = 0; i < 8; ++i) {
        pthread_join(threads[i], NULL);
        CHECK(workers[i].result == HMC_OK);
    }
    CHECK(memcmp(src.bytes, dst.bytes, dst.size) == 0);
    unmap_buffer(src), unmap_buffer(dst);
    hmc_client_close(client);
}

static void *fail_once(void *arg) {
    hmc_buffer *none = NULL;
    *(hmc_status *)arg = hmc_lookup(NULL, "x", &none);
    return strcmp(hmc_last_error(), "the client is NULL") == 0 ? arg : NULL;
}

/* Each thread has its own last error: another thread's failure does not replace this one's. */
static void test_last_error_is_per_thread(void) {
    hmc_client *client = connect_unix();
    hmc_buffer *none = NULL;
    EXPECT(HMC_ERR_UNKNOWN_BUFFER, hmc_lookup(client, "not-here", &none));
    char mine[256];
    snprintf(mine, sizeof mine, "%s", hmc_last_error());
    CHECK(strstr(mine, "not-here") != NULL);
    pthread_t thread;
    hmc_status theirs = HMC_OK;
    void *result = NULL;
    CHECK(pthread_create(&thread, NULL, fail_once, &theirs) == 0);
    pthread_join(thread, &result);
    CHECK(theirs == HMC_ERR_INVALID_ARGUMENT && result != NULL);
    CHECK(strcmp(hmc_last_error(), mine) == 0);
    hmc_client_close(client);
}

/* An agent started (and then killed) by the test: its arrival and departure come as events, and the fd says so. */
static void test_events(void) {
    hmc_client *client = connect_unix();
    hmc_events *events = NULL;
    EXPECT(HMC_OK, hmc_events_subscribe(client, 0, &events));
    int fd = hmc_events_fd(events);
    CHECK(fd >= 0);
    hmc_event event;
    EXPECT(HMC_ERR_TIMEOUT, hmc_events_next(events, 0.0, &event));
    EXPECT(HMC_ERR_INVALID_ARGUMENT, hmc_events_next(events, NAN, &event));
    struct pollfd ready = {.fd = fd, .events = POLLIN};
    CHECK(poll(&ready, 1, 0) == 0);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        execl(state("python"), state("python"), state("cluster"), "agent", "extra", state("dir"), "node", "capi-extra:4096", (char *)NULL);
        _exit(127);
    }
    int added = 0, up = 0;
    double deadline = now_s() + 60.0;
    while (!(added && up)) {
        CHECK(now_s() < deadline);
        CHECK(poll(&ready, 1, 60000) == 1);  /* the fd wakes the loop */
        while (hmc_events_next(events, 0.0, &event) == HMC_OK) {
            added |= event.kind == HMC_EVENT_BUFFER_ADDED && strcmp(event.buffer_name, "capi-extra") == 0;
            up |= event.kind == HMC_EVENT_AGENT_UP;
            CHECK(event.sequence > 0 && strcmp(event.node, "node") == 0);
        }
    }
    kill(child, SIGKILL);
    waitpid(child, NULL, 0);
    int gone = 0;
    while (!gone) {
        hmc_status got = hmc_events_next(events, 60.0, &event);
        EXPECT(HMC_OK, got);
        gone |= event.kind == HMC_EVENT_BUFFER_WITHDRAWN && strcmp(event.buffer_name, "capi-extra") == 0;
    }
    hmc_events_close(events);
    /* a subscription outlives the client it came from */
    EXPECT(HMC_OK, hmc_events_subscribe(client, 0, &events));
    hmc_client_close(client);
    EXPECT(HMC_ERR_TIMEOUT, hmc_events_next(events, 0.05, &event));
    hmc_events_close(events);
}

/* A scripted hmcd (cluster.py fake) that goes away between two answers of one wait: the wait ends UNAVAILABLE with the
 * last known status, readable (the first, early answer replaced the one it began with); then one that goes silent
 * (stopped): its subscription ends UNAVAILABLE, by keepalive pings, though nothing arrives to say so. */
static void fake_hmcd_goes_away(void) {
    char dir[512], port_file[600], address[64];
    snprintf(dir, sizeof dir, "%s", state("dir"));
    snprintf(port_file, sizeof port_file, "%s/fake.port", dir);
    unlink(port_file);
    char *argv[] = {(char *)state("python"), (char *)state("cluster"), "fake", dir, NULL};
    pid_t fake = start_process(argv);
    await_file(port_file, 60.0);
    FILE *file = fopen(port_file, "r");
    int port = 0;
    CHECK(file != NULL && fscanf(file, "%d", &port) == 1);
    fclose(file);
    snprintf(address, sizeof address, "127.0.0.1:%d", port);
    hmc_client *client = NULL;
    EXPECT(HMC_OK, hmc_connect(address, NULL, NULL, 10.0, &client));
    uint64_t zero = 0, one = 1;
    hmc_transfer *transfer = NULL;
    EXPECT(HMC_OK, hmc_submit(client, "capi-src", "capi-dst", &zero, &zero, &one, 1, 10.0, &transfer));
    hmc_transfer_status status;
    EXPECT(HMC_ERR_UNAVAILABLE, hmc_wait(client, transfer, 10.0, &status));
    CHECK(status.state == HMC_TRANSFER_RUNNING && strncmp(status.path, "running-", 8) == 0);
    memset(&status, 0x5a, sizeof status);
    EXPECT(HMC_ERR_UNAVAILABLE, hmc_poll(client, transfer, &status));
    CHECK(status.state == HMC_TRANSFER_RUNNING && strncmp(status.path, "running-", 8) == 0);
    hmc_transfer_free(transfer);
    /* a migration hmcd takes and then says nothing more of: TIMEOUT once hmcd's verdict was waited for (5 s past
     * the timeout) and a cancel tried (1 s), not after a Wait's 5 s of slack and the client's 10 s call timeout */
    double started = now_s();
    EXPECT(HMC_ERR_TIMEOUT, hmc_migrate(client, "capi-held", "capi-dst", &zero, &zero, &one, 1, 1.0, &status));
    double took = now_s() - started;
    printf("a migration against an hmcd that stopped answering returned after %.1f s\n", took);
    CHECK(took >= 1.0 + 5.0 && took < 1.0 + 5.0 + 1.0 + 1.0 + 1.5);
    CHECK(status.state == HMC_TRANSFER_PENDING && strcmp(status.path, "held") == 0);
    hmc_events *events = NULL;
    EXPECT(HMC_OK, hmc_events_subscribe(client, 0, &events));
    CHECK(kill(fake, SIGSTOP) == 0);
    started = now_s();
    hmc_event event;
    EXPECT(HMC_ERR_UNAVAILABLE, hmc_events_next(events, 60.0, &event));
    printf("the stopped hmcd's subscription ended after %.1f s\n", now_s() - started);
    CHECK(now_s() - started < 30.0);
    hmc_events_close(events);
    hmc_client_close(client);
    kill(fake, SIGKILL);
    waitpid(fake, NULL, 0);
    unlink(port_file);
}

/* hmcd killed while a wait and a subscription are outstanding: both end typed, within their deadlines. Last. */
static void test_hmcd_gone_mid_call(void) {
    fake_hmcd_goes_away();
    hmc_client *client = connect_unix();
    hmc_events *events = NULL;
    EXPECT(HMC_OK, hmc_events_subscribe(client, 0, &events));
    enum { N = 4096 };
    static uint64_t so[N], dof[N], len[N];
    for (int i = 0; i < N; ++i) so[i] = dof[i] = (uint64_t)i * 16384, len[i] = 16384;
    hmc_transfer *transfer = NULL;
    EXPECT(HMC_OK, hmc_submit(client, "capi-src", "capi-dst", so, dof, len, N, 30.0, &transfer));
    CHECK(kill((pid_t)atoi(state("hmcd_pid")), SIGKILL) == 0);
    double started = now_s();
    hmc_transfer_status status;
    hmc_status got = hmc_wait(client, transfer, 10.0, &status);
    CHECK(got == HMC_ERR_UNAVAILABLE || got == HMC_OK);  /* OK: it ended before hmcd did */
    CHECK(now_s() - started < 20.0);
    hmc_event event;
    got = hmc_events_next(events, 10.0, &event);
    while (got == HMC_OK) got = hmc_events_next(events, 10.0, &event);
    CHECK(got == HMC_ERR_UNAVAILABLE);
    struct pollfd ready = {.fd = hmc_events_fd(events), .events = POLLIN};
    CHECK(poll(&ready, 1, 0) == 1);  /* an ended stream keeps its fd readable */
    EXPECT(HMC_ERR_UNAVAILABLE, hmc_poll(client, transfer, &status));
    hmc_node_info *info = NULL;
    EXPECT(HMC_ERR_UNAVAILABLE, hmc_node_info_get(client, &info));
    hmc_transfer_free(transfer);
    hmc_events_close(events);
    hmc_client_close(client);
}

static const struct {
    const char *name;
    void (*run)(void);
} tests[] = {
    {"status_table", test_status_table},
    {"connect_bad_input", test_connect_bad_input},
    {"connect_refuses_an_untrusted_socket", test_connect_refuses_an_untrusted_socket},
    {"tcp_token_and_tls", test_tcp_token_and_tls},
    {"node_devices_and_metrics", test_node_devices_and_metrics},
    {"null_handles", test_null_handles},
    {"buffers_and_paths", test_buffers_and_paths},
    {"across_nodes", test_across_nodes},
    {"transfer_every_byte", test_transfer_every_byte},
    {"bad_ranges_write_nothing", test_bad_ranges_write_nothing},
    {"deadline_and_cancel", test_deadline_and_cancel},
    {"threads_share_a_client", test_threads_share_a_client},
    {"last_error_is_per_thread", test_last_error_is_per_thread},
    {"events", test_events},
    {"hmcd_gone_mid_call", test_hmcd_gone_mid_call},
};

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s TEST\n", argv[0]);
        return 2;
    }
    for (size_t i = 0; i < sizeof tests / sizeof tests[0]; ++i) {
        if (strcmp(argv[1], tests[i].name) == 0) {
            tests[i].run();
            return 0;
        }
    }
    fprintf(stderr, "no test %s\n", argv[1]);
    return 2;
}
