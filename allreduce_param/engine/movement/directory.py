"""PeerDirectory: where every peer of one parameter is, and a client of any of them.

Made once per ``PeerGroup``: this partition's server's advertised address goes through the
rendezvous, and every peer's comes back (``(host, port)``, plus a Unix socket name and the
kernel scope it lives in). A bare ``(host, port)`` (a fixed list) is completed by asking
that peer; peers that serve another parameter are refused on every partition at once. A
client of a peer in this partition's scope (this machine and network namespace) goes over
its Unix socket (and reads its shared memory in place), of any other over TCP.
"""

from __future__ import annotations

import time

from allreduce_param.engine.movement.rendezvous import Rendezvous
from allreduce_param.engine.spec import ParameterSpec
from allreduce_param.engine.wire.blocks import (
    BlockServer,
    PeerAddress,
    PeerClient,
    parse_address,
)
from allreduce_param.errors import AuthenticationError, ProtocolError


class PeerDirectory:
    """Every partition's address (``addresses``, by partition) as ``rendezvous`` exchanged
    ``server``'s, completed and checked; a client of any peer with ``spec``'s secret,
    timeouts and encryption."""

    def __init__(self, spec: ParameterSpec, server: BlockServer, rendezvous: Rendezvous) -> None:
        self.spec = spec
        self.partition_id = rendezvous.partition_id
        self._server = server
        exchanged = rendezvous.exchange(server.advertised_address)
        self.addresses: list[PeerAddress] = self._complete(
            [parse_address(address) for address in exchanged]
        )
        self._check_fingerprints()

    def _complete(self, addresses: list[PeerAddress]) -> list[PeerAddress]:
        """The exchanged addresses with what a bare ``(host, port)`` leaves out (a fixed list,
        ``StaticRendezvous``): this partition's own from its server, each peer's asked of
        it over TCP with the secret proven (``PeerClient.ask_address``), so that plain
        processes on one host find each other's scope and Unix socket as tasks do. The
        host and port stay those the meeting gave. Only with Unix sockets on: without
        them (or where this platform has none), every peer is reached over TCP anyway."""
        if self._server.local_name is None or all(a.fingerprint is not None for a in addresses):
            return addresses
        completed = []
        for peer, address in enumerate(addresses):
            if address.fingerprint is None:
                if peer == self.partition_id:
                    full = parse_address(self._server.advertised_address)
                else:
                    try:
                        full = self._ask_address(peer, address)
                    except AuthenticationError:
                        # a peer of another parameter: keep serving (refusing it in turn)
                        # a while, so that it hears "the secrets differ" from us too,
                        # rather than finding us gone
                        time.sleep(min(self.spec.timeout, self.spec.network.failure_linger))
                        raise
                address = address._replace(
                    fingerprint=full.fingerprint, local_name=full.local_name, scope=full.scope
                )
            completed.append(address)
        return completed

    def client(self, peer: int, address: PeerAddress, local_name: str | None = None) -> PeerClient:
        """A client of ``peer``'s server at ``address`` (over its Unix socket ``local_name``
        where given), with this parameter's secret, timeouts and encryption."""
        return PeerClient(
            (address.host, address.port),
            self.spec.secret,
            self.spec.param_id,
            self.partition_id,
            peer,
            self.spec.timeout,
            local_name=local_name,
            handshake_timeout=self.spec.network.connect_timeout,
            encrypt=self.spec.network.encrypt,
        )

    def client_of(self, peer: int) -> PeerClient:
        """A client of ``peer`` at its exchanged address: over its Unix socket (and shared
        memory, if on) where the peer is in this partition's scope (the same machine and
        network namespace, as its own server says), else over TCP."""
        address = self.addresses[peer]
        same_scope = (
            address.local_name is not None
            and address.scope == self.addresses[self.partition_id].scope
        )
        return self.client(peer, address, address.local_name if same_scope else None)

    def _ask_address(self, peer: int, address: PeerAddress) -> PeerAddress:
        client = self.client(peer, address)
        try:
            answer = client.ask_address()
        finally:
            client.close()
        try:
            full = parse_address(answer)
        except TypeError as error:
            raise ProtocolError(
                f"partition {peer} at {address.host}:{address.port} gave the address {answer!r}"
            ) from error
        if not all(
            value is None or isinstance(value, str)
            for value in (full.fingerprint, full.local_name, full.scope)
        ):
            raise ProtocolError(
                f"partition {peer} at {address.host}:{address.port} gave the address {answer!r}"
            )
        return full

    def _check_fingerprints(self) -> None:
        """Refuse, on every partition at once, peers that serve another parameter (each
        task made its own AllReduceParameter instead of using the driver's)."""
        own = self.addresses[self.partition_id].fingerprint
        others = [
            peer
            for peer, address in enumerate(self.addresses)
            if address.fingerprint is not None and own is not None and address.fingerprint != own
        ]
        if others:
            raise AuthenticationError(
                f"partition {self.partition_id} met partitions {others} with another AllReduceParameter: the "
                "secrets differ. Every partition must use the same AllReduceParameter object, made on the driver "
                "(make it before the barrier stage; the tasks get it in their closure)"
            )
