// hmc.hpp: RAII over libhmc's C ABI (hmc.h), header-only, C++17. Failures throw hmc::Error, which carries
// the hmc_status and the message; handles free themselves. Thread safety is the C ABI's: a Client may be
// shared by threads, every other object is for one thread at a time.
//
//     hmc::Client hmcd("unix:/run/user/1000/hmc/hmcd.sock");
//     hmc::Path path = hmcd.negotiate("prefill-kv", "decode-kv");
//     hmcd.migrate("prefill-kv", "decode-kv", src, dst, len);   // std::vector<uint64_t> each
#ifndef HMC_HMC_HPP
#define HMC_HMC_HPP

#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "hmc/hmc.h"

namespace hmc {

class Error : public std::runtime_error {
public:
    Error(hmc_status status, const std::string &message)
        : std::runtime_error(std::string(hmc_status_name(status)) + ": " + message), status_(status) {}
    hmc_status status() const noexcept { return status_; }

private:
    hmc_status status_;
};

namespace detail {
inline void check(hmc_status status) {
    if (status != HMC_OK) throw Error(status, hmc_last_error());
}
template <typename T, void (*Free)(T *)>
struct Deleter {
    void operator()(T *p) const noexcept { Free(p); }
};
template <typename T, void (*Free)(T *)>
using Owned = std::unique_ptr<T, Deleter<T, Free>>;
}  // namespace detail

struct Rejected {
    std::string path, reason;
};

struct Path {
    std::string name, reason;
    std::vector<Rejected> rejected;
};

struct Buffer {
    std::string id, name, node, device;
    uint64_t size = 0;
};

// A transfer's status with its path copied (hmc_transfer_status's points into the transfer).
struct TransferStatus {
    hmc_transfer_state state = HMC_TRANSFER_UNKNOWN;
    hmc_status error = HMC_OK;
    uint64_t bytes_total = 0, bytes_done = 0;
    std::string path;
    static TransferStatus of(const hmc_transfer_status &s) { return TransferStatus{s.state, s.error, s.bytes_total, s.bytes_done, s.path ? s.path : ""}; }
};

struct Event {
    hmc_event_kind kind;
    uint64_t sequence;
    double time;
    std::string node, buffer_id, buffer_name, agent_id, peer;
};

class Client;

class Transfer {
public:
    const char *id() const { return hmc_transfer_id(handle_.get()); }
    TransferStatus poll() {
        hmc_transfer_status status{};
        detail::check(hmc_poll(client_, handle_.get(), &status));
        return TransferStatus::of(status);
    }
    // Throws the transfer's error (or HMC_ERR_TIMEOUT) unless it ended DONE.
    TransferStatus wait(double timeout_s) {
        hmc_transfer_status status{};
        detail::check(hmc_wait(client_, handle_.get(), timeout_s, &status));
        return TransferStatus::of(status);
    }
    void cancel() { detail::check(hmc_cancel(client_, handle_.get())); }

private:
    friend class Client;
    Transfer(hmc_client *client, hmc_transfer *handle) : client_(client), handle_(handle) {}
    hmc_client *client_;
    detail::Owned<hmc_transfer, hmc_transfer_free> handle_;
};

class Events {
public:
    int fd() const { return hmc_events_fd(handle_.get()); }
    // The next event within `timeout_s` (0: none waited for), or nothing; throws once the stream ended.
    std::optional<Event> next(double timeout_s) {
        hmc_event e{};
        hmc_status status = hmc_events_next(handle_.get(), timeout_s, &e);
        if (status == HMC_ERR_TIMEOUT) return std::nullopt;
        detail::check(status);
        return Event{e.kind, e.sequence, e.time, e.node, e.buffer_id, e.buffer_name, e.agent_id, e.peer};
    }

private:
    friend class Client;
    explicit Events(hmc_events *handle) : handle_(handle) {}
    detail::Owned<hmc_events, hmc_events_close> handle_;
};

class Client {
public:
    explicit Client(const std::string &address, const std::string &token = "", const std::string &tls_ca = "", double timeout_s = 10.0) {
        hmc_client *client = nullptr;
        detail::check(hmc_connect(address.c_str(), token.empty() ? nullptr : token.c_str(), tls_ca.empty() ? nullptr : tls_ca.c_str(), timeout_s, &client));
        handle_.reset(client);
    }

