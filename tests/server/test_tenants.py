"""Nobody reaches another's data: tenants from a tokens file (reloaded on SIGHUP) or client
certificates, sessions namespaced by tenant, unguessable anonymous sessions, errors that never
carry tokens, and no bearer tokens over plaintext unless allowed."""
import shutil
import signal
import subprocess
import sys
import time

import grpc
import pytest

from maskd.server import MaskServer, ServerConfig
from maskd.server.auth import AuthConfigError, parse_tokens
from maskd.server.config import ConfigError
from maskd.specs import GrammarSpec
from maskd.v1 import maskd_pb2 as pb
from maskd.v1 import maskd_pb2_grpc as pb_grpc
from maskd.v1.contract import SESSION_METADATA_KEY
from maskd_client import MaskClient, MaskClientError

C = grpc.StatusCode
TOKEN_A, TOKEN_B = "alice-token-0123456789", "bob-token-9876543210xx"
SPEC = GrammarSpec.from_dict({"regex": "[0-9]{1,3}"}).to_proto()


def tokens_file(tmp_path, text):
    path = tmp_path / "tokens"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tokens_file(tmp_path_factory.mktemp("auth"), f"# tenants\nalice {TOKEN_A}\n\nbob {TOKEN_B}  # rotated\n")
    srv = MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, auth_tokens_file=str(path))).start()
    yield srv
    srv.stop(grace=0.5)


def stream(address, token, session=None):
    ch = grpc.insecure_channel(address)
    md = [("authorization", f"Bearer {token}")] + ([(SESSION_METADATA_KEY, session)] if session else [])
    return ch, pb_grpc.MaskServiceStub(ch), md


def run(address, token, requests, session=None):
    ch, stub, md = stream(address, token, session)
    with ch:
        return list(stub.Session(iter(requests), metadata=md))


def test_a_tenant_cannot_see_step_or_close_anothers_sequences(server, cl100k):
    import queue
    ch, stub, md = stream(server.address, TOKEN_A, "shared-name")
    q = queue.SimpleQueue()
    alice = stub.Session(iter(q.get, None), metadata=md)
    q.put(pb.StepRequest(seqs=[pb.SeqStep(seq_id="secret", step=0, spec=SPEC)]))
    first = next(alice)
    n = 0
    while first.results[0].status == pb.SEQ_STATUS_WAITING:
        n += 1
        q.put(pb.StepRequest(seqs=[pb.SeqStep(seq_id="secret", step=n)]))
        first = next(alice)
    q.put(pb.StepRequest(seqs=[pb.SeqStep(seq_id="secret", step=n + 1, tokens=cl100k.encode("42"))]))
    assert next(alice).results[0].status == pb.SEQ_STATUS_READY
    # bob, with the same session name: a session of his own, where alice's sequence does not exist
    replies = run(server.address, TOKEN_B, [
        pb.StepRequest(seqs=[pb.SeqStep(seq_id="secret", step=n + 2, tokens=cl100k.encode("7"))]),
        pb.StepRequest(seqs=[pb.SeqStep(seq_id="secret", step=n + 1, close=True)]),
        pb.StepRequest(seqs=[pb.SeqStep(seq_id="secret", step=n + 1, tokens=cl100k.encode("9"))])],
        session="shared-name")
    for r in replies:
        assert r.results[0].status == pb.SEQ_STATUS_ERROR and r.results[0].code == C.NOT_FOUND.value[0]
        assert "42" not in r.results[0].reason
    # alice's sequence is untouched: her repeat of her step still answers, her next step works
    q.put(pb.StepRequest(seqs=[pb.SeqStep(seq_id="secret", step=n + 2, tokens=cl100k.encode("1"))]))
    assert next(alice).results[0].status in (pb.SEQ_STATUS_READY, pb.SEQ_STATUS_FINISHED)
    # a divergence says where, never what
    q.put(pb.StepRequest(seqs=[pb.SeqStep(seq_id="secret", step=n + 2, tokens=cl100k.encode("8"))]))
    div = next(alice).results[0]
    assert div.code == C.ABORTED.value[0] and "divergence" in div.reason
    assert f"step {n + 2} of sequence 'secret'" in div.reason
    where_not_what = div.reason.replace(f"step {n + 2}", "step N")     # the step may share digits with a token id
    for t in cl100k.encode("42") + cl100k.encode("1") + cl100k.encode("8"):
        assert str(t) not in where_not_what
    q.put(None)
    ch.close()


