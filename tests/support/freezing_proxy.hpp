// SPDX-License-Identifier: MIT
// A TCP proxy on 127.0.0.1 in front of a store server that can be frozen: from then on it forwards nothing and closes
// nothing, as a host that froze or dropped off the network looks to its clients (no reply, no FIN, no RST).
#pragma once

#include <atomic>
#include <thread>

namespace weft::testing {

class FreezingProxy {
public:
    /// Listens on 127.0.0.1 (a free port) and forwards every connection to 127.0.0.1:server_port.
    explicit FreezingProxy(int server_port);
    ~FreezingProxy();
    FreezingProxy(const FreezingProxy&) = delete;
    FreezingProxy& operator=(const FreezingProxy&) = delete;

    int port() const { return port_; }
    /// Stops forwarding in both directions; the connections stay open until the proxy is destroyed.
    void freeze() { frozen_ = true; }

private:
    void run();

    int server_port_;
    int listen_fd_ = -1;
    int port_ = 0;
    std::atomic<bool> frozen_{false};
    std::atomic<bool> stop_{false};
    std::thread thread_;
};

}  // namespace weft::testing
