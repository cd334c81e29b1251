"""This VM's identity (agent/identity.py) read from the real fake metadata services of the three clouds, and the
failure domain made of it or named by --failure-domain.

Only the fakes on 127.0.0.1 are ever contacted: every read gets a fake's endpoint.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys

import pytest
from conftest import REPO, load_fake_metadata, wait_for

from dashrun.agent.identity import Identity, read_identity, this_domain
from dashrun.agent.pollers import AwsPoller, MetadataError
from dashrun.errors import ProtocolError, UsageError
from dashrun.wire.domain import FailureDomain, parse_instance_type

fake_metadata = load_fake_metadata()
FakeMetadata = fake_metadata.FakeMetadata

DEFAULTS = {
    "aws": Identity("aws", "us-east-1a", "g5.12xlarge", "spot"),
    "gcp": Identity("gcp", "us-central1-a", "a2-highgpu-1g", "spot"),
    "azure": Identity("azure", "eastus-1", "Standard_NC24ads_A100_v4", "spot"),
}


@pytest.fixture
def fakes():
    """Start fakes with ``fakes(cloud, **kwargs)``; all stopped at the test's end."""
    started: list[FakeMetadata] = []

    def start(cloud: str, **kwargs) -> FakeMetadata:
        fake = FakeMetadata(cloud, **kwargs).start()
        started.append(fake)
        return fake
    yield start
    for fake in started:
        fake.stop()


