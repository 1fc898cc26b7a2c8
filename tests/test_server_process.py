"""The test harness's port choice: servers started by the tests must not race clients for a port."""
import socket

from server_process import _ephemeral_ports, free_port


def test_free_port_is_bindable_and_outside_the_range_clients_take_source_ports_from():
    ephemeral = _ephemeral_ports()
    for _ in range(20):
        port = free_port()
        assert port not in ephemeral
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
