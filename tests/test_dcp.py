"""dashrun.dcp: DCP's own save/load through dash-memd (Writer/Reader), resharded, exported, pickled."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import dashrun_cmd, kill_tree
from torch.distributed.checkpoint.api import CheckpointException

from dashrun import dcp as ddcp
from dashrun.errors import UsageError
from dashrun.launch import export
from dashrun.rank.sharded import byte_runs, joined
from dashrun.wire.messages import ShardHeader
from dashrun.wire.tls import TlsSettings

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "tests" / "bin" / "dcp_roundtrip.py"


def _tls(memd) -> TlsSettings:
    return TlsSettings(plaintext=bool(memd.tls_args))


def _writer(memd, job, **kwargs) -> ddcp.Writer:
    return ddcp.Writer(job, memd.address, memd.token_file, tls=_tls(memd), **kwargs)


def _reader(memd, job, **kwargs) -> ddcp.Reader:
    return ddcp.Reader(job, memd=memd.address, token_file=memd.token_file, tls=_tls(memd), **kwargs)


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"weight": torch.randn(64, 32, generator=g), "bias": torch.randn(32, generator=g).to(torch.bfloat16)},
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.zeros(0, 4),
        "extra": {"epoch": 3, "name": "run-a", "lrs": [0.1, 0.01]},  # DCP pickles these itself: opaque bytes to us
    }


def _zeros_like(state):
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: _zeros_like(v) for k, v in state.items()}
    return None if not isinstance(state, list) else [None for _ in state]


def _assert_equal(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _assert_equal(a[k], b[k], f"{path}.{k}")
    else:
        assert a == b, path


def test_round_trip_in_one_process_is_an_ordinary_checkpoint(memd, monkeypatch):
    state = _state()
    writer = _writer(memd, "dcp-one")
    dcp.save(state, checkpoint_id="/ckpt/step-7", storage_writer=writer, no_dist=True)
    with memd.client() as client:
        info = client.latest("dcp-one")
    assert (info.step, info.world, info.rep_total) == (7, 1, 0)
    assert info.shards[0].private_len >= sum(t.nbytes for t in state["model"].values())

    loaded = _zeros_like(state)
    dcp.load(loaded, checkpoint_id=7, storage_reader=_reader(memd, "dcp-one"), no_dist=True)
    _assert_equal(state, loaded)

    # The writer survives pickling after use (DCP's process-based async_save pickles it): no live connection.
    assert writer._client is not None
    copy = pickle.loads(pickle.dumps(writer))
    assert copy._client is None and copy.job == "dcp-one" and copy.step == 7
    dcp.save(state, checkpoint_id=8, storage_writer=copy, no_dist=True)
    with memd.client() as client:
        assert client.latest("dcp-one").step == 8
    writer.close()
    copy.close()

    # Under dashrun the ranks' environment names the job, dash-memd, the token file and TLS: Reader() needs nothing.
    for var, value in (("DASH_JOB_ID", "dcp-one"), ("DASH_MEMD", memd.address),
                       ("DASH_TOKEN_FILE", str(memd.token_file)), ("DASH_NO_TLS", "1" if memd.tls_args else None),
                       ("DASH_TLS_CA", None)):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, value)
    loaded = _zeros_like(state)
    reader = ddcp.Reader()
    dcp.load(loaded, checkpoint_id=8, storage_reader=reader, no_dist=True)
    _assert_equal(state, loaded)
    reader.close()


def test_newest_step_and_export_state(memd, tmp_path):
    state = _state()
    for step in (3, 5):
        state["model"]["weight"].add_(1)
        dcp.save(state, checkpoint_id=step, storage_writer=_writer(memd, "dcp-exp"), no_dist=True)
    loaded = _zeros_like(state)
    reader = _reader(memd, "dcp-exp")  # no step: the newest committed one
    dcp.load(loaded, storage_reader=reader, no_dist=True)
    assert reader.step == 5
    _assert_equal(state, loaded)

    with memd.client() as client:
        info = client.latest("dcp-exp", 3)
        full = ddcp.full_state(client, info)
    expected = _state()
    expected["model"]["weight"].add_(1)
    _assert_equal(expected, full)
    # What dashrun export writes of it loads with plain torch and with DCP's own file reader.
    export.write(full, "torch", tmp_path / "out.pt")
    _assert_equal(expected, torch.load(tmp_path / "out.pt", weights_only=True))
    export.write(full, "dcp", tmp_path / "out.dcp")
    again = _zeros_like(expected)
    dcp.load(again, checkpoint_id=str(tmp_path / "out.dcp"), no_dist=True)
    _assert_equal(expected, again)

    # The command itself: dashrun export finds that the Writer wrote the step and exports DCP's state of it.
    _run([sys.executable, "-m", "dashrun", "export", "--memd", memd.address, "--token-file", str(memd.token_file),
          *memd.tls_args, "dcp-exp", str(tmp_path / "cli.pt"), "--step", "3", "--format", "torch"], "dashrun export")
    _assert_equal({**expected, "dashrun": {"job": "dcp-exp", "step": 3, "world": 1}},
                  torch.load(tmp_path / "cli.pt", weights_only=True))


def test_a_tensor_the_load_already_has_is_read_straight_into_its_memory(memd, monkeypatch):
    """The bytes of a stored chunk land in the tensor DCP loads into when its memory is theirs (same dtype and
    shape, dense, in RAM); otherwise (another dtype, a column slice) through a buffer, converted as copy_ does."""
    g = torch.Generator().manual_seed(3)
    state = {"w": torch.randn(64, 48, generator=g), "rows": torch.randn(32, 16, generator=g),
             "cast": torch.randn(40, generator=g)}
    dcp.save(state, checkpoint_id=4, storage_writer=_writer(memd, "dcp-inplace"), no_dist=True)
    loaded = {"w": torch.zeros(64, 48), "rows": torch.zeros(32, 16), "cast": torch.zeros(40, dtype=torch.float64)}
    versions = {key: t._version for key, t in loaded.items()}
    landed: list[int] = []
    read = ddcp.Reader._read

    def spy(self, where, offset, view):
        landed.append(torch.frombuffer(view, dtype=torch.uint8).data_ptr() if len(view) else 0)
        return read(self, where, offset, view)

    monkeypatch.setattr(ddcp.Reader, "_read", spy)
    reader = _reader(memd, "dcp-inplace")
    dcp.load(loaded, checkpoint_id=4, storage_reader=reader, no_dist=True)
    reader.close()
    assert torch.equal(loaded["w"], state["w"]) and torch.equal(loaded["rows"], state["rows"])
    assert torch.equal(loaded["cast"], state["cast"].double())
    assert loaded["w"].data_ptr() in landed and loaded["rows"].data_ptr() in landed
    assert loaded["cast"].data_ptr() not in landed  # another dtype: read into a buffer, converted
    assert all(t._version > versions[key] for key, t in loaded.items())  # marked changed, as copy_() marks it
    # A tensor whose memory does not hold its elements in order (a transposed view): through a buffer too.
    landed.clear()
    strided = {"w": torch.zeros(48, 64).t()}
    reader = _reader(memd, "dcp-inplace")
    dcp.load(strided, checkpoint_id=4, storage_reader=reader, no_dist=True)
    reader.close()
    assert torch.equal(strided["w"], state["w"]) and strided["w"].data_ptr() not in landed


class _Planted:
    """A value whose unpickling would create a file: what a writer into dash-memd's disk could plant."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_an_export_never_runs_what_a_pickled_value_in_the_checkpoint_says(memd, tmp_path):
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "planted": _Planted(marker)}, checkpoint_id=1,
             storage_writer=_writer(memd, "dcp-planted"), no_dist=True)
    marker.unlink(missing_ok=True)  # (pickling it ran nothing; this is the state before the export)
    with memd.client() as client, pytest.raises(UsageError, match="not plain data"):
        ddcp.full_state(client, client.latest("dcp-planted"))
    assert not marker.exists()


