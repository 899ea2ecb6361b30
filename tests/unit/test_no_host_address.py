"""Tests, benchmarks and CI send traffic only to loopback or to test hosts they make themselves (network
namespaces: tests/netns.py). This test fails when code under tests/, benchmarks/, tools/, .ci/ or the
Makefile learns this machine's own addresses (`hostname -I`, resolving the host name, listing
interfaces) or names an address outside the ranges that are nobody's:

- 127.0.0.0/8 and ::1: loopback;
- 198.18.0.0/15: the namespaced test hosts (RFC 2544's range for testing between devices);
- 198.51.100.0/24 and 2001:db8::/32: documentation ranges (RFC 5737, RFC 3849), for addresses that
  appear in generated scripts or checked arguments and must reach no one.

192.0.2.0/24 (TEST-NET-1), 10/8 and the like are refused: a sandbox or a cluster may use them for real
(this machine's own address is 192.0.2.2). Recorded data (tests/fixtures/) is not code and is not read.
"""
from __future__ import annotations

import ipaddress
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HELPER = ROOT / "tests" / "netns.py"
ALLOWED = [ipaddress.ip_network(n) for n in ("127.0.0.0/8", "::1/128", "198.18.0.0/15", "198.51.100.0/24",
                                              "2001:db8::/32")]
# Ways to find this machine's own addresses or interfaces; each found only in the helper (which finds none).
DISCOVERY = {
    r"hostname\s+(-I|-i|--all-ip-addresses|--ip-address|--all-fqdns|-f)\b": "hostname -I / -i / -f",
    r"gethostbyname|gethostbyaddr|getfqdn": "resolving the host name",
    r"gethostname\s*\(": "the host name (it resolves to this machine's address on many machines)",
    r"if_nameindex|getifaddrs|net_if_addrs|netifaces|SIOCGIFADDR": "listing interfaces",
    r"\bip\s+(-[046o]\s+)*(a|addr|address)\b|\bip\s+(-[046o]\s+)*route\s+get\b|\bifconfig\b": "ip addr / ifconfig",
}
_IPV4 = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?![\w.])")
_IPV6 = re.compile(r"(?<![\w:.])([0-9a-fA-F]{0,4}(?::[0-9a-fA-F]{0,4}){2,7})(?![\w:.])")


def _sources() -> list[Path]:
    files = [ROOT / "Makefile", *sorted((ROOT / ".ci").iterdir())]
    for top in ("tests", "benchmarks", "tools"):
        files += [p for p in sorted((ROOT / top).rglob("*"))
                  if p.is_file() and p.suffix in (".py", ".sh", ".toml", "") and "fixtures" not in p.parts
                  and "__pycache__" not in p.parts]
    return [p for p in files if p not in (HELPER, Path(__file__).resolve())]


_SLICE = re.compile(r"\[::-?\d*\](?!:)")  # a Python slice, x[::-1], x[::2], x[::] (not the host "[::]:80")


def _addresses(text: str) -> list[str]:
    found = []
    for pattern in (_IPV4, _IPV6):
        for match in pattern.finditer(text):
            if match.start(1) > 0 and _SLICE.match(text, match.start(1) - 1):
                continue
            try:
                found.append(str(ipaddress.ip_address(match.group(1))))
            except ValueError:  # a version number, a time of day, a ratio: not an address
                continue
    return found


def test_the_scan_finds_what_it_looks_for():
    assert _addresses("dial 192.0.2.2:29400, [fd00::2]:1 or 127.0.0.1; torch 2.13.0; 12:30:45") == \
        ["192.0.2.2", "127.0.0.1", "fd00::2"]
    # A slice is not the unspecified address; a bind to [::] is.
    assert _addresses("ids[::-1], rows[::2], all[::]") == [] and _addresses("listen on [::]:80 or :: ") == ["::", "::"]
    bad = "subprocess.run(['hostname', '-I']); socket.gethostbyname(socket.gethostname()); ip -4 addr show"
    assert {why for pattern, why in DISCOVERY.items() if re.search(pattern, bad.replace("', '", " "))} == \
        {"hostname -I / -i / -f", "resolving the host name", "the host name (it resolves to this machine's address "
         "on many machines)", "ip addr / ifconfig"}
    assert len(_sources()) > 50  # tests/, benchmarks/, tools/, .ci/run, Makefile


def test_no_code_outside_the_helper_finds_or_names_a_host_address():
    problems = []
    for path in _sources():
        rel = path.relative_to(ROOT)
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for pattern, why in DISCOVERY.items():
                if re.search(pattern, line):
                    problems.append(f"{rel}:{n}: {why}: {line.strip()}")
            for addr in _addresses(line):
                if not any(ipaddress.ip_address(addr) in net for net in ALLOWED):
                    problems.append(f"{rel}:{n}: address {addr} is not loopback, a namespaced test host "
                                    f"(198.18.0.0/15) or a documentation address: {line.strip()}")
    assert not problems, ("tests may talk only to loopback or to hosts they create in network namespaces "
                          "(tests/netns.py):\n" + "\n".join(problems))