def test_anonymous_streams_never_share_a_session(cl100k):
    with MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1)) as srv:
        req = [pb.StepRequest(seqs=[pb.SeqStep(seq_id="mine", step=0, spec=SPEC)])]
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.MaskServiceStub(ch)
            list(stub.Session(iter(req)))
            again = list(stub.Session(iter(req)))   # a fresh anonymous session: opening again is fine
        assert again[0].results[0].status in (pb.SEQ_STATUS_WAITING, pb.SEQ_STATUS_READY)
        keys = [key for _, key in srv.service.sessions._sessions]
        assert all(len(k) > 32 for k in keys)


def test_tokens_are_checked_and_the_file_is_reloaded_on_sighup(tmp_path):
    path = tokens_file(tmp_path, f"alice {TOKEN_A}\n")
    proc = subprocess.Popen([sys.executable, "-m", "maskd.cli", "serve", "--port", "0", "--tokenizer", "cl100k",
                             "--threads", "1", "--auth-tokens-file", str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        address = proc.stdout.readline().split("serving on ")[1].split(",")[0].strip()
        with MaskClient(address, auth_token=TOKEN_A) as mc:
            assert mc.info().tokenizer == "cl100k"
        for bad in (TOKEN_B, "", TOKEN_A[:-1]):
            with pytest.raises(MaskClientError) as err:
                MaskClient(address, auth_token=bad or None, timeout_s=5).info()
            assert err.value.code == C.UNAUTHENTICATED
        path.write_text(f"bob {TOKEN_B}\n")
        proc.send_signal(signal.SIGHUP)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                MaskClient(address, auth_token=TOKEN_B, timeout_s=2).info()
                break
            except MaskClientError:
                time.sleep(0.1)
        with MaskClient(address, auth_token=TOKEN_B) as mc:
            assert mc.info().tokenizer == "cl100k"
        with pytest.raises(MaskClientError):
            MaskClient(address, auth_token=TOKEN_A, timeout_s=5).info()   # alice's token was removed
        path.write_text("not a tokens file at all\n")
        proc.send_signal(signal.SIGHUP)                                 # a bad file keeps the old tokens
        time.sleep(0.5)
        with MaskClient(address, auth_token=TOKEN_B) as mc:
            assert mc.info().tokenizer == "cl100k"
    finally:
        proc.terminate()
        proc.wait(30)
    assert "tokens file not reloaded" in proc.stderr.read()


@pytest.mark.parametrize("text,message", [
    ("alice\n", "expected 'TENANT TOKEN'"),
    ("al ice tok\n", "expected 'TENANT TOKEN'"),
    ("al/ice 0123456789abcdefgh\n", "is not letters"),
    ("alice short\n", "shorter than 16"),
    (f"alice {TOKEN_A}\nbob {TOKEN_A}\n", "already 'alice'"),
    ("# only comments\n\n", "holds no"),
])
def test_garbage_tokens_files_are_refused_with_the_line(text, message):
    with pytest.raises(AuthConfigError, match=message):
        parse_tokens(text)


def test_bearer_tokens_over_plaintext_need_loopback_tls_or_a_flag(tmp_path):
    path = tokens_file(tmp_path, f"alice {TOKEN_A}\n")
    with pytest.raises(ConfigError, match="allow-plaintext-auth"):
        ServerConfig(host="0.0.0.0", auth_tokens_file=str(path)).check()
    ServerConfig(host="0.0.0.0", auth_tokens_file=str(path), allow_plaintext_auth=True).check()
    ServerConfig(host="127.0.0.1", auth_tokens_file=str(path)).check()
    done = subprocess.run([sys.executable, "-m", "maskd.cli", "serve", "--host", "0.0.0.0", "--port", "0",
                           "--auth-tokens-file", str(path)], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "--allow-plaintext-auth" in done.stderr
    done = subprocess.run([sys.executable, "-m", "maskd.cli", "serve", "--port", "0", "--auth-tokens-file",
                           str(tmp_path / "missing")], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "cannot read the tokens file" in done.stderr


def _openssl(*args):
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make test certificates")
def test_mtls_client_certificates_name_the_tenant(tmp_path, cl100k):
    ca_key, ca, key, cert = (tmp_path / n for n in ("ca.key", "ca.pem", "server.key", "server.pem"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca),
             "-days", "1", "-subj", "/CN=maskd test CA")
    for name, cn, extra in (("server", "localhost", ["-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"]),
                            ("alice", "alice", []), ("bob", "bob", [])):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(tmp_path / f"{name}.key"),
                 "-out", str(tmp_path / f"{name}.csr"), "-subj", f"/CN={cn}", *extra)
        _openssl("x509", "-req", "-in", str(tmp_path / f"{name}.csr"), "-CA", str(ca), "-CAkey", str(ca_key),
                 "-CAcreateserial", "-out", str(tmp_path / f"{name}.pem"), "-days", "1", "-copy_extensions", "copy")
    with MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, tls_cert=str(cert), tls_key=str(key),
                                 tls_client_ca=str(ca))) as srv:
        target = f"localhost:{srv.port}"

        def channel(who):
            creds = grpc.ssl_channel_credentials(ca.read_bytes(), (tmp_path / f"{who}.key").read_bytes(),
                                                 (tmp_path / f"{who}.pem").read_bytes())
            return grpc.secure_channel(target, creds)

        req = [pb.StepRequest(seqs=[pb.SeqStep(seq_id="s", step=0, spec=SPEC)])]
        md = [(SESSION_METADATA_KEY, "same")]
        with channel("alice") as ch:
            assert next(iter(pb_grpc.MaskServiceStub(ch).Session(iter(req), metadata=md))).results[0].status in (
                pb.SEQ_STATUS_WAITING, pb.SEQ_STATUS_READY)
        assert {t for t, _ in srv.service.sessions._sessions} <= {"alice"}
        with channel("bob") as ch:
            pb_grpc.MaskServiceStub(ch).Info(pb.InfoRequest(), timeout=10)
        with grpc.secure_channel(target, grpc.ssl_channel_credentials(ca.read_bytes())) as ch:   # no certificate
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.MaskServiceStub(ch).Info(pb.InfoRequest(), timeout=10)
            assert err.value.code() == C.UNAVAILABLE


def test_a_changed_tokens_file_is_picked_up_without_a_signal(tmp_path):
    """A Kubernetes secret update rewrites the mounted file and sends no SIGHUP."""
    path = tokens_file(tmp_path, f"alice {TOKEN_A}\n")
    with MaskServer(ServerConfig(port=0, tokenizer="cl100k", threads=1, auth_tokens_file=str(path))) as srv:
        with pytest.raises(MaskClientError):
            MaskClient(srv.address, auth_token=TOKEN_B, timeout_s=3).info()
        path.write_text(f"alice {TOKEN_A}\nbob {TOKEN_B}\n")
        deadline = time.time() + 15
        while srv.credentials.tenant_of([("authorization", f"Bearer {TOKEN_B}")]) is None:
            assert time.time() < deadline, "the changed tokens file was not picked up"
            time.sleep(0.2)
        with MaskClient(srv.address, auth_token=TOKEN_B) as mc:
            assert mc.info().tokenizer == "cl100k"