def test_a_pickled_value_dash_memd_serves_never_runs_whatever_planner_dcp_uses(memd, tmp_path):
    """dcp.load with no planner gets DCP's DefaultLoadPlanner, whose load_bytes is torch.load(weights_only=False):
    the Reader alone must keep what dash-memd serves (from its disk, its bucket) from running."""
    marker = tmp_path / "ran"
    dcp.save({"w": torch.ones(3), "planted": _Planted(marker), "epoch": 4}, checkpoint_id=1,
             storage_writer=_writer(memd, "dcp-served"), no_dist=True)
    marker.unlink(missing_ok=True)
    for planner in (None, ddcp.SafeLoadPlanner(), ddcp.SafeLoadPlanner(allow_pickle=True)):
        state = {"w": torch.zeros(3), "planted": None, "epoch": 0}
        with pytest.raises(CheckpointException) as caught:
            dcp.load(state, checkpoint_id=1, storage_reader=_reader(memd, "dcp-served"), planner=planner, no_dist=True)
        refused = [failure[0] for failure in caught.value.failures.values()]
        assert [type(e) for e in refused] == [ddcp.PickleRefused], refused
        assert "'planted'" in str(refused[0]) and "allow_pickle=True" in refused[0].hint and "\n" not in str(refused[0])
        assert not marker.exists()
    # A planner that refuses does so with a reader that allows: a full unpickling needs both to opt in.
    with pytest.raises(CheckpointException, match="not plain data"):
        dcp.load({"planted": None}, checkpoint_id=1, storage_reader=_reader(memd, "dcp-served", allow_pickle=True),
                 planner=ddcp.SafeLoadPlanner(), no_dist=True)
    assert not marker.exists()

    # Plain values still load through DCP's default planner and the safe one alike.
    for planner in (None, ddcp.SafeLoadPlanner()):
        state = {"w": torch.zeros(3), "epoch": 0}
        dcp.load(state, checkpoint_id=1, storage_reader=_reader(memd, "dcp-served"), planner=planner, no_dist=True)
        assert state["epoch"] == 4 and torch.equal(state["w"], torch.ones(3))
    # The opt-in is DCP's own behaviour: the pickle runs (so the refusals above did stop a payload that works).
    state = {"planted": None}
    dcp.load(state, checkpoint_id=1, storage_reader=_reader(memd, "dcp-served", allow_pickle=True), no_dist=True)
    assert marker.exists()


