// The client: connecting (unix socket checks, token, TLS), node info, metrics, buffers and paths.
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "internal.hpp"

using hmc_internal::fail;
using hmc_internal::from_rpc;
using hmc_internal::to_ref;
using hmc_internal::valid_timeout;

namespace {

constexpr int kMaxMetadata = 1 << 20;  // hmcd's error messages repeat the names given: a long one still arrives as its error, not BUSY

// As hmc/control/_auth.py's check_socket_dir: a missing entry passes (connecting then fails UNAVAILABLE).
hmc_status trusted(const std::string &path, const char *what, mode_t forbidden, bool directory, bool *exists) {
    struct stat info;
    *exists = false;
    if (lstat(path.c_str(), &info) != 0) {
        if (errno == ENOENT) return HMC_OK;
        return fail(HMC_ERR_AUTHENTICATION, std::string("cannot inspect ") + what + " " + path + ": " + std::strerror(errno) + "; it is not this user's");
    }
    *exists = true;
    if (S_ISLNK(info.st_mode)) return fail(HMC_ERR_AUTHENTICATION, std::string(what) + " " + path + " is a symlink; refusing it (it could point anywhere)");
    if (directory ? !S_ISDIR(info.st_mode) : !S_ISSOCK(info.st_mode)) {
        return fail(HMC_ERR_AUTHENTICATION, std::string(what) + " " + path + " is not a " + (directory ? "directory" : "socket"));
    }
    if (info.st_uid != geteuid() && info.st_uid != 0) {
        return fail(HMC_ERR_AUTHENTICATION, std::string(what) + " " + path + " is owned by uid " + std::to_string(info.st_uid) + ", not by this user or root");
    }
    if (info.st_mode & forbidden) {
        std::ostringstream mode;
        mode << std::oct << (info.st_mode & 07777);
        return fail(HMC_ERR_AUTHENTICATION, std::string(what) + " " + path + " has mode 0" + mode.str() + ": it is open to others");
    }
    return HMC_OK;
}

bool read_file(const char *path, std::string *out) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return false;
    std::ostringstream text;
    text << in.rdbuf();
    *out = text.str();
    return true;
}

// The socket path with "//" and "/./" collapsed and no trailing "/": the directory is then checked by lstat on its
// own name (a symlinked directory named with a trailing "/" would be followed). "" when it holds a "..".
std::string normalized(const std::string &path) {
    std::string out = path[0] == '/' ? "/" : "";
    std::string part;
    size_t at = 0;
    while (at <= path.size()) {
        size_t next = path.find('/', at);
        if (next == std::string::npos) next = path.size();
        part = path.substr(at, next - at);
        if (part == "..") return "";
        if (!part.empty() && part != ".") {
            if (!out.empty() && out.back() != '/') out += '/';
            out += part;
        }
        at = next + 1;
    }
    return out;
}

bool printable(const char *text) {
    for (const char *c = text; *c; ++c) {
        if (*c < 0x20 || *c > 0x7e) return false;
    }
    return true;
}

template <typename Out>
hmc_status need(hmc_client *client, Out **out) {
    if (out == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "the out pointer is NULL");
    *out = nullptr;
    if (client == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "the client is NULL");
    return client->check_socket();
}

}  // namespace

void hmc_client::prepare(grpc::ClientContext &context, double seconds) const {
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::duration_cast<std::chrono::system_clock::duration>(std::chrono::duration<double>(seconds)));
    if (!token.empty()) context.AddMetadata("authorization", "Bearer " + token);
}

hmc_status hmc_client::check_socket() const {
    if (socket_path.empty()) return HMC_OK;
    size_t slash = socket_path.find_last_of('/');  // the directory without a trailing slash: lstat must not follow a link
    std::string directory = slash == std::string::npos ? "." : slash == 0 ? "/" : socket_path.substr(0, slash);
    bool exists = false;
    hmc_status status = trusted(directory, "hmcd's socket directory", 022, true, &exists);
    if (status != HMC_OK || !exists) return status;
    return trusted(socket_path, "hmcd's socket", 002, false, &exists);
}