    std::string node() const {
        hmc_node_info *info = nullptr;
        detail::check(hmc_node_info_get(handle_.get(), &info));
        detail::Owned<hmc_node_info, hmc_node_info_free> owned(info);
        return hmc_node_info_node(info);
    }

    std::string metrics() const {
        char *text = nullptr;
        detail::check(hmc_metrics(handle_.get(), &text));
        std::string out(text);
        hmc_string_free(text);
        return out;
    }

    Buffer lookup(const std::string &ref) const {
        hmc_buffer *buffer = nullptr;
        detail::check(hmc_lookup(handle_.get(), ref.c_str(), &buffer));
        detail::Owned<hmc_buffer, hmc_buffer_free> owned(buffer);
        return Buffer{hmc_buffer_id(buffer), hmc_buffer_name(buffer), hmc_buffer_node(buffer), hmc_buffer_device(buffer), hmc_buffer_size(buffer)};
    }

    Path negotiate(const std::string &src, const std::string &dst) const {
        hmc_path *path = nullptr;
        detail::check(hmc_negotiate(handle_.get(), src.c_str(), dst.c_str(), &path));
        detail::Owned<hmc_path, hmc_path_free> owned(path);
        Path out{hmc_path_name(path), hmc_path_reason(path), {}};
        for (size_t i = 0; i < hmc_path_rejected_count(path); ++i) out.rejected.push_back({hmc_path_rejected_name(path, i), hmc_path_rejected_reason(path, i)});
        return out;
    }

    // A transfer uses its client: it must not outlive it (submit on a temporary Client does not compile).
    Transfer submit(const std::string &src, const std::string &dst, const std::vector<uint64_t> &src_offsets, const std::vector<uint64_t> &dst_offsets,
                    const std::vector<uint64_t> &lengths, double timeout_s) && = delete;
    Transfer submit(const std::string &src, const std::string &dst, const std::vector<uint64_t> &src_offsets, const std::vector<uint64_t> &dst_offsets,
                    const std::vector<uint64_t> &lengths, double timeout_s) & {
        same_sizes(src_offsets, dst_offsets, lengths);
        hmc_transfer *transfer = nullptr;
        detail::check(hmc_submit(handle_.get(), src.c_str(), dst.c_str(), src_offsets.data(), dst_offsets.data(), lengths.data(), lengths.size(), timeout_s,
                                 &transfer));
        return Transfer(handle_.get(), transfer);
    }

    TransferStatus migrate(const std::string &src, const std::string &dst, const std::vector<uint64_t> &src_offsets,
                           const std::vector<uint64_t> &dst_offsets, const std::vector<uint64_t> &lengths, double timeout_s) {
        same_sizes(src_offsets, dst_offsets, lengths);
        hmc_transfer_status status{};
        detail::check(hmc_migrate(handle_.get(), src.c_str(), dst.c_str(), src_offsets.data(), dst_offsets.data(), lengths.data(), lengths.size(), timeout_s,
                                  &status));
        return TransferStatus::of(status);
    }

    Events subscribe(bool include_peers = false) {
        hmc_events *events = nullptr;
        detail::check(hmc_events_subscribe(handle_.get(), include_peers ? 1 : 0, &events));
        return Events(events);
    }

    hmc_client *get() const noexcept { return handle_.get(); }

private:
    static void same_sizes(const std::vector<uint64_t> &a, const std::vector<uint64_t> &b, const std::vector<uint64_t> &c) {
        if (a.size() != b.size() || b.size() != c.size()) throw Error(HMC_ERR_INVALID_ARGUMENT, "offset and length vectors differ in size");
    }
    detail::Owned<hmc_client, hmc_client_close> handle_;
};

}  // namespace hmc

#endif  // HMC_HMC_HPP
