// Third-party transfers through hmcd: submit, poll, wait, cancel, migrate.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>

#include "internal.hpp"

using hmc_internal::fail;
using hmc_internal::from_rpc;
using hmc_internal::to_ref;
using hmc_internal::valid_timeout;

namespace {

constexpr double kWaitSlackS = 1.0;  // a Wait call's own deadline beyond the time hmcd holds it (as the Python client)
constexpr double kVerdictS = 5.0;    // hmc_migrate: how long past its timeout hmcd's own verdict is waited for
constexpr double kCancelS = 1.0;     // hmc_migrate: the bound on cancelling a migration it stopped waiting for

bool final_state(int state) {
    return state == hmc::v1::TRANSFER_STATE_DONE || state == hmc::v1::TRANSFER_STATE_FAILED || state == hmc::v1::TRANSFER_STATE_CANCELLED;
}

void clear(hmc_transfer_status *out) {
    if (out != nullptr) *out = hmc_transfer_status{HMC_TRANSFER_UNKNOWN, HMC_OK, 0, 0, ""};
}

void report(const hmc_transfer &transfer, hmc_transfer_status *out) {
    if (out == nullptr) return;
    const hmc::v1::TransferStatus &last = transfer.last;
    out->state = hmc_internal::known<hmc_transfer_state>(last.state(), HMC_TRANSFER_CANCELLED);
    out->error = hmc_internal::to_status(last.error().code());
    out->bytes_total = last.bytes_total();
    out->bytes_done = last.bytes_done();
    out->path = last.path().c_str();
}

// The status an ended transfer's caller gets: OK when DONE, else its error (CANCELLED when it names none).
hmc_status outcome(const hmc_transfer &transfer) {
    const hmc::v1::TransferStatus &last = transfer.last;
    if (last.state() == hmc::v1::TRANSFER_STATE_DONE) return HMC_OK;
    hmc_status error = hmc_internal::to_status(last.error().code());
    if (error == HMC_OK) error = last.state() == hmc::v1::TRANSFER_STATE_CANCELLED ? HMC_ERR_CANCELLED : HMC_ERR_INTERNAL;
    std::string message = last.error().message();
    if (message.empty()) message = "transfer " + transfer.id + " ended " + hmc::v1::TransferState_Name(last.state());
    return fail(error, message);
}

// One call about `transfer` (`rpc`: Wait or Cancel), bounded by `call_s`; hmcd's answer becomes transfer->last.
template <typename Rpc>
hmc_status call_about(hmc_client *client, hmc_transfer *transfer, double seconds, double call_s, Rpc rpc) {
    hmc::v1::TransferRef ref;
    ref.set_transfer_id(transfer->id);
    ref.set_timeout_s(seconds);
    grpc::ClientContext context;
    client->prepare(context, call_s);
    hmc::v1::TransferStatus status;
    hmc_status result = from_rpc(rpc(&context, ref, &status), context, client->address);
    if (result == HMC_OK) transfer->last.Swap(&status);
    return result;
}

// One Wait call: hmcd holds it up to `seconds` (0: answers at once), the call itself bounded by `call_s`.
hmc_status ask(hmc_client *client, hmc_transfer *transfer, double seconds, double call_s) {
    return call_about(client, transfer, seconds, call_s, [client](grpc::ClientContext *context, const hmc::v1::TransferRef &ref, hmc::v1::TransferStatus *status) {
        return client->transfers->Wait(context, ref, status);
    });
}

hmc_status check(hmc_client *client, hmc_transfer *transfer) {
    if (client == nullptr || transfer == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "the client or the transfer is NULL");
    return client->check_socket();
}

// hmc_wait's loop: asks hmcd until the transfer ended or `timeout_s` passed, each call bounded by what is left plus
// kWaitSlackS (an hmcd that stopped answering costs no more); the caller reports transfer->last.
hmc_status wait_for(hmc_client *client, hmc_transfer *transfer, double timeout_s) {
    if (!valid_timeout(timeout_s)) return fail(HMC_ERR_INVALID_ARGUMENT, "the timeout must be finite seconds in (0, 1e6]");
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
    while (!final_state(transfer->last.state())) {
        double left = std::chrono::duration<double>(deadline - std::chrono::steady_clock::now()).count();
        hmc_status status = ask(client, transfer, left > 0 ? left : 0.0, (left > 0 ? left : 0.0) + kWaitSlackS);
        if (status != HMC_OK) return status;
        if (!final_state(transfer->last.state()) && std::chrono::steady_clock::now() >= deadline) {
            return fail(HMC_ERR_TIMEOUT, "transfer " + transfer->id + " still " + hmc::v1::TransferState_Name(transfer->last.state()) + " after " +
                                             std::to_string(timeout_s) + " s");
        }
    }
    return outcome(*transfer);
}

// One Cancel call, bounded by `call_s`.
hmc_status cancel(hmc_client *client, hmc_transfer *transfer, double call_s) {
    return call_about(client, transfer, 0.0, call_s, [client](grpc::ClientContext *context, const hmc::v1::TransferRef &ref, hmc::v1::TransferStatus *status) {
        return client->transfers->Cancel(context, ref, status);
    });
}

thread_local hmc_transfer migrated;  // hmc_migrate's last transfer: its status's path lives here

}  // namespace

