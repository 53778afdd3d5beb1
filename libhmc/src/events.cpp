// Event subscriptions: a reader thread per subscription fills a queue (bounded); an eventfd is readable while it
// holds events (or the stream ended), for a scheduler's poll/epoll loop; hmc_events_next takes them in order.
// A subscription keeps its own channel, stub, address and token: it may outlive the client it came from.
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <system_error>
#include <thread>

#include "internal.hpp"

using hmc_internal::fail;
using hmc_internal::from_rpc;
using hmc_internal::valid_timeout;

namespace {

constexpr size_t kMaxQueued = 65536;  // events waiting to be taken; past it the subscriber has fallen behind
constexpr const char *kSubscribed = "hmc-subscribed";  // hmcd's initial metadata once the subscription exists

}  // namespace

struct hmc_events {
    std::shared_ptr<grpc::Channel> channel;
    std::unique_ptr<hmc::v1::EventService::Stub> stub;
    std::string address;
    grpc::ClientContext context;
    std::thread reader;
    int fd = -1;
    std::mutex lock;
    std::condition_variable changed;
    std::deque<hmc::v1::Event> queue;  // guarded by lock
    bool subscribed = false;           // guarded by lock
    bool ended = false;                // guarded by lock
    hmc_status end = HMC_OK;           // guarded by lock: why the stream ended
    std::string end_message;           // guarded by lock
    hmc::v1::Event current;            // the event last handed out (its strings)

    void run(hmc::v1::WatchRequest request);
    void finish(hmc_status status, const std::string &message);
};

namespace {

void signal(int fd) {
    uint64_t one = 1;
    ssize_t written = write(fd, &one, sizeof one);
    (void)written;  // the counter only saturates: readable either way
}

void drain(int fd) {
    uint64_t count;
    ssize_t got = read(fd, &count, sizeof count);
    (void)got;  // EAGAIN: already drained
}

}  // namespace

void hmc_events::finish(hmc_status status, const std::string &message) {
    std::lock_guard<std::mutex> hold(lock);
    ended = true;
    end = status == HMC_OK ? HMC_ERR_CLOSED : status;
    end_message = message;
    signal(fd);
    changed.notify_all();
}

void hmc_events::run(hmc::v1::WatchRequest request) {
    std::unique_ptr<grpc::ClientReader<hmc::v1::Event>> stream = stub->Watch(&context, request);
    stream->WaitForInitialMetadata();  // returns on failure too: hmcd's marker tells the two apart
    if (context.GetServerInitialMetadata().count(kSubscribed)) {
        std::lock_guard<std::mutex> hold(lock);
        subscribed = true;
        changed.notify_all();
    }
    hmc::v1::Event event;
    bool behind = false;
    while (!behind && stream->Read(&event)) {
        std::lock_guard<std::mutex> hold(lock);
        if (queue.size() >= kMaxQueued) {
            behind = true;
            context.TryCancel();
            break;
        }
        queue.push_back(std::move(event));
        subscribed = true;
        signal(fd);
        changed.notify_all();
    }
    grpc::Status status = stream->Finish();
    if (behind) {
        finish(HMC_ERR_BUSY, "the subscriber fell behind: " + std::to_string(kMaxQueued) + " events were waiting to be taken");
        return;
    }
    if (status.ok()) {
        finish(HMC_ERR_CLOSED, "hmcd ended the event stream");
    } else if (status.error_code() == grpc::StatusCode::CANCELLED) {
        finish(HMC_ERR_CLOSED, "the subscription was closed");
    } else {
        hmc_status code = from_rpc(status, context, address);  // recorded as the reader thread's last error
        finish(code, hmc_last_error());
    }
}

extern "C" hmc_status hmc_events_subscribe(hmc_client *client, int include_peers, hmc_events **out) {
    if (out == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "the out pointer is NULL");
    *out = nullptr;
    if (client == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "the client is NULL");
    // One unary call first: hmcd is there and takes the token (a stream that fails says so only on its first read).
    hmc_node_info *info = nullptr;
    hmc_status status = hmc_node_info_get(client, &info);
    hmc_node_info_free(info);
    if (status != HMC_OK) return status;
    auto events = std::make_unique<hmc_events>();
    events->channel = client->channel;
    events->stub = hmc::v1::EventService::NewStub(client->channel);
    events->address = client->address;
    events->fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (events->fd < 0) return fail(HMC_ERR_INTERNAL, "cannot make an eventfd");
    if (!client->token.empty()) events->context.AddMetadata("authorization", "Bearer " + client->token);
    hmc::v1::WatchRequest request;
    request.set_include_peers(include_peers != 0);
    try {
        events->reader = std::thread(&hmc_events::run, events.get(), request);
    } catch (const std::system_error &error) {
        close(events->fd);
        return fail(HMC_ERR_INTERNAL, std::string("cannot start the subscription's reader thread: ") + error.what());
    }
    std::unique_lock<std::mutex> hold(events->lock);
    bool settled = events->changed.wait_for(hold, std::chrono::duration<double>(client->timeout_s), [&] { return events->subscribed || events->ended; });
    if (events->subscribed) {
        hold.unlock();
        *out = events.release();
        return HMC_OK;
    }
    hmc_status end = events->end;
    std::string message = events->end_message;
    hold.unlock();
    events->context.TryCancel();
    events->reader.join();
    close(events->fd);
    if (!settled) return fail(HMC_ERR_TIMEOUT, "hmcd at " + events->address + " did not take the subscription before the deadline");
    return fail(end, message);
}

extern "C" int hmc_events_fd(const hmc_events *events) { return events ? events->fd : -1; }

extern "C" hmc_status hmc_events_next(hmc_events *events, double timeout_s, hmc_event *out) {
    if (events == nullptr || out == nullptr) return fail(HMC_ERR_INVALID_ARGUMENT, "the subscription or the out pointer is NULL");
    if (!valid_timeout(timeout_s, true)) return fail(HMC_ERR_INVALID_ARGUMENT, "the timeout must be finite seconds in [0, 1e6]");
    std::unique_lock<std::mutex> hold(events->lock);
    events->changed.wait_for(hold, std::chrono::duration<double>(timeout_s), [&] { return !events->queue.empty() || events->ended; });
    if (events->queue.empty()) {
        if (events->ended) return fail(events->end, events->end_message);
        return fail(HMC_ERR_TIMEOUT, "no event within the timeout");
    }
    events->current = std::move(events->queue.front());
    events->queue.pop_front();
    if (events->queue.empty() && !events->ended) drain(events->fd);
    hold.unlock();
    const hmc::v1::Event &event = events->current;
    out->kind = hmc_internal::known<hmc_event_kind>(event.kind(), HMC_EVENT_AGENT_DOWN);
    out->sequence = event.sequence();
    out->time = event.time();
    out->node = event.node().c_str();
    out->buffer_id = event.buffer().id().c_str();
    out->buffer_name = event.buffer().name().c_str();
    out->agent_id = event.agent_id().c_str();
    out->peer = event.peer().c_str();
    return HMC_OK;
}

extern "C" void hmc_events_close(hmc_events *events) {
    if (events == nullptr) return;
    events->context.TryCancel();
    if (events->reader.joinable()) events->reader.join();
    close(events->fd);
    delete events;
}