extern "C" hmc_status hmc_connect(const char *address, const char *token, const char *tls_ca, double timeout_s, hmc_client **out) {
    if (out == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "the out pointer is NULL");
    *out = nullptr;
    if (address == nullptr || *address == '\0') return fail(HMC_ERR_INVALID_ARGUMENT, "the address is NULL or empty");
    if (!valid_timeout(timeout_s)) return fail(HMC_ERR_INVALID_ARGUMENT, "the timeout must be finite seconds in (0, 1e6]");
    auto client = std::make_unique<hmc_client>();
    client->address = address;
    client->timeout_s = timeout_s;
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
    if (std::strncmp(address, "unix:", 5) == 0) {
        std::string given = address + 5;
        if (given.rfind("//", 0) == 0) given = given.substr(2);
        if (given.empty()) return fail(HMC_ERR_INVALID_ARGUMENT, "a unix: address names no socket");
        if (token != nullptr && *token != '\0') return fail(HMC_ERR_INVALID_ARGUMENT, "a token goes with TCP addresses only (the unix socket checks who connects)");
        if (tls_ca != nullptr && *tls_ca != '\0') return fail(HMC_ERR_INVALID_ARGUMENT, "TLS goes with TCP addresses only");
        // gRPC reads the target as a URI (percent-decoded, "?" and "#" end the path): the path it connects to would not be the one checked.
        if (given.find_first_of("%?#") != std::string::npos) {
            return fail(HMC_ERR_INVALID_ARGUMENT, "refusing the socket path " + given + ": it holds '%', '?' or '#', which gRPC would not take literally");
        }
        client->socket_path = normalized(given);
        if (client->socket_path.empty()) return fail(HMC_ERR_AUTHENTICATION, "refusing the socket path " + given + ": it holds \"..\"");
        client->address = "unix:" + client->socket_path;
        hmc_status status = client->check_socket();
        if (status != HMC_OK) return status;
    } else {
        client->token = token == nullptr ? "" : token;
        if (!printable(client->token.c_str())) return fail(HMC_ERR_INVALID_ARGUMENT, "a token is printable ASCII (no control characters, nothing past 0x7e)");
        if (tls_ca != nullptr && *tls_ca != '\0') {
            grpc::SslCredentialsOptions options;
            if (!read_file(tls_ca, &options.pem_root_certs) || options.pem_root_certs.find("-----BEGIN CERTIFICATE-----") == std::string::npos) {
                return fail(HMC_ERR_INVALID_ARGUMENT, std::string("the TLS CA file ") + tls_ca + " is missing or holds no PEM certificate");
            }
            credentials = grpc::SslCredentials(options);
        }
    }
    grpc::ChannelArguments arguments;
    arguments.SetInt(GRPC_ARG_ENABLE_RETRIES, 0);
    arguments.SetInt(GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, hmc_internal::kMaxMessage);
    arguments.SetInt(GRPC_ARG_MAX_METADATA_SIZE, kMaxMetadata);
    // A silent hmcd (stopped, cut off) ends a subscription UNAVAILABLE within ~15 s, as the agents' links do;
    // hmcd permits pings every 5 s (hmc/control/_hmcd.py's SERVER_OPTIONS).
    arguments.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 10000);
    arguments.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 5000);
    arguments.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    arguments.SetInt(GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA, 0);
    client->channel = grpc::CreateCustomChannel(client->address, credentials, arguments);
    client->nodes = hmc::v1::NodeService::NewStub(client->channel);
    client->registry = hmc::v1::RegistryService::NewStub(client->channel);
    client->paths = hmc::v1::PathService::NewStub(client->channel);
    client->transfers = hmc::v1::TransferService::NewStub(client->channel);
    client->events = hmc::v1::EventService::NewStub(client->channel);
    // hmcd answers (and takes the token) before the client is handed out.
    grpc::ClientContext context;
    client->prepare(context, timeout_s);
    context.set_wait_for_ready(true);  // until the deadline, not the first refused connect
    hmc::v1::NodeInfo info;
    hmc_status status = from_rpc(client->nodes->GetNodeInfo(&context, hmc::v1::NodeInfoRequest(), &info), context, client->address);
    if (status == HMC_ERR_TIMEOUT && client->channel->GetState(false) != GRPC_CHANNEL_READY) {  // never reached hmcd at all
        return fail(HMC_ERR_UNAVAILABLE, "no hmcd answered at " + client->address + " within " + std::to_string(timeout_s) + " s");
    }
    if (status == HMC_OK) status = client->check_socket();  // what answered is still what was checked
    if (status != HMC_OK) return status;
    *out = client.release();
    return HMC_OK;
}