extern "C" hmc_status hmc_submit(hmc_client *client, const char *src, const char *dst, const uint64_t *src_offsets, const uint64_t *dst_offsets,
                                 const uint64_t *lengths, size_t count, double timeout_s, hmc_transfer **out) {
    if (out == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "the out pointer is NULL");
    *out = nullptr;
    if (client == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "the client is NULL");
    if (!valid_timeout(timeout_s)) return fail(HMC_ERR_INVALID_ARGUMENT, "the timeout must be finite seconds in (0, 1e6]");
    hmc::v1::SubmitTransferRequest request;
    if (!to_ref(src, request.mutable_src()) || !to_ref(dst, request.mutable_dst())) {
        return fail(HMC_ERR_INVALID_ARGUMENT, hmc_internal::kRefRule);
    }
    if (count == 0) return fail(HMC_ERR_INVALID_ARGUMENT, "no ranges to move");
    if (src_offsets == nullptr || dst_offsets == nullptr || lengths == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "a range array is NULL");
    if (count > (SIZE_MAX >> 4)) return fail(HMC_ERR_INVALID_ARGUMENT, "too many ranges");
    constexpr uint64_t kMax = UINT64_C(1) << 63;
    for (size_t i = 0; i < count; ++i) {
        if (src_offsets[i] >= kMax || dst_offsets[i] >= kMax || lengths[i] >= kMax) {
            return fail(HMC_ERR_INVALID_ARGUMENT, "range " + std::to_string(i) + " has an offset or length of 2^63 or more");
        }
    }
    // The wire's RangeList: little-endian int64 arrays (this library is built for little-endian machines).
    auto *ranges = request.mutable_ranges();
    ranges->mutable_src_offsets()->assign(reinterpret_cast<const char *>(src_offsets), count * 8);
    ranges->mutable_dst_offsets()->assign(reinterpret_cast<const char *>(dst_offsets), count * 8);
    ranges->mutable_lengths()->assign(reinterpret_cast<const char *>(lengths), count * 8);
    request.set_timeout_s(timeout_s);
    if (request.ByteSizeLong() > static_cast<size_t>(hmc_internal::kMaxMessage)) {  // else RESOURCE_EXHAUSTED, read as BUSY: retried for ever
        return fail(HMC_ERR_INVALID_ARGUMENT, "a submit of " + std::to_string(count) + " ranges is larger than hmcd's 64 MiB bound on a message: submit fewer at once");
    }
    hmc_status status = client->check_socket();
    if (status != HMC_OK) return status;
    auto transfer = std::make_unique<hmc_transfer>();
    grpc::ClientContext context;
    client->prepare(context, client->timeout_s);
    status = from_rpc(client->transfers->Submit(&context, request, &transfer->last), context, client->address);
    if (status != HMC_OK) return status;
    transfer->id = transfer->last.transfer_id();
    *out = transfer.release();
    return HMC_OK;
}

extern "C" const char *hmc_transfer_id(const hmc_transfer *transfer) { return transfer ? transfer->id.c_str() : ""; }

extern "C" hmc_status hmc_poll(hmc_client *client, hmc_transfer *transfer, hmc_transfer_status *out) {
    clear(out);
    hmc_status status = check(client, transfer);
    if (status != HMC_OK) return status;
    if (out == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "the out pointer is NULL");
    status = ask(client, transfer, 0.0, client->timeout_s);
    report(*transfer, out);
    return status;
}

extern "C" hmc_status hmc_wait(hmc_client *client, hmc_transfer *transfer, double timeout_s, hmc_transfer_status *out) {
    clear(out);
    hmc_status status = check(client, transfer);
    if (status != HMC_OK) return status;
    status = wait_for(client, transfer, timeout_s);
    report(*transfer, out);  // on every return: an early answer may have replaced the status `out` was filled from
    return status;
}

extern "C" hmc_status hmc_cancel(hmc_client *client, hmc_transfer *transfer) {
    hmc_status status = check(client, transfer);
    if (status != HMC_OK) return status;
    return cancel(client, transfer, client->timeout_s);
}

extern "C" void hmc_transfer_free(hmc_transfer *transfer) { delete transfer; }

extern "C" hmc_status hmc_migrate(hmc_client *client, const char *src, const char *dst, const uint64_t *src_offsets, const uint64_t *dst_offsets,
                                  const uint64_t *lengths, size_t count, double timeout_s, hmc_transfer_status *out) {
    clear(out);
    hmc_transfer *transfer = nullptr;
    hmc_status status = hmc_submit(client, src, dst, src_offsets, dst_offsets, lengths, count, timeout_s, &transfer);
    if (status != HMC_OK) return status;
    // hmcd fails the migration at its timeout: its verdict is waited for kVerdictS longer, no Wait call past that by
    // more than kWaitSlackS, and a cancel by no more than kCancelS (an hmcd that stopped costs the caller that much)
    status = wait_for(client, transfer, std::min(timeout_s + kVerdictS, 1e6));
    if (!final_state(transfer->last.state())) {  // not ended: stop it before saying so (its id is not the caller's)
        std::string why = hmc_last_error();
        cancel(client, transfer, std::min(client->timeout_s, kCancelS));
        fail(status, why);
    }
    migrated.id.swap(transfer->id);
    migrated.last.Swap(&transfer->last);
    hmc_transfer_free(transfer);
    report(migrated, out);
    return status;
}
