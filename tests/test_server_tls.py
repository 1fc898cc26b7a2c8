"""HTTPS with vLLM's flags (--ssl-certfile, --ssl-keyfile): a client that trusts the certificate
talks to the server as over HTTP; plain HTTP to the port gets no answer; a certificate that
cannot be loaded is a one-line start-up error before the model loads."""
from __future__ import annotations

import datetime
import ipaddress
import ssl
import time

import httpx
import openai
import pytest
from server_process import TINY_SERVER_ARGS, ServerProcess

x509 = pytest.importorskip("cryptography.x509", reason="cryptography makes the test's self-signed certificate")


def self_signed(directory) -> tuple[str, str]:
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_https_serves_the_api_and_refuses_plain_http(tiny_llama, tmp_path):
    cert, key = self_signed(tmp_path)
    server = ServerProcess.start([str(tiny_llama), *TINY_SERVER_ARGS, "--ssl-certfile", cert, "--ssl-keyfile", key],
                                 tmp_path, wait=False)
    url = f"https://127.0.0.1:{server.port}"
    trusting = ssl.create_default_context(cafile=cert)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.process.poll() is None, server.log()
            try:
                if httpx.get(f"{url}/health", verify=trusting, timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, server.log()
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", http_client=httpx.Client(verify=trusting))
        reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2)
        assert reply.usage.completion_tokens >= 1
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{server.port}/health", timeout=5)
        with pytest.raises(httpx.ConnectError):  # a client that does not trust the certificate
            httpx.get(f"{url}/health", timeout=5)
    finally:
        server.stop()


def test_a_certificate_that_cannot_be_loaded_is_a_one_line_error(tmp_path, capsys):
    from kvserve.cli import main

    cert, _ = self_signed(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    _, other_key = self_signed(other)
    for argv, message in ((["serve", "--ssl-certfile", cert, "--ssl-keyfile", other_key],
                           "cannot load the TLS certificate"),
                          (["serve", "--ssl-certfile", cert], "--ssl-certfile and --ssl-keyfile go together"),
                          (["router", "--backend", "http://a:1", "--ssl-cert-reqs", "2"], "need HTTPS")):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