def test_reads_only_the_bytes_it_needs(memd):
    big = torch.arange(256 * 1024, dtype=torch.float32).reshape(256, 1024)  # 1 MiB
    other = torch.ones(256 * 1024)
    dcp.save({"big": big, "other": other}, checkpoint_id=1, storage_writer=_writer(memd, "dcp-ranges"), no_dist=True)

    reader = _reader(memd, "dcp-ranges")
    part = {"big": torch.zeros_like(big)}  # only one key asked for: the other is never read
    dcp.load(part, checkpoint_id=1, storage_reader=reader, no_dist=True)
    assert torch.equal(part["big"], big)
    assert reader.bytes_read == big.nbytes

    # A slice of a stored chunk: rows are one range; a column band reads its rows' stretch (gaps under MAX_GAP
    # are read rather than asked for piece by piece), never the whole chunk.
    md = reader.metadata.state_dict_metadata["big"]
    where = reader.metadata.storage_data[next(i for i in reader.metadata.storage_data if i.fqn == "big")]
    before = reader.bytes_read
    rows = reader._read_slice(where, md, [0, 0], [10, 0], [20, 1024])
    assert torch.equal(rows, big[10:30]) and reader.bytes_read - before == 20 * 1024 * 4
    before = reader.bytes_read
    band = reader._read_slice(where, md, [0, 0], [100, 512], [4, 256])
    assert torch.equal(band, big[100:104, 512:768])
    assert reader.bytes_read - before == (3 * 1024 + 256) * 4
    # One column: a 4-byte range per row, 4092 bytes apart, more than the gap: none merged.
    assert joined(byte_runs([256, 1024], [0, 0], [256, 1], 4), 40) == [(i * 4096, i * 4096 + 4)
                                                                                   for i in range(256)]