extern "C" void hmc_client_close(hmc_client *client) { delete client; }

// -- the node ----------------------------------------------------------------------------

extern "C" hmc_status hmc_node_info_get(hmc_client *client, hmc_node_info **out) {
    hmc_status status = need(client, out);
    if (status != HMC_OK) return status;
    auto info = std::make_unique<hmc_node_info>();
    grpc::ClientContext context;
    client->prepare(context, client->timeout_s);
    status = from_rpc(client->nodes->GetNodeInfo(&context, hmc::v1::NodeInfoRequest(), &info->info), context, client->address);
    if (status == HMC_OK) *out = info.release();
    return status;
}

extern "C" const char *hmc_node_info_node(const hmc_node_info *info) { return info ? info->info.node().c_str() : ""; }
extern "C" const char *hmc_node_info_host_id(const hmc_node_info *info) { return info ? info->info.host_id().c_str() : ""; }
extern "C" const char *hmc_node_info_version(const hmc_node_info *info) { return info ? info->info.version().c_str() : ""; }
extern "C" int hmc_node_info_agents(const hmc_node_info *info) { return info ? info->info.agents() : 0; }
extern "C" int hmc_node_info_buffers(const hmc_node_info *info) { return info ? info->info.buffers() : 0; }
extern "C" size_t hmc_node_info_device_count(const hmc_node_info *info) { return info ? static_cast<size_t>(info->info.devices_size()) : 0; }

extern "C" hmc_status hmc_node_info_device(const hmc_node_info *info, size_t i, hmc_device *out) {
    if (info == nullptr || out == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "the node info or the out pointer is NULL");
    if (i >= static_cast<size_t>(info->info.devices_size())) {
        return fail(HMC_ERR_OUT_OF_RANGE, "device " + std::to_string(i) + " of " + std::to_string(info->info.devices_size()));
    }
    const hmc::v1::DeviceInfo &device = info->info.devices(static_cast<int>(i));
    out->name = device.name().c_str();
    out->kind = hmc_internal::known<hmc_device_kind>(device.kind(), HMC_DEVICE_HIP);
    out->vendor = hmc_internal::known<hmc_vendor>(device.vendor(), HMC_VENDOR_AMD);
    out->index = device.index();
    out->total_memory = device.total_memory();
    out->model = device.model().c_str();
    return HMC_OK;
}

extern "C" void hmc_node_info_free(hmc_node_info *info) { delete info; }

extern "C" hmc_status hmc_metrics(hmc_client *client, char **text) {
    hmc_status status = need(client, text);
    if (status != HMC_OK) return status;
    grpc::ClientContext context;
    client->prepare(context, client->timeout_s);
    hmc::v1::MetricsResponse reply;
    status = from_rpc(client->nodes->GetMetrics(&context, hmc::v1::MetricsRequest(), &reply), context, client->address);
    if (status != HMC_OK) return status;
    *text = strdup(reply.text().c_str());
    return *text ? HMC_OK : fail(HMC_ERR_INTERNAL, "out of memory");
}

extern "C" void hmc_string_free(char *text) { free(text); }

// -- buffers -----------------------------------------------------------------------------

extern "C" hmc_status hmc_lookup(hmc_client *client, const char *ref, hmc_buffer **out) {
    hmc_status status = need(client, out);
    if (status != HMC_OK) return status;
    hmc::v1::LookupBufferRequest request;
    if (!to_ref(ref, request.mutable_ref())) return fail(HMC_ERR_INVALID_ARGUMENT, hmc_internal::kRefRule);
    auto buffer = std::make_unique<hmc_buffer>();
    grpc::ClientContext context;
    client->prepare(context, client->timeout_s);
    status = from_rpc(client->registry->LookupBuffer(&context, request, &buffer->descriptor), context, client->address);
    if (status == HMC_OK) *out = buffer.release();
    return status;
}

