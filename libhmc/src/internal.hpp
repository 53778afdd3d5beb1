// libhmc's internals: the objects behind the C handles, status plumbing and deadlines.
#pragma once

#include <grpcpp/grpcpp.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "hmc/hmc.h"
#include "hmc/v1/common.pb.h"
#include "hmc/v1/daemon.grpc.pb.h"

namespace hmc_internal {

// Records `message` as this thread's last error and returns `status` (HMC_OK records nothing).
hmc_status fail(hmc_status status, const std::string &message);

// The hmc_status of a finished gRPC call: hmcd's own code from the trailing metadata
// ("hmc-error-code"), else one matching the gRPC status; recorded as the last error.
hmc_status from_rpc(const grpc::Status &status, const grpc::ClientContext &context, const std::string &address);

// A timeout in seconds as the contract has it: finite, in (0, 1e6]; `zero_ok` admits 0 (do not wait).
bool valid_timeout(double seconds, bool zero_ok = false);

constexpr int kMaxMessage = 64 << 20;  // hmcd's own bound (hmc/control/_auth.py's MAX_MESSAGE_BYTES): gRPC's 4 MiB would refuse a big listing
constexpr size_t kMaxName = 65536;     // the longest buffer name or id hmcd takes (hmc/control/_registry.py's MAX_NAME_BYTES)
constexpr const char *kRefRule = "a buffer reference must be a non-empty name or 'id:<id>' of valid UTF-8, at most 65536 bytes after 'id:'";

// A buffer reference: "id:<id>" or a name (non-empty, NUL-terminated, valid UTF-8, at most kMaxName bytes); false
// (kRefRule) otherwise, before anything is sent.
bool to_ref(const char *text, hmc::v1::BufferRef *ref);

// A wire error code as an hmc_status: the table's own values, anything else (a newer hmcd's) HMC_ERR_INTERNAL.
hmc_status to_status(int code);

// A wire enum value as a C enum whose values run 0..last: unknown ones (a newer hmcd's) become 0.
template <typename Enum>
Enum known(int value, int last) {
    return static_cast<Enum>(value >= 0 && value <= last ? value : 0);
}

}  // namespace hmc_internal

struct hmc_client {
    std::string address;
    std::string token;
    std::string socket_path;  // empty on TCP
    double timeout_s = 0;
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<hmc::v1::NodeService::Stub> nodes;
    std::unique_ptr<hmc::v1::RegistryService::Stub> registry;
    std::unique_ptr<hmc::v1::PathService::Stub> paths;
    std::unique_ptr<hmc::v1::TransferService::Stub> transfers;
    std::unique_ptr<hmc::v1::EventService::Stub> events;

    // A context for one call: the deadline `seconds` from now, the token on TCP.
    void prepare(grpc::ClientContext &context, double seconds) const;
    // The unix socket's ownership and modes, checked before every call (gRPC reconnects on its own).
    hmc_status check_socket() const;
};

struct hmc_node_info {
    hmc::v1::NodeInfo info;
};

struct hmc_buffer {
    hmc::v1::BufferDescriptor descriptor;
};

struct hmc_buffer_list {
    std::vector<hmc_buffer> buffers;
};

struct hmc_path {
    hmc::v1::PathDecision decision;
};

struct hmc_transfer {
    std::string id;
    hmc::v1::TransferStatus last;
};
