// A scheduler step in C++ (hmc.hpp over libhmc): migrate a request's KV blocks between two agents' ConnBuffers
// through hmcd, and say what moved.
//
//     kv_migrate ADDRESS SRC DST BLOCK_BYTES SRC_BLOCK:DST_BLOCK ...
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <string>
#include <vector>

#include "hmc/hmc.hpp"

int main(int argc, char **argv) {
    if (argc < 6) {
        std::cerr << "usage: " << argv[0] << " ADDRESS SRC DST BLOCK_BYTES SRC_BLOCK:DST_BLOCK ...\n";
        return 2;
    }
    try {
        hmc::Client hmcd(argv[1]);
        const std::string src = argv[2], dst = argv[3];
        const uint64_t block = std::strtoull(argv[4], nullptr, 10);
        std::vector<uint64_t> from, to, lengths;
        for (int i = 5; i < argc; ++i) {
            unsigned long long a, b;
            if (std::sscanf(argv[i], "%llu:%llu", &a, &b) != 2) throw hmc::Error(HMC_ERR_INVALID_ARGUMENT, std::string("bad block pair ") + argv[i]);
            from.push_back(a * block), to.push_back(b * block), lengths.push_back(block);
        }
        hmc::Path path = hmcd.negotiate(src, dst);
        hmc::TransferStatus status = hmcd.migrate(src, dst, from, to, lengths, 60.0);
        std::cout << "moved " << lengths.size() << " blocks (" << status.bytes_done << " bytes) " << src << " -> " << dst << " over " << status.path
                  << " (" << path.reason << ")\n";
    } catch (const hmc::Error &error) {
        std::cerr << error.what() << "\n";
        return 1;
    }
    return 0;
}
