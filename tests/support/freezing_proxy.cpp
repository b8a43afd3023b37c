// SPDX-License-Identifier: MIT
#include "support/freezing_proxy.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <array>
#include <stdexcept>
#include <string>
#include <vector>

namespace weft::testing {

namespace {

sockaddr_in loopback(int port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return a;
}

/// Moves what `from` has to `to`; false once `from` closed or failed.
bool forward(int from, int to) {
    std::array<char, 65536> buffer;
    const ssize_t got = ::recv(from, buffer.data(), buffer.size(), 0);
    if (got <= 0) return false;
    for (ssize_t done = 0; done < got;) {
        const ssize_t sent = ::send(to, buffer.data() + done, static_cast<size_t>(got - done), MSG_NOSIGNAL);
        if (sent <= 0) return false;
        done += sent;
    }
    return true;
}

}  // namespace

FreezingProxy::FreezingProxy(int server_port) : server_port_(server_port) {
    listen_fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a = loopback(0);
    socklen_t length = sizeof(a);
    if (listen_fd_ < 0 || ::bind(listen_fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
        ::listen(listen_fd_, 64) != 0 || ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&a), &length) != 0) {
        if (listen_fd_ >= 0) ::close(listen_fd_);
        throw std::runtime_error("FreezingProxy: cannot listen on 127.0.0.1");
    }
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { run(); });
}

FreezingProxy::~FreezingProxy() {
    stop_ = true;
    thread_.join();
    ::close(listen_fd_);
}

void FreezingProxy::run() {
    struct Pair {
        int client, server;
    };
    std::vector<Pair> pairs;
    while (!stop_) {
        std::vector<pollfd> fds{{listen_fd_, POLLIN, 0}};
        const size_t polled = frozen_ ? 0 : pairs.size();  // connections accepted below wait for the next poll
        for (size_t i = 0; i < polled; ++i) {
            fds.push_back({pairs[i].client, POLLIN, 0});
            fds.push_back({pairs[i].server, POLLIN, 0});
        }
        if (::poll(fds.data(), fds.size(), 20) <= 0) continue;
        if (fds[0].revents & POLLIN) {
            const int client = ::accept(listen_fd_, nullptr, nullptr);
            if (client >= 0) {
                const int server = ::socket(AF_INET, SOCK_STREAM, 0);
                const sockaddr_in a = loopback(server_port_);
                if (server >= 0 && ::connect(server, reinterpret_cast<const sockaddr*>(&a), sizeof(a)) == 0) {
                    pairs.push_back({client, server});
                } else {
                    ::close(client);
                    if (server >= 0) ::close(server);
                }
            }
        }
        if (frozen_) continue;  // nothing forwarded, nothing closed
        for (size_t i = 0; i < polled; ++i) {
            const short from_client = fds[1 + 2 * i].revents, from_server = fds[2 + 2 * i].revents;
            const bool open = (!from_client || forward(pairs[i].client, pairs[i].server)) &&
                              (!from_server || forward(pairs[i].server, pairs[i].client));
            if (!open) {
                ::close(pairs[i].client);
                ::close(pairs[i].server);
                pairs[i] = {-1, -1};
            }
        }
        std::erase_if(pairs, [](const Pair& p) { return p.client < 0; });
    }
    for (const Pair& p : pairs) {
        ::close(p.client);
        ::close(p.server);
    }
}

}  // namespace weft::testing
