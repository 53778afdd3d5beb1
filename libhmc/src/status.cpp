// Status codes, the per-thread last error, and gRPC statuses turned into hmc_status.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

#include "internal.hpp"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libhmc sends range arrays as the wire's little-endian int64s straight from memory: a little-endian machine only"
#endif

namespace {

thread_local std::string last_error;

const char *const kNames[] = {
    "HMC_OK",
    "HMC_ERR_INTERNAL",
    "HMC_ERR_INVALID_ARGUMENT",
    "HMC_ERR_OUT_OF_RANGE",
    "HMC_ERR_ACCESS_DENIED",
    "HMC_ERR_UNKNOWN_BUFFER",
    "HMC_ERR_BUFFER_WITHDRAWN",
    "HMC_ERR_AUTHENTICATION",
    "HMC_ERR_PROTOCOL",
    "HMC_ERR_VERSION_MISMATCH",
    "HMC_ERR_TIMEOUT",
    "HMC_ERR_CANCELLED",
    "HMC_ERR_PEER_LOST",
    "HMC_ERR_CLOSED",
    "HMC_ERR_BUSY",
    "HMC_ERR_NO_PATH",
    "HMC_ERR_UNSUPPORTED",
    "HMC_ERR_DEVICE",
    "HMC_ERR_UNAVAILABLE",
    "HMC_ERR_STALE_DESCRIPTOR",
};
constexpr int kCount = sizeof(kNames) / sizeof(kNames[0]);

// For statuses without hmcd's code (raised by gRPC itself): as hmc/control/_errors.py's _FALLBACK.
hmc_status fallback(grpc::StatusCode code) {
    switch (code) {
        case grpc::StatusCode::INVALID_ARGUMENT: return HMC_ERR_INVALID_ARGUMENT;
        case grpc::StatusCode::OUT_OF_RANGE: return HMC_ERR_OUT_OF_RANGE;
        case grpc::StatusCode::PERMISSION_DENIED: return HMC_ERR_ACCESS_DENIED;
        case grpc::StatusCode::NOT_FOUND: return HMC_ERR_UNKNOWN_BUFFER;
        case grpc::StatusCode::UNAUTHENTICATED: return HMC_ERR_AUTHENTICATION;
        case grpc::StatusCode::FAILED_PRECONDITION: return HMC_ERR_PROTOCOL;
        case grpc::StatusCode::DEADLINE_EXCEEDED: return HMC_ERR_TIMEOUT;
        case grpc::StatusCode::CANCELLED: return HMC_ERR_CANCELLED;
        case grpc::StatusCode::ABORTED: return HMC_ERR_PEER_LOST;
        case grpc::StatusCode::RESOURCE_EXHAUSTED: return HMC_ERR_BUSY;
        case grpc::StatusCode::UNIMPLEMENTED: return HMC_ERR_UNSUPPORTED;
        case grpc::StatusCode::UNAVAILABLE: return HMC_ERR_UNAVAILABLE;
        default: return HMC_ERR_INTERNAL;
    }
}

}  // namespace

extern "C" const char *hmc_status_name(hmc_status status) {
    int value = static_cast<int>(status);
    return value >= 0 && value < kCount ? kNames[value] : "HMC_ERR_UNKNOWN";
}

extern "C" const char *hmc_last_error(void) { return last_error.c_str(); }

extern "C" const char *hmc_version(void) { return HMC_VERSION; }

namespace hmc_internal {

hmc_status fail(hmc_status status, const std::string &message) {
    if (status != HMC_OK) last_error = message;
    return status;
}

hmc_status from_rpc(const grpc::Status &status, const grpc::ClientContext &context, const std::string &address) {
    if (status.ok()) return HMC_OK;
    const auto &trailing = context.GetServerTrailingMetadata();
    auto found = trailing.find("hmc-error-code");
    if (found != trailing.end()) {
        std::string text(found->second.data(), found->second.size());
        char *end = nullptr;
        long code = std::strtol(text.c_str(), &end, 10);
        if (end != text.c_str() && *end == '\0' && code > 0 && code < kCount) {
            return fail(static_cast<hmc_status>(code), status.error_message());
        }
    }
    hmc_status mapped = fallback(status.error_code());
    if (mapped == HMC_ERR_UNAVAILABLE) return fail(mapped, "hmcd at " + address + " is unavailable: " + status.error_message());
    if (mapped == HMC_ERR_TIMEOUT) return fail(mapped, "hmcd at " + address + " did not answer before the deadline: " + status.error_message());
    return fail(mapped, status.error_message());
}

hmc_status to_status(int code) { return code >= 0 && code < kCount ? static_cast<hmc_status>(code) : HMC_ERR_INTERNAL; }

bool valid_timeout(double seconds, bool zero_ok) {
    return std::isfinite(seconds) && seconds <= 1e6 && (seconds > 0 || (zero_ok && seconds == 0));
}

// Whether text[0, size) is UTF-8 as protobuf's string fields require: no overlong forms, no surrogates, at most U+10FFFF.
static bool valid_utf8(const unsigned char *text, size_t size) {
    for (size_t i = 0; i < size;) {
        unsigned char c = text[i];
        size_t more = c < 0x80 ? 0 : (c >= 0xC2 && c <= 0xDF) ? 1 : (c >= 0xE0 && c <= 0xEF) ? 2 : (c >= 0xF0 && c <= 0xF4) ? 3 : 4;
        if (more == 4 || more >= size - i) return false;
        unsigned char low = 0x80, high = 0xBF;  // the second byte's range, narrowed where the first byte demands
        if (c == 0xE0) low = 0xA0;
        if (c == 0xED) high = 0x9F;
        if (c == 0xF0) low = 0x90;
        if (c == 0xF4) high = 0x8F;
        for (size_t k = 1; k <= more; ++k) {
            unsigned char b = text[i + k];
            if (b < (k == 1 ? low : 0x80) || b > (k == 1 ? high : 0xBF)) return false;
        }
        i += more + 1;
    }
    return true;
}

bool to_ref(const char *text, hmc::v1::BufferRef *ref) {
    if (text == nullptr || *text == '\0') return false;
    bool by_id = std::strncmp(text, "id:", 3) == 0;
    const char *value = by_id ? text + 3 : text;
    size_t size = strnlen(value, kMaxName + 1);
    if (size == 0 || size > kMaxName || !valid_utf8(reinterpret_cast<const unsigned char *>(value), size)) return false;
    if (by_id) {
        ref->set_id(value, size);
    } else {
        ref->set_name(value, size);
    }
    return true;
}

}  // namespace hmc_internal
