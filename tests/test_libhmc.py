"""libhmc, the C ABI: built with CMake under AddressSanitizer and UndefinedBehaviorSanitizer, its C test suite run by
ctest against a real hmcd and real agents (libhmc/tests/cluster.py), its status table checked against hmc.errors,
the C and C++ scheduler examples migrating 64 MiB of KV blocks between two real agents through hmcd (every byte
verified by the agents), and the install (library, headers, pkg-config file, CMake package) used by a consumer.

Needs cmake, a C/C++ compiler, Debian's libgrpc++-dev, libprotobuf-dev and protobuf-compiler-grpc (.ci/run
installs them); without them the module skips, except under CI, where it fails.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from control_fixtures import REPO, DaemonSet, Hmcd
from hmc.errors import ErrorCode, error_from_code
from hmc.testing import PeerProcess

LIBHMC = REPO / "libhmc"
HEADER = LIBHMC / "include" / "hmc" / "hmc.h"
pytestmark = pytest.mark.timeout(900)


def _toolchain_missing() -> str | None:
    for tool in ("cmake", "cc", "c++", "protoc", "grpc_cpp_plugin", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not Path("/usr/include/grpcpp/grpcpp.h").exists():
        return "gRPC's C++ headers (libgrpc++-dev) are not installed"
    return None


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """libhmc, its tests and examples, built once with the sanitizers on."""
    missing = _toolchain_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"libhmc cannot be built here: {missing}")
        pytest.skip(f"libhmc cannot be built here: {missing}")
    where = tmp_path_factory.mktemp("libhmc-build")
    configure = ["cmake", "-S", str(LIBHMC), "-B", str(where), "-DHMC_SANITIZE=ON", f"-DHMC_PYTHON={sys.executable}"]
    for command in (configure, ["cmake", "--build", str(where), "-j", str(os.cpu_count() or 2)]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=800)
        assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return where


def _sanitized_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(ASAN_OPTIONS="detect_leaks=1:halt_on_error=1", LSAN_OPTIONS=f"suppressions={LIBHMC / 'tests' / 'lsan.supp'}", UBSAN_OPTIONS="halt_on_error=1", **extra)
    return env


def test_the_c_suite_passes_under_the_sanitizers(build: Path) -> None:
    done = subprocess.run(["ctest", "--output-on-failure", "--timeout", "300"], cwd=build, capture_output=True, text=True, timeout=800)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    ran = re.search(r"(\d+)% tests passed, 0 tests failed out of (\d+)", done.stdout)
    assert ran and int(ran.group(2)) == 19, done.stdout[-2000:]  # 15 C tests and the two nodes' start and stop


def test_the_status_table_is_the_python_exception_tree() -> None:
    """hmc.h's hmc_status values are the wire's ErrorCode values, and each names the Python exception of its code."""
    table = re.findall(r"^\s+(HMC_(?:OK|ERR_\w+)) = (\d+),?[ \t]*(?:/\* (\w+) \*/)?", HEADER.read_text(), re.MULTILINE)
    assert len(table) == len(ErrorCode)
    for name, value, exception in table:
        code = ErrorCode(int(value))
        assert name == ("HMC_OK" if code is ErrorCode.OK else f"HMC_ERR_{code.name}")
        if code is not ErrorCode.OK:
            assert exception == type(error_from_code(code, "")).__name__, (name, exception)


@pytest.fixture
def kv_node() -> Iterator[tuple[Hmcd, PeerProcess, PeerProcess]]:
    """A real hmcd with a prefill agent and a decode agent attached (each in its own process)."""
    daemons = DaemonSet()
    try:
        hmcd = daemons.start("kv")
        with PeerProcess(hmcd.config(), daemon=True) as prefill, PeerProcess(hmcd.config(), daemon=True) as decode:
            yield hmcd, prefill, decode
    finally:
        daemons.close()


def _kv_blocks(rng: np.random.Generator, size: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """A request's blocks: every source block to a random destination block."""
    count = size // block
    return np.arange(count), rng.permutation(count)


def test_the_c_scheduler_migrates_64_MiB_of_kv_blocks_when_told_to(build: Path, kv_node: tuple[Hmcd, PeerProcess, PeerProcess]) -> None:
    hmcd, prefill, decode = kv_node
    size, block = 64 << 20, 64 << 10
    rng = np.random.default_rng(1564)
    data = rng.integers(1, 256, size, dtype=np.uint8)
    source = prefill.register(size, name="prefill-kv")
    prefill.fill(source.id, data.tobytes())
    target = decode.register(size, name="decode-kv", fill=0xA5)
    src_blocks, dst_blocks = _kv_blocks(rng, size, block)
    instruction = "migrate req-7 %d %s\nquit\n" % (block, " ".join(f"{a}:{b}" for a, b in zip(src_blocks, dst_blocks)))
    done = subprocess.run(
        [str(build / "examples" / "kv_scheduler"), hmcd.unix_address, "prefill-kv", "decode-kv"],
        input=instruction, capture_output=True, text=True, timeout=120, env=_sanitized_env(),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"request req-7: moved 1024 blocks \(67108864 bytes\) prefill-kv -> decode-kv over ipc", done.stdout), done.stdout
    expected = np.empty(size, np.uint8)
    for a, b in zip(src_blocks, dst_blocks):
        expected[b * block : (b + 1) * block] = data[a * block : (a + 1) * block]
    assert decode.contents(target.id) == expected.tobytes()