def test_more_ranges_than_one_request_holds_are_read_in_batches_into_one_image(memd, agent_factory, monkeypatch):
    """Under dashrun, on a node of several ranks, the node's dash-agent reads a load's ranges; more than
    MAX_RANGES go in several requests, all into the same image, which the agent keeps until the last. The
    only rank of a node reads them itself, straight into its tensors: the agent is not asked."""
    from dashrun.rank import restore

    state = {f"t{i}": torch.full((8, 8), float(i)) for i in range(40)}  # 40 items: 40 ranges
    dcp.save(state, checkpoint_id=1, storage_writer=_writer(memd, "dcp-batches"), no_dist=True)
    agent = agent_factory(memd)
    for var, value in (("DASH_MEMD", memd.address), ("DASH_TOKEN_FILE", str(memd.token_file)),
                       ("DASH_AGENT_SOCKET", str(agent.socket_path)), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(var, value)
    monkeypatch.setattr(restore, "MAX_RANGES", 16)  # the rank's batches (dash-agent takes up to 16384 at once)
    requests = []
    fetch = restore.fetch
    monkeypatch.setattr(restore, "fetch", lambda link, request, on_wait: requests.append(request) or fetch(
        link, request, on_wait))
    loaded = _zeros_like(state)
    reader = ddcp.Reader("dcp-batches", tls=_tls(memd))
    dcp.load(loaded, checkpoint_id=1, storage_reader=reader, no_dist=True)
    _assert_equal(state, loaded)
    assert [(len(r.ranges), r.more) for r in requests] == [(16, True), (16, True), (8, False)]
    assert reader.bytes_via == {"agent": sum(t.nbytes for t in state.values()), "memd": 0}
    assert reader.bytes_read == sum(t.nbytes for t in state.values())
    with open("/proc/self/maps") as maps:
        assert "dashrun-restore-dcp-batches" not in maps.read()  # the image is let go once the load has it
    requests.clear()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    loaded = _zeros_like(state)
    reader = ddcp.Reader("dcp-batches", tls=_tls(memd))
    dcp.load(loaded, checkpoint_id=1, storage_reader=reader, no_dist=True)
    reader.close()
    _assert_equal(state, loaded)
    assert requests == [] and reader.bytes_read == sum(t.nbytes for t in state.values())
    assert reader.bytes_via == {"agent": 0, "memd": reader.bytes_read}


def test_a_checkpointer_told_to_restore_a_dcp_written_step_says_how_to_load_it(memd, agent_factory, rank_env):
    dcp.save({"model": {"weight": torch.ones(4)}}, checkpoint_id=5, storage_writer=_writer(memd, "dcp-ckpt"),
             no_dist=True)
    ckpt = rank_env(agent_factory(memd), "dcp-ckpt", 0, 1, model=torch.nn.Linear(2, 2))
    try:
        with pytest.raises(UsageError, match="step 5 of job dcp-ckpt was written by dcp.save") as caught:
            ckpt.restore()
        assert "storage_reader=dashrun.dcp.Reader()" in caught.value.hint
    finally:
        ckpt.close()


def test_bad_checkpoint_ids_and_missing_settings(memd, monkeypatch):
    writer = _writer(memd, "dcp-bad")
    with pytest.raises(UsageError, match="names no step"):
        dcp.save({"t": torch.ones(2)}, checkpoint_id="latest", storage_writer=writer, no_dist=True)
    with pytest.raises(UsageError, match="names no step"):
        ddcp.step_of(-3)
    assert ddcp.step_of("runs/step_0012") == 12 and ddcp.step_of(Path("/c/2024/step-9")) == 9
    for var in ("DASH_JOB_ID", "DASH_MEMD", "DASH_TOKEN_FILE", "DASH_AGENT_SOCKET"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(UsageError, match="needs a job"):
        ddcp.Writer()
    with pytest.raises(UsageError, match="how to reach dash-memd"):
        ddcp.Reader("dcp-bad")
    monkeypatch.setenv("DASH_JOB_ID", "dcp-env")
    monkeypatch.setenv("DASH_MEMD", memd.address)
    monkeypatch.setenv("DASH_TOKEN_FILE", str(memd.token_file))
    assert ddcp.Writer(tls=_tls(memd)).job == "dcp-env"
    monkeypatch.delenv("DASH_NO_TLS", raising=False)
    monkeypatch.setenv("DASH_TLS_CA", str(memd.token_file))  # any file: it is read only when connecting
    assert ddcp.Reader()._target.tls == TlsSettings(ca=memd.token_file.absolute())


def test_a_checkpoint_not_written_by_dcp_is_refused(memd):
    meta = json.dumps({"format": 1, "step": 4, "rank": 0, "world": 1,
                       "replicated": {"tree": {}, "tensors": [], "total": 0},
                       "private": {"tree": {}, "tensors": []}}).encode()
    header = ShardHeader(job="dcp-plain", step=4, rank=0, world=1, rep_total=0, rep_start=0, rep_end=0,
                         private_len=0, meta_len=len(meta), layout="0" * 64)
    with memd.client() as client:
        assert client.put_shard(header, [meta])["committed"]
        assert ddcp.full_state(client, client.latest("dcp-plain")) is None
    with pytest.raises(CheckpointException, match="not written by dashrun.dcp.Writer"):
        dcp.load({"t": torch.zeros(2)}, storage_reader=_reader(memd, "dcp-plain"), no_dist=True)


def _run(cmd: list[str], what: str, timeout: float = 120) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{what} did not finish within {timeout:g} s:\n{out[-3000:]}")
    assert proc.returncode == 0, f"{what} failed:\n{out[-3000:]}"


def _torchrun(nproc: int, memd, job: str, out: Path, tag: str, *args: str) -> None:
    _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
          str(SCRIPT), "--out", str(out), "--tag", tag, "--job", job, "--memd", memd.address,
          "--token-file", str(memd.token_file), *memd.tls_args, *args], f"{tag} on {nproc} ranks")