@pytest.fixture
def warnings(caplog):
    caplog.set_level(logging.INFO, logger="dashrun.agent")
    return lambda: [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- what each cloud says -----------------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_each_clouds_default_vm(fakes, cloud):
    fake = fakes(cloud)
    identity = read_identity(cloud, fake.url)
    assert identity == DEFAULTS[cloud]
    assert read_identity("auto", fake.url) == identity  # the cloud detected, as for the notices
    assert identity.domain == FailureDomain(identity.zone, f"{identity.instance_type}:spot", "spot")


@pytest.mark.parametrize("cloud, zone, instance_type, expected", [
    ("aws", "eu-west-1c", "p4d.24xlarge", "eu-west-1c"),
    ("gcp", "europe-west4-b", "n1-standard-8", "europe-west4-b"),
    ("azure", "3", "Standard_ND96asr_v4", "westeurope-3"),
    ("azure", "", "Standard_ND96asr_v4", "westeurope"),  # a VM in no zone: its location
])
def test_zone_instance_type_and_market_as_each_fake_is_told(fakes, cloud, zone, instance_type, expected):
    region = "westeurope" if cloud == "azure" else None
    fake = fakes(cloud, zone=zone, instance_type=instance_type, region=region, life_cycle="on-demand")
    assert read_identity(cloud, fake.url) == Identity(cloud, expected, instance_type, "on-demand")


def test_aws_with_imdsv2_required_and_an_expired_token(fakes):
    fake = fakes("aws", imdsv2="required", zone="us-west-2b", instance_type="g6.xlarge")
    poller = AwsPoller(fake.url)
    try:
        assert poller.read("latest/meta-data/placement/availability-zone") == "us-west-2b"
        fake.expire_tokens()  # a 401 renews the token once
        assert poller.read("latest/meta-data/instance-type") == "g6.xlarge"
        assert poller.read("latest/meta-data/no-such-thing") is None  # 404
    finally:
        poller.close()
    assert fake.tokens_issued == 2
    assert read_identity("aws", fake.url).zone == "us-west-2b"


def test_botocore_reads_the_region_of_the_zone_a_fake_is_given(fakes):
    from botocore.utils import InstanceMetadataRegionFetcher

    fake = fakes("aws", zone="ap-southeast-2c")
    assert fake.region == "ap-southeast-2"
    assert InstanceMetadataRegionFetcher(timeout=2, base_url=fake.url).retrieve_region() == "ap-southeast-2"


def test_gcp_legacy_preemptible_is_spot(fakes):
    fake = fakes("gcp")
    fake.set_value("instance/scheduling/provisioning-model", "STANDARD")  # as a legacy preemptible VM says
    assert read_identity("gcp", fake.url).market == "spot"  # scheduling/preemptible is TRUE
    on_demand = fakes("gcp", life_cycle="on-demand")
    assert read_identity("gcp", on_demand.url).market == "on-demand"


def test_the_command_line_fake_takes_zone_instance_type_and_region(tmp_path):
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "fake_metadata.py"), "--cloud", "azure",
                             "--zone", "2", "--instance-type", "Standard_NC4as_T4_v3", "--region", "northeurope",
                             "--life-cycle", "on-demand", "--ready-file", str(ready)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: ready.exists() or proc.poll() is not None, 30, "the fake to listen")
        assert proc.poll() is None, proc.stdout.read()
        identity = read_identity("azure", "http://" + ready.read_text().strip())
        assert identity == Identity("azure", "northeurope-2", "Standard_NC4as_T4_v3", "on-demand")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    bad = subprocess.run([sys.executable, str(REPO / "scripts" / "fake_metadata.py"), "--cloud", "aws", "--zone",
                          "us east"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "zone 'us east'" in bad.stderr


def test_a_fake_refuses_a_zone_that_is_no_name():
    with pytest.raises(ValueError, match="zone"):
        FakeMetadata("gcp", zone="")
    with pytest.raises(ValueError, match="instance_type"):
        FakeMetadata("aws", instance_type="g5.12xlarge\n")


# -- a service that cannot tell -----------------------------------------------------------------------------


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
@pytest.mark.parametrize("fault", ["fail", "garbage", "refuse", "hang"])
def test_a_bad_service_gives_none_and_one_warning(fakes, warnings, cloud, fault):
    fake = fakes(cloud)
    {"fail": lambda: fake.fail_next(None, status=503), "garbage": lambda: fake.garbage_next(None),
     "refuse": lambda: fake.refuse_next(None), "hang": lambda: fake.hang_next(None)}[fault]()
    assert read_identity(cloud, fake.url, timeout=0.3) is None
    said = warnings()
    assert len(said) == 1 and "failure domain is unknown" in said[0], said
    fake.clear_faults()  # hanging answers go
    assert this_domain(None, cloud, fake.url) == DEFAULTS[cloud].domain  # the service answers again


def test_nothing_listening_gives_none(warnings):
    url = f"http://127.0.0.1:{closed_port()}"
    assert read_identity("aws", url, timeout=0.5) is None
    assert len(warnings()) == 1
    assert read_identity("auto", url, timeout=0.5) is None  # nothing detected: no cloud, nothing to warn of
    assert read_identity("none", url) is None
    assert len(warnings()) == 1
    assert this_domain(None, "none") == FailureDomain()
    with pytest.raises(UsageError):
        read_identity("moon", url)


def test_answers_are_bounded(fakes, warnings):
    fake = fakes("aws")
    poller = AwsPoller(fake.url)
    try:
        with pytest.raises(MetadataError, match="bytes") as refused:
            poller.read("latest/dynamic/instance-identity/document", limit=64)
        assert refused.value.problem == "too long"
    finally:
        poller.close()
    fake = fakes("gcp")
    fake.set_value("instance/zone", "projects/1/zones/" + "a" * 300)  # longer than any value read
    assert read_identity("gcp", fake.url) is None
    assert "bytes" in warnings()[-1]
    fake.set_value("instance/zone", "projects/1/zones/us central\x01")
    assert read_identity("gcp", fake.url) is None
    assert len(warnings()) == 2 and "printable" in warnings()[-1]


# -- failure domains ----------------------------------------------------------------------------------------


def test_labels_parse_and_round_trip():
    assert FailureDomain.parse("us-east-1a") == FailureDomain("us-east-1a")
    domain = FailureDomain.parse("us-east-1a/g5.12xlarge:spot")
    assert domain == FailureDomain("us-east-1a", "g5.12xlarge:spot", "spot")
    assert domain.label == "us-east-1a/g5.12xlarge:spot"
    assert FailureDomain.parse("rack-7/a100:on-demand").market == "on-demand"
    assert FailureDomain.parse("rack-7/a100").market == ""
    identity = DEFAULTS["azure"]
    assert FailureDomain.parse(identity.domain.label) == identity.domain
    assert FailureDomain.from_body(domain.to_body()) == domain
    assert not FailureDomain().known and FailureDomain().label == ""


@pytest.mark.parametrize("label", ["", "/g5", "us-east-1a/", "a/b/c", "us east", "zone\n", "zone/\x1b[31m",
                                   "-zone", "z" * 128, "z/" + "p" * 128, "zoné"])
def test_a_bad_label_is_one_line_with_a_hint(label):
    with pytest.raises(UsageError) as refused:
        FailureDomain.parse(label)
    assert "\n" not in str(refused.value) and "--failure-domain" in str(refused.value)
    assert "ZONE/POOL" in refused.value.hint


@pytest.mark.parametrize("body", [None, [], {"zone": 5}, {"zone": "z" * 200}, {"zone": "a b"}, {"pool": "p q"},
                                  {"zone": "z", "market": "cheap"}, {"zone": "z", "pool": "p/q"}])
def test_a_peer_sent_domain_is_checked(body):
    with pytest.raises(ProtocolError):
        FailureDomain.from_body(body)


def test_a_label_wins_over_the_metadata_service(fakes):
    fake = fakes("aws")
    label = FailureDomain.parse("rack-1/big")
    assert this_domain(label, "aws", fake.url) == label
    assert fake.requests == []  # not even asked


def test_instance_type_and_market_flags_name_the_pool_over_the_metadata_service_and_a_label(fakes):
    fake = fakes("aws")  # a Spot g5.12xlarge in us-east-1a
    assert this_domain(None, "aws", fake.url, market="on-demand") == FailureDomain(
        "us-east-1a", "g5.12xlarge:on-demand", "on-demand")  # the zone and type still read from the service
    assert this_domain(None, "aws", fake.url, instance_type="p4d.24xlarge") == FailureDomain(
        "us-east-1a", "p4d.24xlarge:spot", "spot")
    assert this_domain(FailureDomain.parse("rack-1"), "aws", fake.url, instance_type="a100", market="spot") == \
        FailureDomain("rack-1", "a100:spot", "spot")
    assert this_domain(FailureDomain.parse("rack-1/big"), "none", market="spot") == FailureDomain(
        "rack-1", "big:spot", "spot")
    # no zone known: the pool and market alone, which the ledger reads and placement compares
    alone = this_domain(None, "none", instance_type="g5.xlarge", market="on-demand")
    assert alone == FailureDomain("", "g5.xlarge:on-demand", "on-demand") and alone.known
    assert FailureDomain.from_body(alone.to_body()) == alone
    assert this_domain(None, "none", market="spot") == FailureDomain(market="spot")
    assert this_domain(None, "none") == FailureDomain()


@pytest.mark.parametrize("text", ["", "g5 big", "g5:spot", "-g5", "x" * 120, "g5\x1b[31m"])
def test_a_bad_instance_type_is_one_line_with_a_hint(text):
    with pytest.raises(UsageError) as refused:
        parse_instance_type(text)
    assert "\n" not in str(refused.value) and str(refused.value).startswith("--instance-type ")
    assert "g5.12xlarge" in refused.value.hint


def test_identity_imports_no_torch():
    code = "import sys, dashrun.agent.identity, dashrun.agent.peers.placement; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
