"""The fake metadata services are faithful, and the notice pollers survive everything they can serve.

Only the fake on 127.0.0.1 is ever contacted: every poller and probe gets the
fake's endpoint (or, for the SDK-variable tests, an environment pointing at it).
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests
from conftest import REPO, load_fake_metadata, wait_for

from dashrun.agent import pollers
from dashrun.agent.pollers import AwsPoller, AzurePoller, GcpPoller, Notice, NoticeKind
from dashrun.errors import UsageError

fake_metadata = load_fake_metadata()
FakeMetadata = fake_metadata.FakeMetadata

AWS_GET = "/latest/meta-data/"
GCP = "/computeMetadata/v1/"
EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"
GOOGLE = {"Metadata-Flavor": "Google"}
AZURE = {"Metadata": "true"}

#: small intervals so a test sees several rounds in a fraction of a second
FAST = {
    "aws": dict(interval=0.05, timeout=0.5, retry=0.05, max_retry=0.2),
    "gcp": dict(watch_timeout=1, timeout=0.5, retry=0.05, max_retry=0.2),
    "azure": dict(interval=0.05, timeout=0.5, first_timeout=2.0, retry=0.05, max_retry=0.2),
}
POLLERS = {"aws": AwsPoller, "gcp": GcpPoller, "azure": AzurePoller}


class Watch:
    """A poller running in its thread, and the notices it reported."""

    def __init__(self, poller: pollers.Poller):
        self.poller = poller
        self.notices: list[Notice] = []
        poller.start(self.notices.append)

    def wait_notice(self, kind: NoticeKind, timeout: float = 10.0) -> Notice:
        return wait_for(lambda: next((n for n in self.notices if n.kind == kind), None), timeout,
                        f"a {kind.value} notice")

    def wait_rounds(self, more: int = 1, timeout: float = 10.0) -> None:
        target = self.poller.rounds_ok + more
        wait_for(lambda: self.poller.rounds_ok >= target, timeout, f"{more} good polling rounds")


class Lab:
    """Fakes and pollers a test started; all stopped at its end (pollers told first, fakes release hangs)."""

    def __init__(self):
        self.fakes: list[FakeMetadata] = []
        self.watches: list[Watch] = []

    def fake(self, cloud: str, **kwargs) -> FakeMetadata:
        fake = FakeMetadata(cloud, **kwargs).start()
        self.fakes.append(fake)
        return fake

    def poller(self, fake: FakeMetadata, **kwargs) -> pollers.Poller:
        return POLLERS[fake.cloud](fake.url, **{**FAST[fake.cloud], **kwargs})

    def watch(self, fake: FakeMetadata, **kwargs) -> Watch:
        watch = Watch(self.poller(fake, **kwargs))
        self.watches.append(watch)
        return watch

    def close(self) -> None:
        for watch in self.watches:
            watch.poller.stop(timeout=0)
        for fake in self.fakes:
            fake.stop()
        for watch in self.watches:
            watch.poller.stop(timeout=10)
            assert not watch.poller.alive, "a poller thread did not stop"


@pytest.fixture
def lab():
    lab = Lab()
    yield lab
    lab.close()


@pytest.fixture
def problems(caplog):
    """The kinds of problem the pollers logged at WARNING (each must appear once)."""
    caplog.set_level(logging.DEBUG, logger="dashrun.agent.pollers")

    def kinds(level: int = logging.WARNING) -> list[str]:
        return [r.metadata_problem for r in list(caplog.records)
                if r.levelno == level and hasattr(r, "metadata_problem")]
    return kinds


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def no_probe_threads() -> bool:
    return not any(t.name.startswith("probe-") for t in threading.enumerate())


# -- the fakes are faithful ---------------------------------------------------------------------------------


def test_botocore_reads_a_spot_notice_from_the_imdsv2_only_fake(lab, monkeypatch):
    import botocore.session
    from botocore.exceptions import MetadataRetrievalError
    from botocore.utils import IMDSFetcher, InstanceMetadataFetcher, InstanceMetadataRegionFetcher

    fake = lab.fake("aws", imdsv2="required")
    # the SDK's own variable, resolved by botocore's own config chain
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", fake.url)
    endpoint = botocore.session.Session().get_config_variable("ec2_metadata_service_endpoint")
    assert endpoint == fake.url
    fetcher = IMDSFetcher(timeout=2, config={"ec2_metadata_service_endpoint": endpoint})
    assert fetcher.get_base_url() == fake.url

    token = fetcher._fetch_metadata_token()
    assert token and fake.tokens_issued == 1
    never_retry = lambda response: False  # noqa: E731
    path = "latest/meta-data/spot/instance-action"
    assert fetcher._get_request(path, never_retry, token).status_code == 404
    assert fetcher._get_request(path, never_retry, None).status_code == 401  # IMDSv2 required

    stamp = fake.notice("terminate", lead=120)
    answer = fetcher._get_request(path, None, token)  # the default retry insists on a 200 with a body
    assert answer.status_code == 200 and answer.headers["Content-Type"] == "text/plain"
    assert answer.text == f'{{"action": "terminate", "time": "{stamp}"}}'
    assert fetcher._get_request("latest/meta-data/spot/termination-time", None, token).text == stamp
    assert fetcher._get_request("latest/meta-data/instance-life-cycle", None, token).text == "spot"

    # botocore's higher-level fetchers work against it unchanged
    creds = InstanceMetadataFetcher(timeout=2, base_url=fake.url).retrieve_iam_role_credentials()
    assert creds["role_name"] == fake_metadata.AWS_ROLE and creds["access_key"]
    assert InstanceMetadataRegionFetcher(timeout=2, base_url=fake.url).retrieve_region() == "us-east-1"
    with pytest.raises(MetadataRetrievalError):  # a client that may not use IMDSv1 is refused nothing silently
        IMDSFetcher(timeout=2, base_url=fake.url, config={"ec2_metadata_v1_disabled": True})._get_request(
            path, None, None)


def test_imds_token_and_path_rules(lab):
    fake = lab.fake("aws")
    url = fake.url
    for ttl in (None, "0", "21601", "abc", "-5", ""):
        headers = {} if ttl is None else {"X-aws-ec2-metadata-token-ttl-seconds": ttl}
        assert requests.put(f"{url}/latest/api/token", headers=headers).status_code == 400, ttl
    for ttl in ("1", "21600"):
        r = requests.put(f"{url}/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": ttl})
        assert r.status_code == 200 and r.headers["X-aws-ec2-metadata-token-ttl-seconds"] == ttl and r.text
    token = r.text
    assert requests.get(f"{url}/latest/api/token").status_code == 405
    assert requests.put(f"{url}/latest/api/token", headers={"X-aws-ec2-metadata-token-ttl-seconds": "60",
                                                            "X-Forwarded-For": "10.0.0.9"}).status_code == 403

    def get(path, token=token):
        return requests.get(f"{url}{AWS_GET}{path}", headers={"X-aws-ec2-metadata-token": token} if token else {})

    assert get("instance-id").text == fake.instance_id
    assert get("instance-id", token=None).text == fake.instance_id  # IMDSv1 allowed in optional mode
    assert get("instance-id", token="not-a-token").status_code == 401
    assert get("placement/availability-zone/").text == "us-east-1a"
    for path in ("spot/instance-action", "spot/termination-time", "events/recommendations/rebalance"):
        assert get(path).status_code == 404
    fake.early()
    rebalance = get("events/recommendations/rebalance")
    assert rebalance.headers["Content-Type"] == "text/plain" and "noticeTime" in rebalance.json()
    fake.notice("hibernate")
    assert get("spot/instance-action").json()["action"] == "hibernate"
    assert "spot/" in get("").text.splitlines()
    fake.expire_tokens()
    assert get("instance-id").status_code == 401  # expired: the client must fetch a new token
    fake.clear()
    assert get("spot/instance-action", token=None).status_code == 404


def test_gcp_header_etag_and_hanging_get(lab):
    fake = lab.fake("gcp")
    url = f"{fake.url}{GCP}instance/preempted"
    assert requests.get(url).status_code == 403
    assert requests.get(url, headers={"Metadata-Flavor": "google"}).status_code == 403
    first = requests.get(url, headers=GOOGLE)
    assert first.text == "FALSE" and first.headers["Metadata-Flavor"] == "Google" and first.headers["ETag"]
    assert requests.get(f"{fake.url}{GCP}instance/scheduling/provisioning-model", headers=GOOGLE).text == "SPOT"
    assert requests.get(f"{fake.url}{GCP}instance/maintenance-event", headers=GOOGLE).text == "NONE"

    def hanging(etag, timeout_sec):
        return requests.get(url, headers=GOOGLE, timeout=30,
                            params={"wait_for_change": "true", "last_etag": etag, "timeout_sec": timeout_sec})

    started = time.monotonic()
    same = hanging(first.headers["ETag"], 1)  # nothing changes: answers the same value at the timeout
    assert time.monotonic() - started >= 0.9 and same.text == "FALSE"
    assert same.headers["ETag"] == first.headers["ETag"]
    # An ETag that differs: answered at once, not at timeout_sec (the client's own 30 s read timeout would
    # end a wait for the 600 s first: requests.ReadTimeout).
    stale = hanging("0000000000000000", 600)
    assert stale.text == "FALSE"

    answers = []
    waiter = threading.Thread(target=lambda: answers.append(hanging(first.headers["ETag"], 30)))
    waiter.start()
    wait_for(lambda: fake.hanging_gets, 10, "the hanging GET to wait")
    fake.preempt()
    waiter.join(10)
    assert not waiter.is_alive() and answers[0].text == "TRUE"
    assert answers[0].headers["ETag"] != first.headers["ETag"]
    fake.early()
    assert requests.get(f"{fake.url}{GCP}instance/maintenance-event",
                        headers=GOOGLE).text == "TERMINATE_ON_HOST_MAINTENANCE"


def test_azure_header_incarnation_and_acknowledgements(lab):
    fake = lab.fake("azure", vm_name="gpu-7")
    url = f"{fake.url}{EVENTS}"
    refused = requests.get(url)
    assert refused.status_code == 400 and "metadata header" in refused.json()["error"]
    assert requests.get(f"{fake.url}/metadata/scheduledevents", headers=AZURE).status_code == 400  # no api-version
    empty = requests.get(url, headers=AZURE).json()
    assert empty["Events"] == [] and isinstance(empty["DocumentIncarnation"], int)
    name = requests.get(f"{fake.url}/metadata/instance/compute/name?api-version=2021-02-01&format=text",
                        headers=AZURE)
    assert name.text == "gpu-7"

    incarnations = [empty["DocumentIncarnation"]]
    other = fake.add_event("Preempt", resources=["gpu-8"])
    ours = fake.notice("preempt", lead=45)
    doc = requests.get(url, headers=AZURE).json()
    incarnations.append(doc["DocumentIncarnation"])
    event = next(e for e in doc["Events"] if e["EventId"] == ours)
    assert event["Resources"] == ["gpu-7"] and event["EventType"] == "Preempt" and event["EventStatus"] == "Scheduled"
    assert event["NotBefore"].endswith(" GMT") and event["DurationInSeconds"] == -1
    for body in (b"not json", b"{}", b'{"StartRequests": []}', b'{"StartRequests": [{"EventId": 5}]}',
                 b'{"StartRequests": "x"}'):
        assert requests.post(url, headers=AZURE, data=body).status_code == 400, body
    assert requests.post(url, json={"StartRequests": [{"EventId": ours}]}).status_code == 400  # no header
    assert requests.post(url, headers=AZURE, json={"StartRequests": [{"EventId": ours}]}).status_code == 200
    assert fake.acknowledgements == [ours]
    started = next(e for e in requests.get(url, headers=AZURE).json()["Events"] if e["EventId"] == ours)
    assert started["EventStatus"] == "Started" and started["NotBefore"] == ""
    incarnations.append(fake.incarnation)
    fake.remove_event(other)
    incarnations.append(fake.incarnation)
    assert incarnations == sorted(set(incarnations))  # grows on every change


def test_command_line_fake_with_the_control_interface(tmp_path):
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "fake_metadata.py"), "--cloud", "aws",
                             "--port", "0", "--imdsv2", "required", "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    poller = None
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 30, "the fake to listen")
        assert proc.poll() is None, proc.stdout.read()
        url = "http://" + ready.read_text().strip()
        assert url.startswith("http://127.0.0.1:")
        assert requests.post(f"{url}/_control/notice?kind=bogus").status_code == 400
        assert requests.post(f"{url}/_control/nonsense").status_code == 404
        notices: list[Notice] = []
        poller = AwsPoller(url, **FAST["aws"]).start(notices.append)
        wait_for(lambda: poller.rounds_ok >= 1, 10, "a good round")
        assert requests.post(f"{url}/_control/notice?kind=stop&lead=60").json()["ok"]
        wait_for(lambda: notices, 10, "the stop notice")
        assert notices[0].kind == NoticeKind.STOP
        state = requests.get(f"{url}/_control/state").json()
        assert state["spot_action"]["action"] == "stop" and state["tokens_issued"] >= 1
    finally:
        if poller is not None:
            poller.stop(timeout=10)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


# -- pollers see each cloud's notices -----------------------------------------------------------------------


@pytest.mark.parametrize("action", ["terminate", "hibernate"])
def test_aws_poller_reports_a_notice_once_with_its_deadline(lab, action, problems):
    fake = lab.fake("aws", imdsv2="required")
    watch = lab.watch(fake)
    watch.wait_rounds(2)
    at = time.time() + (120 if action == "terminate" else 0)
    fake.notice(action, at=at)
    notice = watch.wait_notice(NoticeKind(action))
    assert notice.cloud == "aws" and not notice.early_warning and abs(notice.deadline - at) < 1.0
    fake.early()
    rebalance = watch.wait_notice(NoticeKind.REBALANCE)
    assert rebalance.early_warning and rebalance.deadline is None
    watch.wait_rounds(3)
    assert len(watch.notices) == 2  # each once, though served every round
    gets = [r for r in fake.requests if r.method == "GET"]
    assert gets and all(r.header("X-aws-ec2-metadata-token") for r in gets)
    assert problems() == []


def test_aws_poller_renews_an_expired_token_and_never_falls_back_on_401(lab, problems):
    fake = lab.fake("aws", imdsv2="required")
    watch = lab.watch(fake)
    watch.wait_rounds(1)
    fake.expire_tokens()  # every GET with the old token is now 401
    watch.wait_rounds(2)
    assert fake.tokens_issued >= 2
    fake.notice("terminate")
    watch.wait_notice(NoticeKind.TERMINATE)
    assert all(r.header("X-aws-ec2-metadata-token") for r in fake.requests if r.method == "GET")
    assert problems() == []


def test_aws_poller_uses_imdsv1_only_when_the_token_put_fails(lab, problems):
    fake = lab.fake("aws")  # IMDSv1 allowed
    fake.refuse_next(1)  # the first request, the poller's token PUT, gets 403
    watch = lab.watch(fake)
    watch.wait_rounds(2)
    seen = fake.requests
    assert (seen[0].method, seen[0].status) == ("PUT", 403)
    assert seen[1].method == "GET" and not seen[1].header("X-aws-ec2-metadata-token") and seen[1].status == 404
    # the next round asks for a token again, and uses it
    again = next(i for i, r in enumerate(seen) if r.method == "PUT" and r.status == 200)
    assert all(r.header("X-aws-ec2-metadata-token") for r in seen[again:] if r.method == "GET")
    assert problems() == []  # a round on IMDSv1 is no problem


def test_gcp_poller_watches_with_the_hanging_get(lab, problems):
    fake = lab.fake("gcp")
    watch = lab.watch(fake)
    watch.wait_rounds(2)
    hanging = [r for r in fake.requests if r.path.endswith("/preempted") and "wait_for_change" in r.query]
    assert hanging and all(r.query["last_etag"][0] and r.query["timeout_sec"] == ["1"] for r in hanging)
    assert all(r.header("Metadata-Flavor") == "Google" for r in fake.requests)
    # GCP gives 30 s from when the poller sees the notice: between the notice served and the notice reported.
    before = time.time()
    fake.preempt()
    notice = watch.wait_notice(NoticeKind.PREEMPT, timeout=30)
    after = time.time()
    assert notice.cloud == "gcp" and not notice.early_warning
    assert before + 30 <= notice.deadline <= after + 30, (before, notice.deadline, after)
    before = time.time()
    fake.early()
    maintenance = watch.wait_notice(NoticeKind.MAINTENANCE, timeout=30)
    after = time.time()
    assert maintenance.early_warning and before + 3600 <= maintenance.deadline <= after + 3600, \
        (before, maintenance.deadline, after)
    watch.wait_rounds(2)
    assert len(watch.notices) == 2
    assert problems() == []


def test_azure_poller_reports_this_vms_events_and_acknowledges(lab, problems):
    fake = lab.fake("azure", vm_name="gpu-7")
    watch = lab.watch(fake)  # learns the VM's name from the fake
    watch.wait_rounds(1)
    assert watch.poller.vm_name == "gpu-7"
    fake.add_event("Preempt", resources=["gpu-8", "gpu-9"])  # another VM's: ignored
    not_before = time.time() + 40
    ours = fake.notice("preempt", at=not_before)
    notice = watch.wait_notice(NoticeKind.PREEMPT)
    assert notice.id == ours and notice.cloud == "azure" and not notice.early_warning
    assert abs(notice.deadline - not_before) < 1.0
    redeploy = fake.early("redeploy", lead=600)
    early = watch.wait_notice(NoticeKind.MAINTENANCE)
    assert early.id == redeploy and early.early_warning
    assert watch.poller.acknowledge(notice) is True
    assert fake.acknowledgements == [ours]
    watch.wait_rounds(3)  # the acknowledged event, now Started, is not reported again
    assert [n.id for n in watch.notices] == [ours, redeploy]
    assert all(r.header("Metadata") == "true" for r in fake.requests)
    assert problems() == []


# -- pollers survive a bad metadata service ---------------------------------------------------------------

FAULTS = {
    "5xx": (lambda fake: fake.fail_next(None, 503), {"aws": "http 503", "gcp": "http 503", "azure": "http 503"}),
    "throttled": (lambda fake: fake.throttle(None), {"aws": "throttled", "gcp": "throttled", "azure": "throttled"}),
    "garbage": (lambda fake: fake.garbage_next(None), {"aws": "garbage", "gcp": "garbage", "azure": "garbage"}),
    "refused": (lambda fake: fake.refuse_next(None), {"aws": "http 403", "gcp": "http 403", "azure": "http 400"}),
    "timeout": (lambda fake: fake.hang_next(None), {"aws": "timeout", "gcp": "timeout", "azure": "timeout"}),
}


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
@pytest.mark.parametrize("fault", list(FAULTS))
def test_poller_survives_a_bad_service_and_still_sees_the_notice(lab, problems, cloud, fault):
    inject, expected = FAULTS[fault][0], FAULTS[fault][1][cloud]
    fake = lab.fake(cloud, imdsv2="required") if cloud == "aws" else lab.fake(cloud)
    watch = lab.watch(fake)
    watch.wait_rounds(1)
    inject(fake)  # every request from now on, until cleared
    wait_for(lambda: problems(logging.DEBUG).count(expected) >= 1, 15, f"the poller to retry past {fault}")
    assert watch.poller.alive
    kind = {"aws": NoticeKind.TERMINATE, "gcp": NoticeKind.PREEMPT, "azure": NoticeKind.PREEMPT}[cloud]
    fake.notice()
    fake.clear_faults()
    watch.wait_notice(kind, timeout=15)
    assert watch.poller.alive
    logged = problems()
    assert logged.count(expected) == 1, logged  # once per kind of problem, not once per round
    assert len(logged) == len(set(logged)), logged


# -- detection ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_detects_each_cloud(lab, cloud):
    fake = lab.fake(cloud, imdsv2="required") if cloud == "aws" else lab.fake(cloud)
    assert pollers.detect_cloud(fake.url, timeout=2.0) == cloud
    poller = pollers.make_poller("auto", fake.url)
    try:
        assert isinstance(poller, POLLERS[cloud]) and poller.base_url == fake.url
    finally:
        poller.stop()
    wait_for(no_probe_threads, 10, "the probes to end")


def test_detects_none_when_nothing_answers_within_its_budget(lab):
    assert pollers.detect_cloud(f"http://127.0.0.1:{closed_port()}", timeout=1.0) == "none"
    hung = lab.fake("aws")
    hung.hang_next(None)  # a service that never answers costs the budget, no more: detection's own deadline
    found = []
    probe = threading.Thread(target=lambda: found.append(pollers.detect_cloud(hung.url, timeout=0.5)))
    probe.start()
    probe.join(60)  # without its deadline it would wait on the hung service for ever
    assert not probe.is_alive() and found == ["none"]
    hung.clear_faults()
    wait_for(no_probe_threads, 10, "the probes to end")
    assert pollers.make_poller("none") is None
    with pytest.raises(UsageError):
        pollers.resolve_cloud("ibm")


def test_detection_and_pollers_honour_the_sdk_variables(lab):
    aws, gcp = lab.fake("aws"), lab.fake("gcp")
    env = {"AWS_EC2_METADATA_SERVICE_ENDPOINT": aws.url + "/", "GCE_METADATA_HOST": f"127.0.0.1:{gcp.port}"}
    assert pollers.detect_cloud(env=env, clouds=["aws"]) == "aws"
    assert pollers.detect_cloud(env=env, clouds=["gcp"]) == "gcp"
    assert AwsPoller(env=env).base_url == aws.url
    assert GcpPoller(env=env).base_url == gcp.url
    assert AwsPoller(gcp.url, env=env).base_url == gcp.url  # an explicit endpoint wins
    wait_for(no_probe_threads, 10, "the probes to end")


def test_notice_is_a_validated_value():
    notice = Notice("aws", "terminate", 100, id="x", detail={"action": "terminate"})
    assert notice.kind is NoticeKind.TERMINATE and notice.deadline == 100.0
    assert notice == Notice("aws", NoticeKind.TERMINATE, 100.0, id="x") and hash(notice)
    assert notice.seconds_left(now=40) == 60
    with pytest.raises(ValueError):
        Notice("oci", "terminate", None)
    with pytest.raises(ValueError):
        Notice("aws", "explode", None)


def test_pollers_do_not_import_torch():
    code = "import sys, dashrun.agent.pollers; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "False"