def test_the_c_scheduler_reports_events_and_a_refused_request(build: Path, kv_node: tuple[Hmcd, PeerProcess, PeerProcess]) -> None:
    """It prints a buffer that appears while it runs, and a request past the destination is refused (nothing lands)."""
    hmcd, prefill, decode = kv_node
    prefill.register(1 << 20, name="prefill-kv", fill=0x11)
    target = decode.register(1 << 20, name="decode-kv", fill=0xA5)
    with subprocess.Popen(
        [str(build / "examples" / "kv_scheduler"), hmcd.unix_address, "prefill-kv", "decode-kv"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_sanitized_env(),
    ) as scheduler:
        try:
            assert scheduler.stdout is not None and scheduler.stdin is not None and scheduler.stderr is not None
            assert scheduler.stdout.readline().startswith("watching hmcd")  # subscribed: what comes next is seen
            decode.register(4096, name="late-arrival")
            while "late-arrival" not in (line := scheduler.stdout.readline()):
                assert line, "the scheduler ended before it reported the new buffer"
            scheduler.stdin.write("migrate req-9 65536 0:16\nquit\n")  # block 16 of a 1 MiB buffer is past its end
            scheduler.stdin.close()
            assert scheduler.wait(timeout=60) == 1
            assert "request req-9: HMC_ERR_OUT_OF_RANGE" in scheduler.stderr.read()
        finally:
            if scheduler.poll() is None:
                scheduler.kill()
    assert decode.contents(target.id) == bytes([0xA5]) * (1 << 20)


def test_the_cpp_example_migrates_through_the_raii_header(build: Path, kv_node: tuple[Hmcd, PeerProcess, PeerProcess]) -> None:
    hmcd, prefill, decode = kv_node
    rng = np.random.default_rng(7)
    data = rng.integers(1, 256, 1 << 20, dtype=np.uint8)
    source = prefill.register(1 << 20, name="prefill-kv")
    prefill.fill(source.id, data.tobytes())
    target = decode.register(1 << 20, name="decode-kv", fill=0xA5)
    done = subprocess.run(
        [str(build / "examples" / "kv_migrate"), hmcd.unix_address, "prefill-kv", "decode-kv", "4096", "3:0", "0:5", "255:255"],
        capture_output=True, text=True, timeout=60, env=_sanitized_env(),
    )
    assert done.returncode == 0, done.stderr
    assert "moved 3 blocks (12288 bytes) prefill-kv -> decode-kv over ipc" in done.stdout
    expected = np.full(1 << 20, 0xA5, np.uint8)
    for a, b in ((3, 0), (0, 5), (255, 255)):
        expected[b * 4096 : (b + 1) * 4096] = data[a * 4096 : (a + 1) * 4096]
    assert decode.contents(target.id) == expected.tobytes()
    refused = subprocess.run(
        [str(build / "examples" / "kv_migrate"), hmcd.unix_address, "prefill-kv", "no-such-kv", "4096", "0:0"],
        capture_output=True, text=True, timeout=60, env=_sanitized_env(),
    )
    assert refused.returncode == 1 and "HMC_ERR_UNKNOWN_BUFFER" in refused.stderr


def test_the_install_serves_a_consumer_through_its_cmake_package_and_pkg_config(build: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    done = subprocess.run(["cmake", "--install", str(build), "--prefix", str(prefix)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for shipped in ("include/hmc/hmc.h", "include/hmc/hmc.hpp", "lib/libhmc.so", "lib/pkgconfig/hmc.pc", "lib/cmake/hmc/hmcConfig.cmake"):
        assert (prefix / shipped).exists(), shipped
    consumer = tmp_path / "consumer"
    consumer.mkdir()
    (consumer / "main.c").write_text('#include <hmc/hmc.h>\n#include <string.h>\nint main(void) { return strcmp(hmc_status_name(HMC_ERR_NO_PATH), "HMC_ERR_NO_PATH"); }\n')
    (consumer / "CMakeLists.txt").write_text(
        "cmake_minimum_required(VERSION 3.16)\nproject(consumer C)\nfind_package(hmc 0.1 REQUIRED)\n"
        "add_executable(consumer main.c)\ntarget_link_libraries(consumer PRIVATE hmc::hmc)\n"
        "target_compile_options(consumer PRIVATE -fsanitize=address,undefined)\ntarget_link_options(consumer PRIVATE -fsanitize=address,undefined)\n"
    )
    for command in (["cmake", "-S", str(consumer), "-B", str(consumer / "build"), f"-DCMAKE_PREFIX_PATH={prefix}"], ["cmake", "--build", str(consumer / "build")]):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = subprocess.run([str(consumer / "build" / "consumer")], capture_output=True, timeout=60, env=_sanitized_env(LD_LIBRARY_PATH=str(prefix / "lib")))
    assert ran.returncode == 0, ran.stderr
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "hmc"], capture_output=True, text=True, env={**os.environ, "PKG_CONFIG_PATH": str(prefix / "lib" / "pkgconfig")})
    assert flags.returncode == 0 and "-lhmc" in flags.stdout, flags.stderr
    built = subprocess.run(["cc", str(consumer / "main.c"), *flags.stdout.split(), "-fsanitize=address,undefined", "-o", str(tmp_path / "via-pkg-config")], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr
    ran = subprocess.run([str(tmp_path / "via-pkg-config")], capture_output=True, timeout=60, env=_sanitized_env(LD_LIBRARY_PATH=str(prefix / "lib")))
    assert ran.returncode == 0, ran.stderr
