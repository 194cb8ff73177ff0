"""``vllm serve``'s transport flags on a real server: HTTPS with a self-signed certificate,
``--middleware`` (a class and a function), ``--enable-server-load-tracking`` with ``GET /load``
and ``--return-tokens-as-token-ids``; and their start-up errors in one line."""

from __future__ import annotations

import datetime
import ipaddress
import subprocess
import threading

import httpx
import pytest

from tests.entrypoints.conftest import SERVE_COMMAND, RemoteServer, tiny_args


def _self_signed(folder, passphrase: bytes | None = None) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)

    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = folder / "key.pem", folder / "cert.pem"
    encryption = (serialization.BestAvailableEncryption(passphrase) if passphrase
                  else serialization.NoEncryption())
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8, encryption))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


class TLSServer(RemoteServer):
    scheme = "https"


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory, tiny_model_dir, chat_template_file):
    key, cert = _self_signed(tmp_path_factory.mktemp("tls"))
    TLSServer.verify = cert
    server = TLSServer([
        *tiny_args(tiny_model_dir), "--chat-template", chat_template_file,
        "--ssl-keyfile", key, "--ssl-certfile", cert,
        "--middleware", "tests.entrypoints.middleware_samples.TagResponses",
        "--middleware", "tests.entrypoints.middleware_samples.tag_function",
        "--enable-server-load-tracking", "--return-tokens-as-token-ids",
        "--root-path", "/api",  # load tracking must see through the prefix
    ])
    yield server
    server.stop()


def test_https_middleware_and_token_ids(tls_server):
    with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
        httpx.get(f"http://127.0.0.1:{tls_server.port}/health", timeout=5)
    r = tls_server.post("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "logprobs": 2,
                                             "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.headers["x-tagged"] == "class" and r.headers["x-function"] == "yes"
    lp = r.json()["choices"][0]["logprobs"]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert all(k.startswith("token_id:") for top in lp["top_logprobs"] for k in top)
    # A request may still ask for texts.
    r = tls_server.post("/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
        "return_tokens_as_token_ids": False})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert not any(c["token"].startswith("token_id:") for c in content)


def test_load_counts_requests_in_flight(tls_server):
    assert tls_server.get("/load").json() == {"server_load": 0}
    seen = []

    def stream() -> None:
        body = {"prompt": "Hi", "max_tokens": 64, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", tls_server.url + "/v1/completions", json=body,
                          verify=tls_server.verify, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data:") and not seen:
                    seen.append(tls_server.get("/load").json()["server_load"])

    worker = threading.Thread(target=stream)
    worker.start()
    worker.join(120)
    assert seen == [1]
    assert tls_server.get("/load").json() == {"server_load": 0}


@pytest.mark.parametrize("flags, words", [
    (["--ssl-keyfile", "/nonexistent.pem"], "go together"),
    (["--ssl-keyfile", "/nonexistent.pem", "--ssl-certfile", "/nonexistent.pem"],
     "cannot read"),
    (["--ssl-ca-certs", __file__], "need --ssl-certfile"),
    (["--middleware", "nodots"], "not an import path"),
    (["--middleware", "tests.entrypoints.middleware_samples.missing"], "cannot import"),
    (["--middleware", "tests.entrypoints.middleware_samples.NOT_MIDDLEWARE"],
     "neither a class"),
    (["--middleware", "tests.entrypoints.middleware_samples."], "not an import path"),
    (["--middleware", "tests.entrypoints.middleware_samples.NeedsArgs"],
     "the app as its only argument"),
    (["--middleware", "tests.entrypoints.middleware_broken.x"], "RuntimeError"),
    (["@TLS", "--ssl-cert-reqs", "2"], "needs --ssl-ca-certs"),
    (["@TLS", "--ssl-ca-certs", "@DIR"], "--ssl-ca-certs"),
    (["@TLS", "--ssl-ca-certs", __file__], "not PEM certificates"),
    (["@ENCRYPTED"], "the key is encrypted"),
])
def test_transport_flag_errors_in_one_line(tmp_path, flags, words):
    key, cert = _self_signed(tmp_path)
    (tmp_path / "enc").mkdir()
    enc_key, enc_cert = _self_signed(tmp_path / "enc", b"secret")
    expand = {"@TLS": ["--ssl-keyfile", key, "--ssl-certfile", cert], "@DIR": [str(tmp_path)],
              "@ENCRYPTED": ["--ssl-keyfile", enc_key, "--ssl-certfile", enc_cert]}
    flags = [part for flag in flags for part in expand.get(flag, [flag])]
    result = subprocess.run([*SERVE_COMMAND, *flags], capture_output=True, text=True,
                            timeout=120, stdin=subprocess.DEVNULL)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr
