"""``--trace``: a Chrome/Perfetto trace naming every stream of every device and the host threads."""
from __future__ import annotations

import json

from cgdp.cli.trace import chrome_trace, stats_compute_spans
from cgdp.cli.train import main


def _threads(trace):
    ev = trace["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in ev if e.get("name") == "process_name"}
    threads = {(e["pid"], e["tid"]): (procs[e["pid"]], e["args"]["name"]) for e in ev if e.get("name") == "thread_name"}
    return procs, threads


def test_trace_of_a_run_names_every_stream(tmp_path, capsys):
    path = tmp_path / "trace.json"
    rc = main(["--steps", "8", "--chunks", "1", "--trace", str(path), "--trace_step", "3", "--trace_steps", "2",
               "--progress", "off"])
    capsys.readouterr()
    assert rc == 0
    trace = json.loads(path.read_text())  # valid JSON
    procs, threads = _threads(trace)
    assert list(procs.values()) == ["cpu:0", "cpu:1", "host"]
    names = set(threads.values())
    for dev in ("cpu:0", "cpu:1"):
        for stream in ("compute", "d2h", "h2d"):
            assert (dev, stream) in names
    assert ("host", "accumulate") in names
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    by_stream = {}
    for e in spans:
        assert e["dur"] >= 0 and e["ts"] >= 0
        by_stream.setdefault(threads[(e["pid"], e["tid"])], []).append(e)
    for key in [("cpu:0", "d2h"), ("cpu:1", "h2d"), ("host", "accumulate"), ("cpu:0", "compute")]:
        assert by_stream.get(key), f"no spans on {key}"
    # 4 layers, one chunk each, 2 traced steps: every chunk goes down and back on each device
    assert len(by_stream[("cpu:0", "d2h")]) == 8 and len(by_stream[("host", "accumulate")]) == 8
    assert trace["otherData"]["steps"] == [3, 4]  # --trace_step 3 traces step 3


def test_chrome_trace_layout():
    spans = [{"device": "host", "stream": "accumulate", "name": "chunk 0", "start": 0.002, "end": 0.003},
             {"device": "cuda:1", "stream": "d2h", "name": "chunk 0", "start": 0.001, "end": 0.002}]
    spans += stats_compute_spans(["cuda:0", "cuda:1"], {"forward_s": 0.01, "backward_s": 0.02, "update_s": 0.001,
                                                         "step_s": 0.035})
    t = chrome_trace([(7, 0.5, 0.035, spans)], ["cuda:0", "cuda:1"])
    procs, threads = _threads(t)
    assert list(procs.values()) == ["cuda:0", "cuda:1", "host"]
    assert [s for (d, s) in sorted(threads.values()) if d == "cuda:1"] == ["compute", "d2h", "h2d"]
    x = {e["name"]: e for e in t["traceEvents"] if e["ph"] == "X" and threads[(e["pid"], e["tid"])][0] == "cuda:1"}
    assert x["chunk 0"]["ts"] == 0.501e6 and abs(x["chunk 0"]["dur"] - 1000) < 1e-6
    assert x["backward"]["args"]["approx"] is True
    json.dumps(t)