def _reports(out: Path, tag: str, world: int) -> list[dict]:
    return [json.loads((out / f"{tag}-rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.slow
def test_fsdp2_saved_on_2_loaded_resharded_on_3_and_1(memd, tmp_path):
    job = "dcp-fsdp"
    # Saved on 2 ranks under dashrun: the Writer hands its shard to dash-agent by shared memory.
    _run(dashrun_cmd(memd, str(SCRIPT), "--out", str(tmp_path), "--tag", "save2", "--train", "2", "--save", "5",
                     job=job, nproc=2), "save on 2 ranks under dashrun")
    assert {r["transport"] for r in _reports(tmp_path, "save2", 2)} == {"agent"}
    with memd.client() as client:
        info = client.latest(job)
    assert (info.step, info.world, info.rep_total) == (5, 2, 0)

    # Loaded on 3 ranks (straight from dash-memd: no agent under torchrun), trained on and saved again by those 3
    # with a process-based async_save: DCP pickles the Writer into its checkpointing process, which connects to
    # dash-memd itself.
    _torchrun(3, memd, job, tmp_path, "load3", "--load", "5", "--train", "1", "--save", "6", "--async-process")
    for report in _reports(tmp_path, "load3", 3):
        # The save of 6 went from DCP's checkpointing process (a copy of the Writer): not from this one.
        assert report["transport"] is None and report["loads"][0]["transport"] == ["memd"], report
        (load,) = report["loads"]
        assert load["differ"] == [] and load["extra"] == 5
        assert 0 < load["bytes_read"] <= 1.2 * load["needed"], load
    with memd.client() as client:
        assert (client.latest(job).step, client.latest(job).world) == (6, 3)

    # Both loaded on 1 rank under dashrun: 2 -> 1 and 3 -> 1. The only rank of its node reads straight from
    # dash-memd into its tensors (an image by the node's dash-agent only pays off for several ranks of a node).
    _run(dashrun_cmd(memd, str(SCRIPT), "--out", str(tmp_path), "--tag", "load1", "--load", "5", "--load", "6",
                     job=job, nproc=1), "load on 1 rank under dashrun")
    (report,) = _reports(tmp_path, "load1", 1)
    assert [(x["step"], x["differ"], x["extra"]) for x in report["loads"]] == [(5, [], 5), (6, [], 6)]
    assert [x["transport"] for x in report["loads"]] == [["memd"], ["memd"]], report
    assert all(x["bytes_read"] <= 1.2 * x["needed"] for x in report["loads"]), report

