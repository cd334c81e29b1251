"""Links a test can cut: nodes in network namespaces on a bridge, and a loopback relay.

:class:`Fleet` puts each simulated node in a network namespace of its own,
joined by a veth pair to a bridge in the root namespace. The bridge holds
``fleet.host_address`` (where a dash-memd started by the test in the root
namespace listens); node ``i`` holds ``fleet[i].address``, and the nodes
reach each other through the bridge. A node's link is cut the way a cable
is: its veth end on the bridge goes down, packets are dropped, TCP on both
sides just sees silence. Needs root and ``ip netns``; :func:`unavailable`
says why not, for a skip. Everything it made is removed on exit, whatever
happened::

    with Fleet(2) as fleet:
        memd = start_memd(listen=f"{fleet.host_address}:0")
        proc = fleet[0].popen([sys.executable, "-m", "dashrun", ...])
        fleet[0].link_down(); ...; fleet[0].link_up()

:class:`Relay` is the loopback-only stand-in that always runs: a TCP relay
in front of a server whose link the test cuts (``link_down``/``link_up``,
or ``cut_after(nbytes)`` to cut in the middle of a stream at an exact
byte) or whose connections it drops (``drop``).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import threading
from typing import Sequence

__all__ = ["Fleet", "Node", "Relay", "burst", "unavailable"]

#: Addresses for the test networks: a /24 per fleet, picked by process id, in a private range.
TEST_RANGE = ipaddress.ip_network("10.213.0.0/16")
#: A token bucket of 4 KiB (:func:`_tbf`): the rate holds over milliseconds, not only on average.
SMALL_BURST = "32kbit"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None: they can): not root, no ``ip``, no netns support."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the 'ip' command (iproute2) is not installed"
    probe = f"dash-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"'ip netns add' fails: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Node:
    """One node of a :class:`Fleet`: a network namespace with one address on the fleet's bridge."""

    def __init__(self, fleet: Fleet, index: int):
        self.index = index
        self.namespace = f"{fleet.prefix}-n{index}"
        self.address = str(fleet.subnet[index + 2])
        self.host_end = f"{fleet.prefix}h{index}"   # on the bridge, in the root namespace
        self.node_end = f"{fleet.prefix}n{index}"   # in the node's namespace
        self._prefix_len = fleet.subnet.prefixlen

    def _create(self, bridge: str, mtu: int | None) -> None:
        _ip("netns", "add", self.namespace)
        _ip("link", "add", self.host_end, *(["mtu", str(mtu)] if mtu else []), "type", "veth", "peer", "name",
            self.node_end, *(["mtu", str(mtu)] if mtu else []), "netns", self.namespace)
        _ip("link", "set", self.host_end, "master", bridge)
        _ip("link", "set", self.host_end, "up")
        _ip("-n", self.namespace, "addr", "add", f"{self.address}/{self._prefix_len}", "dev", self.node_end)
        _ip("-n", self.namespace, "link", "set", self.node_end, "up")
        _ip("-n", self.namespace, "link", "set", "lo", "up")  # torch's rendezvous store listens on loopback

    def _remove(self) -> None:
        _ip("netns", "del", self.namespace, check=False)  # takes its veth pair with it
        _ip("link", "del", self.host_end, check=False)

    def command(self, cmd: Sequence[str]) -> list[str]:
        """``cmd`` as it runs inside the node."""
        return ["ip", "netns", "exec", self.namespace, *cmd]

    def run(self, cmd: Sequence[str], **kwargs) -> subprocess.CompletedProcess:
        """Run ``cmd`` in the node and wait (``subprocess.run``'s keywords)."""
        return subprocess.run(self.command(cmd), **kwargs)

    def popen(self, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` in the node (``subprocess.Popen``'s keywords); the caller stops it."""
        return subprocess.Popen(self.command(cmd), **kwargs)

    def rx_bytes(self) -> int:
        """Bytes the node has received over its link (its veth's counter)."""
        out = self.run(["cat", f"/sys/class/net/{self.node_end}/statistics/rx_bytes"], capture_output=True,
                       text=True, check=True, timeout=30)
        return int(out.stdout)

    def link_down(self) -> None:
        """Cut the node's cable: from now on its packets are dropped, both ways."""
        _ip("link", "set", self.host_end, "down")

    def link_up(self) -> None:
        _ip("link", "set", self.host_end, "up")

    def shape(self, rate: str | None, burst: str = SMALL_BURST) -> None:
        """Limit what the node sends to ``rate`` (tc's units: ``8mbit``); None lifts the limit. ``burst``: the
        token bucket's size (see :func:`_tbf`)."""
        _tbf(["ip", "netns", "exec", self.namespace], self.node_end, rate, burst)

    def shape_inbound(self, rate: str | None, burst: str = SMALL_BURST) -> None:
        """Limit what the node receives to ``rate``: the same tbf on the bridge's end of its veth, whose egress
        is the node's ingress (a qdisc shapes only what leaves a device); None lifts the limit."""
        _tbf([], self.host_end, rate, burst)


def _tbf(prefix: list[str], device: str, rate: str | None, burst: str = SMALL_BURST) -> None:
    """Replace ``device``'s root qdisc by a token bucket of ``rate`` (None: back to the default).

    The bucket is small by default (4 KiB), so that the rate holds over milliseconds, not only on average (tbf
    cuts a GSO packet larger than it into segments); above a few hundred Mbit/s a bucket that small caps the
    link below its rate (the kernel's timers refill it too seldom), so a fast link takes a bigger ``burst``.
    Its packets wait first in, first out: netem, fq_codel, fq and sfq are missing on some kernels.
    """
    base = [*prefix, "tc", "qdisc"]
    subprocess.run([*base, "del", "dev", device, "root"], capture_output=True, timeout=30)
    if rate is not None:
        subprocess.run([*base, "add", "dev", device, "root", "tbf", "rate", rate, "burst", burst, "latency", "1s"],
                       capture_output=True, text=True, check=True, timeout=30)


def burst(bytes_per_s: int, mtu: int | None = None) -> str:
    """A token bucket for ``bytes_per_s``: 0.2 ms of the rate and at least four packets (tbf drops a packet
    bigger than its bucket): small enough that the rate holds over milliseconds, big enough that the kernel's
    timers refill it fast enough at a few hundred MiB/s."""
    return f"{max(4 * (mtu or 1500), bytes_per_s // 5000)}b"


#: The two ends of :meth:`Fleet.measure`: a plain socket each, the receiver's clock.
_RECEIVER = """import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
buf, n, first = bytearray(1 << 20), 0, None
while (k := conn.recv_into(buf)):
    first = first or time.perf_counter()
    n += k
print(n, time.perf_counter() - first)
"""
_SENDER = """import socket, sys
conn = socket.create_connection((sys.argv[1], int(sys.argv[2])))
left, piece = int(sys.argv[3]), bytes(1 << 20)
while left:
    left -= conn.send(memoryview(piece)[:min(left, len(piece))])
conn.close()
"""


def _subnet_index() -> int:
    """Which /24 of the test range this process takes: by pid, and by pytest-xdist worker so that
    two workers of one run (``gw0``, ``gw1``) never share a subnet whatever their pids are."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    parity = int(worker) % 2 if worker.isdigit() else 0
    return (os.getpid() % 128) * 2 + parity


class Fleet:
    """``count`` nodes, each in its own network namespace, on one bridge in the root namespace."""

    def __init__(self, count: int, mtu: int | None = None):
        """``mtu``: every link's (None: the kernel's 1500); a cloud's network may carry jumbo frames (9001 on
        AWS within a VPC), which cost the kernel a sixth of the packets per byte."""
        if not 1 <= count <= 250:
            raise ValueError("a fleet has 1 to 250 nodes")
        self.mtu = mtu
        tag = os.getpid() % 100000
        self.prefix = f"dt{tag}"  # interface names stay under Linux's 15 characters
        self.bridge = f"{self.prefix}br"
        self.subnet = list(TEST_RANGE.subnets(new_prefix=24))[_subnet_index()]
        self.host_address = str(self.subnet[1])
        self.nodes = [Node(self, i) for i in range(count)]

    def __enter__(self) -> Fleet:
        self.close()  # what a killed earlier run with the same names may have left
        try:
            _ip("link", "add", self.bridge, *(["mtu", str(self.mtu)] if self.mtu else []), "type", "bridge")
            _ip("addr", "add", f"{self.host_address}/{self.subnet.prefixlen}", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for node in self.nodes:
                node._create(self.bridge, self.mtu)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __getitem__(self, index: int) -> Node:
        return self.nodes[index]

    def __len__(self) -> int:
        return len(self.nodes)

    def close(self) -> None:
        for node in self.nodes:
            node._remove()
        _ip("link", "del", self.bridge, check=False)

    def measure(self, sender: Node | None, receiver: Node | None, nbytes: int, timeout: float = 120,
                cores: tuple[int, int] | None = None) -> float:
        """Bytes per second a bare TCP pair (no TLS, no framing) moves ``nbytes`` at from ``sender`` to
        ``receiver`` (None: the root namespace, on the bridge): the link's own limit, timed by the receiver from
        its first byte to its last; ``cores``: the sender's and the receiver's, as a benchmark pins its nodes."""
        return self.measure_pairs([(sender, receiver)], nbytes, timeout, cores)[0]

    def measure_pairs(self, pairs: Sequence[tuple[Node | None, Node | None]], nbytes: int, timeout: float = 120,
                      cores: tuple[int, int] | None = None) -> list[float]:
        """:meth:`measure` for several (sender, receiver) pairs moving at once, all senders started together
        once every receiver listens: the bytes per second of each, as nodes that share links and cores get."""
        send_core, recv_core = cores if cores is not None else (None, None)
        receivers, senders = [], []
        try:
            for _sender, receiver in pairs:
                where = receiver.address if receiver is not None else self.host_address
                cmd = _pinned([sys.executable, "-c", _RECEIVER, where], recv_core)
                receivers.append(subprocess.Popen(receiver.command(cmd) if receiver else cmd, stdout=subprocess.PIPE,
                                                  text=True))
            ports = [recv.stdout.readline().strip() for recv in receivers]
            for (sender, receiver), port in zip(pairs, ports):
                where = receiver.address if receiver is not None else self.host_address
                cmd = _pinned([sys.executable, "-c", _SENDER, where, port, str(nbytes)], send_core)
                senders.append(subprocess.Popen(sender.command(cmd) if sender else cmd))
            for send in senders:
                if send.wait(timeout=timeout) != 0:
                    raise AssertionError(f"a bare sender exited with {send.returncode}")
            results = [recv.communicate(timeout=timeout)[0].split() for recv in receivers]
        finally:
            for proc in [*senders, *receivers]:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
            for recv in receivers:
                recv.stdout.close()
        rates = []
        for got, seconds in results:
            if int(got) != nbytes:
                raise AssertionError(f"the receiver got {got} of {nbytes} bytes")
            rates.append(nbytes / float(seconds))
        return rates


def _pinned(cmd: list[str], core: int | None) -> list[str]:
    return cmd if core is None else ["taskset", "-c", str(core), *cmd]


class Relay:
    """A TCP relay on loopback in front of ``target``; the test cuts its link or drops its connections.

    While the link is down nothing is read on either side, so bytes wait in
    the senders' socket buffers and then in the senders, as they do behind a
    cut cable; new connections are accepted and wait too. ``link_up`` lets
    everything through again. ``forwarded`` counts the bytes passed towards
    the target.
    """

    PIECE = 64 << 10

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1"):
        self.target = target
        self._listener = socket.create_server((host, 0))
        self.host, self.port = self._listener.getsockname()[:2]
        self._cond = threading.Condition()
        self._up = True
        self._budget: int | None = None  # bytes towards the target before the link goes down by itself
        self._closed = False
        self._sockets: set[socket.socket] = set()
        self.forwarded = 0
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def up(self) -> bool:
        with self._cond:
            return self._up

    def __enter__(self) -> Relay:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def link_down(self) -> None:
        with self._cond:
            self._up = False

    def link_up(self) -> None:
        with self._cond:
            self._up, self._budget = True, None
            self._cond.notify_all()

    def cut_after(self, nbytes: int) -> None:
        """Pass ``nbytes`` more towards the target, then take the link down (mid-stream, at that exact byte)."""
        with self._cond:
            self._budget = nbytes

    def drop(self) -> None:
        """Reset every connection now (the link stays as it is)."""
        with self._cond:
            sockets = list(self._sockets)
        for sock in sockets:
            _shut(sock)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        _shut(self._listener)
        self._listener.close()
        self.drop()

    def _wait_up(self) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._up or self._closed)
            return not self._closed

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), name="relay-conn", daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        with self._cond:
            self._sockets.add(client)
        server = None
        try:
            if not self._wait_up():
                return
            try:
                server = socket.create_connection(self.target, timeout=10)
                server.settimeout(None)
            except OSError:
                return
            with self._cond:
                self._sockets.add(server)
            back = threading.Thread(target=self._pump, args=(server, client, False), name="relay-back", daemon=True)
            back.start()
            self._pump(client, server, True)
            back.join()
        finally:
            for sock in (client, server):
                if sock is not None:
                    _shut(sock)
                    sock.close()
                    with self._cond:
                        self._sockets.discard(sock)

    def _pump(self, src: socket.socket, dst: socket.socket, towards_target: bool) -> None:
        """Copy ``src`` to ``dst`` while the link is up; the first end to close or fail closes both."""
        try:
            while self._wait_up():
                data = memoryview(src.recv(self.PIECE))
                if not self._wait_up():  # what arrived while the link was down, an end closing included, waits
                    return
                if not data:
                    break
                while data:
                    if not self._wait_up():
                        return
                    with self._cond:
                        n = len(data) if not towards_target or self._budget is None else min(len(data), self._budget)
                        if n == 0:
                            self._up = False
                            continue
                    dst.sendall(data[:n])
                    data = data[n:]
                    if towards_target:
                        with self._cond:
                            self.forwarded += n
                            if self._budget is not None:
                                self._budget -= n
                                if self._budget == 0:
                                    self._up = False
        except OSError:
            pass
        finally:
            _shut(src)
            _shut(dst)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