extern "C" hmc_status hmc_list_buffers(hmc_client *client, int local_only, hmc_buffer_list **out) {
    hmc_status status = need(client, out);
    if (status != HMC_OK) return status;
    hmc::v1::ListBuffersRequest request;
    request.set_local_only(local_only != 0);
    hmc::v1::ListBuffersResponse reply;
    grpc::ClientContext context;
    client->prepare(context, client->timeout_s);
    status = from_rpc(client->registry->ListBuffers(&context, request, &reply), context, client->address);
    if (status != HMC_OK) return status;
    auto list = std::make_unique<hmc_buffer_list>();
    list->buffers.resize(static_cast<size_t>(reply.buffers_size()));
    for (int i = 0; i < reply.buffers_size(); ++i) list->buffers[static_cast<size_t>(i)].descriptor.Swap(reply.mutable_buffers(i));
    *out = list.release();
    return HMC_OK;
}

extern "C" size_t hmc_buffer_list_count(const hmc_buffer_list *list) { return list ? list->buffers.size() : 0; }
extern "C" const hmc_buffer *hmc_buffer_list_at(const hmc_buffer_list *list, size_t i) {
    return list && i < list->buffers.size() ? &list->buffers[i] : nullptr;
}
extern "C" void hmc_buffer_list_free(hmc_buffer_list *list) { delete list; }

extern "C" const char *hmc_buffer_id(const hmc_buffer *buffer) { return buffer ? buffer->descriptor.id().c_str() : ""; }
extern "C" const char *hmc_buffer_name(const hmc_buffer *buffer) { return buffer ? buffer->descriptor.name().c_str() : ""; }
extern "C" const char *hmc_buffer_node(const hmc_buffer *buffer) { return buffer ? buffer->descriptor.owner().node().c_str() : ""; }
extern "C" const char *hmc_buffer_device(const hmc_buffer *buffer) { return buffer ? buffer->descriptor.device().name().c_str() : ""; }
extern "C" uint64_t hmc_buffer_size(const hmc_buffer *buffer) { return buffer ? buffer->descriptor.size() : 0; }
extern "C" void hmc_buffer_free(hmc_buffer *buffer) { delete buffer; }

// -- paths -------------------------------------------------------------------------------

extern "C" hmc_status hmc_negotiate(hmc_client *client, const char *src, const char *dst, hmc_path **out) {
    hmc_status status = need(client, out);
    if (status != HMC_OK) return status;
    hmc::v1::NegotiateRequest request;
    if (!to_ref(src, request.mutable_src()) || !to_ref(dst, request.mutable_dst())) {
        return fail(HMC_ERR_INVALID_ARGUMENT, hmc_internal::kRefRule);
    }
    auto path = std::make_unique<hmc_path>();
    grpc::ClientContext context;
    client->prepare(context, client->timeout_s);
    status = from_rpc(client->paths->Negotiate(&context, request, &path->decision), context, client->address);
    if (status == HMC_OK) *out = path.release();
    return status;
}

extern "C" const char *hmc_path_name(const hmc_path *path) { return path ? path->decision.path().c_str() : ""; }
extern "C" const char *hmc_path_reason(const hmc_path *path) { return path ? path->decision.reason().c_str() : ""; }
extern "C" size_t hmc_path_rejected_count(const hmc_path *path) { return path ? static_cast<size_t>(path->decision.rejected_size()) : 0; }
extern "C" const char *hmc_path_rejected_name(const hmc_path *path, size_t i) {
    return path && i < static_cast<size_t>(path->decision.rejected_size()) ? path->decision.rejected(static_cast<int>(i)).path().c_str() : nullptr;
}
extern "C" const char *hmc_path_rejected_reason(const hmc_path *path, size_t i) {
    return path && i < static_cast<size_t>(path->decision.rejected_size()) ? path->decision.rejected(static_cast<int>(i)).reason().c_str() : nullptr;
}
extern "C" void hmc_path_free(hmc_path *path) { delete path; }
